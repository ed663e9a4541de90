"""Shared fixtures: an isolated Prefect home, a real throwaway OpenSSH server, and `node`
(one connected Node per transport, so one behaviour suite covers both)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Set before anything imports Prefect (its settings are read at import): tests must never
# touch the developer's ~/.prefect, results or telemetry.
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="fleet-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect-home")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_SESSION_TMP / "prefect-results")
# The CLI tests run `fleet ...` as subprocesses; the first on a PREFECT_HOME starts its local
# Prefect server, which Prefect's default 20 s does not cover on a loaded 2-core CI machine
# ("Timed out while attempting to connect to ephemeral Prefect API server"). Inherited by them.
# (Scaled, like every deadline of the suite, by the slowdown factor measured here once a run, in the
# xdist controller or the one process, and inherited by the workers and everything they start.)
import harness  # noqa: E402

if not os.environ.get(harness.MEASURED_ENV):
    os.environ[harness.MEASURED_ENV] = f"{harness.measure():.2f}"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", f"{harness.scaled(120):.0f}")
# Those commands share one local Prefect server per PREFECT_HOME (flows/localserver.py), which
# outlives them by design; the session stops its own at the end (`_local_prefect_servers_stop`),
# and one left by a killed run stops itself after this many idle seconds instead of ten minutes.
os.environ.setdefault("FLEET_PREFECT_SERVER_IDLE_S", "120")
# Local nodes run `python3` from PATH (the staging helper, probes). Where that is a pyenv shim (a bash
# script that asks pyenv which Python to run: ≈ 0.1 s of CPU per start, against ≈ 0.06 s for the whole
# `python3 -c pass`), the interpreter it resolves to goes first on PATH: the same Python, without the shim.
_python3 = shutil.which("python3") or ""
if "/shims/" in _python3:
    _resolved = subprocess.run([_python3, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    if _resolved.returncode == 0 and _resolved.stdout.strip():
        os.environ["PATH"] = f"{Path(_resolved.stdout.strip()).parent}{os.pathsep}{os.environ['PATH']}"
# This test process's RAM disk (nodes.ramdisk). Copies are per user, fleet and source state
# (<ramdisk>/fleet-<uid>/<fleet>/<name>-<key>), but tests of one uid reuse fleet names ("t") and
# freeing one test's copies must not race another process's: the default /dev/shm is shared by
# every test process on the machine. Still a tmpfs where the machine has /dev/shm.
RAMDISK = tempfile.mkdtemp(prefix="fleet-tests-ram-", dir="/dev/shm" if os.path.isdir("/dev/shm") else _SESSION_TMP)

from fleet.config import NodeConfig  # noqa: E402
from fleet.node import LocalNode, Node  # noqa: E402

SSHD = "/usr/sbin/sshd"

# `--cpu-report PATH`: each test's CPU, its servers and subprocesses included (tests/cpu_report.py)
pytest_plugins = ["cpu_report"]


@pytest.fixture(autouse=True)
def _log_handlers_outlive_the_test() -> Iterator[None]:
    """Prefect sets up its logging when a test first imports a flow (`prefect.main`): its console
    handler (a rich Console) writes to sys.stderr as it is then. In a test with capsys/capfd that is
    the test's capture file, closed when the test ends, so every later Prefect log line in this
    process raised "I/O operation on closed file" (the next tests on that worker failed). After
    each test, a handler left on a closed stream writes to the current sys.stderr again."""
    yield
    import logging

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            with handler.lock:   # not setStream(): it would flush the closed stream first
                handler.stream = sys.stderr
                if hasattr(handler, "console"):   # Prefect's PrefectConsoleHandler writes through it
                    handler.console.file = sys.stderr


@pytest.fixture(scope="session", autouse=True)
def _local_prefect_servers_stop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the session, stop every local Prefect server that a `fleet` command of this
    test process started for a PREFECT_HOME under its temp dirs (found by the server's environment,
    not by a walk of the temp dirs: some hold mounts)."""
    yield
    import psutil

    from flows.localserver import stop

    ours = (str(_SESSION_TMP), str(tmp_path_factory.getbasetemp()))
    dirs = {pid: _environ(pid).get("FLEET_PREFECT_SERVER_DIR", "") for pid in local_prefect_servers()}
    pids = [pid for pid, d in dirs.items() if d.startswith(ours)]
    for pid in pids:
        stop(Path(dirs[pid]))  # its record's server (normally this pid)
    procs = []
    for pid in pids:  # and any other, unrecorded one, by pid
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=30)
    for p in alive:
        p.kill()


