"""The per-node lock (tasks/locks.py) against a real Prefect server: who holds it is named, and a
slot whose holder is gone is reclaimed — by one waiting run, and only when the holder is gone.

Real parts: the session's Prefect test server, its concurrency limits and variables, real flow
runs. Holders that are gone are made the way they happen: a slot taken and its process dead, a
record of another machine whose heartbeat stopped, a flow run that ended, a slot with no record.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import pytest

import tasks.locks as locks
from fleet.config import FleetConfig

pytestmark = pytest.mark.usefixtures("prefect_api")


def cfg_for(host: str) -> FleetConfig:
    """A fleet on its own (fake) SSH machine, so each test has its own lock."""
    return FleetConfig(name="lk", nodes=[{"name": "n", "kind": "ssh", "host": host, "port": 22, "user": "u",
                                          "workdir": "/w"}])


def client() -> Any:
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def take_slot(name: str) -> str:
    """Take the one slot with a Prefect lease, as a holder does; return the lease id."""
    with client() as c:
        from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
        from prefect.exceptions import ObjectAlreadyExists

        try:
            c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
        lease = locks._try_acquire(c, [name], None)
        assert lease is not None
        return lease


def write_record(name: str, **kw: Any) -> None:
    from prefect.client.schemas.actions import VariableCreate

    h = dict(run_id=None, run_name="other-run", purpose="bringup", host="elsewhere", machine="m-other", pid=1,
             pid_start="", lease_id="00000000-0000-0000-0000-000000000000", since=time.time() - 42)
    h.update(kw)
    with client() as c:
        c.create_variable(VariableCreate(name=locks.record_name(name), value={**h, "beat": time.time()}))


def active(name: str) -> int:
    with client() as c:
        return locks._active_slots(c, name)


def hold(cfg: FleetConfig, wait_s: float) -> dict[str, Any]:
    """hold_nodes inside a flow run (it logs through the run logger); what happened."""
    from prefect import flow

    @flow(name="lock-test")
    def holder() -> dict[str, Any]:
        listen()
        t0 = time.monotonic()
        with locks.hold_nodes(cfg, wait_s=wait_s, purpose="bringup") as names:
            with client() as c:
                _, rec = locks._read_record(c, names[0])
            return {"waited": time.monotonic() - t0, "record": rec, "active": active(names[0])}

    return holder()


class Logs(logging.Handler):
    """What the flow runs logged: a handler on Prefect's run logger (it does not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


_LOGS: list[Logs] = []


def listen() -> None:
    """Attach the test's handler now: Prefect configures its loggers on first use (dropping
    handlers added earlier), so this runs inside the flow, when that has happened."""
    logger = logging.getLogger("prefect.flow_runs")
    for h in _LOGS:
        if h not in logger.handlers:
            logger.addHandler(h)


@pytest.fixture
def logs() -> Iterator[Logs]:
    h = Logs()
    _LOGS.append(h)
    try:
        yield h
    finally:
        _LOGS.remove(h)
        logging.getLogger("prefect.flow_runs").removeHandler(h)


def test_dead_process_on_this_machine_is_reclaimed_at_once(logs: Logs) -> None:
    """Protects against the lock a killed `fleet up` left: the slot taken, its holder record
    naming a process that no longer exists. The next run takes it over at once and says so."""
    cfg = cfg_for("dead-pid.example")
    name = locks.lock_names(cfg)[0]
    lease = take_slot(name)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_record(name, host=socket.gethostname(), machine=locks._machine_id(), pid=gone.pid, pid_start="1",
                 lease_id=lease, run_name="bringup-killed")
    res = hold(cfg, wait_s=60)
    assert res["waited"] < 30 and res["record"].pid == os.getpid()
    assert f"reclaimed the lock {name} of run 'bringup-killed'" in logs.text
    assert f"its process {gone.pid} is gone" in logs.text
    assert active(name) == 0  # given back at the end, and the dead one's slot not counted twice


def test_live_holder_is_named_and_kept(logs: Logs) -> None:
    """Protects against a waiting run that says nothing useful ("another run holds …") and
    against stealing a live holder's slot: this process is alive, so it is waited for, named,
    with how long it has held the node, and the waiter gives up with NodeBusy."""
    from prefect import flow

    cfg = cfg_for("live.example")
    name = locks.lock_names(cfg)[0]
    lease = take_slot(name)
    write_record(name, host=socket.gethostname(), machine=locks._machine_id(), pid=os.getpid(),
                 pid_start=locks._pid_start(os.getpid()), lease_id=lease, run_name="bringup-alive")

    @flow(name="lock-test-busy")
    def waiter() -> str:
        listen()
        try:
            with locks.hold_nodes(cfg, wait_s=2, purpose="bringup"):
                return "held"
        except locks.NodeBusy as exc:
            return exc.one_line()

    msg = waiter()
    assert "node busy" in msg and "held by run 'bringup-alive' (bringup, pid" in msg, msg
    assert f"{name} is held by run 'bringup-alive'" in logs.text and " s; waiting (up to 2 s)" in logs.text
    assert "reclaimed" not in logs.text
    assert active(name) == 1
    with client() as c:
        c.release_concurrency_slots_with_lease(lease)


