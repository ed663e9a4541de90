"""The seam to a machine: everything fleet does on a node goes through `Node`.

Implementations provide the transport primitives (`_exec`, `stream`, `put`, `get`,
`forward_port`, `close`); detached processes, stopping them and reading files are built
here once, on top of `run` and the sh programs in `scripts.py`, so both transports behave
the same. Commands are argv lists; they are quoted exactly once, where they leave the
process (`shlex.join` in the SSH implementation, `subprocess` argv in the local one).
"""

from __future__ import annotations

import abc
import shlex
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fleet.config import ENV_NAME
from fleet.errors import CommandFailed, CommandNotFound
from fleet.node.scripts import ALIVE, DETACH, KILL_STARTED, LAUNCH, READ_PID, STATE, STOP, WATCH, WRITE


# How long a detached launch may take to write its pid file (the shell's first few commands).
PID_FILE_TIMEOUT_S = 10.0

# A process as `watch` and `process_state` see it: "stopped" is SIGSTOP (state T), never serving.
ProcState = Literal["alive", "stopped", "dead"]


@dataclass(frozen=True)
class RunResult:
    """What one command did on a node."""

    host: str
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class Detached:
    """A process started in its own session; it outlives the connection that started it."""

    pid: int
    log_path: str
    pid_path: str

    @property
    def pgid(self) -> int:
        # started with setsid: the process leads its own session and process group
        return self.pid


@dataclass
class StopResult:
    pid: int | None
    was_running: bool
    killed: bool  # needed SIGKILL after the grace period
    seconds: float


