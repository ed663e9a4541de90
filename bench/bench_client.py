"""Client overhead: requests/s the generation Dispatcher sustains vs AsyncOpenAI + a semaphore.

    .venv/bin/python bench/bench_client.py [--requests 5000] [--in-flight 64] [--rounds 3]

Two simulated SGLang servers that answer at once (huge --tokens-per-s, max_tokens 8), so
the client is the bottleneck. Side by side in one run, order alternating every round:

- fleet Dispatcher + ResultStore: the runner's hot path as it runs, results committed to a
  throwaway output directory (Parquet shards, zstd, fsync);
- fleet Dispatcher + null store: the same without the store, to show what writing costs;
- AsyncOpenAI + semaphore: what most people write — the official `openai` package, one
  client per server, round-robin, `asyncio.Semaphore(in_flight)`, `asyncio.gather`.

Same requests, same servers, same concurrency (Dispatcher: in_flight / 2 workers per
server). Client CPU is this process's CPU time (the servers are other processes).
Prints a markdown table and appends it to bench/RESULTS.md under "## Generation client overhead".
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet.config import GenerationConfig  # noqa: E402
from fleet.generation.hotpath.dispatch import Dispatcher, Endpoint  # noqa: E402
from fleet.generation.data.rows import Request  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sims(n: int, mrr: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """n sims that answer at once (the client is what is measured)."""
    from bench.sims import start_sims as start

    return start([1e9] * n, mrr)


class NullStore:
    def __init__(self) -> None:
        self.n = 0

    def add_result(self, row: dict[str, Any]) -> None:
        self.n += 1

    def add_error(self, id: str, **kw: Any) -> None:
        self.n += 1

    def add_reject(self, reject: Any) -> None:
        pass


def make_requests(n: int, max_tokens: int, tag: str) -> list[Request]:
    # distinct ids per variant and round: a store never sees an id twice
    return [Request(f"{tag}-{i}", i + 1, [{"role": "user", "content": f"Write a haiku about the number {i}."}],
                    {"max_tokens": max_tokens, "temperature": 0.6}) for i in range(n)]


async def run_dispatcher(urls: list[str], reqs: list[Request], in_flight: int, store: Any) -> int:
    gen = GenerationConfig(max_concurrency_per_server=in_flight // len(urls), max_tokens=8)
    eps = [Endpoint(f"s{i}", u, "sim-model") for i, u in enumerate(urls)]
    d = Dispatcher(eps, store, gen, stats_poll_s=3600)
    s = await d.run(reqs)
    assert s.complete and s.completed == len(reqs), s
    return s.completed


async def run_openai(urls: list[str], reqs: list[Request], in_flight: int) -> int:
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=u + "/v1", api_key="none") for u in urls]
    sem = asyncio.Semaphore(in_flight)

    async def one(i: int, r: Request) -> str:
        async with sem:
            resp = await clients[i % len(clients)].chat.completions.create(
                model="sim-model", messages=r.messages, **r.params)  # type: ignore[arg-type]
            return resp.choices[0].message.content or ""

    try:
        out = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    finally:
        for c in clients:
            await c.close()
    assert len(out) == len(reqs)
    return len(out)


def measure(name: str, urls: list[str], n: int, in_flight: int, tag: str) -> dict[str, Any]:
    reqs = make_requests(n, 8, tag)
    tmp = None
    if name == "fleet Dispatcher + ResultStore":
        from fleet.generation.data.store import ResultStore

        tmp = tempfile.mkdtemp(prefix="bench-client-")
        store = ResultStore(tmp, shard_rows=10000)
        coro = run_dispatcher(urls, reqs, in_flight, store)
    elif name == "fleet Dispatcher + null store":
        store = NullStore()
        coro = run_dispatcher(urls, reqs, in_flight, store)
    else:
        store = None
        coro = run_openai(urls, reqs, in_flight)
    cpu0, t0 = time.process_time(), time.perf_counter()
    done = asyncio.run(coro)
    if tmp is not None:
        store.close()   # the final shard commit is part of the job's cost
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"name": name, "n": done, "wall": wall, "rps": done / wall, "cpu_ms": 1000 * cpu / done}


def machine() -> str:
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return (f"{platform.node()}, {platform.platform()}, nproc {os.cpu_count()}, RAM {mem}, "
            f"Python {platform.python_version()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only; do not touch RESULTS.md")
    args = ap.parse_args()

    import aiohttp
    import openai

    names = ["fleet Dispatcher + ResultStore", "fleet Dispatcher + null store", "AsyncOpenAI + semaphore"]
    procs, urls = start_sims(args.servers, mrr=args.in_flight)
    rows: list[dict[str, Any]] = []
    try:
        for name in names:  # warm-up: imports, first connections
            measure(name, urls, 300, args.in_flight, f"warm-{name[:5]}")
        for rnd in range(1, args.rounds + 1):
            order = names if rnd % 2 else list(reversed(names))
            for name in order:
                r = measure(name, urls, args.requests, args.in_flight, f"r{rnd}-{names.index(name)}")
                r["round"] = rnd
                rows.append(r)
                print(f"round {rnd}: {name:32s} {r['rps']:8.0f} req/s  {r['cpu_ms']:.3f} client CPU-ms/req",
                      flush=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()

    load = os.getloadavg()
    lines = [
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — "
        f"`{shlex.join(['.venv/bin/python', 'bench/bench_client.py', *sys.argv[1:]])}`",
        "",
        f"- machine: {machine()}; load average at the end {load[0]:.2f}",
        f"- {args.servers} sim servers answering at once (`--tokens-per-s 1e9`, max_tokens 8), {args.in_flight} "
        f"requests in flight, {args.requests} requests per run, {args.rounds} rounds, order alternating; "
        f"aiohttp {aiohttp.__version__}, openai {openai.__version__}",
        "- client CPU = this process's CPU time per request (the servers are separate processes on the same cores)",
        "",
        "| client | round | req/s | client CPU-ms/req | wall s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['round']} | {r['rps']:.0f} | {r['cpu_ms']:.3f} | {r['wall']:.2f} |")
    lines += ["", "| client | median req/s | median client CPU-ms/req | vs AsyncOpenAI |", "| --- | --- | --- | --- |"]
    med = {n: (statistics.median(r["rps"] for r in rows if r["name"] == n),
               statistics.median(r["cpu_ms"] for r in rows if r["name"] == n)) for n in names}
    base = med["AsyncOpenAI + semaphore"][0]
    for n in names:
        lines.append(f"| {n} | {med[n][0]:.0f} | {med[n][1]:.3f} | {med[n][0] / base:.1f}x |")
    text = "\n".join(lines)
    print("\n" + text)
    if not args.no_append:
        results = ROOT / "bench" / "RESULTS.md"
        old = results.read_text() if results.exists() else "# Benchmark results\n"
        header = "## Generation client overhead"
        if header not in old:
            old = old.rstrip("\n") + f"\n\n\n{header}\n"
        # append this run at the end of its section
        head, _, rest = old.partition(header)
        nxt = rest.find("\n## ")
        section, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        results.write_text(head + header + section.rstrip("\n") + "\n\n" + text + "\n" + tail)
        print(f"\nappended to {results}")


if __name__ == "__main__":
    main()
