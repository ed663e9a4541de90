"""Fault soak: random faults during generation jobs on a local sim fleet, exact accounting after each.

    .venv/bin/python bench/bench_faults.py [--jobs 4] [--rows 20000] [--faults-per-job 8] [--seed 1]

The fleet is launched through fleet's own path (LocalNode, plan_servers, launch, wait_ready), so
the runner relaunches servers with their launch specs exactly as on a GPU node. The runner runs as
its own process (`python -m fleet.generation.runner --job JOB.json`) at DEFAULT generation
settings (stall_s derived, 30 s floor; 20 s generation probe), and these faults are injected at
random moments, one at a time, on a server that is up:

- server-kill     SIGKILL of a server's process group (a crash)
- server-stop     SIGSTOP of a server, left stopped (a hang: the process lives, answers nothing)
- runner-kill     SIGKILL of the runner, then the same command again (resume)
- burst-5xx       SIGUSR1 to a sim: its next 30 generation requests answer HTTP 500
- relaunch-kill   SIGKILL of a server, then SIGKILL of its relaunch while it starts

Each job's input holds a few genuinely bad rows (prompts over the context: HTTP 400) and a few
malformed lines. After each job: `checks.account` (every input id in exactly one place, no
duplicate), errors == exactly the bad rows, rejects == exactly the malformed lines.

Measured per fault: detection (the server leaves `up` in progress.json: its rows go back to the
queue and flow to the others), back in use (`up` again with a new pid), and the capacity lost
(server-seconds out of service; for a runner kill, seconds with no runner and rows re-sent).
Prints a table and, unless --no-append, writes it to bench/RESULTS.md under "## Fault soak".

`soak_job()` is also what tests/test_gen_faults.py runs, small and with short stall settings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet.config import FleetConfig  # noqa: E402
from fleet.generation.checks import account  # noqa: E402
from fleet.generation.runner import ServerEntry  # noqa: E402
from fleet.generation.results import read_errors, read_rejects  # noqa: E402

KINDS = ("server-kill", "server-stop", "runner-kill", "burst-5xx", "relaunch-kill")


@dataclass
class Fault:
    kind: str
    server: int | None
    t: float                        # when injected (monotonic)
    at_rows: int = 0                # rows done when injected
    old_pid: int | None = None
    second_pid: int | None = None   # relaunch-kill: the relaunch that was killed too
    down_s: float | None = None     # injection → the server leaves `up` (its rows flow elsewhere)
    up_s: float | None = None       # injection → `up` again with a new process
    resumed_s: float | None = None  # runner-kill: → the new runner completes rows again
    resent: int | None = None       # runner-kill: rows done but not committed at the kill
    went_down: bool = False         # burst-5xx: did the burst take the server out (it should not)
    done: bool = False

    def open_on(self, server: int | None) -> bool:
        return not self.done and (server is None or self.server == server or self.kind == "runner-kill")


def write_input(path: Path, n: int, bad: int, malformed: int, rng: random.Random) -> tuple[set[str], set[str], int]:
    """n rows (ids j<k>), `bad` of them over the context (HTTP 400), plus `malformed` broken lines."""
    bad_at = set(rng.sample(range(n), bad))
    broken_at = set(rng.sample(range(n), malformed))
    ids, bad_ids = set(), set()
    lines = 0
    with path.open("w") as f:
        for i in range(n):
            if i in broken_at:
                f.write('{"id": "broken", "messages": [\n')
                lines += 1
            rid = f"j{i}"
            content = "word " * 9000 if i in bad_at else f"question {i}: tell me about topic {i % 97}"
            f.write(json.dumps({"id": rid, "messages": [{"role": "user", "content": content}]}) + "\n")
            lines += 1
            ids.add(rid)
            if i in bad_at:
                bad_ids.add(rid)
    return ids, bad_ids, malformed


def sim_config(workdir: Path, base_port: int, servers: int, *, tokens_per_s: float, slots: int, startup_s: float,
               max_tokens: int, generation: dict[str, Any] | None = None) -> FleetConfig:
    return FleetConfig(
        name="soak", nodes=[{"name": "local", "workdir": str(workdir)}],
        engine={"kind": "sim", "sim": {"startup_s": startup_s, "tokens_per_s": tokens_per_s,
                                       "max_running_requests": slots}},
        model={"source": "/dev/null/sim-model", "served_name": "sim-model"},
        servers={"count": servers, "base_port": base_port, "ready_timeout_s": 60, "stop_grace_s": 2},
        smoke={"first_timeout_s": 20, "timeout_s": 10, "attempts": 3, "backoff_s": 0.2},
        generation={"max_tokens": max_tokens, **(generation or {})},
    )


def launch_fleet(cfg: FleetConfig) -> list[ServerEntry]:
    from fleet.node import LocalNode
    from fleet.servers import launch, plan_servers, wait_ready

    node = LocalNode("local")
    entries = []
    for spec in plan_servers(cfg, cfg.nodes[0], [], model_path="/dev/shm/sim-model", python=sys.executable):
        res = launch(node, cfg, spec)
        ready = wait_ready(node, cfg, spec, res.pid)
        entries.append(ServerEntry(node="local", index=spec.index, url=ready.url, model="sim-model",
                                   spec={k: v for k, v in vars(spec).items() if k != "api_key"}))
    return entries


def stop_fleet(cfg: FleetConfig) -> None:
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    for i in range(cfg.servers.count):
        pid = server_pid(cfg, i)
        if pid:
            try:
                os.killpg(pid, signal.SIGCONT)   # a stopped group must act on the stop's TERM
            except OSError:
                pass
    stop_servers(LocalNode("local"), cfg, cfg.nodes[0])


def server_pid(cfg: FleetConfig, index: int) -> int | None:
    from fleet.servers import server_paths

    try:
        text = Path(server_paths(cfg.nodes[0].workdir, cfg.name, index).pid).read_text().strip()
    except OSError:
        return None
    first = text.split()[0] if text else ""   # "PID STARTTIME"
    return int(first) if first.isdigit() else None


def _progress(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return None


def _start_runner(job: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "fleet.generation.runner", "--job", str(job)], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


@dataclass
class JobResult:
    rows: int
    wall_s: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    account_ok: bool = False
    completed: int = 0
    errors: int = 0
    rejects: int = 0
    duplicated: int = 0
    missing: int = 0
    errors_exact: bool = False
    rejects_exact: bool = False
    runner_runs: int = 1
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.account_ok and self.errors_exact and self.rejects_exact and not self.problems


def soak_job(cfg: FleetConfig, entries: list[ServerEntry], work: Path, *, rows: int, faults: int, kinds: tuple[str, ...],
             rng: random.Random, first_after_s: float = 3.0, gap_s: tuple[float, float] = (3.0, 10.0),
             dispatch: dict[str, Any] | None = None, bad: int = 5, malformed: int = 3, deadline_s: float = 3600,
             progress_interval_s: float = 0.5, flush_interval_s: float = 30.0, log: Any = print) -> JobResult:
    """One job through the fleet with `faults` random faults of `kinds`; returns what happened.

    Every wait polls a condition (progress.json, pid files) with a deadline; nothing asserts speed.
    The sequence of `kinds` is cycled in a shuffled order so each kind appears."""
    work.mkdir(parents=True, exist_ok=True)
    inp, out = work / "input.jsonl", work / "out"
    ids, bad_ids, n_malformed = write_input(inp, rows, bad, malformed, rng)
    job = work / "job.json"
    job.write_text(json.dumps({
        "config": cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), "input": str(inp), "output": str(out),
        "servers": [asdict(e) for e in entries], "flush_interval_s": flush_interval_s,
        "progress_interval_s": progress_interval_s, "console_interval_s": 30, "stop_grace_s": 5,
        "dispatch": dict(dispatch or {}),
    }))
    runner_log = work / "runner.log"
    plan = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(plan)
    res = JobResult(rows=rows)
    t0 = time.monotonic()
    runner = _start_runner(job, runner_log)
    next_at = t0 + first_after_s
    open_faults: list[Fault] = []
    last_p: dict[str, Any] | None = None
    n_servers = len(entries)

    def state_of(p: dict[str, Any] | None, i: int) -> str | None:
        if not p or p.get("pid") != runner.pid or len(p.get("servers") or []) <= i:
            return None
        return p["servers"][i]["state"]

    while True:
        now = time.monotonic()
        if now - t0 > deadline_s:
            res.problems.append(f"job did not end within {deadline_s:.0f} s")
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
            break
        p = _progress(out)
        if p is not None:
            last_p = p
        rc = runner.poll()
        if rc is not None:
            if last_p and last_p.get("state") == "done" and last_p.get("pid") == runner.pid:
                if rc != 0:
                    res.problems.append(f"runner exited {rc} after done")
                break
            res.problems.append(f"runner exited {rc} in state {last_p and last_p.get('detail')}")
            break
        # follow the open faults
        for f in open_faults:
            if f.done:
                continue
            if f.kind == "runner-kill":
                if p and p.get("pid") == runner.pid and (p.get("this_run") or {}).get("completed", 0) > 0:
                    f.resumed_s, f.done = now - f.t, True
                continue
            st = state_of(p, f.server)  # type: ignore[arg-type]
            pid = server_pid(cfg, f.server)  # type: ignore[arg-type]
            if f.kind == "burst-5xx":
                f.went_down = f.went_down or (st is not None and st != "up")
                if now - f.t > 5:
                    f.done = True
                continue
            if f.down_s is None and st is not None and st != "up":
                f.down_s = now - f.t
            if f.kind == "relaunch-kill" and f.second_pid is None and pid and pid != f.old_pid:
                try:
                    os.killpg(pid, signal.SIGKILL)      # its relaunch, while it starts
                    f.second_pid = pid
                except OSError:
                    pass
            if f.down_s is not None and st == "up" and pid not in (None, f.old_pid, f.second_pid) and (
                    f.kind != "relaunch-kill" or f.second_pid is not None):
                f.up_s, f.done = now - f.t, True
        open_faults = [f for f in open_faults if not f.done]
        # inject the next one: one at a time, on a server that is up
        if plan and now >= next_at and not open_faults and p and p.get("pid") == runner.pid \
                and p.get("state") == "running" and (p.get("rows_total") or rows) - p["rows_done"] > rows * 0.15:
            kind = plan[0]
            up = [i for i in range(n_servers) if state_of(p, i) == "up"]
            if kind == "runner-kill" or len(up) == n_servers:
                plan.pop(0)
                server = None if kind == "runner-kill" else rng.choice(up)
                f = Fault(kind, server, time.monotonic(), at_rows=p["rows_done"])
                if kind == "runner-kill":
                    f.resent = p["rows_done"] - (p.get("committed") or 0)
                    os.killpg(runner.pid, signal.SIGKILL)
                    runner.wait()
                    runner = _start_runner(job, runner_log)
                    res.runner_runs += 1
                else:
                    f.old_pid = server_pid(cfg, server)  # type: ignore[arg-type]
                    sig = {"server-kill": signal.SIGKILL, "server-stop": signal.SIGSTOP, "burst-5xx": signal.SIGUSR1,
                           "relaunch-kill": signal.SIGKILL}[kind]
                    if sig == signal.SIGKILL:
                        os.killpg(f.old_pid, sig)  # type: ignore[arg-type]
                    else:
                        os.kill(f.old_pid, sig)  # type: ignore[arg-type]
                log(f"  t={f.t - t0:6.1f}s rows {f.at_rows:,}: {kind}" + (f" server {server}" if server is not None else ""))
                res.faults.append(f)
                open_faults.append(f)
                next_at = time.monotonic() + rng.uniform(*gap_s)
        time.sleep(0.1)
    res.wall_s = time.monotonic() - t0
    if plan:
        res.problems.append(f"{len(plan)} fault(s) not injected before the job ended")
    for f in res.faults:
        if not f.done and f.kind != "burst-5xx":
            res.problems.append(f"{f.kind} on server {f.server}: not recovered before the job ended")
    acc = account(inp, out)
    res.account_ok = bool(acc.get("ok"))
    res.duplicated, res.missing = int(acc["duplicated"]), int(acc["missing"])
    err_ids = {str(r["id"]) for r in read_errors(out)}
    res.errors = len(err_ids)
    res.errors_exact = err_ids == bad_ids
    if not res.errors_exact:
        res.problems.append(f"errors != the bad rows: extra {sorted(err_ids - bad_ids)[:5]}, "
                            f"missing {sorted(bad_ids - err_ids)[:5]}")
    rejects = list(read_rejects(out))
    res.rejects = len(rejects)
    res.rejects_exact = len(rejects) == n_malformed
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else {}
    res.completed = (manifest.get("counts") or {}).get("completed", 0)
    if not res.account_ok:
        res.problems.append(f"accounting: {json.dumps(acc, default=str)[:400]}")
    return res


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f}" if xs else "—"


def _max(xs: list[float]) -> str:
    return f"{max(xs):.1f}" if xs else "—"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--faults-per-job", type=int, default=8)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=64, help="running requests per sim server")
    ap.add_argument("--tokens-per-s", type=float, default=10.0, help="per stream: rows of ~2-3 s")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--startup-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline", action="store_true", help="first a job of the same size with no fault")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    import tempfile

    from fleet.demo import free_port_block

    rng = random.Random(args.seed)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="fleet-soak-"))
    port = free_port_block(args.servers, start=rng.randrange(20000, 50000, 100))
    cfg = sim_config(base / "work", port, args.servers, tokens_per_s=args.tokens_per_s, slots=args.slots,
                     startup_s=args.startup_s, max_tokens=args.max_tokens)
    print(f"soak in {base}: {args.servers} sim servers from port {port}, {args.jobs} jobs x {args.rows:,} rows, "
          f"{args.faults_per_job} faults each", flush=True)
    results: list[JobResult] = []
    baseline: JobResult | None = None
    try:
        entries = launch_fleet(cfg)
        if args.baseline:
            print("baseline job (no fault)", flush=True)
            baseline = soak_job(cfg, entries, base / "job-0", rows=args.rows, faults=0, kinds=KINDS, rng=rng)
            print(f"  {baseline.wall_s:.1f} s, ok {baseline.ok} {baseline.problems}", flush=True)
        for j in range(1, args.jobs + 1):
            print(f"job {j}", flush=True)
            r = soak_job(cfg, entries, base / f"job-{j}", rows=args.rows, faults=args.faults_per_job, kinds=KINDS,
                         rng=rng, first_after_s=5, gap_s=(3, 12), log=lambda s: print(s, flush=True))
            results.append(r)
            print(f"  job {j}: {r.wall_s:.1f} s, ok {r.ok}, completed {r.completed:,} errors {r.errors} rejects "
                  f"{r.rejects}, runner runs {r.runner_runs} {r.problems}", flush=True)
    finally:
        stop_fleet(cfg)

    faults = [f for r in results for f in r.faults]
    by_kind: dict[str, list[Fault]] = {k: [f for f in faults if f.kind == k] for k in KINDS}
    survived = sum(1 for r in results for f in r.faults if r.ok and (f.done or f.kind == "burst-5xx"))
    load = os.getloadavg()
    lines = [
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — "
        f"`{shlex.join(['.venv/bin/python', 'bench/bench_faults.py', *sys.argv[1:]])}`",
        "",
        f"- machine: {os.uname().sysname} {os.uname().machine}, nproc {os.cpu_count()}, shared with other work; "
        f"load average at the end {load[0]:.2f}",
        f"- {args.servers} sim servers launched by fleet (local node), {args.slots} running requests each, "
        f"{args.tokens_per_s:g} tokens/s per stream, max_tokens {args.max_tokens}; the runner as its own process "
        "at DEFAULT generation settings (stall_s derived: 30 s floor; generation probe 20 s)",
        f"- {len(results)} jobs x {args.rows:,} rows, each with 5 prompts over the context (must end in errors) and "
        "3 malformed lines (must be rejects)",
        "",
        "| job | faults | wall s | completed | errors (= bad rows) | rejects | duplicated | missing | runner runs | exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if baseline is not None:
        lines.append(f"| baseline | 0 | {baseline.wall_s:.1f} | {baseline.completed:,} | {baseline.errors} | "
                     f"{baseline.rejects} | {baseline.duplicated} | {baseline.missing} | 1 | {baseline.ok} |")
    for j, r in enumerate(results, 1):
        lines.append(f"| {j} | {len(r.faults)} | {r.wall_s:.1f} | {r.completed:,} | {r.errors} ({r.errors_exact}) | "
                     f"{r.rejects} | {r.duplicated} | {r.missing} | {r.runner_runs} | {r.ok} |")
    lines += [
        "",
        f"Faults injected: **{len(faults)}**, survived (job exact, server back in use): **{survived}**.",
        "",
        "| fault | n | to leave `up` (rows flow elsewhere) s, median / max | back in use s, median / max | "
        "capacity lost per fault |",
        "| --- | --- | --- | --- | --- |",
    ]
    n = args.servers
    for k in KINDS:
        fs = by_kind[k]
        if not fs:
            continue
        if k == "runner-kill":
            res_s = [f.resumed_s for f in fs if f.resumed_s is not None]
            resent = [f.resent or 0 for f in fs]
            lines.append(f"| {k} | {len(fs)} | — | runner completing rows again: {_med(res_s)} / {_max(res_s)} | "
                         f"whole fleet idle ≈ that long, plus a median {statistics.median(resent):,.0f} uncommitted "
                         "rows sent again |")
        elif k == "burst-5xx":
            downs = sum(f.went_down for f in fs)
            lines.append(f"| {k} | {len(fs)} | taken out: {downs} of {len(fs)} | — | the 30 rows retried "
                         "(charged one attempt each: a 5xx may be the row's) |")
        else:
            d = [f.down_s for f in fs if f.down_s is not None]
            u = [f.up_s for f in fs if f.up_s is not None]
            lost = statistics.median(u) / n if u else float("nan")
            lines.append(f"| {k} | {len(fs)} | {_med(d)} / {_max(d)} | {_med(u)} / {_max(u)} | one server of {n} for "
                         f"{_med(u)} s ≈ {lost:.1f} s of the whole fleet |")
    if baseline is not None and results:
        rate0 = baseline.completed / baseline.wall_s
        extra = [r.wall_s - r.completed / rate0 for r in results]
        lines += ["", f"Against the fault-free baseline ({rate0:.0f} rows/s): each job took "
                      f"{', '.join(f'{e:+.0f}' for e in extra)} s longer, "
                      f"≈ {sum(extra) / max(1, len(faults)):.1f} s per fault on average."]
    problems = [p for r in results for p in r.problems]
    if problems:
        lines += ["", "Problems: " + "; ".join(problems)]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    if not args.no_append:
        path = ROOT / "bench" / "RESULTS.md"
        old = path.read_text()
        header = "## Fault soak"
        if header not in old:
            old = old.rstrip("\n") + f"\n\n{header}\n"
        head, _, rest = old.partition(header)
        nxt = rest.find("\n## ")
        section, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
        path.write_text(head + header + section.rstrip("\n") + "\n\n" + text + "\n" + tail)
        print(f"\nwritten to {path}")
    return 0 if all(r.ok for r in results) and (baseline is None or baseline.ok) else 1


if __name__ == "__main__":
    sys.exit(main())