def local_prefect_servers() -> list[int]:
    """Pids of this machine's local Prefect servers (flows/localserver.py), by their command line."""
    return [p.pid for p in processes() if "flows.localserver:create_app" in p.argv]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(RAMDISK, ignore_errors=True)
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


# Waits and starts take their deadlines from one slowdown factor (tests/harness.py): re-exported here,
# where the tests have always imported them from.
from harness import StartFailed, scaled, start_twice, tail_of, wait_until  # noqa: E402,F401


# Ports. The suite runs in parallel (pytest-xdist workers) beside other runs of it on the same
# machine, and a port that was free when picked can be taken before the server binds it. So each
# test process claims a block of ports for its life (an flock on a file named after the block, shared
# by every run of this suite on the machine) and hands out ports only from its block, each checked
# free by a bind. The blocks lie below the kernel's ephemeral range (32768-60999 by default: the
# ports of outgoing connections and of bind(0)) and below `fleet demo`'s 31000, so nothing else on
# the machine is handed them either. With every block taken: a port from the kernel (bind(0)).
PORT_LO, PORT_HI, PORT_BLOCK = 10000, 30000, 400
_PORT_LOCKS = Path(tempfile.gettempdir()) / f"fleet-test-ports-{os.getuid()}"


class _PortPool:
    def __init__(self) -> None:
        self.base: int | None = None
        self.owner = 0
        self.next = 0
        self._lock_fd: int | None = None

    def _claim(self) -> int | None:
        import fcntl
        import random

        if self.base is not None and self.owner == os.getpid():
            return self.base
        self.base, self.owner = None, os.getpid()   # a forked child claims its own block
        _PORT_LOCKS.mkdir(mode=0o700, exist_ok=True)
        bases = list(range(PORT_LO, PORT_HI - PORT_BLOCK + 1, PORT_BLOCK))
        first = random.randrange(len(bases))
        for base in bases[first:] + bases[:first]:
            fd = os.open(_PORT_LOCKS / f"{base}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.base, self.next, self._lock_fd = base, 0, fd   # held until this process exits
            return base
        return None

    def take(self, n: int) -> int:
        """The first of `n` consecutive ports, all free now, from this process's block."""
        base = self._claim()
        if base is None:
            return _kernel_port() if n == 1 else _kernel_block(n)
        for _ in range(PORT_BLOCK):
            first = base + self.next
            if self.next + n > PORT_BLOCK:   # wrap: ports handed out long ago are free again by now
                self.next, first = 0, base
            self.next += n
            if all(_bindable(p) for p in range(first, first + n)):
                return first
        raise RuntimeError(f"no {n} free consecutive ports in {base}..{base + PORT_BLOCK - 1}")


def _bindable(port: int) -> bool:
    # no SO_REUSEADDR: a port with connections in TIME_WAIT counts as taken (a server that does
    # not set SO_REUSEADDR could not bind it)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kernel_block(n: int) -> int:
    import random

    from fleet.demo import free_port_block

    return free_port_block(n, start=random.randrange(32768, 60000, 100))


_PORTS = _PortPool()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 that no other test process on this machine is handed."""
    return _PORTS.take(1)


def port_block(n: int) -> int:
    """The first of `n` consecutive free ports (servers.base_port for n servers), as free_port."""
    return _PORTS.take(n)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    comm: str
    argv: list[str]


def processes() -> list[Proc]:
    """This machine's processes (psutil); one that exits while being read is left out."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "ppid", "name", "cmdline"]):
        info = p.info
        if info["ppid"] is None or info["name"] is None:
            continue  # exited meanwhile (or not ours to read)
        out.append(Proc(info["pid"], info["ppid"], info["name"], list(info["cmdline"] or [])))
    return out


def descendants(pid: int) -> list[Proc]:
    """Every process below `pid` (children, their children, …)."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    by_pid = {p.pid: p for p in processes()}
    return [by_pid[k.pid] for k in kids if k.pid in by_pid]


def _keygen(path: Path, kind: str = "ed25519") -> str:
    """A new unencrypted key pair; returns the public key line."""
    extra = ["-b", "2048"] if kind == "rsa" else []
    subprocess.run(["ssh-keygen", "-q", "-t", kind, *extra, "-N", "", "-C", f"fleet-test-{kind}", "-f", str(path)],
                   check=True, capture_output=True)
    return Path(f"{path}.pub").read_text().strip()


@dataclass
class Sshd:
    """A running throwaway sshd and the keys to use it."""

    host: str
    port: int
    user: str
    key_file: Path  # authorized ed25519 client key
    host_key: str  # 'ssh-ed25519 AAAA…' of the server
    dir: Path
    pid: int
    extra_keys: dict[str, Path]  # other authorized client keys by type: 'ecdsa', 'rsa'
    unauthorized_key: Path

    def node_config(self, **overrides) -> NodeConfig:
        fields = dict(name="ssh-test", kind="ssh", host=self.host, port=self.port, user=self.user,
                      key_file=self.key_file, host_key=self.host_key, workdir=str(self.dir / "work"),
                      ramdisk=RAMDISK, connect_timeout_s=5.0)
        fields.update(overrides)
        return NodeConfig(**fields)

    def session_pids(self) -> set[int]:
        """Pids of the sshd processes serving connections (children of the listener)."""
        return {p.pid for p in processes() if p.ppid == self.pid}


def start_sshd(d: Path, host_key_file: Path, authorized_keys: Path, log: Path, limit: float,
               started: list[subprocess.Popen[bytes]], setenv: str = "SHLVL=1") -> tuple[subprocess.Popen[bytes], int]:
    """An sshd on a free 127.0.0.1 port (config and pid file in `d`), listening within `limit` s; added to
    `started` at once (the caller stops it). `setenv`: the SetEnv of its sessions."""
    port = free_port()   # a new one per attempt: the last one may have been taken meanwhile
    config = d / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {host_key_file}",
        f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",  # keys under /tmp would be refused otherwise
        "PermitRootLogin prohibit-password",
        "Subsystem sftp internal-sftp",
        "AllowTcpForwarding yes",
        "MaxStartups 100",
        "LogLevel VERBOSE",
        # bash started by sshd for a command reads ~/.bashrc unless it is a nested shell (SHLVL=1); this
        # machine's runs `pyenv init` (≈ 150 ms of CPU and 0.4 s at load on every command of every test,
        # against ≈ 7 ms without). A real node's shell profile is its own; the tests measure fleet, not this one.
        f"SetEnv {setenv}",
    ]) + "\n")
    proc = subprocess.Popen([SSHD, "-D", "-f", str(config), "-E", str(log)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    started.append(proc)

    def listening() -> bool:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"sshd exited with {proc.returncode}: {err.strip()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return False

    wait_until(listening, timeout=limit, scale=False, what=f"sshd on 127.0.0.1:{port}")
    return proc, port


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if not os.path.exists(SSHD):
        pytest.fail(f"{SSHD} is missing: install openssh-server (apt-get install -y openssh-server); "
                    "the SSH tests need a real sshd")
    d = tmp_path_factory.mktemp("sshd")
    host_key_file, client_key = d / "host_ed25519", d / "client_ed25519"
    host_pub = _keygen(host_key_file)
    authorized = [_keygen(client_key)]
    extra = {}
    for kind in ("ecdsa", "rsa"):
        extra[kind] = d / f"client_{kind}"
        authorized.append(_keygen(extra[kind], kind))
    unauthorized = d / "stranger_ed25519"
    _keygen(unauthorized)
    (d / "authorized_keys").write_text("\n".join(authorized) + "\n")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    log = d / "sshd.log"
    started: list[subprocess.Popen[bytes]] = []

    def start(limit: float) -> tuple[subprocess.Popen[bytes], int]:
        return start_sshd(d, host_key_file, d / "authorized_keys", log, limit, started)

    def stop_started() -> None:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()

    try:
        proc, port = start_twice(start, what="the session's sshd", timeout=60, log_tail=lambda: tail_of(log),
                                 cleanup=stop_started)
    except StartFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    import getpass

    try:
        yield Sshd(host="127.0.0.1", port=port, user=getpass.getuser(), key_file=client_key, host_key=host_pub,
                   dir=d, pid=proc.pid, extra_keys=extra, unauthorized_key=unauthorized)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def global_api(url: str | None) -> None:
    """Set the Prefect API of this process's global settings (what a thread with no context reads),
    leaving the environment as it was."""
    import prefect.context

    before = os.environ.pop("PREFECT_API_URL", None)
    if url is not None:
        os.environ["PREFECT_API_URL"] = url
    try:
        prefect.context.refresh_global_settings_context()
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        if before is not None:
            os.environ["PREFECT_API_URL"] = before


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A Prefect API for the whole session, shared by every test that needs real blocks, flows or
    artifacts: this test process's local server (flows/localserver.py, on the session's PREFECT_HOME and
    its migrated database), the same one the `fleet` commands of this worker attach to. One server per
    worker, not two: Prefect's test harness started a second one (≈ 8 s of CPU to start, and its
    services' polling for the whole run). This process holds the server's client lock for its life, so
    it never stops idle under the session; `_local_prefect_servers_stop` stops it at the end.

    Started with `start_twice`: a start that fails twice (the one in a busy CI run took over its
    120 s) fails the tests that ask for it with the server's log tail, and starts nothing more."""
    import prefect.settings

    import flows.localserver as localserver

    attempts = localserver.ATTEMPTS
    localserver.ATTEMPTS = 1   # start_twice's two tries, the second with a longer wait, not attach's 2 × 2
    try:
        url = start_twice(lambda limit: localserver.attach(timeout=limit), what="the session's Prefect server "
                          "(flows/localserver.py)", timeout=45,
                          log_tail=lambda: tail_of(localserver.state_dir() / "server.log"))
    except StartFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        localserver.ATTEMPTS = attempts
    # The process's global settings too, not only this thread's context: a plain thread starts with no
    # context, and Prefect's client there (its log worker; before tasks/locks ran its heartbeat in its
    # creator's context, the lock's too) found no API and started a temporary server of its own on
    # this PREFECT_HOME's database, one per pytest worker (≈ 20–30 s of CPU each over a run). The
    # environment is left as it was: the `fleet` commands the tests start attach as a user's would.
    global_api(url)
    with prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_API_URL: url}):
        yield url


