"""Drafter data a trainer takes as it is (issue 24): before/after on one all-turns job.

    .venv/bin/python bench/bench_trainer.py [--conversations 600] [--refused-share 0.05] [--tps 60]

Four sims of unequal speed (tps, tps, tps, tps/3 per request; 16 slots each), with the sim's
fault flags: a share of looping answers (`--loop-rate`) and lognormal answer lengths, some of
which run into max_tokens. Input: N multi-turn ShareGPT conversations (1-3 assistant turns)
plus a share of rows SpecForge's check refuses (two user turns in a row, an empty user
message). The same job runs twice, side by side:

- before: `input_rules = "openai"` (what fleet did: refused rows are generated, then dropped at
  export) and an export that keeps flagged conversations (`--keep-flagged`: what it wrote before);
- after: `input_rules = "specforge"` and the default export (flagged conversations left out).

Reported per run: makespan, the ideal (max of total decoded tokens / total capacity and the
longest conversation decoded alone on a fast server), their ratio, requests sent per input
conversation, and the export: rows written, flagged rows kept unmarked or left out by flag,
skipped rows.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sims import start_sims  # noqa: E402

SLOTS = 16


def write_input(path: Path, n: int, refused_share: float, rng: random.Random) -> int:
    """N conversations, a share of them ones SpecForge refuses; returns the refused count."""
    refused = 0
    with open(path, "w") as f:
        for i in range(n):
            turns: list[dict[str, str]] = []
            for t in range(rng.randint(1, 3)):
                turns += [{"from": "human", "value": f"question {i}.{t} " + "words " * rng.randint(2, 30)},
                          {"from": "gpt", "value": "an older model's answer"}]
            if rng.random() < refused_share:
                refused += 1
                if rng.random() < 0.5:
                    turns.insert(1, {"from": "human", "value": "and another thing"})   # two user turns in a row
                else:
                    turns[0]["value"] = "   "                                          # an empty user message
            f.write(json.dumps({"id": f"c{i}", "conversations": turns, "source": "bench"}) + "\n")
    return refused


def run(name: str, inp: Path, out: Path, entries: list[Any], rules: str, keep: bool, speeds: list[float],
        max_tokens: int) -> dict[str, Any]:
    from fleet.config import FleetConfig
    from fleet.generation.data.checks import account
    from fleet.generation.data.export import export
    from fleet.generation.data.results import iter_results, read_errors, read_quality_rejects
    from fleet.generation.job.runner import run_local

    cfg = FleetConfig(name="b", engine={"kind": "sim"}, generation={
        "max_tokens": max_tokens, "regenerate": "all-turns", "max_concurrency_per_server": SLOTS, "seed": 7,
        "input_rules": rules, "quality": {"truncated": "flag", "repetition": "flag", "missing_reasoning": "keep",
                                          "empty_content": "keep", "think_markers": "keep"}})
    t0 = time.monotonic()
    rc = run_local(cfg, inp, out, entries, flush_interval_s=1.0, progress_interval_s=0.5)
    wall = time.monotonic() - t0
    m = json.loads((out / "manifest.json").read_text())
    tokens = [int(t) for b in iter_results(out, ["completion_tokens"]) for t in b.column(0).to_pylist()]
    ideal = max(sum(tokens) / (SLOTS * sum(speeds)), max(tokens) / max(speeds))
    # requests sent (every turn, gate retry and failed try): each row's `attempts`, wherever it ended
    requests = sum(int(a or 0) for b in iter_results(out, ["attempts"]) for a in b.column(0).to_pylist())
    requests += sum(int(r.get("attempts") or 0) for r in [*read_errors(out), *read_quality_rejects(out)])
    assert m["state"] == "done", m["state"]
    rows = sum(1 for _ in open(inp))
    s = export(out, "specforge", out / "train.jsonl", keep_flagged=keep)
    acc = account(inp, out, cfg.generation)
    r = {"rc": rc, "makespan_s": round(wall, 1), "ideal_s": round(ideal, 1), "ratio": round(wall / ideal, 2),
         "requests": requests, "requests_per_conversation": round(requests / rows, 3),
         "input_rejects": acc["rejects"], "exactly_once": acc["ok"], "rows_written": s.rows,
         "flagged_kept_unmarked": s.flagged_kept, "flagged_left_out": s.flagged_left_out,
         "left_out_by_flag": s.left_out_by_flag, "skipped": s.skipped, "errors": s.errors}
    print(f"{name}: {json.dumps(r)}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=600)
    ap.add_argument("--refused-share", type=float, default=0.05)
    ap.add_argument("--tps", type=float, default=60.0, help="a fast server's tok/s per request (the slow one: a third)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--loop-rate", type=float, default=0.05)
    args = ap.parse_args()
    speeds = [args.tps, args.tps, args.tps, args.tps / 3]
    flags = ["--loop-rate", str(args.loop_rate), "--lengths", "lognormal:40:0.6"]
    procs, urls = start_sims(speeds, SLOTS, seed=5, extra=[flags] * 4)
    from fleet.generation.job.runner import ServerEntry

    try:
        entries = [ServerEntry(node="local", index=i, url=u, model="sim-model") for i, u in enumerate(urls)]
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            inp = tmp / "in.jsonl"
            refused = write_input(inp, args.conversations, args.refused_share, random.Random(11))
            print(f"input: {args.conversations} conversations, {refused} of them refused by SpecForge's check; "
                  f"speeds {speeds} tok/s per request x {SLOTS} slots", flush=True)
            before = run("before", inp, tmp / "before", entries, "openai", True, speeds, args.max_tokens)
            after = run("after", inp, tmp / "after", entries, "specforge", False, speeds, args.max_tokens)
            print(f"requests per conversation: before {before['requests_per_conversation']}, "
                  f"after {after['requests_per_conversation']} "
                  f"({before['requests'] - after['requests']} requests saved)")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    main()
