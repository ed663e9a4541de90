"""The multi-node controller's own cost at 20, 100, 1,000 nodes: its real code, fake nodes.

    .venv/bin/python bench/bench_controller_scale.py --nodes 100 [--rows 902087 --speed 20 --losses 0.1]
    .venv/bin/python bench/bench_controller_scale.py --nodes 1000 --rows 9000000 --speed 4 --max-wall-s 420
    .venv/bin/python bench/bench_controller_scale.py --nodes 100 --speed 4 --store s3   # a real store server
    .venv/bin/python bench/bench_controller_scale.py --nodes 100 --speed 4 --store s3 --ssh 20   # + real SSH

Prints one JSON line per pass, then a Markdown table (one column per pass); `--compare-state` adds
a pass with the whole state written on every change (as before the log), `--compare` one with
the scans before the per-change cache; `--probe-decisions` only times one decision mid-job.

What runs for real: `Controller` (node_loop per node in a thread, as the flow's one task per node;
run_chunk per chunk attempt; next_size/claim/cuts/prestart; `Assignments` appending each change to
state.jsonl, compacting into state.json, and putting both in the store's `_control/`) and
the flow's progress writer (`write_progress` every 5 s). What is fake: the node transport at the
seam — `connect` hands out a FakeNode, and `start_job` starts a FakeRunner on it instead of the
detached runner. With `--ssh K` every node operation also makes the real SSH round trip fleet's seam
makes for it (fleet.node's SSHNode, an exec channel each, on a connection to one of K sshd on loopback;
each connect a real handshake), and file reads return what SSH read: the controller's CPU then includes
paramiko's and the seam's, and the sshd side's CPU is reported apart. A runner reports progress.json at its node's drawn rate (7–8 servers per node,
≈ 1 row/s per server: the seed's job, 902,087 rows in 1.5 days on one node), after a runner start of
8 s; two runners on one node (one started while the other drains) share its capacity, the older
first. A node loss: every operation raises ConnectionLost (what the SSH seam raises) for a drawn while and its runners die; it
answers again afterwards and rejoins. The job is on object storage: each runner "puts" its manifest
there, as publish.py does, and the controller reads it. By default that store is fsspec's memory:// (free);
`--store s3` makes it moto's S3 server on a loopback port (a real server: s3fs, botocore and HTTP in the
controller's process, the server's latency on every PUT and GET; its own CPU reported apart). Time is
not compressed for the store: a PUT that takes 10 ms of wall takes --speed × 10 ms of job time, so a
store that bounds the controller shows it more at a higher --speed.

Time is compressed by --speed: the controller's and the fake nodes' clocks (`time` in controller.py
and chunks.py, the controller's stop event) run --speed times faster than the wall. Its settings
(poll_s, node_lost_s, MIN_CHUNK_S, …) are therefore in job seconds. CPU is real: the controller's
CPU over the job's (virtual) seconds is what it would use of one core on a real job; when that
comes near 1 / --speed of the wall the compressed run itself is CPU-bound (reported: `gil_busy`).

Reported (one JSON line per pass, then the table): makespan ÷ ideal (ideal: rows over the nodes'
summed rates, no runner start), controller CPU total and per decision (next_size + claim, thread
CPU), peak RSS, the state's changes and bytes written per job minute (log lines and snapshots) and
per change, the store PUTs and bytes of its copy, plan.json's rewrites (a cut), node operations and SSH
connections per node per job minute, Prefect task runs per job minute (one per node + one per chunk
attempt) and the progress writes (each one Prefect artifact update).
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import random
import resource
import sys
import tempfile
import threading
import time as _time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUNNER_START_S = 8.0     # job seconds from a runner's start to its first rows (the seed's runner)
START_JOB_OPS = 5        # node round trips of a real start_job on a connection that knows the node: the pid
#                          look, the input's, job.json (+ the exit file's removal), the launch, the pid read
#                          (tests/test_gen_job_edges.py::test_a_runner_start_on_a_known_node_is_five_round_trips)
OLD_START_JOB_OPS = 10   # the same before 42a37ca's successor (--old-starts: that test's count on the old code)
FIRST_START_OPS = 4      # a start's first on a connection: the workdir's check, the runner venv's stamp, its
#                          python, its import timed; and the runner's zip put (a real SFTP put of its bytes)
SLOTS_PER_SERVER = 64


class VClock:
    """A clock `speed` times faster than the wall, shaped like the `time` module for the controller's use."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.real0 = _time.monotonic()
        self.mono0 = _time.monotonic()
        self.wall0 = _time.time()

    def monotonic(self) -> float:
        return self.mono0 + (_time.monotonic() - self.real0) * self.speed

    def time(self) -> float:
        return self.wall0 + (_time.monotonic() - self.real0) * self.speed

    def sleep(self, s: float) -> None:
        _time.sleep(s / self.speed)

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


class VEvent(threading.Event):
    """The controller's stop event, its waits in job seconds."""

    def __init__(self, speed: float) -> None:
        super().__init__()
        self.speed = speed

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(None if timeout is None else timeout / self.speed)


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c: dict[str, float] = {}

    def add(self, key: str, n: float = 1) -> None:
        with self.lock:
            self.c[key] = self.c.get(key, 0) + n