# Every Prefect server the suite starts (the session's test server, the local server of `fleet`
# commands, `prefect server start` of the deployment, UI and fresh-clone tests) began on an empty
# SQLite database and ran all of Prefect's migrations on it first: ≈ 7 s of CPU per server, half
# of a start, some 30 times a run on a CPU-bound 2-core machine. So the migrations run once per
# Prefect version on the machine (`prefect server database upgrade`, under an flock, shared by
# the workers and later runs), and each server starts on a copy of that database: the same
# schema the server would make itself (it still checks it at start), nothing else in it.
_PREFECT_DB_TEMPLATES = Path(tempfile.gettempdir()) / f"fleet-test-prefect-db-{os.getuid()}"


def prefect_db_template() -> Path:
    """A migrated, empty Prefect SQLite database for this Prefect version (made on first use)."""
    import fcntl
    import hashlib
    from importlib.metadata import version

    import importlib.util

    # found, not imported: importing prefect.server.database costs ≈ 4.7 s of CPU, in every test process
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.origin is not None, "prefect is not installed"
    db_pkg = Path(spec.origin).parent / "server" / "database"
    migrations = sorted(p.name for p in (db_pkg / "_migrations").rglob("*.py"))
    key = hashlib.sha256("\n".join([version("prefect"), *migrations]).encode()).hexdigest()[:16]
    _PREFECT_DB_TEMPLATES.mkdir(mode=0o700, exist_ok=True)
    path = _PREFECT_DB_TEMPLATES / f"prefect-{key}.db"
    with open(_PREFECT_DB_TEMPLATES / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = Path(tempfile.mkdtemp(dir=_PREFECT_DB_TEMPLATES))
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            env.update(PREFECT_HOME=str(tmp), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                       PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp / 'prefect.db'}")
            subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                           check=True, capture_output=True, timeout=600)
            os.replace(tmp / "prefect.db", path)
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def seed_prefect_db(db: Path) -> Path:
    """Put a migrated empty Prefect database at `db` (a server's database file), unless one is there."""
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(prefect_db_template(), db)
    return db


