"""Client CPU of streamed answers vs whole ones: what token liveness by streaming costs.

    .venv/bin/python bench/bench_stream.py [--rows 640] [--tokens 100] [--rounds 2]

`transformers serve` has no token counters, so the runner streams its answers and takes
each chunk as progress (Endpoint.stream). That changes the hot path: one server-sent event
per token instead of one body per row. Two simulated servers decode at 50 tokens/s per
stream (the sim then sends one chunk per token, like `transformers serve`), 32 rows in flight
each, rows of --tokens tokens (ignore_eos); the Dispatcher runs the same rows streamed and
whole, alternating, into a null store. Measured: this process's CPU time (the servers are
other processes) per row and per 1,000 tokens, and the wall time of each pass.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sims import start_sims  # noqa: E402
from fleet.config import GenerationConfig  # noqa: E402
from fleet.generation.hotpath.dispatch import Dispatcher, Endpoint  # noqa: E402
from fleet.generation.data.rows import Request  # noqa: E402


class NullStore:
    def __init__(self) -> None:
        self.tokens = 0

    def add_result(self, row: dict[str, Any]) -> None:
        self.tokens += row.get("completion_tokens") or 0

    def add_error(self, id: str, **kw: Any) -> None:
        raise SystemExit(f"row {id} failed: {kw}")

    def add_reject(self, reject: Any) -> None: ...

    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], *, line: int | None) -> None: ...


def one_pass(urls: list[str], rows: int, tokens: int, stream: bool) -> dict[str, float]:
    items = [Request(f"r{i}", i + 1, [{"role": "user", "content": f"question {i}"}],
                     {"max_tokens": tokens, "ignore_eos": True}) for i in range(rows)]
    eps = [Endpoint(f"s{i}", u, "sim-model", stream=stream) for i, u in enumerate(urls)]
    store = NullStore()
    d = Dispatcher(eps, store, GenerationConfig(max_concurrency_per_server=32, request_timeout_s=600))
    c0, t0 = time.process_time(), time.perf_counter()
    summary = asyncio.run(d.run(items))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    assert summary.complete and summary.completed == rows and store.tokens == rows * tokens
    return {"cpu_ms_per_row": 1000 * cpu / rows, "cpu_ms_per_1k_tokens": 1e6 * cpu / store.tokens, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=640)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    procs, urls = start_sims([50.0, 50.0], 32)
    res: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    try:
        for r in range(a.rounds):
            for stream in ((False, True) if r % 2 == 0 else (True, False)):
                res[stream].append(one_pass(urls, a.rows, a.tokens, stream))
    finally:
        for pr in procs:
            pr.kill()
    print("| answers | client CPU ms per row | client CPU ms per 1,000 tokens | wall s per pass |")
    print("| --- | --- | --- | --- |")
    for stream in (False, True):
        m = {k: statistics.median(x[k] for x in res[stream]) for k in res[stream][0]}
        print(f"| {'streamed (one event per token)' if stream else 'whole'} | {m['cpu_ms_per_row']:.2f} "
              f"| {m['cpu_ms_per_1k_tokens']:.1f} | {m['wall_s']:.1f} |")
    print("load average:", os.getloadavg())


if __name__ == "__main__":
    main()
