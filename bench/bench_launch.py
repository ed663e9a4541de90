"""Parallel launch and crash detection, with the sim engine on the local node.

    .venv/bin/python bench/bench_launch.py [--startup-s 5] [--ns 1,4,8,16] [--crash-trials 5]

1. Time to N healthy sim servers (each takes --startup-s to become ready), launched in parallel
   the way the flow's launch stage does (one thread per server: launch + wait_ready), for each N;
   t(N)/t(1) is the overhead of launching in parallel. Goal: <= 1.2 at N = 8.
2. Crash detection: a server that hangs at start is SIGKILLed at a known moment; the seconds
   from its death to wait_ready raising ServerFailed. Goal: <= 2 s.
Appends a section to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from fleet.config import FleetConfig
from fleet.demo import free_port_block
from fleet.errors import ServerFailed
from fleet.node import LocalNode
from fleet.servers import launch, plan_servers, stop_servers, wait_ready


def config(work: Path, n: int, startup_s: float, base: int, extra: dict | None = None) -> FleetConfig:
    import sys

    return FleetConfig(name="bench", nodes=[{"name": "local", "workdir": str(work)}],
                       engine={"kind": "sim", "sim": {"startup_s": startup_s}},
                       servers={"count": n, "base_port": base, "ready_timeout_s": 120, "stop_grace_s": 2,
                                "extra_args_by_index": extra or {}},
                       venv={"path": sys.prefix, "use_existing": True})


def time_to_healthy(n: int, startup_s: float) -> float:
    import sys

    with tempfile.TemporaryDirectory() as d:
        cfg = config(Path(d), n, startup_s, free_port_block(n, start=40000))
        node = LocalNode()
        specs = plan_servers(cfg, cfg.nodes[0], [], model_path="/dev/shm/sim", python=sys.executable)
        t0 = time.monotonic()

        def one(spec):  # the launch task's body
            started = launch(node, cfg, spec)
            wait_ready(node, cfg, spec, started.pid, poll_s=0.5)

        try:
            with ThreadPoolExecutor(max_workers=32) as pool:
                list(pool.map(one, specs))
            return time.monotonic() - t0
        finally:
            stop_servers(node, cfg, cfg.nodes[0])


def crash_detection() -> float:
    import sys

    with tempfile.TemporaryDirectory() as d:
        cfg = config(Path(d), 1, 1.0, free_port_block(1, start=45000), {0: ["--hang-at-start"]})
        node = LocalNode()
        spec = plan_servers(cfg, cfg.nodes[0], [], model_path="/dev/shm/sim", python=sys.executable)[0]
        started = launch(node, cfg, spec)
        died_at: list[float] = []

        def killer():
            # a random moment, so the death does not line up with the 0.5 s polling phase
            time.sleep(2.0 + random.random())
            os.killpg(started.pid, signal.SIGKILL)
            died_at.append(time.monotonic())

        threading.Thread(target=killer, daemon=True).start()
        try:
            wait_ready(node, cfg, spec, started.pid, poll_s=0.5)
        except ServerFailed:
            return time.monotonic() - died_at[0]
        finally:
            stop_servers(node, cfg, cfg.nodes[0])
        raise RuntimeError("the dead server was reported ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--startup-s", type=float, default=5.0)
    ap.add_argument("--ns", default="1,4,8,16")
    ap.add_argument("--crash-trials", type=int, default=5)
    ap.add_argument("--results", default=str(Path(__file__).parent / "RESULTS.md"))
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    times = {}
    for n in ns:  # one round each; N = 1 first and again last to see drift
        times[n] = time_to_healthy(n, args.startup_s)
        print(f"N={n:>2}: {times[n]:.2f} s", flush=True)
    t1_again = time_to_healthy(1, args.startup_s)
    crash = [crash_detection() for _ in range(args.crash_trials)]
    lines = [
        "", "## Parallel launch and crash detection (sim engine, local node)", "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC — `.venv/bin/python bench/bench_launch.py "
        f"--startup-s {args.startup_s:g} --ns {args.ns} --crash-trials {args.crash_trials}`", "",
        f"- host: {platform.node()}, {platform.platform()}, {os.cpu_count()} CPUs; load average at the end "
        f"{os.getloadavg()[0]:.2f}",
        f"- each sim server becomes ready {args.startup_s:g} s after start; launch + readiness polling "
        "(every 0.5 s: process alive, new log bytes, GET /health) run in one thread per server, as in the flow", "",
        "| N servers | seconds to all healthy | t(N)/t(1) |", "| --- | --- | --- |",
    ]
    for n in ns:
        lines.append(f"| {n} | {times[n]:.2f} | {times[n] / times[ns[0]]:.2f} |")
    lines += [f"| 1 (again, at the end) | {t1_again:.2f} | {t1_again / times[ns[0]]:.2f} |", "",
              f"Crash detection (SIGKILL of a starting server → wait_ready raises), {len(crash)} trials: "
              f"median {statistics.median(crash):.2f} s, max {max(crash):.2f} s.", ""]
    text = "\n".join(lines)
    print(text)
    with open(args.results, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