def seed_prefect_home(home: Path) -> Path:
    """`home` as a PREFECT_HOME whose server (default database `<home>/prefect.db`) skips the migrations."""
    seed_prefect_db(home / "prefect.db")
    return home


def compile_sources(root: Path) -> None:
    """Write the bytecode of fleet's packages under `root`. The suite starts hundreds of Python processes
    on them (`fleet` commands, flow runs, workers, runners), and with PYTHONDONTWRITEBYTECODE set (as on
    this machine and its CI) none writes what it compiled: each compiled every module it imported again."""
    import compileall

    for pkg in ("fleet", "flows", "tasks", "blocks"):
        if (root / pkg).is_dir():
            compileall.compile_dir(root / pkg, quiet=2)


@pytest.hookimpl(trylast=True)   # after pytest-timeout's, whose timeout it scales
def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):   # once a run: the xdist controller, or the one process
        compile_sources(Path(__file__).resolve().parents[1])
    # pytest-timeout's hang guard is a deadline too: scaled like the waits (a test's own
    # `@pytest.mark.timeout` in pytest_collection_modifyitems)
    if getattr(config, "_env_timeout", None):
        config._env_timeout = float(config._env_timeout) * harness.factor()   # type: ignore[attr-defined]
    # Prefect's temporary servers take a random port in 8000-8999 after a bind check (a flow called
    # with no API, and the retry after a failed bind): if another process takes it first, the server's
    # health check can be answered by that process's server (another database). Take their ports
    # from this process's block instead.
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller runs no test (and need not import Prefect's server)
    # Patched when something imports it, not imported here: Prefect's server module costs ≈ 7.6 s of CPU
    # to import (2,165 modules; Prefect's client ≈ 2.5 s), once per test process, and the servers the tests
    # use run in processes of their own.
    _when_imported("prefect.server.api.server", _server_ports_from_our_block)
    # and every server on this process's PREFECT_HOME (the `fleet` commands' and `prefect_api`'s local
    # one) starts on a migrated database
    seed_prefect_home(Path(os.environ["PREFECT_HOME"]))


def _server_ports_from_our_block(mod: Any) -> None:
    mod.SubprocessASGIServer.find_available_port = lambda self: free_port()


def _when_imported(name: str, patch: Any) -> None:
    """Run `patch(module)` right after `name` is first imported in this process (at once if it is)."""
    import importlib.machinery

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder:
        done = False   # a flag: removing itself while the import system walks sys.meta_path skips a finder

        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if self.done or fullname != name:
                return None
            self.done = True
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())  # type: ignore[arg-type]


