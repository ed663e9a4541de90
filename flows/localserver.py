"""The local Prefect server that `fleet` commands share when no `PREFECT_API_URL` is set.

Why one shared server rather than one per command: starting Prefect's server (import, app,
migrations check) cost 11–30 s of wall and 7–19 s of CPU per command on a busy 2-core machine,
for flows that take a second (`fleet up` on a fleet already up: 13.3 s for a 1.3 s flow). The
first command starts it; later commands find it and pay a health check (milliseconds).

The promises, and what keeps each:
- **One per PREFECT_HOME, never two on one database.** Everything lives in
  `<PREFECT_HOME>/fleet-server/`: `server.json` (the record: pid, its start time, port, URL),
  `start.lock` (an flock held while a command reads the record and, if needed, starts the
  server), `clients.lock` (shared-locked by every command for its life), `server.log`.
  Commands that find no live server queue on `start.lock`: one starts it, the others then find
  it. A record whose pid is gone (or reused: its start time differs) is stale and replaced.
- **Stops when unused.** The server process itself (this module's `create_app`, Prefect's app
  plus one watcher thread) stops after `FLEET_PREFECT_SERVER_IDLE_S` (default 600) without a
  command: no command holds `clients.lock` and none touched `used` since. It takes
  `clients.lock` exclusively, removes its record, and exits holding it, so a command arriving
  meanwhile waits for it to be gone and then starts a new one: never two servers on the
  database, never a command attached to a server that is going away. It also stops at once when
  its record is removed or names another server (`stop`, a deleted PREFECT_HOME).
- **Outlives Ctrl-C and the command.** Its own session (Ctrl-C in the terminal reaches only
  the command, whose cleanups talk to it), no tie to the command's life. A long job
  (`fleet generate` attached for days) holds `clients.lock` all along, so it is never idle.
- **Slow is not failed.** A first start on a busy machine took over 90 s (load 22–24: two tries
  of 90 s, then exit 2, and nothing printed for three minutes), and the same command again
  worked. So a command says within a moment what it is doing ("starting the local Prefect
  server…", then the seconds it has waited, on stderr) and waits as long as the server
  process is alive and progressing — its CPU time moves or its log grows. It gives up on a
  server that exited (at once, with the reason from its log), one that made no progress for
  `PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (default 90 s here: stopped, or stuck on a
  lock or a disk), or, as a last bound, one that never answered in 15 minutes (or ten times that). Two
  attempts, then one line with the remedy and the log's tail.
- **A log that says something.** The server's output went to `server.log` through Python's
  block buffering, so a server killed for not answering left it empty; it now runs unbuffered
  at uvicorn's info level (no access log): its start steps are there, and each line is progress.

It serves the API only (Prefect's ephemeral mode: no UI, only the services an ephemeral server
runs), on 127.0.0.1, with the database Prefect would use for this PREFECT_HOME; on a free port
the kernel picks, or the first free one of `FLEET_PREFECT_PORT` / `FLEET_PREFECT_PORTS=lo-hi`
(a shared machine's users are each given a range).

**No client back-off for a busy database.** Prefect's SQLite database refuses a write at once
("database is locked", HTTP 503) when the request's transaction read first and another writer
(the server's own event and task-run recorders, mostly) took the lock meanwhile. Prefect's client
then sleeps 2 s (then 4, 8, …) before trying again: that was 2 s of a 3 s `fleet up` in about
half the runs on an idle machine (the node lock's holder-record DELETE). This server runs such a
request again itself after a few milliseconds, for up to `REPLAY_S`, and sends the 503 (the
client's own back-off) only after that, or stops when the client is gone. Only that refusal: any
other 503 (another database error, /api/ready's) goes out at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.errors import FleetError
from fleet.net import tls_context

if TYPE_CHECKING:
    import asyncio

DEFAULT_STARTUP_TIMEOUT_S = 90.0  # no progress for this long: stuck (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)
LAST_BOUND_S = 900.0  # a server that progresses but never answers: given up after this long (or 10 × the above)
SAY_EVERY_S = 10.0   # how often a command waiting for the server says it still waits
SAYING = "fleet: starting the local Prefect server"  # every line a command prints about it begins so
DEFAULT_IDLE_S = 600.0
ATTEMPTS = 2
WATCH_EVERY_S = 1.0
EXIT_GRACE_S = 20.0  # after the idle SIGTERM, uvicorn's graceful exit; then os._exit
REPLAY_S = 10.0      # how long the server runs a request refused with 503 again before sending the 503
REPLAY_PAUSE_S = (0.005, 0.2)  # the first pause between two runs of it, and the longest (doubling)
READS = ("GET", "HEAD", "OPTIONS")  # the methods `ReplayBusy` does not queue behind the writes
QUEUE_S = 30.0       # the longest a write waits for the one ahead of it; then it runs beside it
READ_POSTS = ("filter", "count", "paginate", "history", "lateness", "counts")   # POSTs that only read (…/filter)
REMEDY = ("set PREFECT_API_URL to a running server (`prefect server start`, then "
          "PREFECT_API_URL=http://127.0.0.1:4200/api), or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
PORT_ENVS = ("FLEET_PREFECT_PORT", "FLEET_PREFECT_PORTS")


class PrefectApiUnavailable(FleetError):
    """The Prefect API fleet needs could not be started or reached."""


@dataclass(frozen=True)
class Record:
    """What `server.json` says: which process serves which port, since when."""

    pid: int
    port: int
    started: float        # time.time() at start, for people reading the file
    proc_start: str       # the kernel's start time of `pid` (/proc/<pid>/stat field 22): a reused pid differs

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"


def state_dir() -> Path:
    """`<PREFECT_HOME>/fleet-server` (PREFECT_HOME as Prefect resolves it: the environment, else ~/.prefect)."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser() / "fleet-server"


