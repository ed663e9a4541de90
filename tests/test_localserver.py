"""The local Prefect server that `fleet` commands share per PREFECT_HOME (flows/localserver.py).

Real parts: each "command" is a separate Python process that attaches as a flow command does
(`attach()`, the call `fleet up`/`generate`/`demo` make through flows/api.py), each test on its
own PREFECT_HOME; the servers are real `uvicorn` Prefect servers on loopback. The end-to-end
`fleet up` path (a Ctrl-C'd command, then the next one reusing the same server) is in
tests/test_interrupt.py.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import _environ, local_prefect_servers, seed_prefect_home, wait_until
from flows.localserver import Record, is_live, proc_start, read_record, stop

pytestmark = pytest.mark.prefect
ROOT = Path(__file__).resolve().parents[1]

# A command's part in it: attach, say which server, and (with an argument) stay attached until
# a line arrives on stdin, as a long `fleet generate` does.
CLIENT = r"""
import sys
from flows.localserver import attach, read_record, state_dir
url = attach()
print(url, read_record(state_dir()).pid, flush=True)
if len(sys.argv) > 1:
    sys.stdin.readline()
"""


def env_for(home: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FLEET_PREFECT_"))}
    e.update({"PREFECT_HOME": str(seed_prefect_home(home)), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
              "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240", **extra})
    return e


class Client:
    """One command attached to the local server, held until `release()` when `hold`."""

    def __init__(self, env: dict[str, str], hold: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT, *(["hold"] if hold else [])], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def attached(self) -> tuple[str, int]:
        """(url, server pid) once attached."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert len(line) == 2, f"the client failed: {self.proc.communicate(timeout=60)}"
        return line[0], int(line[1])

    def release(self) -> None:
        out, err = self.proc.communicate("\n", timeout=60)
        assert self.proc.returncode == 0, err


def servers_of(home: Path) -> list[int]:
    """The live local servers whose state dir is under `home`."""
    return [pid for pid in local_prefect_servers()
            if _environ(pid).get("FLEET_PREFECT_SERVER_DIR") == str(home / "fleet-server")]


@pytest.fixture
def home(tmp_path: Path):
    h = tmp_path / "prefect-home"
    yield h
    stop(h / "fleet-server")


def test_two_first_commands_at_once_start_one_server_and_the_next_reuses_it(home: Path) -> None:
    """Protects against two commands started together each starting a server on the same
    database (the start is under start.lock: one starts it, the other finds it), and against
    a later command paying for a server start again: it uses the recorded server (same pid).
    The server outlives the commands, so it must not keep their secrets: none is in its environment."""
    env = dict(env_for(home), FLEET_API_KEY="sk-local-server-test", AWS_SECRET_ACCESS_KEY="aws-local-server-test")
    a, b = Client(env, hold=True), Client(env, hold=True)
    (url_a, pid_a), (url_b, pid_b) = a.attached(), b.attached()
    assert (url_a, pid_a) == (url_b, pid_b)
    assert servers_of(home) == [pid_a]
    kept = _environ(pid_a)
    assert kept["PREFECT_HOME"] == str(home) and "FLEET_API_KEY" not in kept and "AWS_SECRET_ACCESS_KEY" not in kept
    a.release()
    b.release()
    c = Client(env)
    assert c.attached() == (url_a, pid_a)  # reused: no second server
    c.release()
    assert servers_of(home) == [pid_a]
    rec = read_record(home / "fleet-server")
    assert rec is not None and rec.pid == pid_a and is_live(rec)


def test_a_stale_record_is_replaced(home: Path) -> None:
    """Protects against a record left by a server that died (kill -9, a reboot) sending every
    later command to a dead port, or to a process that got its pid since: such a record is
    stale (its pid's start time differs) and the next command starts a server in its place."""
    d = home / "fleet-server"
    d.mkdir(parents=True)
    me = os.getpid()  # alive, but not the recorded process: its start time is not the one recorded
    assert proc_start(me) not in (None, "", "1")
    stale = Record(me, 9, 0.0, "1")
    (d / "server.json").write_text(json.dumps({"pid": me, "port": 9, "started": 0.0, "proc_start": "1"}))
    assert not is_live(stale)
    c = Client(env_for(home))
    url, pid = c.attached()
    c.release()
    assert pid != me and servers_of(home) == [pid]
    rec = read_record(d)
    assert rec is not None and rec.pid == pid and rec.url == url and is_live(rec)


