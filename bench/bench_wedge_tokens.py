"""A wedged server with long rows, at default watchdog settings: when is it taken out, and why?

    .venv/bin/python bench/bench_wedge_tokens.py [--rows 100] [--tokens 800] [--tokens-per-s 8]

Issue 22's sim case: two servers, 8 tokens/s per stream, 64 slots, rows of 800 tokens
(ignore_eos: 100 s each); the second server is started with --hang-after 8 (/health answers,
generations never do). The Dispatcher runs with its default options (stall_s 30 s, counters
read every 5 s, the 20 s generation probe). Prints when the wedged server finished its last
row, came under suspicion, and was taken out, and checks every row ended once.
"""

from __future__ import annotations

import argparse
import asyncio
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


class Store:
    def __init__(self) -> None:
        self.ids: list[str] = []

    def add_result(self, row: dict[str, Any]) -> None:
        self.ids.append(row["id"])

    def add_error(self, id: str, **kw: Any) -> None:
        raise SystemExit(f"row {id} failed: {kw}")

    def add_reject(self, reject: Any) -> None: ...

    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], *, line: int | None) -> None: ...


async def run(urls: list[str], rows: int, tokens: int, hang_after: int) -> dict[str, Any]:
    items = [Request(f"r{i}", i + 1, [{"role": "user", "content": f"q {i}"}], {"max_tokens": tokens, "ignore_eos": True})
             for i in range(rows)]

    async def stay_down(ep: Endpoint) -> bool:
        await asyncio.Event().wait()
        return False

    store = Store()
    d = Dispatcher([Endpoint("good", urls[0], "sim-model"), Endpoint("wedged", urls[1], "sim-model")], store,
                   GenerationConfig(request_timeout_s=3600), on_server_down=stay_down)
    t0, marks = time.monotonic(), {}

    async def watch() -> None:
        w = d.servers[1]
        while True:
            now = round(time.monotonic() - t0, 1)
            if w.requests >= hang_after:
                marks.setdefault("last_row_s", now)
            if w.under_suspicion:
                marks.setdefault("suspect_s", now)
            if w.downs:
                marks.setdefault("down_s", now)
                marks.setdefault("reason", w.down_reason)
            await asyncio.sleep(0.2)

    watcher = asyncio.ensure_future(watch())
    summary = await d.run(items)
    watcher.cancel()
    assert summary.complete and sorted(store.ids) == sorted(r.id for r in items), "a row lost or doubled"
    return {"wall_s": round(summary.wall_s, 1), **marks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--tokens", type=int, default=800)
    p.add_argument("--tokens-per-s", type=float, default=8.0)
    p.add_argument("--hang-after", type=int, default=8)
    a = p.parse_args()
    procs, urls = start_sims([a.tokens_per_s] * 2, 64, extra=[[], ["--hang-after", str(a.hang_after)]])
    try:
        print(asyncio.run(run(urls, a.rows, a.tokens, a.hang_after)))
    finally:
        for pr in procs:
            pr.kill()


if __name__ == "__main__":
    main()
