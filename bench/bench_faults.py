"""Fault soak: random faults during generation jobs on a local sim fleet, exact accounting after each.

    .venv/bin/python bench/bench_faults.py [--jobs 4] [--rows 20000] [--faults-per-job 8] [--seed 1]

The fleet is launched through fleet's own path (LocalNode, plan_servers, launch, wait_ready), so
the runner relaunches servers with their launch specs exactly as on a GPU node. The runner runs as
its own process (`python -m fleet.generation.job.runner --job JOB.json`) at DEFAULT generation
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

`--garbage` (issue 23): the fuzz of tests/test_gen_answers.py, longer — `--jobs` jobs of `--rows` rows,
each through a good sim and a stand-in server (bench/garbage.py) whose answers hypothesis draws
(mistyped, malformed, cut, oversized, slow, dribbled bodies, wrong statuses; `--seed` picks them).
After each: exit 0, every id exactly once, every row done by the good sim (none in errors or quality
rejects), the bad server out with its reason.

`--node-loss` (issue 14): jobs over two local nodes through the multi-node controller, each losing
a node twice (`soak_nodes`: frozen, then back: it must rejoin; killed, like a reboot); after each,
every input id exactly once in the merge. tests/test_gen_faults.py runs it small too.
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
from fleet.generation.data.checks import account  # noqa: E402
from fleet.generation.job.runner import ServerEntry  # noqa: E402
from fleet.generation.data.results import read_errors, read_rejects  # noqa: E402

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
    return subprocess.Popen([sys.executable, "-m", "fleet.generation.job.runner", "--job", str(job)], cwd=ROOT, env=env,
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


# ---------------------------------------------------------------------------- node loss (issue 14)

NODE_KINDS = ("node-freeze", "node-kill")


def two_node_config(workdir: Path, base_port: int, *, tokens_per_s: float, slots: int, startup_s: float,
                    max_tokens: int, generation: dict[str, Any] | None = None) -> FleetConfig:
    """Two local nodes on this machine, "a" with 2 sim servers and "b" with 1, each with its own workdir."""
    nodes = []
    for name, servers, port in (("a", 2, base_port), ("b", 1, base_port + 2)):
        (workdir / f"shm-{name}").mkdir(parents=True, exist_ok=True)
        nodes.append({"name": name, "workdir": str(workdir / f"work-{name}"), "servers": servers,
                      "base_port": port, "ramdisk": str(workdir / f"shm-{name}")})
    return FleetConfig(
        name="soakmn", nodes=nodes,
        engine={"kind": "sim", "sim": {"startup_s": startup_s, "tokens_per_s": tokens_per_s,
                                       "max_running_requests": slots}},
        model={"source": "/dev/null/sim-model", "served_name": "sim-model"},
        venv={"path": sys.prefix, "use_existing": True},
        servers={"ready_timeout_s": 60, "stop_grace_s": 2},
        smoke={"first_timeout_s": 20, "timeout_s": 10, "attempts": 3, "backoff_s": 0.2},
        generation={"max_tokens": max_tokens, **(generation or {})},
    )


def launch_nodes(cfg: FleetConfig) -> dict[str, list[Any]]:
    """Every node's sim servers, launched and ready (fleet's own launch path): specs per node."""
    from fleet.node import LocalNode
    from fleet.servers import launch, plan_servers, wait_ready

    out: dict[str, list[Any]] = {}
    for n in cfg.nodes:
        node = LocalNode(n.name)
        out[n.name] = []
        for spec in plan_servers(cfg, n, [], model_path="/dev/shm/sim-model", python=sys.executable):
            wait_ready(node, cfg, spec, launch(node, cfg, spec).pid)
            out[n.name].append(spec)
    return out


def stop_nodes(cfg: FleetConfig) -> None:
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    for n in cfg.nodes:
        for pid in _node_pids(Path(n.workdir)):
            try:
                os.kill(pid, signal.SIGCONT)   # a stopped process must act on the stop's TERM
            except OSError:
                pass
        for pid in _node_pids(Path(n.workdir), servers=False):
            try:
                os.kill(pid, signal.SIGKILL)   # runners the soak left behind (a lost node's)
            except OSError:
                pass
        stop_servers(LocalNode(n.name), cfg, n)


def _node_pids(workdir: Path, *, runners: bool = True, servers: bool = True) -> list[int]:
    """Live runner and/or server pids of a local node (its workdir's pid files)."""
    from fleet.node import LocalNode

    files = [*(workdir.glob("jobs/*/runner.pid") if runners else []), *(workdir.glob("servers/*.pid") if servers else [])]
    out = []
    for f in files:
        try:
            first = (f.read_text().split() or ["0"])[0]
        except OSError:
            continue
        if first.isdigit() and int(first) and LocalNode().is_alive(int(first)):
            out.append(int(first))
    return out


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _open_attempt(ctl: Any, node: str, index: int) -> int | None:
    """The position of `node`'s attempt on chunk `index` that has not ended, or None."""
    attempts = ctl.assign.chunks[index].attempts
    return next((i for i in range(len(attempts) - 1, -1, -1)
                 if attempts[i].node == node and attempts[i].outcome is None), None)


def _chunk_complete(out: Path) -> bool:
    """Has the runner of this (local) chunk output written its complete manifest?"""
    from fleet.generation.data.manifest import MANIFEST_FILE

    try:
        return bool(json.loads((out / MANIFEST_FILE).read_text()).get("complete"))
    except (OSError, ValueError):
        return False


@dataclass
class NodeFault:
    kind: str
    node: str
    t: float
    chunk: int | None = None
    pids: list[int] = field(default_factory=list)
    attempt: int | None = None        # the node's attempt on `chunk` still open when the loss was injected
    lost_s: float | None = None       # injection → the controller ended that attempt: the chunk back in the queue
    back_s: float | None = None       # node-freeze: the node resumed → the controller sees it rejoin
    resumed_at: float | None = None


@dataclass
class NodeSoak:
    rows: int
    wall_s: float = 0.0
    faults: list[NodeFault] = field(default_factory=list)
    account_ok: bool = False
    completed: int = 0
    duplicated: int = 0
    missing: int = 0
    duplicates_dropped: int = 0
    errors_exact: bool = False
    rejects_exact: bool = False
    chunks: int = 0
    rows_by_node: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.account_ok and self.errors_exact and self.rejects_exact and not self.problems


def soak_nodes(cfg: FleetConfig, specs: dict[str, list[Any]], work: Path, *, rows: int, kinds: tuple[str, ...],
               rng: random.Random, bad: int = 3, malformed: int = 2, deadline_s: float = 1800,
               controller: dict[str, Any] | None = None, log: Any = print) -> NodeSoak:
    """One job over the nodes of `cfg` (the Prefect-free multi-node controller, one thread per node) with
    one node lost per entry of `kinds`, one at a time, each while that node runs a chunk it has committed
    shards of and has not finished (the node is frozen first and its chunk checked: still open, no complete
    manifest; else it is let go and another chunk is picked later):

    - node-freeze: SIGSTOP of the node's runner and servers (a hung machine: no progress, no answer);
      once the controller has marked it lost, SIGCONT (the machine is back): it must rejoin.
    - node-kill: SIGKILL of the node's runner and servers (a reboot); the chunk fails back to the queue
      (the node still answers, so it may claim that chunk again itself); the next runner there relaunches
      its servers.

    A loss counts as handled (`lost_s`) when the controller has ended the node's attempt that the loss cut
    short (lost or failed): a state that stays, not "the chunk is on another node", which a killed node
    that claims its chunk back at once makes true only for an instant.

    After the job: the merge (`Controller.finalize`), `checks.account` (every input id exactly once),
    errors exactly the rows over the context, rejects exactly the malformed lines."""
    import threading

    from fleet.generation.multinode.chunks import ControllerLock
    from fleet.generation.multinode.controller import Controller, NodeWork

    work.mkdir(parents=True, exist_ok=True)
    inp = work / "input.jsonl"
    ids, bad_ids, n_malformed = write_input(inp, rows, bad, malformed, rng)
    nodes = {name: NodeWork(name, sp) for name, sp in specs.items()}
    pdir = work / "plan"
    res = NodeSoak(rows=rows)
    ctl = Controller(cfg, pdir, str(work / "remote-out"), nodes, **{"probe_s": 1.0, "poll_s": 0.2, **(controller or {})})
    plan = list(kinds)
    t0 = time.monotonic()
    with ControllerLock(pdir):
        ctl.prepare(str(inp))
        assert ctl.assign is not None
        errors: list[str] = []

        def worker(name: str) -> None:
            try:
                ctl.node_loop(name)
            except Exception as exc:   # a chunk failed too often: the soak reports it
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                ctl.stop()

        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in sorted(nodes)]
        for th in threads:
            th.start()
        open_fault: NodeFault | None = None
        while any(th.is_alive() for th in threads):
            now = time.monotonic()
            if now - t0 > deadline_s:
                res.problems.append(f"job did not end within {deadline_s:.0f} s")
                ctl.stop()
                break
            f = open_fault
            if f is not None:
                st = ctl.assign.nodes.get(f.node, {})
                if f.lost_s is None and f.chunk is not None and f.attempt is not None \
                        and ctl.assign.chunks[f.chunk].attempts[f.attempt].outcome in ("lost", "failed"):
                    # the attempt the loss cut short was ended: its chunk went back to the queue. (A state that
                    # stays, unlike "the chunk is not on this node": a killed node that still answers claims
                    # the first pending chunk again at once, often that one, between two looks of this loop.)
                    f.lost_s = now - f.t
                if f.kind == "node-freeze" and f.lost_s is not None and st.get("state") == "lost" \
                        and f.resumed_at is None:
                    for pid in f.pids:
                        try:
                            os.kill(pid, signal.SIGCONT)
                        except OSError:
                            pass
                    f.resumed_at = now
                if f.resumed_at is not None and st.get("state") == "ok":
                    f.back_s = now - f.resumed_at
                if f.lost_s is not None and (f.kind == "node-kill" or f.back_s is not None):
                    open_fault = None
            elif plan and ctl.assign.counts().get("pending", 0) >= 2:
                # the next loss: a node running a chunk whose committed shards were gathered already
                for name in sorted(nodes, key=lambda _: rng.random()):
                    idx = nodes[name].chunk
                    g = ctl.gathered(name, ctl.chunk(idx)) / "shards" if idx is not None else None
                    if idx is not None and g is not None and len(list(g.glob("part-*.parquet"))) >= 1:
                        kind = plan[0]
                        wd = Path(cfg.node(name).workdir)
                        f = NodeFault(kind, name, time.monotonic(), chunk=idx, pids=_node_pids(wd))
                        # freeze the node first (a kill too), then make sure its chunk is still unfinished:
                        # a runner that ended the chunk before the signal leaves nothing to hand over
                        _signal(f.pids, signal.SIGSTOP)
                        f.attempt = _open_attempt(ctl, name, idx)
                        if f.attempt is None or _chunk_complete(Path(ctl.chunk_output(name, ctl.chunk(idx)))):
                            _signal(f.pids, signal.SIGCONT)   # it finished first: another chunk, later
                            continue
                        plan.pop(0)
                        if kind == "node-kill":
                            _signal(f.pids, signal.SIGKILL)
                        log(f"  t={f.t - t0:6.1f}s {kind} {name} (chunk {idx}, {len(f.pids)} processes)")
                        res.faults.append(f)
                        open_fault = f
                        break
            time.sleep(0.1)
        for th in threads:
            th.join(timeout=60)
        res.wall_s = time.monotonic() - t0
        res.problems += errors
        dest = work / "merged"
        manifest = ctl.finalize(dest)
    if plan:
        res.problems.append(f"{len(plan)} node loss(es) not injected before the job ended")
    for f in res.faults:
        if f.lost_s is None:
            res.problems.append(f"{f.kind} of {f.node}: its unfinished chunk {f.chunk} never went back to the queue")
        if f.kind == "node-freeze" and f.back_s is None:
            res.problems.append(f"node-freeze of {f.node}: the node never rejoined")
    res.chunks = len(ctl.plan.chunks) if ctl.plan else 0
    res.rows_by_node = {n["node"]: n["rows"] for n in manifest.get("nodes") or []}
    res.duplicates_dropped = int(manifest["merge"]["duplicates_dropped"])
    acc = account(inp, dest)
    res.account_ok = bool(acc.get("ok"))
    res.duplicated, res.missing = int(acc["duplicated"]), int(acc["missing"])
    res.completed = int(manifest["counts"]["completed"])
    err_ids = {str(r["id"]) for r in read_errors(dest)}
    res.errors_exact = err_ids == bad_ids
    if not res.errors_exact:
        res.problems.append(f"errors != the bad rows: extra {sorted(err_ids - bad_ids)[:5]}, "
                            f"missing {sorted(bad_ids - err_ids)[:5]}")
    res.rejects_exact = len(list(read_rejects(dest))) == n_malformed
    if not res.account_ok:
        res.problems.append(f"accounting: {json.dumps(acc, default=str)[:400]}")
    return res


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f}" if xs else "—"