def test_the_server_stops_when_idle_and_the_next_command_starts_another(home: Path) -> None:
    """Protects against servers left running for ever by commands that are long gone: with no
    command attached for FLEET_PREFECT_SERVER_IDLE_S, the server removes its record and exits.
    The next command then starts a fresh one (never attaching to one that is going away)."""
    env = env_for(home, FLEET_PREFECT_SERVER_IDLE_S="2")
    c = Client(env)
    _, first = c.attached()
    c.release()
    wait_until(lambda: not servers_of(home), timeout=120, interval=0.2, what="the idle server to exit")
    assert read_record(home / "fleet-server") is None
    again = Client(env)
    _, second = again.attached()
    again.release()
    assert second != first and servers_of(home) == [second]


def test_with_prefect_api_url_set_nothing_is_started(home: Path) -> None:
    """Protects a user's own server setup: with PREFECT_API_URL set, a flow command uses it and
    starts, records and locks nothing of its own."""
    script = "from flows.api import ensure_api; print(ensure_api())"
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env_for(home, PREFECT_API_URL="http://127.0.0.1:9/api"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "http://127.0.0.1:9/api"
    assert not (home / "fleet-server").exists() and not servers_of(home)


class ClientRetries(logging.Handler):
    """The 503s Prefect's client received (each one is a back-off of 2 s or more before it tries again)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "retryable status code 503" in record.getMessage():
            self.seen.append(record.getMessage())


async def asgi_request(app: Any, method: str = "POST", path: str = "/api/x", gone: Any = None,
                       sent: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One request through an ASGI app as uvicorn hands it over: the body, then the client's disconnect
    once `gone` (an asyncio.Event) is set — never, without one; what the app sent (also into `sent`)."""
    import asyncio

    stays = gone if gone is not None else asyncio.Event()
    out = [] if sent is None else sent
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(msg: Any) -> None:
        out.append(dict(msg))

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    return out


def replay_once(app: Any, client_gone: bool = False) -> tuple[list[dict[str, Any]], BaseException | None]:
    """One POST through `ReplayBusy(app)` as uvicorn hands it over: the body, then (only when the
    client is gone) its disconnect; what was sent to the client, and what the wrapper raised."""
    import asyncio

    from flows.localserver import ReplayBusy

    sent: list[dict[str, Any]] = []

    async def go() -> BaseException | None:
        gone = asyncio.Event()
        if client_gone:
            gone.set()
        try:
            await asgi_request(ReplayBusy(app, budget_s=2), gone=gone, sent=sent)  # old code: 2 s of replays
        except Exception as exc:
            return exc
        return None

    return sent, asyncio.run(go())


def refusing_app(error: Exception | None) -> tuple[Any, list[int]]:
    """An ASGI app that answers every request 503 and, as Starlette does after its handler, raises `error`."""
    runs: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        runs.append(1)
        await receive()
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b'{"exception_message":"Service Unavailable"}'})
        if error is not None:
            raise error

    return app, runs


@pytest.mark.parametrize("case", ["ready", "dbapi error", "detached instance"])
def test_a_503_that_is_not_a_locked_database_is_answered_at_once_not_replayed(case: str) -> None:
    """Fault: `ReplayBusy` ran again every request answered 503 for up to 10 s (~55 runs) before the
    client's own retries — but Prefect answers 503 also for any DBAPIError, InvalidRequestError and
    DetachedInstanceError, and /api/ready for a server not ready: none of them a busy database. Now
    only SQLite's busy/locked refusal is run again; any other 503 goes out after one run, with its error."""
    import sqlalchemy.exc
    import sqlalchemy.orm.exc

    error = {"ready": None,
             "dbapi error": sqlalchemy.exc.DBAPIError("SELECT 1", {}, sqlite3.DatabaseError("disk I/O error")),
             "detached instance": sqlalchemy.orm.exc.DetachedInstanceError("gone")}[case]
    app, runs = refusing_app(error)
    sent, raised = replay_once(app)
    assert len(runs) == 1, f"a 503 that is not a locked database was run {len(runs)} times"
    assert sent[0]["status"] == 503 and len(sent) == 2
    assert raised is error


