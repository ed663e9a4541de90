"""`fleet up` on a fleet that is already up: one Prefect server per command (before) vs the
shared local server (flows/localserver.py), side by side in one run.

    .venv/bin/python bench/bench_localserver.py [--reps 5] [--servers 2] [--old-rev REV | --old-dir DIR] [--out F]

The old path is the code just before flows/localserver.py was added (`git archive` of
`--old-rev`, default the parent of the commit that added it), run with this venv's Python from
that directory, so its `flows`/`fleet` are the old ones (`--old-dir`: such a tree extracted
beforehand, for a machine without the git history). Each path has its own PREFECT_HOME
(its own database); both adopt the same sim fleet. After one warm-up command per path (it
brings the fleet up, creates the database and, on the new path, starts the local server),
the two alternate (old, new, new, old, …) so load drifts hit both alike. Per command: wall
seconds, CPU seconds of the command and the children it waited for (the old path's server
among them), CPU seconds the shared server spent meanwhile (new path), the flow's own
"up in X s", and the load average. Prints a markdown table; `fleet down` and the local
server's stop at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet.demo import free_port_block, to_toml  # noqa: E402
from flows.localserver import read_record, stop  # noqa: E402


def old_tree(rev: str | None, dest: Path) -> str:
    if rev is None:
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "flows/localserver.py"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        rev = f"{added[-1]}^"
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return rev


def sim_config(d: Path, servers: int) -> Path:
    data = {"name": "bench-localserver", "nodes": [{"name": "local", "workdir": str(d / "work")}],
            "engine": {"kind": "sim", "sim": {"startup_s": 2.0, "first_request_delay_s": 1.0}},
            "model": {"served_name": "sim-model"}, "venv": {"path": str(d / "venv")},
            "servers": {"count": servers, "base_port": free_port_block(servers, start=30600)},
            "smoke": {"first_timeout_s": 30.0, "timeout_s": 10.0}}
    path = d / "bench.toml"
    path.write_text(to_toml(data))
    return path


def server_cpu(home: Path) -> float:
    rec = read_record(home / "fleet-server")
    if rec is None:
        return 0.0
    try:
        f = Path(f"/proc/{rec.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def up(cwd: Path, home: Path, cfg: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"))
    load = os.getloadavg()[0]
    before, srv = resource.getrusage(resource.RUSAGE_CHILDREN), server_cpu(home)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flows.cli", "up", "-c", str(cfg)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"fleet up failed in {cwd}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    flow = re.search(r"up in ([\d.]+) s", r.stdout)
    return {"wall_s": wall, "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "server_cpu_s": server_cpu(home) - srv, "flow_s": float(flow.group(1)) if flow else float("nan"),
            "load": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--old-rev", default=None)
    ap.add_argument("--old-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-localserver-"))
    old = args.old_dir.resolve() if args.old_dir else d / "old"
    if args.old_dir:
        rev = args.old_rev or str(old)
    else:
        old.mkdir()
        rev = old_tree(args.old_rev, old)
    cfg = sim_config(d, args.servers)
    paths = {"old": (old, d / "home-old"), "new": (ROOT, d / "home-new")}
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    try:
        for name, (cwd, home) in paths.items():
            print(f"warm-up {name}: {json.dumps(up(cwd, home, cfg))}", flush=True)
        for i in range(args.reps):
            for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
                res = up(*paths[name], cfg)
                runs[name].append(res)
                print(f"rep {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
    finally:
        subprocess.run([sys.executable, "-m", "flows.cli", "down", "-c", str(cfg)], cwd=ROOT, capture_output=True)
        stop(paths["new"][1] / "fleet-server")
        shutil.rmtree(d, ignore_errors=True)
    print(f"\nold = {rev}; {args.reps} interleaved reps per path, {args.servers} sim servers adopted each time\n")
    print("| path | wall s (median, min–max) | command CPU s (median) | shared server CPU s (median) "
          "| flow's own s (median) | load (1 min) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rs in runs.items():
        col = {k: [r[k] for r in rs] for k in rs[0]}
        print(f"| {name} | {statistics.median(col['wall_s']):.2f} ({min(col['wall_s']):.2f}–{max(col['wall_s']):.2f}) "
              f"| {statistics.median(col['cpu_s']):.2f} | {statistics.median(col['server_cpu_s']):.2f} "
              f"| {statistics.median(col['flow_s']):.2f} | {min(col['load']):.1f}–{max(col['load']):.1f} |")
    ratio = statistics.median(r["wall_s"] for r in runs["old"]) / statistics.median(r["wall_s"] for r in runs["new"])
    print(f"\nwall old/new (medians): {ratio:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"old": rev, "cpus": os.cpu_count(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
