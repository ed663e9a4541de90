"""CPU cost of judging an answer: the strict parser vs the old unchecked read, per answer.

    .venv/bin/python bench/bench_answer_parse.py [--n 20000]

Side by side in one process, on chat completions of 300 tokens (~2 KB) and 4,096 tokens with
reasoning (~40 KB): `answer.parse_answer(bytes)` (pydantic-core: parse and validate in one pass)
vs `orjson.loads` + the dictionary lookups main's `parse_completion` made (no checks).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.answer import parse_answer  # noqa: E402
from fleet.generation.data.jsonl import loads  # noqa: E402


def unchecked(raw: bytes) -> tuple[object, ...]:
    doc = loads(raw)
    msg = doc["choices"][0]["message"]
    usage = doc.get("usage") or {}
    return (msg.get("content") or "", msg.get("reasoning_content"), msg.get("tool_calls"),
            doc["choices"][0].get("finish_reason"), usage.get("prompt_tokens"), usage.get("completion_tokens"))


def body(words: int, reasoning: int) -> bytes:
    rnd = random.Random(words)
    text = " ".join(f"w{rnd.randrange(5000)}" for _ in range(words))
    why = " ".join(f"r{rnd.randrange(5000)}" for _ in range(reasoning)) or None
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": why, "tool_calls": None},
         "logprobs": None, "finish_reason": "stop", "matched_stop": 151645}],
        "usage": {"prompt_tokens": 120, "completion_tokens": words + reasoning, "total_tokens": 120 + words + reasoning,
                  "prompt_tokens_details": None}}).encode()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    for name, raw in (("300 tokens", body(300, 0)), ("4,096 tokens with reasoning", body(1024, 3072))):
        res = {}
        for _ in range(3):   # interleaved rounds, best of three
            for label, fn in (("strict", parse_answer), ("unchecked", unchecked)):
                t = time.process_time()
                for _ in range(args.n):
                    fn(raw)
                us = (time.process_time() - t) / args.n * 1e6
                res[label] = min(res.get(label, us), us)
        print(f"{name} ({len(raw):,} B): strict {res['strict']:.1f} µs, unchecked {res['unchecked']:.1f} µs per answer "
              f"({res['strict'] / res['unchecked']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