def test_a_locked_database_is_not_replayed_for_a_client_that_is_gone() -> None:
    """Fault: a request refused by a locked database was run again for up to 10 s even after its client
    had disconnected. The app here meets SQLite's "database is locked" on every run (Prefect's wrapped
    error, raised after its 503); the client is gone: the wrapper stops after the first run and sends
    nothing. With the client there, the same refusal is run again until it is answered (and on a real
    server: the test below)."""
    locked = sqlite3.OperationalError("database is locked")
    error = sqlalchemy_operational(locked)
    app, runs = refusing_app(error)
    sent, raised = replay_once(app, client_gone=True)
    assert (len(runs), sent, raised) == (1, [], None)

    runs.clear()

    async def locked_twice(scope: Any, receive: Any, send: Any) -> None:   # the client there: run again
        if len(runs) < 2:
            return await app(scope, receive, send)
        runs.append(1)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent, raised = replay_once(locked_twice)
    assert (len(runs), [m.get("status") for m in sent], raised) == (3, [200, None], None)


def sqlalchemy_operational(orig: Exception) -> Exception:
    import sqlalchemy.exc

    return sqlalchemy.exc.OperationalError("DELETE FROM variable", {}, orig)


async def asgi_status(app: Any, method: str, path: str) -> int:
    """`asgi_request` with a client that stays: the status the app answered."""
    return int((await asgi_request(app, method, path))[0]["status"])


def test_writes_run_one_at_a_time_while_reads_run_beside_them() -> None:
    """Fault: the writes of one command (an adopt-only `fleet up` posts its eight task runs, their
    artifacts and states from four threads; the flow's task runner does the same) met each other in
    SQLite: Prefect's transactions read, then write, and the second writer's upgrade is refused
    "database is locked" at once, which `ReplayBusy` ran again — 63 runs again in three `fleet up`s
    (mostly POST /task_runs/), about a third of the server's CPU for the command, and task runs that
    took 0.4–0.9 s to create. Now the wrapper runs one write (POST, PUT, PATCH, DELETE) at a time, in
    the order they came, and never queues a read (a GET, a POST …/filter) behind them. Eight POSTs,
    three GETs and two POST …/filter go to one wrapper at once: no two writes are ever inside the app
    together, every request is answered, and the five reads are inside it together (each waits until
    all five are: queued, they never would be)."""
    import asyncio

    from flows.localserver import ReplayBusy

    inside = {"writes": 0, "most": 0, "reads": 0}
    order: list[int] = []
    all_reads = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if scope["method"] == "GET" or scope["path"].endswith("/filter"):
            inside["reads"] += 1
            await asyncio.wait_for(all_reads.wait(), 30) if inside["reads"] < 5 else all_reads.set()
        else:
            inside["writes"] += 1
            inside["most"] = max(inside["most"], inside["writes"])
            for _ in range(5):   # a write's awaits (the database's thread): where another would step in
                await asyncio.sleep(0)
            order.append(int(scope["path"].rsplit("/", 1)[1]))
            inside["writes"] -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def go() -> list[int]:
        wrapper = ReplayBusy(app)
        return await asyncio.gather(*[asgi_status(wrapper, "POST", f"/api/x/{n}") for n in range(8)],
                                    *[asgi_status(wrapper, "GET", f"/api/x/{n}") for n in range(3)],
                                    *[asgi_status(wrapper, "POST", f"/api/x/{n}/filter") for n in range(2)])

    statuses = asyncio.run(go())
    assert statuses == [200] * 13
    assert inside["most"] == 1, f"{inside['most']} writes were inside the app at once"
    assert order == list(range(8)), f"writes ran out of the order they came: {order}"