def pytest_report_header(config: pytest.Config) -> str:
    given = os.environ.get(harness.ENV)
    how = f"{harness.ENV}={given}" if given else (
        f"measured at start: load {os.getloadavg()[0]:.1f} on {harness._cpus()} cores; set {harness.ENV} to fix it")
    return f"fleet: deadlines × slowdown {harness.factor():.2g} ({how})"


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    """A connected Node of each kind; closed after the test."""
    if request.param == "local":
        n: Node = LocalNode("local")
    else:
        from fleet.node.ssh import SSHNode

        sshd = request.getfixturevalue("sshd")
        n = SSHNode.from_config(sshd.node_config())
        n.connect()
    try:
        yield n
    finally:
        n.close()


# -- running in parallel (`./dev.sh test` runs pytest-xdist workers, `--dist loadgroup`) ----------
# Modules whose module-scoped fixture is a whole server (a Prefect server with deployments and a
# worker, a Prefect server with its UI and a browser, `transformers serve`) run on one worker, so
# it is started once, not once per worker that gets one of their tests.
# (Node id prefixes; the longest matching one wins; None: not grouped.)
GROUPED: dict[str, str | None] = {
    # One group, one Prefect server and one worker for the whole module. The `fleet deploy` pair and the
    # interrupted-`up` pair (which needs only the server) had groups of their own, to shorten the
    # longest unit of work with 4 workers, but each group started its own server (the pairs' first
    # tests, which set them up, took 103 and 36 s of CPU; 81 and 20 s in one group): on a CPU-bound
    # 2-core run that cost more than it saved. Started first (the largest SLOW_S sum), it ends before
    # the rest of the suite.
    "test_deployments.py": "deployments",
    "test_deployments.py::test_serve_builds_the_deployments_the_yaml_declares": None,
    "test_ui.py": "ui",
    # (not grouped: each of its three README walks has its own clone, Prefect server and worker,
    # so the three run side by side)
    "test_tinymodel.py": "tinymodel",
}
# The longest tests (seconds with 4 workers on a busy 2-core machine: `./dev.sh test
# --durations=60`; a grouped module's fixture setup counted in), started first so that no worker is
# left running a long one while the others are done. Only the order depends on these numbers; a
# test missing here runs after them, in pytest's order.
SLOW_S: dict[str, float] = {
    # `./dev.sh test --durations=60 --cpu-report FILE` 2026-12-03 14:05-14:30 UTC, 4 workers, beside another
    # engineer's targeted runs (load average 4-8); each test's setup and teardown counted in (--cpu-report's wall)
    "test_multinode_fence.py::test_a_lost_nodes_prestarted_runner_is_stopped_and_its_late_parts_count_for_nothing": 144,
    "test_multinode_nodes.py::test_each_nodes_store_check_runs_beside_its_bring_up_not_after_it": 134,
    "test_multinode_nodes.py::test_a_job_over_40_nodes_gives_every_node_a_chunk": 122,
    "test_objstore.py::test_controller_lost_with_its_machine_resumes_from_the_store": 116,
    "test_localserver.py::test_a_slow_first_start_is_waited_for_on_the_port_range_given": 116,
    "test_fresh_clone.py::test_readme_yaml_recipe_on_a_fresh_clone": 115,
    "test_objstore.py::test_node_lost_and_controller_killed_every_id_once_in_the_store": 108,
    "test_fresh_clone.py::test_readme_fleet_deploy_block_on_a_fresh_clone": 103,
    "test_multinode_nodes.py::test_a_node_without_the_store_credentials_is_set_aside_and_the_job_ends_on_the_others": 98,
    "test_multinode.py::test_a_local_and_an_ssh_node_one_job": 94,
    "test_fresh_clone.py::test_readme_serve_on_a_fresh_clone": 88,
    "test_objstore_pin.py::test_s3_input_rewritten_mid_job_never_mixes_two_versions[versioned]": 86,
    "test_multinode_ssh.py::test_ssh_outage_mid_job_the_node_is_lost_then_rejoins_and_finishes": 86,
    "test_interrupt.py::test_two_commands_at_once_both_work_and_the_second_names_the_holder": 81,
    "test_generate_flow.py::test_generate_with_real_transformers_servers_readable_by_pandas": 79,
    "test_objstore_hf.py::test_hf_input_job_reads_every_row_exactly_once": 76,
    "test_multinode.py::test_a_job_over_two_nodes_goes_on_under_a_larger_or_no_limit": 76,
    "test_gen_faults.py::test_fault_soak_node_loss_small_every_row_exactly_once": 69,
    "test_ui.py::test_failed_bringup_shows_the_failed_server_its_error_and_the_remedy": 66,
    "test_interrupt.py::test_interrupted_up_then_up_again_completes_without_waiting[2-launching]": 66,
    "test_multinode.py::test_node_lost_mid_job_its_chunk_goes_elsewhere_without_redoing_fetched_rows": 66,
    "test_objstore_nodes.py::test_ssh_node_runner_reads_hf_writes_gs_with_the_controllers_credentials": 65,
    "test_multinode.py::test_controller_killed_runners_go_on_then_rerun_reattaches": 64,
    "test_interrupt.py::test_a_release_that_frees_nothing_costs_the_next_fleet_up_no_wait": 64,
    "test_interrupt.py::test_double_ctrl_c_says_what_it_cut_short_and_the_next_up_completes": 62,
    "test_bringup.py::test_transformers_engine_end_to_end": 60,
    "test_deployments.py::test_fleet_deploy_one_config_block_four_deployments_schedules_act_on_that_fleet": 58,
    "test_objstore.py::test_a_store_job_with_its_credentials_from_an_aws_credentials_block": 58,
    "test_gen_faults.py::test_fault_soak_small_every_row_exactly_once": 57,
    "test_deployments.py::test_the_yaml_declares_four_deployments": 54,
    "test_generate_flow.py::test_generate_over_ssh_runner_on_node_then_fetch": 54,
    "test_speculators_real.py::test_speculators_loaders_take_both_exports": 51,
    "test_deployments.py::test_bringup_revalidate_teardown_through_a_worker": 51,
    "test_interrupt.py::test_interrupted_up_then_up_again_completes_without_waiting[9-holding]": 51,
    "test_multinode_scale.py::test_controller_decision_evaluates_changed_nodes_only_not_every_node": 51,
    "test_multinode_scale.py::test_controller_twenty_fake_nodes_every_chunk_done_once_with_losses": 50,
    "test_interrupt.py::test_a_second_sigterm_inside_the_locks_release_does_not_leave_the_slot_taken": 49,
    "test_interrupt.py::test_embedded_server_that_cannot_start_is_one_line_with_the_remedy": 48,
    "test_objstore_ranges.py::test_fleet_generate_over_a_size_cut_store_input_every_id_once": 48,
    "test_interrupt.py::test_a_closed_stdout_changes_neither_the_exit_status_nor_prints_a_traceback": 45,
    "test_interrupt.py::test_sighup_at_each_phase_is_a_clean_stop[bring-up]": 45,
    "test_quickup.py::test_fleet_up_adopts_without_prefect_and_a_server_down_takes_the_flows_path": 45,
    "test_gen_job_faults.py::test_disk_full_on_a_real_tmpfs_fails_loud_then_resumes_exactly_once": 44,
    "test_interrupt.py::test_interrupted_up_then_up_again_completes_without_waiting[2-holding]": 44,
    "test_interrupt.py::test_timeout_stops_a_bringup_like_ctrl_c": 44,
    "test_objstore_gcs.py::test_gs_an_unfinished_upload_never_becomes_an_object_and_the_first_error_is_kept": 41,
    "test_interrupt.py::test_ctrl_c_of_generate_leaves_the_runner_going[2]": 40,
    "test_deployments.py::test_prefect_cancel_of_a_bringup_under_a_worker_ends_cancelled_by_its_own_process_with_the_lock_back": 39,
    "test_interrupt.py::test_sigterm_landing_as_the_lock_slot_is_granted_gives_the_slot_back[SIGTERM]": 39,
    "test_generate_flow.py::test_flow_killed_runner_goes_on_then_reattached": 39,
    "test_objstore_pin.py::test_local_input_rewritten_in_place_mid_job_stops_the_job": 39,
    "test_engines.py::test_transformers_profile_runs_real_transformers_serve": 37,
    "test_quickup.py::test_ctrl_c_during_a_quick_fleet_up_gives_the_lock_back_and_marks_the_run": 37,
    "test_objstore_pin.py::test_hf_input_pushed_to_mid_job_stops_the_job": 36,
    "test_generate_flow.py::test_fleet_generate_without_limit_goes_on_after_a_limited_job": 36,
    "test_deployments.py::test_alert_for_a_run_of_a_fresh_schedule_comes_at_once": 35,
    "test_objstore_pin.py::test_s3_input_rewritten_mid_job_never_mixes_two_versions[plain]": 35,
    "test_objstore_errors.py::test_output_bucket_deleted_mid_job_is_a_failed_run_with_its_remedy": 34,
    "test_localserver.py::test_the_server_stops_when_idle_and_the_next_command_starts_another": 33,
    "test_waits.py::test_stopped_launch_shell_during_a_relaunch_is_retried_and_the_job_ends": 32,
    "test_gen_store.py::test_kill_9_at_random_moments_never_tears_a_shard_or_duplicates_an_id": 31,
    "test_security.py::test_secrets_appear_nowhere_after_a_bringup_over_ssh": 30,
    "test_multinode.py::test_two_nodes_one_job_split_merge_fetch_export": 29,
    "test_bringup.py::test_a_changed_port_replaces_the_running_servers_and_down_stops_what_was_recorded": 29,
    "test_interrupt.py::test_interrupted_up_then_up_again_completes_without_waiting[9-launching]": 28,
    "test_reattach.py::test_reattach_sends_no_smoke_request_to_the_servers_the_live_job_is_using": 27,
    "test_bringup.py::test_cli_up_status_down": 27,
    "test_interrupt.py::test_sighup_at_each_phase_is_a_clean_stop[runner-start]": 27,
    "test_objstore_pin.py::test_gcs_input_rewritten_mid_job_stops_the_job": 26,
    "test_gen_job_faults.py::test_fleet_generate_prints_the_runners_cause_and_remedy": 26,
    "test_deployments.py::test_failed_bringup_under_a_worker_logs_its_message_not_an_engine_traceback": 26,
    "test_interrupt.py::test_sigterm_landing_as_the_lock_slot_is_granted_gives_the_slot_back[SIGINT]": 26,
    "test_localserver.py::test_two_first_commands_at_once_start_one_server_and_the_next_reuses_it": 24,
    "test_objstore_ranges.py::test_the_job_checks_are_the_chunks_checks_summed_exactly": 23,
    "test_waits.py::test_stopped_server_at_bringup_is_a_failed_server_and_the_job_starts_on_its_peers": 23,
    "test_bringup.py::test_demo_command_from_readme": 21,
    "test_gen_hedge.py::test_kill_9_during_a_hedge_then_resume_every_id_exactly_once": 21,
    "test_security.py::test_fetch_remote_cannot_inject_options_or_leave_the_job_output[ssh]": 21,
    "test_generate_flow.py::test_the_flows_generate_action_goes_on_under_a_larger_limit": 21,
    "test_revalidate.py::test_revalidate_after_teardown_says_nothing_is_up_until_the_next_bringup": 20,
    "test_reattach.py::test_fleet_down_stops_the_live_runner_first_so_no_server_comes_back": 20,
}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its GROUPED group, or the test itself."""
    short = nodeid.removeprefix("tests/")
    group = next((GROUPED[p] for p in sorted(GROUPED, key=len, reverse=True) if short.startswith(p)), None)
    return f"group:{group}" if group else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` by GROUPED. xdist's own loadgroup reads `xdist_group` marks by renaming each
    item's `_nodeid`, which pytest 9 no longer reads (a node id is `_id` there): every mark was ignored,
    and each test of a grouped module ran wherever it was sent, setting up the module's servers on
    every worker that got one (up to four Prefect servers and workers for the deployment tests). The
    scheduler (in the controller) groups by node id instead, the order of the collection kept."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupedScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return GroupedScheduling(config, log)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    slowdown = harness.factor()
    for item in items:   # a test's own hang guard, scaled like every deadline (pytest-timeout reads the closest)
        mark = item.get_closest_marker("timeout")
        if mark is not None and mark.args and slowdown > 1:
            item.add_marker(pytest.mark.timeout(float(mark.args[0]) * slowdown, *mark.args[1:], **mark.kwargs),
                            append=False)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run keeps pytest's order (and module fixtures set up once)
    unit_cost: dict[str, float] = {}
    for item in items:
        unit = work_unit(item.nodeid)
        unit_cost[unit] = unit_cost.get(unit, 0.0) + SLOW_S.get(item.nodeid.removeprefix("tests/"), 0.0)
    items.sort(key=lambda it: -unit_cost[work_unit(it.nodeid)])  # stable: the rest keeps its order


def start_local_servers(cfg: Any, pids: list[int] | None = None) -> list[Any]:
    """Launch every server of `cfg` on this machine, wait until each is ready, and return the
    runner's `ServerEntry` of each; `pids` gets each pid as it starts (the caller's cleanup)."""
    from fleet.generation.job.runner import ServerEntry
    from fleet.node import LocalNode
    from fleet.servers import launch, plan_servers, wait_ready

    node = LocalNode("local")
    entries = []
    for spec in plan_servers(cfg, cfg.nodes[0], [], model_path="/dev/shm/sim-model", python=sys.executable):
        res = launch(node, cfg, spec)
        ready = wait_ready(node, cfg, spec, res.pid)
        if pids is not None:
            pids.append(res.pid)
        entries.append(ServerEntry(node="local", index=spec.index, url=ready.url, model="sim-model",
                                   spec={k: v for k, v in vars(spec).items() if k != "api_key"}))
    return entries
