"""`fleet up` on a fleet that is already up, and `fleet generate` re-attaching to a live runner:
an older tree (default: one Prefect server per command, before flows/localserver.py) vs this
one, side by side in one run.

    .venv/bin/python bench/bench_localserver.py [--reps 5] [--servers 2] [--old-rev REV | --old-dir DIR]
                                                [--generate] [--out F]

The old path is the code just before flows/localserver.py was added (`git archive` of
`--old-rev`, default the parent of the commit that added it), run with this venv's Python from
that directory, so its `flows`/`fleet` are the old ones (`--old-dir`: such a tree extracted
beforehand, for a machine without the git history). Each path has its own PREFECT_HOME
(its own database); both adopt the same sim fleet. After one warm-up command per path (it
brings the fleet up, creates the database and, on the new path, starts the local server),
the two alternate (old, new, new, old, …) so load drifts hit both alike. Both trees run from
compiled bytecode (compileall first, as a machine that writes bytecode has after a first run). Per command: wall
seconds, CPU seconds of the command and the children it waited for (the old path's server
among them), CPU seconds the shared server spent meanwhile (new path), the flow's own
"up in X s", and the load average. Prints a markdown table; `fleet down` and the local
server's stop at the end.

The idle device machine: bench/bench_localserver_device.sh (installs the carried wheels, then runs
this with `--old-dir`, `--generate` and 6 reps; prints the tables below).

Each rep also runs `fleet status` of the same fleet first (Prefect-free: the yardstick of "an
adopt costs little more than what it does", issue 37), and the tables end with each command's CPU
over it.

`--generate` adds `fleet generate` re-attaching: a second sim fleet (one request at a time per
server, long answers: the job outlasts the bench) gets a job started once by this tree; then each
path runs the same `fleet generate` command, which re-attaches to that runner. Measured per
command: seconds to its first line (the plan, Prefect-free: "re-attaching to the runner …"), to
the flow's "re-attached to runner pid …" line, and the command's CPU seconds at that moment (its
/proc stat, children included); then it gets a Ctrl-C (the runner is detached and goes on). Also
when it reached each phase (the flow run begins, the servers adopted, the last smoke task done),
its longest smoke task, and how many smokes a live job's progress made unnecessary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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


def sim_config(d: Path, servers: int, name: str = "bench-localserver", port: int = 30600,
               **extra: dict[str, object]) -> Path:
    sim: dict[str, object] = {"startup_s": 2.0, "first_request_delay_s": 1.0}
    sim.update(extra.pop("sim", {}))
    data = {"name": name, "nodes": [{"name": "local", "workdir": str(d / "work")}],
            "engine": {"kind": "sim", "sim": sim},
            "model": {"served_name": "sim-model"}, "venv": {"path": str(d / "venv")},
            "servers": {"count": servers, "base_port": free_port_block(servers, start=port)},
            "smoke": {"first_timeout_s": 30.0, "timeout_s": 10.0}, **extra}
    path = d / f"{name}.toml"
    path.write_text(to_toml(data))
    return path


def gen_config(d: Path, servers: int) -> tuple[Path, Path]:
    """A fleet whose job outlasts the bench (one 2,048-token answer at a time per server, 20,000
    rows) and its input."""
    cfg = sim_config(d, servers, name="bench-reattach", port=30700,
                     sim={"tokens_per_s": 1000.0, "max_running_requests": 1},
                     generation={"max_tokens": 2048, "max_concurrency_per_server": 1})
    rows = d / "rows.jsonl"
    with rows.open("w") as f:
        for i in range(20_000):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"row {i}"}]}) + "\n")
    return cfg, rows


def server_cpu(home: Path) -> float:
    rec = read_record(home / "fleet-server")
    if rec is None:
        return 0.0
    try:
        f = Path(f"/proc/{rec.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def command_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"), PYTHONUNBUFFERED="1")
    return env


def tree_cpu(pid: int) -> float:
    """CPU seconds of a running process and the children it has waited for."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


# When a re-attaching command reaches each phase (seconds from its start): the flow run begins
# (Python, Prefect's import, the flow module and attaching are before it), it holds the node lock,
# the servers are adopted ("launching"), every smoke task has ended, then "re-attached".
PHASES = (("flow_begins_s", "Beginning flow run"), ("lock_held_s", "generate-bringup: holding"),
          ("launching_s", "launching "))
SMOKE_DONE = re.compile(r"smoke \S+ server \d+: done in ([\d.]+) s")