def _max(xs: list[float]) -> str:
    return f"{max(xs):.1f}" if xs else "—"


def main_node_loss(args: argparse.Namespace) -> int:
    """`--node-loss`: jobs over two local nodes (2 + 1 sim servers), each losing a node twice."""
    import tempfile

    from fleet.demo import free_port_block

    rng = random.Random(args.seed)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="fleet-soak-nodes-"))
    port = free_port_block(3, start=rng.randrange(20000, 50000, 100))
    cfg = two_node_config(base / "w", port, tokens_per_s=args.tokens_per_s, slots=args.slots,
                          startup_s=args.startup_s, max_tokens=args.max_tokens,
                          generation={"node_lost_s": args.node_lost_s, "shard_rows": 200})
    print(f"node-loss soak in {base}: nodes a (2 servers) and b (1), {args.jobs} jobs x {args.rows:,} rows, "
          f"node_lost_s {args.node_lost_s:g}", flush=True)
    rows = ["| job | losses (kind node: chunk released after s / rejoined after s) | wall s | chunks | completed "
            "| duplicated | missing | dropped by the merge | errors = bad rows | rejects = malformed | rows a / b |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ok = True
    try:
        specs = launch_nodes(cfg)
        for j in range(1, args.jobs + 1):
            r = soak_nodes(cfg, specs, base / f"job-{j}", rows=args.rows, kinds=NODE_KINDS, rng=rng,
                           log=lambda s: print(s, flush=True))
            ok = ok and r.ok
            losses = "; ".join(f"{f.kind} {f.node}: {f.lost_s if f.lost_s is None else round(f.lost_s, 1)}"
                               + (f" / {f.back_s:.1f}" if f.back_s is not None else "") for f in r.faults)
            rows.append(f"| {j} | {losses} | {r.wall_s:.0f} | {r.chunks} | {r.completed:,} | {r.duplicated} | "
                        f"{r.missing} | {r.duplicates_dropped} | {r.errors_exact} | {r.rejects_exact} | "
                        f"{r.rows_by_node.get('a', 0):,} / {r.rows_by_node.get('b', 0):,} |")
            print(rows[-1], r.problems, flush=True)
    finally:
        stop_nodes(cfg)
    print(f"\n{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — "
          f"`{shlex.join(['.venv/bin/python', 'bench/bench_faults.py', *sys.argv[1:]])}`, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("\n".join(rows))
    return 0 if ok else 1


def main_garbage(args: argparse.Namespace) -> int:
    """--garbage: hypothesis draws a broken server's answers for each job; see the module docstring."""
    import collections
    import tempfile

    from hypothesis import HealthCheck, given, seed, settings

    from garbage import GarbageServer, Reply, fuzz_job, script
    from sims import start_sims

    base = Path(args.workdir or tempfile.mkdtemp(prefix="fleet-garbage-"))
    procs, urls = start_sims([4000.0], slots=args.slots)
    bad = GarbageServer()
    walls: list[float] = []
    failed: list[str] = []
    served: collections.Counter[str] = collections.Counter()

    @seed(args.seed)
    @settings(max_examples=args.jobs, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(faults=script())
    def one(faults: list[Reply]) -> None:
        t = time.monotonic()
        r = fuzz_job(base / f"job-{len(walls) + 1}", urls[0], bad, faults, rows=args.rows)
        walls.append(time.monotonic() - t)
        served.update(label.removeprefix("slow ").removeprefix("dribbled ").split(" ")[0].rstrip(",") for label in r.served)
        ok = (r.rc == 0 and r.account["ok"] and r.errors == 0 and r.quality_rejects == 0
              and r.bad.get("requests") == 0 and (r.bad.get("downs") or 0) >= 1 and bool(r.bad.get("down_reason")))
        if not ok:
            failed.append(f"{[f.label for f in faults]}: rc {r.rc}, counts {r.counts}, bad {r.bad.get('down_reason')}")
            print(f"  FAILED: {failed[-1]}", flush=True)
        assert ok

    t0 = time.monotonic()
    try:
        one()
    except AssertionError:
        pass
    finally:
        bad.close()
        for p in procs:
            p.kill()
    print(f"{len(walls)} jobs x {args.rows} rows in {time.monotonic() - t0:.0f} s (median {statistics.median(walls):.2f} s "
          f"per job, max {max(walls):.2f} s); failed: {len(failed)}; load average {os.getloadavg()[0]:.1f}")
    print("answers of the bad server by kind: " + ", ".join(f"{k} {v}" for k, v in served.most_common()))
    return 1 if failed else 0


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
    ap.add_argument("--node-loss", action="store_true", help="instead: jobs over two local nodes, each with a "
                    "node frozen then back and a node killed (issue 14); --rows per job")
    ap.add_argument("--node-lost-s", type=float, default=30.0, help="--node-loss: generation.node_lost_s")
    ap.add_argument("--garbage", action="store_true", help="instead: --jobs jobs of --rows rows through a good sim "
                    "and a stand-in server answering faults drawn by hypothesis (issue 23; the suite's fuzz, longer)")
    args = ap.parse_args()
    if args.node_loss:
        return main_node_loss(args)
    if args.garbage:
        return main_garbage(args)
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
