"""Dispatch balance: makespan vs the ideal with servers of unequal speed.

    .venv/bin/python bench/bench_balance.py [--requests 3000] [--max-tokens 200] [--speeds 1,1,1,0.33]

Four simulated SGLang servers, per-stream decode speeds `--base-tps` x 1, 1, 1, 0.33, each
with `--slots` running requests, all with the same --seed so a row's completion length is
the same whichever server answers it (the workload is fixed). Two policies, same rows,
same client (`fleet.generation.hotpath.client.chat`), same concurrency per server:

- work stealing: the fleet Dispatcher (one queue, every server's workers pull from it);
- round-robin pre-split: row i goes to server i mod 4 up front (SpecForge's shape), each
  server's workers drain only their own share.

ideal = total completion tokens / total capacity (sum over servers of slots x tokens/s):
the makespan of a perfectly fluid split with no tail. Prints a table and appends it to
bench/RESULTS.md under "## Dispatch balance".
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_client import NullStore, machine  # noqa: E402

from fleet.config import GenerationConfig  # noqa: E402
from fleet.generation.hotpath.client import chat, new_session  # noqa: E402
from fleet.generation.hotpath.dispatch import Dispatcher, Endpoint  # noqa: E402
from fleet.generation.data.rows import Request  # noqa: E402


class TokenStore(NullStore):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0
        self.by_server: dict[str, int] = {}

    def add_result(self, row: dict[str, Any]) -> None:
        super().add_result(row)
        self.tokens += row["completion_tokens"]
        self.by_server[row["server"]] = self.by_server.get(row["server"], 0) + 1


def start_sims(speeds: list[float], base_tps: float, slots: int) -> tuple[list[Any], list[str]]:
    """One sim per speed; a shared seed so the work (completion lengths) is the same for every policy."""
    from bench.sims import start_sims as start

    return start([base_tps * sp for sp in speeds], slots, seed=7)


def requests(n: int, max_tokens: int, tag: str) -> list[Request]:
    # the completion length is decided by the messages (and the shared seed), not the id
    return [Request(f"{tag}-{i}", i + 1, [{"role": "user", "content": f"Tell me about item {i}."}],
                    {"max_tokens": max_tokens}) for i in range(n)]


async def work_stealing(urls: list[str], reqs: list[Request], slots: int) -> tuple[float, TokenStore]:
    store = TokenStore()
    gen = GenerationConfig(max_concurrency_per_server=slots)
    d = Dispatcher([Endpoint(f"s{i}", u, "sim-model") for i, u in enumerate(urls)], store, gen, stats_poll_s=3600)
    t0 = time.perf_counter()
    s = await d.run(reqs)
    wall = time.perf_counter() - t0
    assert s.complete and s.completed == len(reqs), s
    return wall, store


async def round_robin(urls: list[str], reqs: list[Request], slots: int) -> tuple[float, TokenStore]:
    store = TokenStore()
    shares: list[list[Request]] = [reqs[i::len(urls)] for i in range(len(urls))]

    async def server(i: int) -> None:
        sess = new_session(slots)
        share = iter(shares[i])

        async def worker() -> None:
            for r in share:
                out = await chat(sess, urls[i], "sim-model", r)
                assert out.ok, out.error
                store.add_result({"server": f"s{i}", "completion_tokens": out.completion_tokens})

        try:
            await asyncio.gather(*(worker() for _ in range(slots)))
        finally:
            await sess.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(server(i) for i in range(len(urls))))
    return time.perf_counter() - t0, store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--speeds", default="1,1,1,0.33")
    ap.add_argument("--base-tps", type=float, default=500.0, help="tokens/s per stream of a speed-1 server")
    ap.add_argument("--slots", type=int, default=8, help="running requests per server")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    speeds = [float(x) for x in args.speeds.split(",")]
    capacity = sum(args.slots * args.base_tps * s for s in speeds)

    procs, urls = start_sims(speeds, args.base_tps, args.slots)
    results: list[dict[str, Any]] = []
    try:
        for rnd in range(1, args.rounds + 1):
            policies = [("work stealing (fleet Dispatcher)", work_stealing), ("round-robin pre-split", round_robin)]
            if rnd % 2 == 0:
                policies.reverse()
            for name, fn in policies:
                reqs = requests(args.requests, args.max_tokens, f"r{rnd}")
                wall, store = asyncio.run(fn(urls, reqs, args.slots))
                ideal = store.tokens / capacity
                share = [store.by_server.get(f"s{i}", 0) for i in range(len(urls))]
                results.append({"policy": name, "round": rnd, "wall": wall, "ideal": ideal, "tokens": store.tokens,
                                "share": share})
                print(f"round {rnd}: {name:34s} makespan {wall:6.2f} s  ideal {ideal:6.2f} s  "
                      f"ratio {wall / ideal:.3f}  rows per server {share}", flush=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()

    load = os.getloadavg()
    lines = [
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — "
        f"`{shlex.join(['.venv/bin/python', 'bench/bench_balance.py', *sys.argv[1:]])}`",
        "",
        f"- machine: {machine()}; load average at the end {load[0]:.2f}",
        f"- {len(speeds)} sim servers, speeds {args.speeds} x {args.base_tps:g} tokens/s per stream, {args.slots} "
        f"running requests each (capacity {capacity:,.0f} tokens/s); {args.requests} rows, max_tokens "
        f"{args.max_tokens}, completion lengths fixed by a shared --seed",
        "- ideal = total completion tokens / total capacity; ratio = makespan / ideal",
        "",
        "| policy | round | makespan s | ideal s | ratio | rows per server |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r['policy']} | {r['round']} | {r['wall']:.2f} | {r['ideal']:.2f} | "
                     f"{r['wall'] / r['ideal']:.3f} | {', '.join(map(str, r['share']))} |")
    text = "\n".join(lines)
    print("\n" + text)
    if not args.no_append:
        path = ROOT / "bench" / "RESULTS.md"
        old = path.read_text() if path.exists() else "# Benchmark results\n"
        header = "## Dispatch balance"
        if header not in old:
            old = old.rstrip("\n") + f"\n\n\n{header}\n"
        head, _, rest = old.partition(header)
        nxt = rest.find("\n## ")
        section, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        path.write_text(head + header + section.rstrip("\n") + "\n\n" + text + "\n" + tail)
        print(f"\nappended to {path}")


if __name__ == "__main__":
    main()