def reattach(cwd: Path, home: Path, cfg: Path, rows: Path, out: Path, want: str = "re-attached to") -> dict[str, float]:
    """`fleet generate` until the flow says `want` about the runner, then Ctrl-C."""
    load = os.getloadavg()[0]
    srv = server_cpu(home)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "generate", "-c", str(cfg), "--input", str(rows),
                             "--output", str(out)], cwd=cwd, env=command_env(home), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    got: dict[str, float] = {}
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            now = time.monotonic() - t0
            if "first_line_s" not in got:
                got["first_line_s"] = now
            for key, mark in PHASES:
                if key not in got and mark in line:
                    got[key] = now
            m = SMOKE_DONE.search(line)
            if m and not seen.is_set():   # the smoke tasks' own seconds, and when the last one ended
                got["smoke_task_s"] = max(got.get("smoke_task_s", 0.0), float(m.group(1)))
                got["smokes_done_s"] = now
            if "no smoke request sent" in line and not seen.is_set():
                got["smokes_skipped"] = got.get("smokes_skipped", 0) + 1
            if want in line and not seen.is_set():
                got["attached_s"] = time.monotonic() - t0
                got["cpu_s"] = tree_cpu(proc.pid)
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while not seen.wait(0.2) and proc.poll() is None and time.monotonic() < deadline:
        pass
    ok = seen.is_set()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(10)
    if not ok:
        sys.exit(f"fleet generate in {cwd} never said {want!r}:\n{''.join(lines)[-3000:]}")
    return {**got, "server_cpu_s": server_cpu(home) - srv, "load": load}


def stop_runner(out: Path, wait_s: float = 60.0, pattern: str = "*.pid") -> None:
    """SIGTERM what still runs of the bench's fleets (the runner and servers: their pid files under `work`)
    and wait for it to be gone: the runner writes its manifest as it stops, into the temp dir removed next."""
    pids = []
    for pid_file in out.rglob(pattern):
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    deadline = time.monotonic() + wait_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def up(cwd: Path, home: Path, cfg: Path) -> dict[str, float]:
    env = command_env(home)
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