def idle_s() -> float:
    return float(os.environ.get("FLEET_PREFECT_SERVER_IDLE_S") or DEFAULT_IDLE_S)


def proc_start(pid: int) -> str | None:
    """The start time of a running process ("" where /proc cannot say); None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        stat = ""
    if stat:
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": state is field 3, starttime 22
        return None if fields[0] in ("Z", "X") else fields[19]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def read_record(d: Path) -> Record | None:
    try:
        data = json.loads((d / "server.json").read_text())
        return Record(int(data["pid"]), int(data["port"]), float(data["started"]), str(data["proc_start"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_live(rec: Record) -> bool:
    """The recorded process still runs (not a new process that got its pid)."""
    now = proc_start(rec.pid)
    return now is not None and (now == rec.proc_start or "" in (now, rec.proc_start))


def _write_record(d: Path, rec: Record) -> None:
    tmp = d / f"server.json.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(rec)) + "\n")
    os.replace(tmp, d / "server.json")


def _remove_record_if(d: Path, pid: int) -> None:
    rec = read_record(d)
    if rec is not None and rec.pid == pid:
        (d / "server.json").unlink(missing_ok=True)


@contextmanager
def _flock(path: Path, how: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)  # closing drops the lock


# ---------------------------------------------------------------------------- the command's side

_client_fds: dict[Path, int] = {}  # this process's shared lock on clients.lock per state dir, held until it exits


def _say(text: str) -> None:
    """A line about the wait, on stderr (stdout is the command's result)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # a closed stderr does not stop the start


def attach(timeout: float | None = None, say: Callable[[str], None] = _say) -> str:
    """The URL of this PREFECT_HOME's local server: the running one, or one started now.
    `timeout`: how long the server may go without progress. `say`: where the lines about a wait go.

    Marks this process as a client for its whole life (the server is not idle while it runs)."""
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    ports = port_range(os.environ)  # a bad setting is an error before anything waits or starts
    if d not in _client_fds:
        fd = os.open(d / "clients.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a server is stopping (it holds LOCK_EX)
        _client_fds[d] = fd
    (d / "used").touch()
    if timeout is None:
        timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or DEFAULT_STARTUP_TIMEOUT_S)
    with _flock_saying(d / "start.lock", say):
        rec = read_record(d)
        if rec is not None and is_live(rec):
            if not _healthy_now(rec):  # another command started it a moment ago, or it is busy
                say(f"{SAYING} (pid {rec.pid}, started by another command) …")
                _wait_healthy(rec, timeout, log=d / "server.log", say=say)
            return rec.url
        # A stale record goes first: a starting server that read it would take it for a successor and stop.
        (d / "server.json").unlink(missing_ok=True)
        say(f"{SAYING} (first start on this machine takes about a minute) …")
        last: PrefectApiUnavailable | None = None
        for _ in range(ATTEMPTS):
            try:
                return _start(d, timeout, ports, say).url
            except PrefectApiUnavailable as exc:
                if exc.remedy:  # not the server's fault (no free port in the range): trying again changes nothing
                    raise
                last = exc
        assert last is not None
        raise PrefectApiUnavailable(f"{last.reason} (tried {ATTEMPTS} times)", remedy=REMEDY)


@contextmanager
def _flock_saying(path: Path, say: Callable[[str], None]) -> Iterator[None]:
    """start.lock, saying so when another command holds it (it is starting the server)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"{SAYING}: another fleet command is starting it …")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def port_range(environ: Mapping[str, str]) -> range | None:
    """The ports the server may use: `FLEET_PREFECT_PORT=N` or `FLEET_PREFECT_PORTS=lo-hi` (both
    ends included); None: any free port the kernel picks."""
    one, many = (environ.get(k, "").strip() for k in PORT_ENVS)
    if one and many:
        raise PrefectApiUnavailable("both FLEET_PREFECT_PORT and FLEET_PREFECT_PORTS are set",
                                    remedy="set one of them: a port (FLEET_PREFECT_PORT=4300) or a range "
                                           "(FLEET_PREFECT_PORTS=4300-4309)")
    text, name = (one, "FLEET_PREFECT_PORT") if one else (many, "FLEET_PREFECT_PORTS")
    if not text:
        return None
    m = re.fullmatch(r"(\d+)" if one else r"(\d+)\s*-\s*(\d+)", text)
    lo, hi = (int(m.group(1)), int(m.group(m.lastindex or 1))) if m else (0, -1)
    if not m or not 1024 <= lo <= hi <= 65535:
        raise PrefectApiUnavailable(f"{name}={text!r} is not a port" + ("" if one else " range") + " in 1024-65535",
                                    remedy=f"set {name}=" + ("4300" if one else "4300-4309 (both ends included)"))
    return range(lo, hi + 1)


def _free_port(ports: range | None = None) -> int:
    """A port free on 127.0.0.1 now: the kernel's pick, or the first free one of `ports`."""
    for port in ports if ports is not None else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            got: int = s.getsockname()[1]
            return got
    assert ports is not None
    name = "FLEET_PREFECT_PORT" if len(ports) == 1 else "FLEET_PREFECT_PORTS"
    raise PrefectApiUnavailable(f"no free port for the local Prefect server in {name} "
                                f"({ports.start}-{ports.stop - 1}: all taken on 127.0.0.1)",
                                remedy=f"free one, or set {name} to ports of yours that are free")


def _start(d: Path, timeout: float, ports: range | None = None, say: Callable[[str], None] = _say) -> Record:
    """Start the server detached, record it, and wait for it to answer (called under start.lock)."""
    port = _free_port(ports)
    env = server_env(os.environ)
    env.update(PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1",
               PREFECT_SERVER_ANALYTICS_ENABLED=env.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
               FLEET_PREFECT_SERVER_DIR=str(d), FLEET_PREFECT_SERVER_IDLE_S=f"{idle_s():g}",
               PYTHONUNBUFFERED="1")  # its log as it happens: a server killed for not answering left it empty
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(__file__).resolve().parents[1]), "--factory",
            "flows.localserver:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info", "--no-access-log", "--lifespan", "on"]
    with (d / "server.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    rec = Record(proc.pid, port, time.time(), proc_start(proc.pid) or "")
    _write_record(d, rec)
    try:
        _wait_healthy(rec, timeout, log=d / "server.log", say=say)
    except PrefectApiUnavailable:
        _remove_record_if(d, proc.pid)
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)  # SIGKILL: at once, unless the kernel holds it (a stopped disk)
        except subprocess.TimeoutExpired:
            pass
        raise
    return rec


