"""CPU per row of the result path: what happens between an answer and a committed shard row.

    .venv/bin/python bench/bench_rowpath.py [--rows 20000] [--root DIR]

New (this tree): `work.RowWork` (quality gates on the answer) + the store's nested-type
conversion + shard commit. `--root DIR` runs the same against another checkout of fleet
(e.g. `git archive 2000b73 | tar -x -C /tmp/base`, before nested types and gates): there
the row is built as it was then (JSON-string columns) and committed. Measured in process CPU
time (`time.process_time`), which a busy machine disturbs far less than wall time. Answers
are 300 words of ordinary text with 50 words of reasoning; prompts a system and a user turn.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    from fleet.config import GenerationConfig
    from fleet.generation.hotpath.client import Outcome
    from fleet.generation.data.jsonl import dumps
    from fleet.generation.data.rows import Request
    from fleet.generation.data.store import ResultStore

    rnd = random.Random(1)
    vocab = ["the", "model", "answer", "is", "a", "token", "of", "data", "and", "drafter", "to", "we"]
    text = " ".join(rnd.choice(vocab) + str(rnd.randrange(50)) for _ in range(300))
    reqs = [Request(f"r{i}", i + 1, [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": f"question {i} " + text[:200]}],
                    {"max_tokens": 512, "temperature": 0.6}) for i in range(args.rows)]
    out = Outcome("ok", status=200, completion=text, reasoning_content="because " * 50, finish_reason="stop",
                  prompt_tokens=50, completion_tokens=300, latency_s=0.5, started_at=1.0, finished_at=1.5)
    try:
        from fleet.generation.hotpath.work import RowPlan
    except ImportError:
        RowPlan = None  # type: ignore[assignment,misc]
    with tempfile.TemporaryDirectory() as d:
        store = ResultStore(d, shard_rows=10000)
        t0 = time.process_time()
        if RowPlan is not None:
            plan = RowPlan(GenerationConfig())
            for r in reqs:
                w = plan.work(r)
                w.advance(out, 1)
                row, _ = w.result(out, "s/0")
                store.add_result(row)
        else:
            for r in reqs:
                store.add_result({"id": r.id, "messages": dumps(r.messages).decode(), "params": dumps(r.params).decode(),
                                  "completion": out.completion, "reasoning_content": out.reasoning_content,
                                  "tool_calls": None, "finish_reason": out.finish_reason, "prompt_tokens": 50,
                                  "completion_tokens": 300, "server": "s/0", "attempts": 1, "latency_s": 0.5,
                                  "started_at": 1.0, "finished_at": 1.5})
        store.close()
        cpu = time.process_time() - t0
    what = "new (RowWork + gates + nested)" if RowPlan is not None else "old (JSON-string row)"
    print(f"{what}: {args.rows} rows, {cpu:.2f} s CPU, {cpu / args.rows * 1e6:.1f} us CPU per row")


if __name__ == "__main__":
    main()