def status(cwd: Path, home: Path, cfg: Path) -> dict[str, float]:
    """`fleet status` of the same fleet (Prefect-free): the yardstick of issue 37's "within 2.5x"."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flows.cli", "status", "-c", str(cfg)], cwd=cwd, env=command_env(home),
                       capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"fleet status failed in {cwd}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return {"wall_s": wall, "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--old-rev", default=None)
    ap.add_argument("--old-dir", type=Path, default=None)
    ap.add_argument("--generate", action="store_true", help="also `fleet generate` re-attaching to a live runner")
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
    for tree, _ in paths.values():
        # Bytecode for both trees, as any machine has after a first run: here PYTHONDONTWRITEBYTECODE=1
        # would make every command compile the project's sources again (~0.2 s of CPU).
        subprocess.run([sys.executable, "-m", "compileall", "-q", *[str(tree / p) for p in ("fleet", "flows", "tasks",
                                                                                           "blocks")]], check=True)
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    gens: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    stats: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    gcfg, rows = gen_config(d, args.servers) if args.generate else (None, None)
    try:
        for name, (cwd, home) in paths.items():
            print(f"warm-up {name}: {json.dumps(up(cwd, home, cfg))}", flush=True)
        if gcfg and rows:
            print(f"job start (new): {json.dumps(reattach(ROOT, paths['new'][1], gcfg, rows, d / 'out', 'started'))}")
            for name, (cwd, home) in paths.items():
                print(f"warm-up generate {name}: {json.dumps(reattach(cwd, home, gcfg, rows, d / 'out'))}", flush=True)
        for i in range(args.reps):
            for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
                res = status(*paths[name], cfg)
                stats[name].append(res)
                print(f"rep {i + 1} {name} status: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
                res = up(*paths[name], cfg)
                runs[name].append(res)
                print(f"rep {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
                if gcfg and rows:
                    res = reattach(*paths[name], gcfg, rows, d / "out")
                    gens[name].append(res)
                    print(f"rep {i + 1} {name} generate: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()),
                          flush=True)
    finally:
        # the job's runner first: alive, it relaunches the servers `fleet down` stops (left running then)
        stop_runner(d / "work", pattern="runner.pid")
        for c in (cfg, gcfg):
            if c:
                subprocess.run([sys.executable, "-m", "flows.cli", "down", "-c", str(c)], cwd=ROOT,
                               env=command_env(paths["new"][1]), capture_output=True)
        stop_runner(d / "work")
        for _, home in paths.values():
            stop(home / "fleet-server")
        shutil.rmtree(d, ignore_errors=True)
    print(f"\nold = {rev}; {args.reps} interleaved reps per path, {args.servers} sim servers adopted each time; "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}\n")
    print("| `fleet up`, running fleet | wall s (median, min–max) | every rep, wall s | command CPU s (median) "
          "| shared server CPU s (median) | flow's own s (median) | load (1 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rs in runs.items():
        col = {k: [r[k] for r in rs] for k in rs[0]}
        print(f"| {name} | {statistics.median(col['wall_s']):.2f} ({min(col['wall_s']):.2f}–{max(col['wall_s']):.2f}) "
              f"| {', '.join(f'{w:.2f}' for w in col['wall_s'])} "
              f"| {statistics.median(col['cpu_s']):.2f} | {statistics.median(col['server_cpu_s']):.2f} "
              f"| {statistics.median(col['flow_s']):.2f} | {min(col['load']):.1f}–{max(col['load']):.1f} |")
    ratio = statistics.median(r["wall_s"] for r in runs["old"]) / statistics.median(r["wall_s"] for r in runs["new"])
    cpu = statistics.median(r["cpu_s"] for r in runs["old"]) / statistics.median(r["cpu_s"] for r in runs["new"])
    print(f"\nfleet up, old/new (medians): wall {ratio:.2f}x, command CPU {cpu:.2f}x")
    if gens["new"]:
        print("\n`fleet generate` re-attaching to a live runner\n")
        print("| path | first line s (median) | re-attached s (median, min–max) | every rep, s | command CPU s by "
              "then (median) | shared server CPU s (median) | load (1 min) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, rs in gens.items():
            col = {k: [r[k] for r in rs] for k in ("first_line_s", "attached_s", "cpu_s", "server_cpu_s", "load")}
            print(f"| {name} | {statistics.median(col['first_line_s']):.2f} "
                  f"| {statistics.median(col['attached_s']):.2f} ({min(col['attached_s']):.2f}–"
                  f"{max(col['attached_s']):.2f}) | {', '.join(f'{w:.2f}' for w in col['attached_s'])} "
                  f"| {statistics.median(col['cpu_s']):.2f} "
                  f"| {statistics.median(col['server_cpu_s']):.2f} | {min(col['load']):.1f}–{max(col['load']):.1f} |")
        print("\nWhere a re-attach's wall goes (medians, s from the command's start): the flow run begins, the "
              "servers are adopted, the last smoke task ends, re-attached; the longest smoke task; smokes not sent\n")
        print("| path | flow begins | launching | smokes done | re-attached | longest smoke task | smokes skipped "
              "(per rep) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, rs in gens.items():
            def med(k: str) -> str:
                xs = [r[k] for r in rs if k in r]
                return f"{statistics.median(xs):.2f}" if xs else "-"
            print(f"| {name} | {med('flow_begins_s')} | {med('launching_s')} | {med('smokes_done_s')} "
                  f"| {med('attached_s')} | {med('smoke_task_s')} "
                  f"| {', '.join(str(int(r.get('smokes_skipped', 0))) for r in rs)} |")
        g = {n: statistics.median(r["attached_s"] for r in rs) for n, rs in gens.items()}
        print(f"\nfleet generate re-attaching, old/new (medians): wall {g['old'] / g['new']:.2f}x")
    print("\n`fleet status` of the same fleet, and each command's CPU over it (medians; user+sys)\n")
    print("| path | status wall s | status CPU s | up CPU ÷ status CPU | generate re-attach CPU ÷ status CPU |")
    print("| --- | --- | --- | --- | --- |")
    for name, rs in stats.items():
        st = statistics.median(r["cpu_s"] for r in rs)
        upc = statistics.median(r["cpu_s"] for r in runs[name])
        gen = f"{statistics.median(r['cpu_s'] for r in gens[name]) / st:.2f}" if gens[name] else "-"
        print(f"| {name} | {statistics.median(r['wall_s'] for r in rs):.2f} | {st:.2f} | {upc / st:.2f} | {gen} |")
    if args.out:
        args.out.write_text(json.dumps({"old": rev, "cpus": os.cpu_count(), "runs": runs, "generate": gens,
                                        "status": stats},
                                       indent=1))


if __name__ == "__main__":
    main()