# What the server may keep of the starting command's environment. It outlives the command by
# minutes, so it does not carry the command's secrets (FLEET_API_KEY, an engine's token, cloud
# credentials, the SSH agent): only what Prefect, Python and the OS need.
_KEEP = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "SSL_CERT_FILE",
         "SSL_CERT_DIR")
_KEEP_PREFIX = ("PREFECT_", "PYTHON", "LC_")
_DROP = ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING")


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items()
            if (k in _KEEP or k.startswith(_KEEP_PREFIX)) and k not in _DROP}


def _healthy_now(rec: Record) -> bool:
    import httpx

    try:
        with httpx.Client(timeout=5, verify=tls_context(rec.url)) as client:
            return _listening(rec.port) and client.get(f"{rec.url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def progress_mark(pid: int, log: Path) -> tuple[int, int]:
    """What moves while a server starts: its CPU ticks (utime + stime; -1 where /proc cannot say)
    and its log's size."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": utime is field 14, stime 15
        ticks = int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        ticks = -1
    try:
        size = log.stat().st_size
    except OSError:
        size = -1
    return ticks, size


def _wait_healthy(rec: Record, timeout: float, log: Path, say: Callable[[str], None] = _say) -> None:
    """Until the server answers /api/health; PrefectApiUnavailable once it exited, made no progress
    for `timeout` s (`progress_mark`), or did not answer within `LAST_BOUND_S` (or 10 × `timeout`)."""
    import httpx

    t0 = time.monotonic()
    bound = max(LAST_BOUND_S, 10 * timeout)
    mark, moved, said = progress_mark(rec.pid, log), t0, t0
    with httpx.Client(timeout=5, verify=tls_context(rec.url)) as client:
        while True:
            if not is_live(rec):
                raise PrefectApiUnavailable(f"the local Prefect server exited{_exit_code(rec.pid)}: {log_tail(log)}")
            try:
                # a bare connect first: an HTTP attempt per turn cost seconds of CPU over a slow start
                if _listening(rec.port) and client.get(f"{rec.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if (seen := progress_mark(rec.pid, log)) != mark:
                mark, moved = seen, now
            tail = log_tail(log) if now - moved > timeout or now - t0 > bound \
                or now - said >= SAY_EVERY_S else ""
            if now - moved > timeout:
                raise PrefectApiUnavailable(
                    f"the local Prefect server (pid {rec.pid}, {rec.url}) made no progress for {timeout:g} s "
                    f"(its CPU time and its log stood still: stopped, or stuck on a lock or a disk?)"
                    f"{'; its log: ' + tail if tail else '; its log is empty'}")
            if now - t0 > bound:
                raise PrefectApiUnavailable(
                    f"the local Prefect server (pid {rec.pid}, {rec.url}) ran {now - t0:.0f} s without answering"
                    f"{'; its log: ' + tail if tail else '; its log is empty'}")
            if now - said >= SAY_EVERY_S:
                said = now
                say(f"{SAYING}: {now - t0:.0f} s (pid {rec.pid}, working" + (f"; {tail[:120]}" if tail else "") + ")")
            time.sleep(0.1)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _exit_code(pid: int) -> str:
    """' with code N' when `pid` is our own child (then it is reaped here), else ''."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return ""
    return f" with code {os.waitstatus_to_exitcode(status)}" if got == pid else ""


def log_tail(log: Path) -> str:
    """The line of the server's log that says why: its last exception line, else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    why = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (why or lines or [""])[-1][:300]


def stop(d: Path | None = None, wait_s: float = 30.0) -> int | None:
    """Stop the recorded server of `d` (default: this PREFECT_HOME's); its pid, or None if none ran."""
    d = d or state_dir()
    rec = read_record(d)
    if rec is None or not is_live(rec):
        return None
    (d / "server.json").unlink(missing_ok=True)  # the server stops itself when it sees this, too
    try:
        os.kill(rec.pid, signal.SIGTERM)
    except ProcessLookupError:
        return rec.pid
    deadline = time.monotonic() + wait_s
    while is_live(rec) and time.monotonic() < deadline:
        _exit_code(rec.pid)  # reaps it if it is our child
        time.sleep(0.05)
    if is_live(rec):
        os.kill(rec.pid, signal.SIGKILL)
    return rec.pid


# ---------------------------------------------------------------------------- the server's side

def create_app() -> Any:
    """uvicorn's factory: Prefect's server app (busy-database refusals run again, `ReplayBusy`), plus the
    watcher that stops it when unused."""
    # its log's first lines (a start's progress for the command waiting, its steps for a person)
    t0 = time.monotonic()
    print(f"fleet: local Prefect server pid {os.getpid()}: importing Prefect's server", flush=True)
    from prefect.server.api.server import create_app as prefect_app

    print(f"fleet: imported in {time.monotonic() - t0:.1f} s; building its app", flush=True)
    app = ReplayBusy(prefect_app())
    print(f"fleet: app built {time.monotonic() - t0:.1f} s after the start; uvicorn starts it", flush=True)
    d = Path(os.environ["FLEET_PREFECT_SERVER_DIR"])
    threading.Thread(target=watch, args=(d, idle_s()), name="fleet-idle-watch", daemon=True).start()
    return app


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ReplayBusy:
    """ASGI wrapper: an HTTP request the app refused with 503 because SQLite was busy ("database is
    locked") is run again after a short pause (5 ms, doubling up to 0.2 s) for up to `budget_s`;
    then the 503 goes out. Any other 503 (Prefect's for any DBAPIError, InvalidRequestError,
    DetachedInstanceError; /api/ready's) goes out at once, and replays stop when the client is gone.

    A busy refusal's transaction was rolled back, and Prefect's client retries such a request as it
    is (after 2 s and more): running it again here is what the client would do, minus the back-off.
    The request body is read once and given to each run; a 503 is held until the run ends (Starlette
    raises its error again after its handler sent it: that error says whether it was SQLite busy);
    nothing of a replayed run's response is sent.

    Writes (POST, PUT, PATCH, DELETE) run one at a time, in the order their bodies arrived; reads
    (GET, HEAD, OPTIONS, and the POSTs that read: `…/filter`, `…/count`) run beside them as they
    come. SQLite takes one writer at a time anyway, but Prefect's transactions read first and then
    write, and two at once meet as a refusal the second one gets at once (no busy wait helps a
    reader that must become a writer): the eight task runs an adopt-only `fleet up` posts from four
    threads were run again 63 times in three commands, ≈ a third of the server's CPU for them
    (bench/RESULTS.md). Queued, each runs once. No endpoint of Prefect's API waits on anything but
    its database, so a write holds the queue for milliseconds; one that holds it `QUEUE_S` (its
    database held that long) has the next one run beside it, as before the queue."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], budget_s: float = REPLAY_S) -> None:
        self.app, self.budget_s = app, budget_s
        self._writes: asyncio.Lock | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        import asyncio

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away before its request was whole
            body.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        gone = asyncio.ensure_future(receive())  # the next message after the body: the client's disconnect
        queue: asyncio.Lock | None = None
        try:
            if _may_write(scope):   # one at a time, in the order they came
                if self._writes is None:
                    self._writes = asyncio.Lock()   # made in the server's loop, on its first write
                try:
                    await asyncio.wait_for(self._writes.acquire(), QUEUE_S)  # bounded: the wait_for
                    queue = self._writes
                except asyncio.TimeoutError:
                    pass   # a write ahead that does not end (a database held for long): run beside it, as before
            loop = asyncio.get_running_loop()
            deadline, pause = loop.time() + self.budget_s, REPLAY_PAUSE_S[0]
            while not await self._run(scope, b"".join(body), gone, send, last=loop.time() >= deadline):
                done, _ = await asyncio.wait({gone}, timeout=pause)
                if done:
                    return  # the client disconnected: nobody to answer, nothing to run again for
                pause = min(2 * pause, REPLAY_PAUSE_S[1])
        finally:
            gone.cancel()
            if queue is not None:
                queue.release()

    async def _run(self, scope: Scope, body: bytes, gone: Awaitable[Message], send: Send, last: bool) -> bool:
        """One run of the request; False if SQLite was busy and it is to run again (nothing was sent)."""
        import asyncio

        given = False
        held: list[Message] = []

        async def replay() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await asyncio.shield(gone)  # after the body: the client's disconnect, as the app expects

        async def guard(msg: Message) -> None:
            if held or (msg["type"] == "http.response.start" and msg["status"] == 503 and not last):
                held.append(msg)
            else:
                await send(msg)

        try:
            await self.app(dict(scope), replay, guard)
        except Exception as exc:
            if held and _sqlite_busy(exc):
                return False
            for msg in held:  # a 503 for anything else goes out as it is, at once
                await send(msg)
            raise
        for msg in held:  # a 503 without an error (/api/ready's): not a busy database
            await send(msg)
        return True


def _may_write(scope: Scope) -> bool:
    """Might this request write? Not a GET, nor one of the API's POSTs that read (`…/filter`, `…/count`)."""
    method = scope.get("method")
    if method in READS:
        return False
    return not (method == "POST" and str(scope.get("path", "")).rstrip("/").rsplit("/", 1)[-1] in READ_POSTS)


def _sqlite_busy(exc: BaseException) -> bool:
    """Whether `exc` (SQLAlchemy's OperationalError, or what it wraps) is SQLite's busy/locked refusal:
    what Prefect's `is_client_retryable_exception` answers 503 for on SQLite."""
    import sqlite3

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, sqlite3.OperationalError):
            name = str(getattr(e, "sqlite_errorname", ""))
            if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "database is locked" in str(e):
                return True
        orig = getattr(e, "orig", None)
        todo += [orig if isinstance(orig, BaseException) else None, e.__cause__, e.__context__]
    return False


def watch(d: Path, idle: float, every: float = WATCH_EVERY_S) -> None:
    """Stop this process when idle for `idle` s, or when its record is removed or replaced."""
    me, seen_mine, last_busy = os.getpid(), False, time.time()
    try:
        fd = os.open(d / "clients.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = -1  # its PREFECT_HOME is gone: nobody can use this server
    while fd >= 0:
        time.sleep(every)
        rec = read_record(d)
        if (rec is not None and rec.pid != me) or (rec is None and seen_mine):
            break  # replaced or removed: another server owns the database now, or nobody wants this one
        seen_mine = seen_mine or rec is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            last_busy = time.time()  # a command is attached
            continue
        try:
            used = max(last_busy, (d / "used").stat().st_mtime)
        except OSError:
            used = last_busy
        if time.time() - used >= idle:
            _remove_record_if(d, me)
            break  # exit holding clients.lock: commands wait until this server is gone
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.kill(me, signal.SIGTERM)  # uvicorn's graceful exit (the database closed cleanly)
    time.sleep(EXIT_GRACE_S)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.localserver [stop]`: this PREFECT_HOME's local server, or stop it."""
    args = sys.argv[1:] if argv is None else argv
    d = state_dir()
    if args == ["stop"]:
        pid = stop(d)
        print(f"stopped the local Prefect server (pid {pid})" if pid else f"no local Prefect server runs for {d}")
        return 0
    if args:
        print("usage: python -m flows.localserver [stop]", file=sys.stderr)
        return 2
    rec = read_record(d)
    if rec is None or not is_live(rec):
        print(f"no local Prefect server runs for {d}")
    else:
        print(f"local Prefect server: pid {rec.pid}, {rec.url}, state in {d}, stops after {idle_s():g} s idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