class FakeCPU:
    """Thread CPU spent inside the fake nodes (their progress, the fake runners' publishing, the counting):
    the bench's own cost, reported apart so that the controller's CPU is measured without it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.local = threading.local()
        self.cells: list[list[float]] = []

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t = _time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                c = getattr(self.local, "c", None)
                if c is None:
                    c = self.local.c = [0.0]
                    self.cells.append(c)
                c[0] += _time.thread_time() - t

        return wrapper

    def total(self) -> float:
        return sum(c[0] for c in self.cells)


FAKE_CPU = FakeCPU()


class FakeRunner:
    def __init__(self, pid: int, output: str, lines: int, started: float) -> None:
        self.pid, self.output, self.lines, self.started = pid, output, lines, started
        self.done = 0.0
        self.ended_at: float | None = None
        self.dead = False


class FakeHost:
    """One node: its capacity (rows/s), its runners, its outages [(from, to)] in job seconds."""

    def __init__(self, name: str, servers: int, rate: float, outages: list[tuple[float, float]], clock: VClock,
                 store_root: str) -> None:
        self.name, self.servers, self.rate, self.outages = name, servers, rate, outages
        self.clock, self.store_root = clock, store_root
        self.lock = threading.Lock()
        self.runners: dict[int, FakeRunner] = {}
        self.by_output: dict[str, FakeRunner] = {}
        self.last = clock.monotonic()
        self.next_pid = 1000
        self.unused = 0.0   # rows of capacity no runner used while the node was up (idle, runner starts)

    def down(self, now: float) -> bool:
        return any(a <= now < b for a, b in self.outages)

    def advance(self) -> float:
        """Move the runners on to now: the capacity goes to the oldest started runner first."""
        now = self.clock.monotonic()
        with self.lock:
            if self.down(now):
                for r in self.runners.values():
                    r.dead = True
            dt, self.last = now - self.last, now
            budget = self.rate * max(0.0, dt)
            for r in sorted(self.runners.values(), key=lambda r: r.started):
                if r.dead or r.ended_at is not None or now - r.started < RUNNER_START_S:
                    continue
                take = min(budget, r.lines - r.done)
                r.done += take
                budget -= take
                if r.done >= r.lines - 1e-9:
                    r.done, r.ended_at = float(r.lines), now
                    self._publish(r)
            if not self.down(now):
                self.unused += budget
            return now

    def _publish(self, r: FakeRunner) -> None:
        from fleet.generation.data.objstore import Store

        name = r.output.rstrip("/").rsplit("/", 1)[-1]
        m = {"complete": True, "state": "done", "accounted": r.lines,
             "this_run": {"completed": r.lines, "errors": 0}, "throughput": {"completion_tokens": r.lines * 200}}
        Store(f"{self.store_root}/_parts/{self.name}/{name}").write_bytes("manifest.json", json.dumps(m).encode())

    def progress(self, output: str, now: float) -> dict[str, Any] | None:
        r = self.by_output.get(output)
        if r is None or now - r.started < 0.5:
            return None
        state = "done" if r.ended_at is not None else "running"
        left = r.lines - r.done
        return {"state": state, "rows_total": r.lines, "rows_done": int(r.done), "rows_per_s": self.rate,
                "in_flight": int(min(left, self.servers * SLOTS_PER_SERVER)) if state == "running" else 0,
                "servers": self.servers, "servers_up": self.servers, "updated_at": round(now, 1),
                "tok_s": self.rate * 200, "this_run": {"completed": int(r.done), "errors": 0}}


class FakeNode:
    """The Node seam for one connection to a FakeHost: every call counted, ConnectionLost while it is down
    (the real SSH node wraps its socket errors so; a bare OSError is a local fault, not the node's)."""

    def __init__(self, host: FakeHost, counters: Counters) -> None:
        self.host, self.counters = host, counters
        self.host_name = host.name

    def _op(self, what: str) -> float:
        self.counters.add("ops")
        self.counters.add(f"op:{what}")
        now = self.host.advance()
        if self.host.down(now):
            from fleet.errors import ConnectionLost

            raise ConnectionLost(f"{self.host.name}: no route to host", host=self.host.name)
        return now

    @FAKE_CPU.timed
    def run(self, argv: list[str], **kw: Any) -> Any:
        self._op("run")
        from fleet.node.base import RunResult

        return RunResult(self.host.name, tuple(argv), 0, "", "", 0.0)

    @FAKE_CPU.timed
    def exists(self, path: str) -> bool:
        now = self._op("exists")
        out = path.rsplit("/", 1)[0]
        return self.host.progress(out, now) is not None

    @FAKE_CPU.timed
    def read_text(self, path: str, tail_bytes: int | None = None) -> str | None:
        now = self._op("read_text")
        out, _, leaf = path.rpartition("/")
        if leaf == "progress.json":
            p = self.host.progress(out, now)
            return json.dumps(p) if p is not None else None
        if leaf == "manifest.json":
            r = self.host.by_output.get(out)
            if r is not None and r.ended_at is not None:
                return json.dumps({"complete": True, "state": "done", "accounted": r.lines})
        return None

    @FAKE_CPU.timed
    def is_alive(self, pid: int) -> bool:
        return self._alive(pid, self._op("is_alive"))

    def _alive(self, pid: int, now: float) -> bool:
        r = self.host.runners.get(pid)
        # a runner exits a moment after its last rows (its final commit and publish)
        return r is not None and not r.dead and (r.ended_at is None or now - r.ended_at < 1.0)

    @FAKE_CPU.timed
    def watch(self, pid: int, log_path: str, offset: int) -> tuple[str, str]:
        """The process's state and a file's text in one operation (the controller's look at a runner)."""
        now = self._op("watch")
        out, _, leaf = log_path.rpartition("/")
        p = self.host.progress(out, now) if leaf == "progress.json" else None
        return ("alive" if self._alive(pid, now) else "dead"), (json.dumps(p) if p is not None else "")

    @FAKE_CPU.timed
    def stop(self, pid: int, grace_s: float = 5.0) -> None:
        self._op("stop")
        r = self.host.runners.get(pid)
        if r is not None:
            r.dead = True

    def close(self) -> None:
        pass


class SeamNode(FakeNode):
    """A FakeNode whose every operation also makes the real SSH round trip fleet's seam makes for it
    (`--ssh K`): an exec channel on a real connection to one of K sshd on loopback, running the same
    shell snippet (`[ -e ]`, the pid check, `cat`) on real files. The fake host still decides the answers,
    except that a file read returns what SSH read (the fake's progress and manifests are written as files
    first, as a runner writes them). The real calls are not in FAKE_CPU: their client side (paramiko's
    crypto, fleet's seam) counts as the controller's CPU, as it would on a real job; sshd's is read apart."""

    def __init__(self, host: FakeHost, counters: Counters, ssh: Any) -> None:
        super().__init__(host, counters)
        self.ssh = ssh

    def _real(self) -> None:
        self.counters.add("ssh_ops")

    def run(self, argv: list[str], **kw: Any) -> Any:
        res = super().run(argv, **kw)
        self._real()
        self.ssh.run(["sh", "-c", ":"], check=False)
        return res

    def exists(self, path: str) -> bool:
        ans = super().exists(path)
        self._real()
        self.ssh.exists(path)
        return ans

    def read_text(self, path: str, tail_bytes: int | None = None) -> str | None:
        text = super().read_text(path, tail_bytes)
        if text is not None:
            _materialize(path, text)
        self._real()
        real = self.ssh.read_text(path, tail_bytes=tail_bytes)
        return real if text is not None else None

    def is_alive(self, pid: int) -> bool:
        ans = super().is_alive(pid)
        self._real()
        self.ssh.is_alive(os.getpid())   # the same check on a real pid: one exec round trip
        return ans

    def watch(self, pid: int, log_path: str, offset: int) -> tuple[str, str]:
        state, text = super().watch(pid, log_path, offset)
        if text:
            _materialize(log_path, text)
        self._real()
        _, real = self.ssh.watch(os.getpid(), log_path, offset)   # the state of a real pid, the file read
        return state, real if text else ""

    def stop(self, pid: int, grace_s: float = 5.0) -> None:
        super().stop(pid, grace_s)
        self._real()
        self.ssh.is_alive(os.getpid())

    def close(self) -> None:
        self.ssh.close()


@FAKE_CPU.timed
def _materialize(path: str, text: str) -> None:
    """The fake runner's file, written whole (a temp file, then a rename) for the real read."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{threading.get_ident()}")
    tmp.write_text(text)
    tmp.replace(p)


def fake_start_job(hosts: dict[str, FakeHost], counters: Counters) -> Callable[..., Any]:
    from fleet.generation.job.remote import JobHandle

    @FAKE_CPU.timed
    def start_job(node: FakeNode, cfg: Any, node_cfg: Any, *, input_path: str, output: str, specs: Any,
                  facts: Any = None, store: str | None = None, seed: list[str] | None = None,
                  input_span: list[int] | None = None, **kw: Any) -> JobHandle:
        host = hosts[node.host.name]
        node._op("start_job")
        counters.add("ops", START_JOB_OPS - 1)
        counters.add("start_job")
        with host.lock:
            r = host.by_output.get(output)
            if r is not None and not r.dead and r.ended_at is None:
                return JobHandle(host.name, output, output, r.pid, True, "")
            lines = counters_lines[output.rsplit("/", 1)[-1]]
            host.next_pid += 1
            r = FakeRunner(host.next_pid, output, lines, host.clock.monotonic())
            host.runners[r.pid], host.by_output[output] = r, r
        return JobHandle(host.name, output, output, r.pid, False, "")

    return start_job


counters_lines: dict[str, int] = {}   # chunk name -> lines (filled as chunks are cut)


def make_hosts(n: int, clock: VClock, store_root: str, rng: random.Random, losses: float,
               horizon_s: float) -> dict[str, FakeHost]:
    hosts = {}
    for i in range(n):
        servers = rng.choice((7, 8))
        rate = servers * rng.lognormvariate(0.0, 0.25)        # ≈ 1 row/s per server, spread ±25 %
        outages = []
        if rng.random() < losses:
            at = rng.uniform(0.1, 0.7) * horizon_s
            outages.append((at, at + rng.uniform(60, 300)))
        name = f"n{i:04d}"
        hosts[name] = FakeHost(name, servers, rate, outages, clock, store_root)
    return hosts


def run(args: argparse.Namespace) -> dict[str, Any]:
    import fleet.generation.multinode.assignments as assign_mod
    import fleet.generation.multinode.chunks as chunks_mod
    import fleet.generation.multinode.planning as planning_mod
    import fleet.generation.multinode.controller as ctl_mod
    import fleet.generation.multinode.jobend as jobend_mod
    import fleet.generation.multinode.nodework as nodework_mod
    import fleet.generation.multinode.runchunk as runchunk_mod
    import fleet.generation.job.remote as remote_mod
    import fleet.generation.multinode.journal as journal_mod
    from fleet.config import FleetConfig
    from fleet.generation.data.objstore import Store
    from fleet.generation.multinode.controller import Controller, NodeWork

    rng = random.Random(args.seed)
    clock = VClock(args.speed)
    tag = f"bench-{os.getpid()}-{args.nodes}-{int(args.uncached)}-{int(args.whole_state)}"
    root = f"s3://{S3_BUCKET}/{tag}" if getattr(args, "store", "memory") == "s3" else f"memory://{tag}"
    body = b"".join(b'{"id":%d,"prompt":"q"}\n' % i for i in range(args.rows))
    Store(root).write_bytes("input.jsonl", body)
    del body
    horizon = args.rows / (7.5 * args.nodes)
    hosts = make_hosts(args.nodes, clock, f"{root}/out", rng, args.losses, horizon)
    counters = Counters()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-ctlscale-"))
    cfg = FleetConfig(name="bench-scale",
                      nodes=[{"name": h, "workdir": str(tmp / h), "servers": hosts[h].servers} for h in sorted(hosts)],
                      engine={"kind": "sim"}, model={"served_name": "sim-model"},
                      generation={"node_lost_s": args.node_lost_s})

    # the controller's modules, each patched where it looks the name up (controller.py split in four)
    timed_mods = (ctl_mod, runchunk_mod, nodework_mod, jobend_mod, assign_mod)
    connect_mods = (ctl_mod, runchunk_mod, jobend_mod)
    saved = ([m.time for m in timed_mods], [m.connect for m in connect_mods], remote_mod.start_job,   # type: ignore[attr-defined]
             assign_mod.write_json_atomic, planning_mod.write_json_atomic, journal_mod.StateLog.due)
    state = {"writes": 0, "bytes": 0, "max": 0}   # plan.json's (a cut rewrites it whole)
    real_write = planning_mod.write_json_atomic

    def counted_write(path: Any, obj: Any) -> None:
        real_write(path, obj)
        if Path(path).name == chunks_mod.PLAN_FILE:
            size = Path(path).stat().st_size
            state["writes"] += 1
            state["bytes"] += size
            state["max"] = max(state["max"], size)

    @FAKE_CPU.timed
    def fake_connect(node_cfg: Any) -> FakeNode:
        counters.add("connect")
        node = FakeNode(hosts[node_cfg.name], counters)
        node._op("connect")
        return node

    sshds = getattr(args, "sshds", None)
    index = {h: i for i, h in enumerate(sorted(hosts))}

    def connect(node_cfg: Any) -> FakeNode:
        node = fake_connect(node_cfg)   # raises ConnectionLost while the fake host is down
        if sshds is None:
            return node
        from fleet.node.ssh.node import SSHNode

        ssh = SSHNode.from_config(sshds.node_config(index[node_cfg.name], name=node_cfg.name,
                                                    workdir=str(tmp / node_cfg.name)))
        ssh.connect()   # the handshake and key exchange, in the controller's process as on a real job
        counters.add("ssh_connects")
        return SeamNode(hosts[node_cfg.name], counters, ssh)

    for m in timed_mods:
        m.time = clock  # type: ignore[attr-defined]
    for m in connect_mods:
        m.connect = connect  # type: ignore[attr-defined]
    fake_start = fake_start_job(hosts, counters)

    zip_file = tmp / "fleet-runner.pyz"
    if sshds is not None:
        zip_file.write_bytes(remote_mod.build_pyz())
    old_starts = bool(getattr(args, "old_starts", False))

    def start_job(node: Any, *a: Any, **kw: Any) -> Any:
        handle = fake_start(node, *a, **kw)
        if isinstance(node, SeamNode):   # a real start_job's round trips, each an exec channel, and its first's zip
            first = old_starts or not node.__dict__.get("_proved")
            for _ in range((OLD_START_JOB_OPS if old_starts else START_JOB_OPS) + (FIRST_START_OPS if first else 0)):
                node._real()
                node.ssh.run(["sh", "-c", ":"], check=False)
            if first:
                node._real()
                node.ssh.put(zip_file, f"{tmp}/{node.host.name}/bin/fleet-runner.pyz")
                counters.add("zip_puts")
                node.__dict__["_proved"] = True
        return handle

    if old_starts:   # the controller before: a connection of its own for each chunk attempt
        real_run_chunk = runchunk_mod.ChunkRuns.run_chunk

        def run_chunk_alone(self: Any, name: str, index: int) -> Any:
            try:
                return real_run_chunk(self, name, index)
            finally:
                self.drop_connection(name)

        runchunk_mod.ChunkRuns.run_chunk = run_chunk_alone  # type: ignore[method-assign]
    saved_run_chunk = real_run_chunk if old_starts else None
    saved_look = runchunk_mod.look_every
    if getattr(args, "old_looks", False):   # before: every running chunk looked at every poll_s
        runchunk_mod.look_every = lambda poll_s, prog, **kw: poll_s  # type: ignore[assignment]

    remote_mod.start_job = start_job  # type: ignore[assignment]
    # plan.json is written by the plan's cut (planning.py) and the state's compaction (assignments.py)
    assign_mod.write_json_atomic = planning_mod.write_json_atomic = counted_write  # type: ignore[assignment]
    if args.whole_state:   # the state before the log: the whole of it written on every change
        journal_mod.StateLog.due = lambda self: True  # type: ignore[method-assign]
    try:
        return _drive(args, cfg, tmp, hosts, counters, state, clock, root, Controller, NodeWork)
    finally:
        Store(root).fs.rm(Store(root).path, recursive=True)
        (times, connects, remote_mod.start_job, assign_mod.write_json_atomic, planning_mod.write_json_atomic,
         journal_mod.StateLog.due) = saved
        for m, t in zip(timed_mods, times):
            m.time = t  # type: ignore[attr-defined]
        for m, c in zip(connect_mods, connects):
            m.connect = c  # type: ignore[attr-defined]
        if saved_run_chunk is not None:
            runchunk_mod.ChunkRuns.run_chunk = saved_run_chunk  # type: ignore[method-assign]
        runchunk_mod.look_every = saved_look  # type: ignore[assignment]


def _uncached(ctl: Any) -> None:
    """The code before the first fix: each node's rate and running chunks from a fresh scan of the whole
    state at every question (per node, per decision), instead of from what changed."""
    assign = ctl.assign

    def running_on(node: str) -> list[int]:
        with assign._lock:
            return sorted(i for i, c in assign.chunks.items() if c.state == "running" and c.node == node)

    assign.running_on = running_on
    if hasattr(ctl, "_finished_by_node"):   # a tree before the per-node index (one bench, both trees)
        real_rates = ctl._finished_by_node

        def finished_by_node() -> Any:
            try:
                return real_rates()
            finally:
                ctl._finished = (-1, {})   # never kept: the next question scans again

        ctl._finished_by_node = finished_by_node
        return
    real = assign.finished_on

    def finished_on(node: str) -> Any:
        with assign._lock:
            for i, c in assign.chunks.items():   # the whole state, as a scan per question did
                assign._on_node.setdefault(node, set()).update(i for a in c.attempts if a.node == node)
            assign._finished.pop(node, None)
            return real(node)

    assign.finished_on = finished_on


def _instrument(ctl: Any, counters: Counters) -> None:
    """next_size and claim count as decisions; their thread CPU is summed. A question for a node's
    finished rows that is not answered from what was kept counts as a scan: of the whole state in a tree
    before the per-node index (`_finished_by_node`, once per change of the state), of that node's chunks
    after it (`Assignments.finished_on`, once per change that touched the node)."""
    if hasattr(ctl, "_finished_by_node"):
        real_rates = ctl._finished_by_node

        def rates() -> Any:
            counters.add("rate_questions")
            with ctl.assign._lock:   # the controller's own check is under it: two threads see one change once
                if ctl._finished[0] != ctl.assign.version:
                    counters.add("rate_scans")
                return real_rates()

        ctl._finished_by_node = rates
    else:
        real_on = ctl.assign.finished_on

        def finished_on(node: str) -> Any:
            counters.add("rate_questions")
            with ctl.assign._lock:
                if node not in ctl.assign._finished:
                    counters.add("rate_scans")
                return real_on(node)

        ctl.assign.finished_on = finished_on
    for obj, name in ((ctl, "next_size"), (ctl.assign, "claim")):
        real = getattr(obj, name)

        def timed(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            t = _time.thread_time()
            out = None
            try:
                out = _real(*a, **kw)
                return out
            finally:
                counters.add("decisions")
                counters.add("decision_cpu", _time.thread_time() - t)
                if (_name == "next_size" and out is not None and not out[1]) or (_name == "claim" and out is None):
                    counters.add("decisions_wait")   # told to wait: nothing pending, or a faster node's

        setattr(obj, name, timed)


@FAKE_CPU.timed
def _unused(hosts: dict[str, FakeHost]) -> float:
    """The capacity the nodes left unused so far (each moved on to now: a node whose thread waits idle
    does no operation that would move it)."""
    for h in hosts.values():
        h.advance()
    return sum(h.unused for h in hosts.values())


def _drive(args: argparse.Namespace, cfg: Any, tmp: Path, hosts: dict[str, FakeHost], counters: Counters,
           state: dict[str, int], clock: VClock, root: str, Controller: Any, NodeWork: Any) -> dict[str, Any]:
    ctl = Controller(cfg, tmp / "plan", f"{root}/out", {h: NodeWork(h, []) for h in hosts},
                     probe_s=args.probe_s, poll_s=args.poll_s)
    ctl._stop = VEvent(args.speed)
    ctl._wait = lambda ev, timeout: ev.wait(timeout / args.speed)   # an idle node's wait, in job seconds
    if getattr(args, "idle_max_s", None) is not None:
        ctl.idle_max_s = max(args.poll_s, args.idle_max_s)
    FAKE_CPU.reset()
    plan = ctl.prepare(f"{root}/input.jsonl")

    def lines_of(name: str) -> int:
        name = name.split(".")[0]   # a node's nth attempt at a chunk: "chunk-00002.2" (fence.attempt_name)
        return next(c.lines for c in ctl.assign.plan.chunks if c.name == name)

    class Lines(dict):   # chunk name -> lines, looked up in the (growing) plan when asked
        def __missing__(self, key: str) -> int:
            v = lines_of(key)
            self[key] = v
            return v

    global counters_lines
    counters_lines = Lines()
    if args.uncached:
        _uncached(ctl)
    _instrument(ctl, counters)
    rss0 = _rss_kb()

    def run_chunk(name: str, index: int) -> dict[str, Any]:
        counters.add("task_runs")
        return ctl.run_chunk(name, index)

    errors: list[str] = []

    with_prefect = getattr(args, "prefect", False)
    if with_prefect:   # each chunk attempt a task run of its own, as tasks/multinode.py's node_worker makes it
        real_run_chunk = ctl.run_chunk

        def counted_run_chunk(name: str, index: int) -> dict[str, Any]:
            counters.add("task_runs")
            return real_run_chunk(name, index)

        ctl.run_chunk = counted_run_chunk

    def worker(name: str) -> None:
        try:
            if with_prefect:   # the flow's task per node (a task run), in the flow run's context
                from tasks.multinode import node_worker

                node_worker(ctl, name)
            else:
                ctl.node_loop(name, run_chunk=run_chunk)
        except Exception as exc:
            errors.append(f"{name}: {exc!r}")
            ctl.stop()

    cpu0, v0, w0 = _time.process_time(), clock.monotonic(), _time.monotonic()
    # each thread in a copy of this one's context: under --prefect, the flow run's (Prefect's thread pool does the same)
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(worker, h), daemon=True)
               for h in sorted(hosts)]
    for h in hosts.values():
        h.last = clock.monotonic()
    unused = {"pending": 0.0, "tail": 0.0}   # capacity unused, while chunks were pending / after
    seen = 0.0
    for t in threads:
        t.start()
    progress_writes = 0
    deadline = w0 + args.max_wall_s
    while any(t.is_alive() for t in threads):
        if _time.monotonic() > deadline:
            ctl.stop()
            errors.append(f"stopped after {args.max_wall_s} s of wall time")
            break
        ctl.write_progress()   # the flow's watch_progress: every 5 s, one Prefect artifact update each
        progress_writes += 1
        now_unused = _unused(hosts)
        unused["pending" if ctl.assign.first_pending() is not None else "tail"] += now_unused - seen
        seen = now_unused
        if ctl._stop.wait(5.0):
            break
    for t in threads:
        t.join(timeout=30)
    vsec = clock.monotonic() - v0
    wall = _time.monotonic() - w0
    cpu = _time.process_time() - cpu0
    fake = FAKE_CPU.total()
    c = counters.c
    rate = sum(h.rate for h in hosts.values())
    minutes = vsec / 60
    unused["tail"] += _unused(hosts) - seen
    n = len(hosts)
    counts = ctl.assign.counts()
    log = ctl.assign.log.counters
    return {
        "nodes": n, "servers": sum(h.servers for h in hosts.values()), "rows": plan.total_lines,
        "chunks": len(ctl.assign.plan.chunks), "chunks_done": counts.get("done", 0), "speed": args.speed,
        "chunks_done_once": sum(1 for c in ctl.assign.chunks.values()
                                if sum(1 for a in c.attempts if a.outcome == "done") == 1),
        "state_writes": log["appends"], "rate_scans": int(c.get("rate_scans", 0)),
        "rate_questions": int(c.get("rate_questions", 0)),
        "losses": sum(1 for h in hosts.values() if h.outages), "errors": errors[:3],
        "makespan_s": round(vsec, 1), "ideal_s": round(plan.total_lines / rate, 1),
        "makespan_over_ideal": round(vsec / (plan.total_lines / rate), 3), "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 2), "cpu_per_job_s": round(cpu / vsec, 4), "gil_busy": round(cpu / wall, 2),
        "fake_cpu_s": round(fake, 2), "controller_cpu_s": round(cpu - fake, 2),
        "controller_cpu_per_job_s": round((cpu - fake) / vsec, 4),
        "decisions_wait": int(c.get("decisions_wait", 0)),
        "unused_while_pending": round(unused["pending"] / (rate * vsec), 3),
        "unused_at_tail": round(unused["tail"] / (rate * vsec), 3),
        "decisions_per_chunk": round(c.get("decisions", 0) / max(1, counts.get("done", 0)), 1),
        "decisions": int(c.get("decisions", 0)),
        "cpu_per_decision_ms": round(1000 * c.get("decision_cpu", 0) / max(1, c.get("decisions", 0)), 3),
        "decision_cpu_s": round(c.get("decision_cpu", 0), 2),
        "rss_mb": round(_peak_kb() / 1024, 1), "rss_after_plan_mb": round(rss0 / 1024, 1),
        "state_changes_per_min": round(log["appends"] / minutes, 1),
        "state_kb_per_min": round((log["log_bytes"] + log["snapshot_bytes"]) / 1024 / minutes, 1),
        "state_bytes_per_change": round((log["log_bytes"] + log["snapshot_bytes"]) / max(1, log["appends"])),
        "snapshots": log["snapshots"], "state_kb_final": round(ctl.assign.log.snapshot_bytes / 1024, 1),
        "store_puts_per_min": round(log["puts"] / minutes, 1),
        "store_kb_per_min": round(log["put_bytes"] / 1024 / minutes, 1),
        "plan_writes": state["writes"], "plan_kb_per_min": round(state["bytes"] / 1024 / minutes, 1),
        "plan_kb_final": round(state["max"] / 1024, 1),
        "ops_per_node_per_min": round(c.get("ops", 0) / n / minutes, 1),
        "op_counts": {k[3:]: int(v) for k, v in sorted(c.items()) if k.startswith("op:")},
        "connects_per_node_per_min": round(c.get("connect", 0) / n / minutes, 2),
        "ssh": f"{len(args.sshds.ports)} sshd on loopback" if getattr(args, "sshds", None) else "none",
        "ssh_ops": int(c.get("ssh_ops", 0)), "ssh_connects": int(c.get("ssh_connects", 0)),
        "zip_puts": int(c.get("zip_puts", 0)),
        "ssh_ops_per_wall_s": round(c.get("ssh_ops", 0) / wall, 1),
        "start_jobs": int(c.get("start_job", 0)),
        "task_runs": int(c.get("task_runs", 0)) + n,
        "task_runs_per_min": round((c.get("task_runs", 0) + n) / minutes, 1),
        "progress_writes_per_min": round(progress_writes / minutes, 1),
    }


def probe_decisions(nodes: int, rows: int, uncached: bool, asks: int = 50) -> dict[str, Any]:
    """One decision's CPU (next_size, as node_loop and _prestart ask it) mid-job at `nodes` nodes,
    without running the job: the plan cut for `nodes`, half its chunks done (one attempt each, spread
    over the nodes), each node running one; `asks` nodes ask once each. The state is not changed
    between questions, as between two polls of an idle node."""
    from fleet.config import FleetConfig
    from fleet.generation.data.objstore import Store
    from fleet.generation.multinode.controller import Controller, NodeWork

    root = f"memory://probe-{os.getpid()}-{nodes}-{int(uncached)}"
    Store(root).write_bytes("input.jsonl", b"".join(b'{"id":%d,"prompt":"q"}\n' % i for i in range(rows)))
    tmp = Path(tempfile.mkdtemp(prefix="fleet-ctlprobe-"))
    names = [f"n{i:04d}" for i in range(nodes)]
    cfg = FleetConfig(name="bench-probe", nodes=[{"name": n, "workdir": str(tmp / n)} for n in names],
                      engine={"kind": "sim"}, model={"served_name": "sim-model"})
    ctl = Controller(cfg, tmp / "plan", f"{root}/out", {n: NodeWork(n, []) for n in names})
    setup0 = _time.monotonic()
    plan = ctl.prepare(f"{root}/input.jsonl")
    assert ctl.assign is not None
    t = 1000.0
    for k, c in enumerate(plan.chunks):
        name = names[k % nodes]
        if k < len(plan.chunks) // 2:
            ctl.assign.start(c.index, name, f"/w/{c.name}")
            ctl.assign.finish(c.index, name, "done", fetched=True)
            t += 1
        elif k < len(plan.chunks) // 2 + nodes:
            ctl.assign.start(c.index, name, f"/w/{c.name}")
            ctl.nodes[name].chunk = c.index
            ctl.nodes[name].progress = {"rows_total": c.lines, "rows_done": c.lines // 2, "rows_per_s": 7.0}
    setup_s = _time.monotonic() - setup0   # was O(chunks²) with state.json rewritten per change: > 500 s at 1,000
    if uncached:
        _uncached(ctl)
    ctl.next_size(names[0])   # the first question after the last change scans (both ways)
    t0 = _time.thread_time()
    for name in names[:asks]:
        ctl.next_size(name)
    per = (_time.thread_time() - t0) / min(asks, nodes)
    size = len(json.dumps(ctl.assign.snapshot()))
    t1 = _time.thread_time()
    ctl.assign._save((plan.chunks[0].index,))    # one change: a line of the log
    save_s = _time.thread_time() - t1
    t2 = _time.thread_time()
    ctl.assign.compact()                          # the whole state: what every change cost before the log
    compact_s = _time.thread_time() - t2
    Store(root).fs.rm(Store(root).path, recursive=True)
    return {"nodes": nodes, "chunks": len(plan.chunks), "scans": "per question (before)" if uncached else
            "per change (after)", "decision_ms": round(per * 1000, 3), "state_kb": round(size / 1024, 1),
            "setup_s": round(setup_s, 1), "change_write_ms": round(save_s * 1000, 2),
            "whole_state_write_ms": round(compact_s * 1000, 2)}


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _peak_kb() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


S3_BUCKET = "bench"


def start_moto() -> tuple[Any, int]:
    """moto's S3 server on a free loopback port, the AWS_* environment of this process pointing at it."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = _time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2).close()
            break
        except OSError:
            if proc.poll() is not None or _time.monotonic() > deadline:
                raise SystemExit("moto's server did not start")
            _time.sleep(0.2)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret", AWS_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    from fleet.generation.data.objstore import Store

    Store(f"s3://{S3_BUCKET}").fs.mkdir(S3_BUCKET)
    return proc, port


def start_prefect() -> int:
    """This PREFECT_HOME's local Prefect server (flows/localserver.py, as `fleet` commands use it): its pid."""
    import json as _json

    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")   # not a line per task run on the console
    from flows.api import ensure_api
    from flows.localserver import state_dir

    ensure_api()
    return int(_json.loads((state_dir() / "server.json").read_text())["pid"])


def run_in_flow(args: argparse.Namespace) -> dict[str, Any]:
    """`run` inside a flow run: each node's loop is the flow's node_worker task, each chunk attempt a task run."""
    from prefect import flow

    @flow(name="bench-controller-scale", log_prints=False)
    def bench_flow() -> dict[str, Any]:
        return run(args)

    out: dict[str, Any] = bench_flow()
    return out


def count_task_runs() -> int:
    """Task runs the Prefect server holds (the bench's PREFECT_HOME is its own: all of them are the bench's)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        res = client._client.post("/task_runs/count", json={})
        res.raise_for_status()
        return int(res.json())


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefect", action="store_true",
                    help="run inside a flow on this PREFECT_HOME's local Prefect server: each node's loop a task "
                         "run, each chunk attempt a task run (tasks/multinode.py), the server's CPU reported apart")
    ap.add_argument("--store", choices=("memory", "s3"), default="memory",
                    help="where the job's input, output and control files are: fsspec's memory:// (free) or "
                         "moto's S3 server on loopback (a real server: HTTP, botocore, its latency)")
    ap.add_argument("--ssh", type=int, default=0, metavar="K",
                    help="a second pass of the same job where every node operation also makes its real SSH round "
                         "trip, on a connection to one of K sshd on loopback (openssh-server), each connect a real "
                         "handshake; use --speed 1 with it (an SSH round trip's wall time is not compressed)")
    ap.add_argument("--ssh-only", action="store_true", help="with --ssh: only the pass with the real SSH seam")
    ap.add_argument("--old-looks", action="store_true",
                    help="with --ssh: first the same pass with every running chunk looked at every poll_s")
    ap.add_argument("--old-starts", action="store_true",
                    help="with --ssh: first the same pass as the controller started chunks before: a connection "
                         "per chunk attempt, each start proving the node again (venv, zip put) in 10 round trips")
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--rows", type=int, default=902_087)
    ap.add_argument("--speed", type=float, default=20.0, help="job seconds per wall second")
    ap.add_argument("--losses", type=float, default=0.1, help="share of the nodes lost once (for 60-300 s)")
    ap.add_argument("--node-lost-s", type=float, default=60.0)
    ap.add_argument("--probe-s", type=float, default=10.0)
    ap.add_argument("--poll-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--idle-max-s", type=float, default=None,
                    help="the controller's longest back-off of an idle node (default: its own, IDLE_MAX_S)")
    ap.add_argument("--max-wall-s", type=float, default=600.0)
    ap.add_argument("--compare", action="store_true", help="also run the same job with the scans before the fix")
    ap.add_argument("--compare-state", action="store_true",
                    help="also run the same job with the whole state written on every change (before the log)")
    ap.add_argument("--probe-decisions", action="store_true",
                    help="only time one decision mid-job at --nodes nodes, before and after the fix")
    args = ap.parse_args()
    import logging

    if args.probe_decisions:
        for uncached in (True, False):
            # before the fix a decision at 1,000 nodes takes seconds: 3 of them are enough to say so
            asks = 3 if uncached and args.nodes > 300 else 50
            print(json.dumps(probe_decisions(args.nodes, args.rows, uncached, asks)), flush=True)
        return

    logging.basicConfig(level=logging.ERROR)
    moto = start_moto()[0] if args.store == "s3" else None
    sshds = None
    if args.ssh:
        sys.path.insert(0, str(ROOT / "bench"))
        from sshds import Sshds

        sshds = Sshds(args.ssh)
    prefect_pid = start_prefect() if args.prefect else None
    try:
        passes = [(False, False, False)]
        if args.compare:
            passes.insert(0, (True, False, False))
        if args.compare_state:
            passes.insert(0, (False, True, False))
        passes4 = [(u, w, ssh, "") for u, w, ssh in passes]
        if sshds:   # the same job again, each node operation also its real SSH round trip
            passes4 = [p for p in passes4 if not args.ssh_only] + \
                ([(False, False, True, "starts")] if args.old_starts else []) + \
                ([(False, False, True, "looks")] if args.old_looks else []) + [(False, False, True, "")]
        rows = []
        for uncached, whole, ssh, old in passes4:
            args.uncached, args.whole_state = uncached, whole
            args.old_starts, args.old_looks = old == "starts", old == "looks"
            args.sshds = sshds if ssh else None
            label = "scans per question (before)" if uncached else \
                "state rewritten whole per change (before)" if whole else \
                "real SSH, a connection and a whole start per attempt (before)" if old == "starts" else \
                "real SSH, every running chunk looked at every poll (before)" if old == "looks" else \
                "now, real SSH" if ssh else "now"
            load = os.getloadavg()[0]
            store_cpu0 = _proc_cpu_s(moto.pid) if moto else 0.0
            prefect_cpu0 = _proc_cpu_s(prefect_pid) if prefect_pid else 0.0
            task_runs0 = count_task_runs() if prefect_pid else 0
            sshd_cpu0 = args.sshds.cpu_s() if args.sshds else 0.0
            r = {"pass": label, "store": args.store, "prefect": "real server" if args.prefect else "none",
                 **(run_in_flow(args) if args.prefect else run(args)), "load_before": round(load, 1),
                 "load_after": round(os.getloadavg()[0], 1)}
            if moto:
                r["store_server_cpu_s"] = round(_proc_cpu_s(moto.pid) - store_cpu0, 1)
            if args.sshds:
                r["sshd_cpu_s"] = round(args.sshds.cpu_s() - sshd_cpu0, 1)
            if prefect_pid:
                r["prefect_server_cpu_s"] = round(_proc_cpu_s(prefect_pid) - prefect_cpu0, 1)
                r["prefect_task_runs"] = count_task_runs() - task_runs0
            print(json.dumps(r), flush=True)
            rows.append(r)
        if moto:
            moto.kill()
            moto.wait()
    finally:
        if sshds:
            sshds.close()
    print_table(rows)


TABLE = [   # (column, key or function of the result)
    ("pass", "pass"), ("store", "store"), ("prefect", "prefect"), ("nodes", "nodes"), ("rows", "rows"),
    ("chunks done / once / total", lambda r: f"{r['chunks_done']} / {r['chunks_done_once']} / {r['chunks']}"),
    ("job s ÷ ideal", lambda r: f"{r['makespan_s']:,.0f} ÷ {r['ideal_s']:,.0f} = {r['makespan_over_ideal']}"),
    ("capacity unused while chunks pending / after", lambda r: f"{r.get('unused_while_pending', '?')} / "
                                                               f"{r.get('unused_at_tail', '?')}"),
    ("CPU / decision ms", "cpu_per_decision_ms"),
    ("decisions (told to wait; per chunk)", lambda r: f"{r['decisions']:,} ({r.get('decisions_wait', '?'):,}; "
                                                      f"{r.get('decisions_per_chunk', '?')})"),
    ("CPU s: all (per job s)", lambda r: f"{r['cpu_s']} ({r['cpu_per_job_s']})"),
    ("CPU s: controller, fake nodes apart (per job s)",
     lambda r: f"{r.get('controller_cpu_s', '?')} ({r.get('controller_cpu_per_job_s', '?')})"),
    ("CPU s: fake nodes", lambda r: r.get("fake_cpu_s", "?")),
    ("peak RSS MB", "rss_mb"),
    ("state KB / min (B / change)", lambda r: f"{r['state_kb_per_min']:,} ({r['state_bytes_per_change']:,})"),
    ("changes / min", "state_changes_per_min"),
    ("store PUTs / min, KB / min", lambda r: f"{r['store_puts_per_min']}, {r['store_kb_per_min']:,}"),
    ("store server CPU s (moto)", lambda r: r.get("store_server_cpu_s", "-")),
    ("Prefect: task runs recorded; server CPU s", lambda r: f"{r.get('prefect_task_runs', '-')}; "
                                                            f"{r.get('prefect_server_cpu_s', '-')}"),
    ("plan.json KB / min (final KB)", lambda r: f"{r['plan_kb_per_min']:,} ({r['plan_kb_final']:,})"),
    ("task runs / min", "task_runs_per_min"),
    ("node ops / node / min", "ops_per_node_per_min"), ("SSH connects / node / min", "connects_per_node_per_min"),
    ("node seam", lambda r: r.get("ssh", "none")),
    ("real SSH round trips (per wall s); handshakes; zips put", lambda r: f"{r.get('ssh_ops', 0):,} "
     f"({r.get('ssh_ops_per_wall_s', 0)}); {r.get('ssh_connects', 0)}; {r.get('zip_puts', 0)}"),
    ("sshd CPU s (every session)", lambda r: r.get("sshd_cpu_s", "-")),
    ("wall s", "wall_s"), ("gil_busy", "gil_busy"), ("load", lambda r: f"{r['load_before']}–{r['load_after']}"),
    ("errors", lambda r: "; ".join(r["errors"]) or "none"),
]


def print_table(rows: list[dict[str, Any]]) -> None:
    """The results as a Markdown table, one column per pass (what bench/RESULTS.md quotes)."""
    print()
    print("| | " + " | ".join(str(r["pass"]) for r in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for name, key in TABLE[1:]:
        cells = [key(r) if callable(key) else r.get(key) for r in rows]
        print(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