@dataclass
class PortForward:
    """A local port that reaches `remote_host:remote_port` on the node."""

    local_port: int
    remote_host: str
    remote_port: int
    _closer: object = field(default=None, repr=False)

    def close(self) -> None:
        closer = self._closer
        if closer is not None and hasattr(closer, "close"):
            closer.close()

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Node(abc.ABC):
    """A machine fleet can run things on."""

    name: str
    host: str
    input_encoding = "utf-8"  # how `input=` text reaches the command's stdin (write_text counts bytes)

    # -- transport primitives (per implementation) ------------------------------------
    @abc.abstractmethod
    def _exec(self, argv: Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None,
              input: str | None) -> RunResult:
        """Run argv and return its result. Never raise on a non-zero exit; raise CommandTimeout
        past `timeout` (after killing the command), and transport errors as fleet errors."""

    @abc.abstractmethod
    def stream(self, argv: Sequence[str], *, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> Iterator[str]:
        """Yield the command's merged stdout/stderr line by line; raise CommandFailed on non-zero exit."""

    @abc.abstractmethod
    def put(self, local: str | Path, remote: str) -> None:
        """Copy a local file to the node (parent directories are created)."""

    @abc.abstractmethod
    def get(self, remote: str, local: str | Path) -> None:
        """Copy a file from the node to a local path."""

    @abc.abstractmethod
    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1", local_port: int = 0) -> PortForward:
        """Make `remote_host:remote_port` (as seen from the node) reachable on a local port."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections (detached processes keep running)."""

    # -- shared behaviour ---------------------------------------------------------------
    def run(self, argv: Sequence[str], *, timeout: float | None = 60.0, check: bool = True,
            env: Mapping[str, str] | None = None, input: str | None = None) -> RunResult:
        """Run `argv` on the node. With check=True a non-zero exit raises (127 → CommandNotFound)."""
        argv = [str(a) for a in argv]
        result = self._exec(argv, timeout=timeout, env=env, input=input)
        if check:
            self.raise_for(result)
        return result

    def raise_for(self, result: RunResult) -> None:
        if result.exit_code == 0:
            return
        if result.exit_code == 127:
            raise CommandNotFound(
                f"command not found: {result.argv[0]}", host=self.host, command=result.argv,
                exit_code=127, stderr=result.stderr,
                remedy=f"install {result.argv[0]!r} on {self.host} or put it on the PATH of non-interactive shells",
            )
        raise CommandFailed(
            f"command failed with exit code {result.exit_code}", host=self.host, command=result.argv,
            exit_code=result.exit_code, stderr=result.stderr or result.stdout,
            remedy="read the stderr above; fix the cause on the node and re-run",
        )

    def start_detached(self, argv: Sequence[str], *, log_path: str, pid_path: str,
                       env: Mapping[str, str] | None = None, cwd: str = "/") -> Detached:
        """Start argv in a new session with its own log and pid file; return once the pid is known.

        `env` reaches the process through a 0600 file, never through any command line."""
        env_file, env_text = "", None
        if env:
            bad = [k for k in env if not ENV_NAME.match(k)]
            if bad:
                raise CommandFailed(f"invalid environment variable names: {bad}", host=self.host,
                                    remedy="use letters, digits and _ only")
            env_file = f"{pid_path}.env"
            env_text = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
        nbytes = len(env_text.encode(self.input_encoding)) if env_text is not None else 0
        launch = ["sh", "-c", DETACH, LAUNCH, pid_path, log_path, cwd, env_file, str(nbytes), "--",
                  *[str(a) for a in argv]]
        started = self.run(launch, timeout=30, input=env_text).stdout.split()
        deadline = time.monotonic() + PID_FILE_TIMEOUT_S
        while True:
            pid = self.read_pid(pid_path)
            if pid is not None:
                return Detached(pid=pid, log_path=log_path, pid_path=pid_path)
            if time.monotonic() > deadline:
                # The launch shell hangs or was stopped before it wrote the pid file: kill it (by its
                # pid and start time), so that no late start races the retry of this launch.
                if len(started) == 2 and all(p.isdigit() for p in started):
                    self.run(["sh", "-c", KILL_STARTED, "fleet-kill", *started], check=False, timeout=30)
                if env_file:   # a shell stopped before it opened its env file: the secrets go with it
                    self.run(["rm", "-f", "--", env_file], check=False, timeout=30)
                raise CommandFailed(f"detached process wrote no pid file within {PID_FILE_TIMEOUT_S:g} s "
                                    f"(launch shell {started[0] if started else '?'} killed)", host=self.host,
                                    command=argv, stderr=self.read_text(log_path, tail_bytes=4000),
                                    remedy="check that 'setsid' (util-linux) exists, the workdir is writable and "
                                           "nothing stops processes on the node; the launch is retried")
            time.sleep(0.05)

    def read_pid(self, pid_path: str, expect: str | None = None) -> int | None:
        """The pid in a pid file, or None when there is none or it no longer names that process.

        fleet's pid files hold "PID STARTTIME": a pid whose process started at another time
        (the process died and the pid was reused) reads as None, so nothing from a record is
        ever signalled or adopted unless it is the very process fleet started. With `expect`,
        the process's command line must also contain that text (e.g. "--port 30001")."""
        res = self.run(["sh", "-c", READ_PID, "fleet-pid", pid_path, expect or ""], check=False, timeout=30)
        text = res.stdout.strip()
        return int(text) if res.ok and text.isdigit() else None

    def is_alive(self, pid: int) -> bool:
        return self.run(["sh", "-c", ALIVE, "fleet-alive", str(pid)], check=False, timeout=30).ok

    def process_state(self, pid: int) -> ProcState:
        """alive, stopped (SIGSTOP: it serves nothing until continued) or dead."""
        word = self.run(["sh", "-c", STATE, "fleet-state", str(pid)], check=False, timeout=30).stdout.strip()
        return _proc_state(word.partition(" ")[0])

    def stop(self, pid: int, grace_s: float = 10.0) -> StopResult:
        """TERM the process group, wait up to grace_s, then KILL it."""
        t0 = time.monotonic()
        res = self.run(["sh", "-c", STOP, "fleet-stop", str(pid), str(max(1, int(round(grace_s))))],
                       timeout=grace_s + 30)
        word = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "absent"
        return StopResult(pid=pid, was_running=word != "absent", killed=word == "killed",
                          seconds=time.monotonic() - t0)

    def watch(self, pid: int, log_path: str, offset: int) -> tuple[ProcState, str]:
        """One round trip: the process's state, and what its log gained since byte `offset`."""
        state, text, _ = self.watch_cpu(pid, log_path, offset)
        return state, text

    def watch_cpu(self, pid: int, log_path: str, offset: int) -> tuple[ProcState, str, int | None]:
        """`watch`, and the CPU time (clock ticks) the process's group has used (None when dead)."""
        res = self.run(["sh", "-c", WATCH, STATE, str(pid), str(offset + 1), log_path],
                       check=False, timeout=60)
        head, _, rest = res.stdout.partition("\n")
        word, _, ticks = head.strip().partition(" ")
        return _proc_state(word), rest, int(ticks) if ticks.isdigit() else None

    def local_url(self, port: int, remote_host: str = "127.0.0.1") -> str:
        """http://127.0.0.1:P reaching remote_host:port on the node (a forward, opened once and kept)."""
        cache: dict[tuple[str, int], PortForward] = self.__dict__.setdefault("_url_forwards", {})
        fwd = cache.get((remote_host, port))
        if fwd is None:
            fwd = cache[(remote_host, port)] = self.forward_port(port, remote_host)
        return f"http://127.0.0.1:{fwd.local_port}"

    def close_forwards(self) -> None:
        for fwd in self.__dict__.pop("_url_forwards", {}).values():
            fwd.close()

    def read_text(self, path: str, *, tail_bytes: int | None = None) -> str:
        """A text file on the node ('' when missing); only the last tail_bytes when given."""
        argv = ["tail", "-c", str(tail_bytes), "--", path] if tail_bytes else ["cat", "--", path]
        res = self.run(argv, check=False, timeout=60)
        return res.stdout if res.ok else ""

    def write_text(self, path: str, text: str, *, remove: Sequence[str] = ()) -> None:
        """Write a file atomically on the node: mode 0600 (directories 0700), through a fresh temp
        file (mktemp: O_EXCL, so never through a symlink someone planted), then a rename (which
        replaces a link at `path` rather than following it). The text travels on stdin. `remove`:
        files removed once it is in place, in the same round trip."""
        nbytes = len(text.encode(self.input_encoding))
        self.run(["sh", "-c", WRITE, "fleet-write", path, str(nbytes), *remove], input=text, timeout=60)

    def exists(self, path: str) -> bool:
        return self.run(["sh", "-c", '[ -e "$1" ]', "fleet-exists", path], check=False, timeout=30).ok

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _proc_state(word: str) -> ProcState:
    return "alive" if word == "alive" else "stopped" if word == "stopped" else "dead"


def describe(argv: Sequence[str]) -> str:
    """The exact command as it would be typed (for logs)."""
    return shlex.join(str(a) for a in argv)