def test_other_machine_with_a_stopped_heartbeat_is_reclaimed(monkeypatch: pytest.MonkeyPatch,
                                                             logs: Logs) -> None:
    """A holder on another machine cannot be asked for its pid: its heartbeat is what says it is
    gone (a worker machine lost, a real Prefect server restarted with the lease in memory)."""
    monkeypatch.setattr(locks, "STALE_S", 1.0)
    cfg = cfg_for("stale-beat.example")
    name = locks.lock_names(cfg)[0]
    take_slot(name)
    write_record(name, lease_id="00000000-0000-0000-0000-000000000001", run_name="bringup-far")
    res = hold(cfg, wait_s=60)
    assert res["record"].pid == os.getpid()
    assert "of run 'bringup-far'" in logs.text and "its heartbeat stopped" in logs.text
    assert active(name) == 0


def test_holder_whose_flow_run_ended_is_reclaimed(logs: Logs) -> None:
    """A run that ended (Completed, Crashed…) holds nothing, even if its process still lives
    (here: this very process) — e.g. a release that failed while its server was down."""
    from prefect import flow

    @flow(name="lock-test-ended")
    def ended() -> str:
        from prefect.context import FlowRunContext

        return str(FlowRunContext.get().flow_run.id)

    run_id = ended()
    cfg = cfg_for("ended-run.example")
    name = locks.lock_names(cfg)[0]
    lease = take_slot(name)
    write_record(name, host=socket.gethostname(), machine=locks._machine_id(), pid=os.getpid(),
                 pid_start=locks._pid_start(os.getpid()), lease_id=lease, run_id=run_id, run_name="bringup-done")
    hold(cfg, wait_s=60)
    assert "of run 'bringup-done'" in logs.text and "its flow run ended Completed" in logs.text
    assert active(name) == 0


def test_slot_without_a_record_is_reclaimed_after_the_grace(monkeypatch: pytest.MonkeyPatch,
                                                            logs: Logs) -> None:
    """The observed jam: `active_slots=1` with no holder anywhere (left by a fleet before holder
    records, or a run killed between taking the slot and writing its record). Reclaimed after
    ORPHAN_GRACE_S (here shortened), never at once: a record may be about to be written."""
    monkeypatch.setattr(locks, "ORPHAN_GRACE_S", 2.0)
    cfg = cfg_for("orphan.example")
    name = locks.lock_names(cfg)[0]
    with client() as c:
        from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

        c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        c.increment_concurrency_slots([name], 1, "concurrency")  # no lease, no record: a leaked slot
    res = hold(cfg, wait_s=60)
    assert res["waited"] >= 2.0
    assert f"reclaimed the lock {name}, taken for" in logs.text and "left no holder record" in logs.text
    assert active(name) == 0
    with client() as c:
        assert c.read_variable_by_name(f"{name}-reclaim") is None  # the reclaim token is gone


def test_the_record_is_written_while_held_and_removed_after() -> None:
    cfg = cfg_for("record.example")
    name = locks.lock_names(cfg)[0]
    res = hold(cfg, wait_s=10)
    rec = res["record"]
    assert rec is not None and rec.pid == os.getpid() and rec.purpose == "bringup" and rec.run_name
    assert rec.machine == locks._machine_id() and res["active"] == 1
    assert set(asdict(rec)) >= {"run_id", "lease_id", "since"}
    with client() as c:
        assert c.read_variable_by_name(locks.record_name(name)) is None
    assert active(name) == 0


def test_of_two_runs_reclaiming_one_dead_holder_only_one_frees_its_slot(logs: Logs) -> None:
    """Two waiting runs see the same dead holder; the slower one must not free the slot the
    faster one has meanwhile taken (two bring-ups on the same GPUs). Deleting the dead record by
    its id is the claim: the second delete finds nothing and frees nothing."""
    cfg = cfg_for("race.example")
    name = locks.lock_names(cfg)[0]
    lease = take_slot(name)
    write_record(name, host=socket.gethostname(), machine=locks._machine_id(), pid=2**22 + 7, pid_start="1",
                 lease_id=lease, run_name="bringup-dead")
    with client() as c:
        var, h = locks._read_record(c, name)  # both waiters read the record before either acts
        import logging as _logging

        log = _logging.getLogger("test-locks")
        locks._reclaim_dead(c, name, var, h, "its process is gone", log)  # the first waiter
        assert locks._active_slots(c, name) == 0
        taken = locks._try_acquire(c, [name], None)  # ... which then takes the node
        assert taken is not None
        locks._reclaim_dead(c, name, var, h, "its process is gone", log)  # the second, on its stale view
        assert locks._active_slots(c, name) == 1  # still held by the first
        c.release_concurrency_slots_with_lease(taken)