def test_a_write_that_does_not_end_holds_the_queue_only_queue_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue's own wait is bounded (issue 23's rule: no wait without a timeout): a write ahead that
    does not end (its database held for long) keeps the next write waiting `QUEUE_S`, then that one runs
    beside it, as every write did before the queue. Here the first write waits until the second has
    been answered: without the bound the two would wait on each other forever (the test's own
    30 s limit would end it)."""
    import asyncio

    import flows.localserver as ls

    monkeypatch.setattr(ls, "QUEUE_S", 0.05)
    second_done, first_in = asyncio.Event(), asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if scope["path"].endswith("/first"):
            first_in.set()   # inside the app: it holds the queue
            await asyncio.wait_for(second_done.wait(), 30)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def post(wrapper: ls.ReplayBusy, path: str) -> int:
        status = await asgi_status(wrapper, "POST", path)
        if path.endswith("/second"):
            second_done.set()
        return status

    async def go() -> list[int]:
        wrapper = ls.ReplayBusy(app)
        first = asyncio.ensure_future(post(wrapper, "/api/x/first"))
        await asyncio.wait_for(first_in.wait(), 30)
        return [await asyncio.wait_for(post(wrapper, "/api/x/second"), 30), await asyncio.wait_for(first, 30)]

    assert asyncio.run(go()) == [200, 200]


def test_a_record_delete_refused_by_a_locked_database_is_not_backed_off(home: Path) -> None:
    """Protects against the 2 s stall of a flow command in about half the runs on an idle machine:
    the node lock's holder-record DELETE (tasks/locks.py) met the server's SQLite database locked by
    another writer, the server answered 503 and Prefect's client slept 2 s before trying again.
    Here the database is really locked (a write transaction held on its file, as the server's own
    event recorder holds it) while the DELETE runs: the server meets the lock (its log says so),
    and once the lock is gone the DELETE completes without Prefect's client ever receiving a 503
    (so with no back-off), and the record is gone (a record left after its slot is freed would let
    a waiting run reclaim the next holder's slot)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import tasks.locks as locks

    holder = Client(env_for(home, PREFECT_SERVER_LOG_RETRYABLE_ERRORS="true"), hold=True)
    url, _ = holder.attached()
    log = home / "fleet-server" / "server.log"

    def refusals() -> int:
        return log.read_text(errors="replace").count("retryable exception in request")

    retries = ClientRetries()
    logging.getLogger("prefect.client").addHandler(retries)
    level = logging.getLogger("prefect.client").level
    logging.getLogger("prefect.client").setLevel(logging.DEBUG)
    db = sqlite3.connect(home / "prefect.db", isolation_level=None, timeout=60)
    try:
        with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
            var = client.create_variable(VariableCreate(name=locks.record_name("fleet-node-replay"), value={"x": 1}))
            before = refusals()
            db.execute("BEGIN IMMEDIATE")  # the write lock, held
            done: list[bool] = []
            deleting = threading.Thread(target=contextvars.copy_context().run,
                                        args=(lambda: done.append(locks._delete_record(client, var.id)),))
            deleting.start()
            wait_until(lambda: refusals() > before, timeout=120, what="the server to meet the locked database")
            db.execute("ROLLBACK")
            unlocked = time.monotonic()
            deleting.join(120)
            took = time.monotonic() - unlocked
            assert done == [True], "the DELETE did not complete"
            assert client.read_variable_by_name(locks.record_name("fleet-node-replay")) is None
        assert retries.seen == [], f"the client backed off ({took:.2f} s after the lock was gone): {retries.seen}"
    finally:
        db.close()
        logging.getLogger("prefect.client").removeHandler(retries)
        logging.getLogger("prefect.client").setLevel(level)
        holder.release()


def test_a_slow_first_start_is_waited_for_on_the_port_range_given(home: Path, tmp_path: Path) -> None:
    """Fault (issue 37): on a busy machine the first flow command gave up on the local server after
    a fixed 90 s, twice ("did not answer within 90 s (machine busy?) (tried 2 times)", exit 2 after
    197 s, nothing printed meanwhile), and the server took any port, outside the range a user of a
    shared machine was given. Here every start is "slow": the server may go only 3 s without
    progress, and a real server's start takes longer than that to answer. `fleet up` in a new
    PREFECT_HOME says at once that it starts the server, keeps waiting while the server works, and
    completes; the server is on the first free port of FLEET_PREFECT_PORTS (the first one is taken)."""
    import socket

    from conftest import port_block
    from test_interrupt import down, sim_cfg

    lo = port_block(3)
    taken = socket.socket()
    taken.bind(("127.0.0.1", lo))
    taken.listen()
    cfg = sim_cfg(tmp_path, "sl", startup_s=0.3)
    env = env_for(home, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="3", FLEET_PREFECT_PORTS=f"{lo}-{lo + 2}")
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "flows.cli", "up", "-c", str(cfg)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
        took = time.monotonic() - t0
        print(f"\nfleet up in a new PREFECT_HOME took {took:.1f} s")
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        said = [ln for ln in r.stderr.splitlines() if ln.startswith("fleet: starting the local Prefect server")]
        assert said and said[0].startswith("fleet: starting the local Prefect server (first start on this machine "
                                           "takes about a minute)"), r.stderr[-3000:]
        rec = read_record(home / "fleet-server")
        assert rec is not None and rec.port == lo + 1 and is_live(rec)
        assert "importing Prefect's server" in (home / "fleet-server" / "server.log").read_text()
        assert took > 3  # the start did take longer than the 3 s the old wait allowed
    finally:
        taken.close()
        down(env, cfg)


def test_a_stopped_server_fails_on_no_progress_with_its_log(home: Path) -> None:
    """The other side of "slow is not failed": a server that makes no progress (here SIGSTOPped as
    soon as it has written its first log line; a real one stuck on a lock or a dead disk) is given
    up after PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS without progress, each of the two
    tries, with its log's last line in the message — the log was empty before (block-buffered
    output of a server killed for not answering, at uvicorn's error level)."""
    import signal

    d = home / "fleet-server"
    c = Client(env_for(home, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="3"))
    stopped: list[int] = []
    try:
        for _ in range(2):
            def started() -> int | None:
                rec = read_record(d)
                log = d / "server.log"
                if c.proc.poll() is not None:
                    pytest.fail(f"the command ended before its server was seen: {c.proc.communicate()}")
                if rec and rec.pid not in stopped and log.exists() and log.stat().st_size:
                    return rec.pid
                return None
            pid = wait_until(started, timeout=240, interval=0.05, what="a server that has written its log")
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        _out, err = c.proc.communicate(timeout=120)
        assert c.proc.returncode != 0
        assert "made no progress for 3 s" in err and "(tried 2 times)" in err, err[-3000:]
        assert "its log: fleet: local Prefect server pid" in err, err[-3000:]
        assert all(proc_start(p) is None for p in stopped)  # the command killed what it gave up on
    finally:
        for p in stopped:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        if c.proc.poll() is None:
            c.proc.kill()


@pytest.mark.parametrize("env,want", [
    ({}, None),
    ({"FLEET_PREFECT_PORT": "4300"}, range(4300, 4301)),
    ({"FLEET_PREFECT_PORTS": "4300-4309"}, range(4300, 4310)),
    ({"FLEET_PREFECT_PORTS": " 4300 - 4301 "}, range(4300, 4302)),
    ({"FLEET_PREFECT_PORTS": "4309-4300"}, "FLEET_PREFECT_PORTS='4309-4300' is not a port range"),
    ({"FLEET_PREFECT_PORTS": "4300"}, "is not a port range"),
    ({"FLEET_PREFECT_PORT": "80"}, "FLEET_PREFECT_PORT='80' is not a port in 1024-65535"),
    ({"FLEET_PREFECT_PORT": "4300", "FLEET_PREFECT_PORTS": "4300-4301"}, "both"),
])
def test_the_port_setting_is_read_or_refused_in_one_line(env: dict[str, str], want: Any) -> None:
    from flows.localserver import PrefectApiUnavailable, port_range

    if isinstance(want, str):
        with pytest.raises(PrefectApiUnavailable) as err:
            port_range(env)
        assert want in err.value.one_line() and err.value.remedy and "\n" not in err.value.one_line()
    else:
        assert port_range(env) == want


def test_no_free_port_in_the_range_is_one_line_naming_it() -> None:
    import socket

    from conftest import port_block
    from flows.localserver import PrefectApiUnavailable, _free_port

    lo = port_block(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", lo))
        s.listen()
        with pytest.raises(PrefectApiUnavailable, match=f"no free port .* in FLEET_PREFECT_PORT \\({lo}-{lo}"):
            _free_port(range(lo, lo + 1))
