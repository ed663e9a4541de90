"""What a flow command costs over what it does (issue 37, item 2): `fleet status` vs an adopt-only
`fleet up` (the quick path, flows/quickup.py) vs the same `fleet up` through the flow's engine
(FLEET_QUICK_UP=0) vs `fleet generate` re-attaching to a live runner — one fleet, one PREFECT_HOME,
side by side, alternated.

    .venv/bin/python bench/bench_flow_overhead.py [--reps 5] [--servers 2] [--no-generate] [--out F]

One sim fleet of `--servers` servers is brought up once (the flow: it also learns the task keys the
quick path records under); with `--generate` (default) a second sim fleet gets a job that outlasts the
bench, started once. Then each rep runs, in an order that rotates every rep: `fleet status`, `fleet
up` (quick), `fleet up` with FLEET_QUICK_UP=0 (the flow), and `fleet generate` until its "re-attached
to runner" line (then Ctrl-C; the runner is detached and goes on), quick (flows/quickgen.py) and with
FLEET_QUICK_UP=0. Per command: wall seconds, CPU
seconds (the command and the children it waited for; for the re-attach, its /proc stat at that line),
the local Prefect server's CPU meanwhile, and the load average. Prints medians and each command's
ratio to `fleet status`; `fleet down`, the runner's stop and the local server's stop at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_localserver import command_env, gen_config, reattach, sim_config, status, stop_runner, up  # noqa: E402
from flows.localserver import stop  # noqa: E402


def _flow(command: Any, *args: Any) -> dict[str, float]:
    """The same command through the flow's engine (FLEET_QUICK_UP=0: no quick path)."""
    os.environ["FLEET_QUICK_UP"] = "0"
    try:
        return dict(command(*args))
    finally:
        del os.environ["FLEET_QUICK_UP"]


def _flow_up(cwd: Path, home: Path, cfg: Path) -> dict[str, float]:
    return _flow(up, cwd, home, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-flow-overhead-"))
    home = d / "home"
    cfg = sim_config(d, args.servers, name="bench-overhead", port=30800)
    subprocess.run([sys.executable, "-m", "compileall", "-q", *[str(ROOT / p) for p in ("fleet", "flows", "tasks",
                                                                                       "blocks")]], check=True)
    gcfg, rows = (None, None) if args.no_generate else gen_config(d, args.servers)
    commands = {"status": lambda: status(ROOT, home, cfg), "up (quick)": lambda: up(ROOT, home, cfg),
                "up (flow)": lambda: _flow_up(ROOT, home, cfg)}
    if gcfg and rows:
        commands["generate re-attach"] = lambda: reattach(ROOT, home, gcfg, rows, d / "out")
        commands["generate re-attach (flow)"] = lambda: _flow(reattach, ROOT, home, gcfg, rows, d / "out")
    res: dict[str, list[dict[str, float]]] = {k: [] for k in commands}
    try:
        print(f"warm-up (the flow launches): {json.dumps(_flow_up(ROOT, home, cfg))}", flush=True)
        if gcfg and rows:
            print(f"job start: {json.dumps(reattach(ROOT, home, gcfg, rows, d / 'out', 'started'))}", flush=True)
        names = list(commands)
        for i in range(args.reps):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                r = commands[name]()
                res[name].append(r)
                print(f"rep {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    finally:
        stop_runner(d / "work", pattern="runner.pid")
        for c in (cfg, gcfg):
            if c:
                subprocess.run([sys.executable, "-m", "flows.cli", "down", "-c", str(c)], cwd=ROOT,
                               env=command_env(home), capture_output=True)
        stop_runner(d / "work")
        stop(home / "fleet-server")
        shutil.rmtree(d, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in res[name])

    wall_key = {"generate re-attach": "attached_s", "generate re-attach (flow)": "attached_s"}
    base_wall, base_cpu = med("status", "wall_s"), med("status", "cpu_s")
    print(f"\n{args.reps} reps, order rotated each rep; {args.servers} sim servers; {os.cpu_count()} CPUs; "
          f"load (1 min) {min(r['load'] for r in res['up (quick)']):.1f}–{max(r['load'] for r in res['up (quick)']):.1f}"
          f" at the quick ups\n")
    print("| command | wall s (median, min–max) | every rep, wall s | CPU s (median) | wall ÷ status | CPU ÷ status |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in res:
        wk = wall_key.get(name, "wall_s")
        walls = [r[wk] for r in res[name]]
        print(f"| {name} | {statistics.median(walls):.2f} ({min(walls):.2f}–{max(walls):.2f}) | "
              f"{', '.join(f'{w:.2f}' for w in walls)} | {med(name, 'cpu_s'):.2f} | "
              f"{statistics.median(walls) / base_wall:.2f} | {med(name, 'cpu_s') / base_cpu:.2f} |")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