class _SignalAsGranted:
    """A Prefect client whose slot request is answered (the slot granted) and then `signum` lands
    in this thread, before the caller has read the lease id."""

    def __init__(self, c: Any, signum: int) -> None:
        self.c, self.signum = c, signum

    def __getattr__(self, name: str) -> Any:
        return getattr(self.c, name)

    def increment_concurrency_slots_with_lease(self, *args: Any, **kwargs: Any) -> Any:
        answer = self.c.increment_concurrency_slots_with_lease(*args, **kwargs)
        signal.raise_signal(self.signum)
        return answer


@pytest.mark.parametrize("handler", ["command", "ignored"])
def test_a_ctrl_c_during_the_slot_request_never_leaves_the_slot_held_by_a_run_going_on(handler: str) -> None:
    """Fault (review): a Ctrl-C noted while the slot was being granted gave the slot back, then the
    command's own SIGINT handler (it only starts the shutdown; it raises nothing) returned, and
    `take` returned the given-back lease: the bring-up went on as the node's holder without the
    slot, and a second run could take the node beside it. Now a noted signal whose handler does not
    raise ends the taking with KeyboardInterrupt, the slot free. An ignored SIGINT (a worker started
    with `nohup … &`) changes nothing: the slot is taken and kept."""
    name = f"fleet-node-take-{handler}"
    lease = take_slot(name)   # creates the limit; given back at once: the slot is free for the test
    with client() as c:
        c.release_concurrency_slots_with_lease(locks.UUID(lease))
    def command_handler(signum: int, frame: Any) -> None:   # as fleet/interrupt.py's: starts the shutdown, raises nothing
        pass

    mine = command_handler if handler == "command" else signal.SIG_IGN
    before = signal.signal(signal.SIGINT, mine)
    taking = locks._Taking([name])
    try:
        with client() as c:
            if handler == "command":
                with pytest.raises(KeyboardInterrupt):
                    taking.take(_SignalAsGranted(c, signal.SIGINT), [name], None)
                assert locks._active_slots(c, name) == 0
            else:
                lease = taking.take(_SignalAsGranted(c, signal.SIGINT), [name], None)
                assert lease is not None and locks._active_slots(c, name) == 1
                c.release_concurrency_slots_with_lease(locks.UUID(lease))
        assert signal.getsignal(signal.SIGINT) == mine   # put back after the request
    finally:
        taking.done()
        signal.signal(signal.SIGINT, before)


def _temporary_servers_of_this_process() -> list[int]:
    """Prefect's own temporary API servers (`prefect.server.api.server:create_app` under uvicorn) that
    this test process started (its children)."""
    me, found = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == me and b"prefect.server.api.server" in cmd:
            found.append(int(d))
    return found


def test_the_heartbeat_renews_the_lease_on_the_flows_server_not_a_temporary_one(
        monkeypatch: pytest.MonkeyPatch, prefect_api: str) -> None:
    """Fault: the lock's heartbeat ran in a plain thread, which starts with no context; with the API
    set by a settings context (a flow called in-process under `temporary_settings`, as this suite and
    a user's own script do) Prefect's client there found no API and started a temporary server of its
    own, one more server on the database, and renewed the lease through it. Now the heartbeat runs in
    its creator's context: the beats reach the flow's server and no temporary server is started. The
    process's global settings are emptied here, as a plain script's are."""
    from conftest import global_api
    from conftest import wait_until as poll

    monkeypatch.setattr(locks, "BEAT_S", 0.2)
    global_api(None)
    try:
        cfg = cfg_for("beat.example")
        name = locks.lock_names(cfg)[0]
        from prefect import flow

        @flow(name="lock-beat-test")
        def holder() -> list[float]:
            with locks.hold_nodes(cfg, wait_s=10, purpose="bringup"):
                beats: list[float] = []

                def beat_moved() -> bool:
                    with client() as c:
                        v = c.read_variable_by_name(locks.record_name(name))
                    b = (v.value or {}).get("beat") if v is not None else None
                    if b is not None and b not in beats:
                        beats.append(b)
                    return len(beats) >= 3   # the record's first write and two heartbeats

                poll(beat_moved, timeout=60, what="two heartbeats on the flow's server", state=lambda: beats)
                return beats

        beats = holder()
        assert beats == sorted(beats)
        assert _temporary_servers_of_this_process() == [], "the heartbeat started a temporary Prefect server"
    finally:
        global_api(prefect_api)
