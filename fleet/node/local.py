"""The local node: subprocess on this machine (when the flow runs on the GPU node itself)."""

from __future__ import annotations

import locale
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from fleet.errors import CommandFailed, CommandNotFound, CommandTimeout
from fleet.node.base import Node, PortForward, RunResult


# How long a killed command's pipes are read before they are given up on.
DRAIN_S = 5.0


class LocalNode(Node):
    # subprocess text mode encodes stdin with the locale's encoding
    input_encoding = locale.getpreferredencoding(False)

    def __init__(self, name: str = "local") -> None:
        self.name = name
        self.host = "localhost"

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str] | None:
        return None if not env else {**os.environ, **env}

    def _exec(self, argv: Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None,
              input: str | None) -> RunResult:
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self._env(env),
                start_new_session=True,  # so a timeout kills the whole command, children included
            )
        except FileNotFoundError:
            return RunResult(self.host, tuple(argv), 127, "", f"{argv[0]}: command not found", time.monotonic() - t0)
        except PermissionError as exc:
            return RunResult(self.host, tuple(argv), 126, "", str(exc), time.monotonic() - t0)
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            err = _drain(proc)
            raise CommandTimeout(f"command timed out after {timeout:g} s", host=self.host, command=argv,
                                 stderr=err, remedy="raise the timeout or check why the command hangs") from None
        return RunResult(self.host, tuple(argv), _shell_code(proc.returncode), out, err, time.monotonic() - t0)

    def stream(self, argv: Sequence[str], *, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> Iterator[str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=self._env(env),
                                    start_new_session=True, bufsize=1)
        except FileNotFoundError:
            raise CommandNotFound(f"command not found: {argv[0]}", host=self.host, command=argv,
                                  exit_code=127, remedy=f"install {argv[0]!r} or fix PATH") from None
        tail: list[str] = []
        assert proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        # A reader thread, so the deadline holds even while the command prints nothing.
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            while True:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise CommandTimeout(f"command timed out after {timeout:g} s", host=self.host,
                                         command=argv, stderr="".join(tail),
                                         remedy="raise the timeout or check why the command hangs")
                try:
                    line = lines.get(timeout=wait)
                except queue.Empty:
                    continue
                if line is None:
                    break
                line = line.rstrip("\n")
                tail = (tail + [line + "\n"])[-20:]
                yield line
            # Output ended, yet the command may go on (it closed stdout): the deadline still holds.
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                raise CommandTimeout(f"command timed out after {timeout:g} s", host=self.host, command=argv,
                                     stderr="".join(tail), remedy="raise the timeout or check why the command hangs") from None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
        if rc != 0:
            self.raise_for(RunResult(self.host, tuple(argv), _shell_code(rc), "", "".join(tail), 0.0))

    def put(self, local: str | Path, remote: str) -> None:
        self._copy(local, remote, private=True)

    def get(self, remote: str, local: str | Path) -> None:
        # What comes back (a job's output) is meant to be shared: it follows the umask.
        self._copy(remote, str(local), private=False)

    def _copy(self, src: str | Path, dest: str, *, private: bool) -> None:
        # Temp file + rename: a reader (a server starting from an uploaded script, a
        # concurrent upload of the same file) never sees a half-written file. O_EXCL |
        # O_NOFOLLOW: never write through a file or link someone put at the temp name.
        # private: 0600 (0700 when the source is executable) and directories 0700.
        tmp = f"{dest}.fleet-put-{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}"
        made = False
        try:
            _makedirs(Path(dest).parent, 0o700 if private else 0o777)
            exe = os.stat(src).st_mode & 0o111
            mode = (0o700 if exe else 0o600) if private else (0o777 if exe else 0o666)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            made = True
            with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
                shutil.copyfileobj(inp, out, 1 << 20)
            os.replace(tmp, dest)
        except OSError as exc:
            if made:
                Path(tmp).unlink(missing_ok=True)
            raise CommandFailed(f"cannot copy {src} to {dest}: {exc.strerror}", host=self.host,
                                remedy="check the paths and permissions") from exc

    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1", local_port: int = 0) -> PortForward:
        # The node's loopback is ours: nothing to forward.
        return PortForward(local_port=remote_port, remote_host=remote_host, remote_port=remote_port)

    def close(self) -> None:
        pass


def _makedirs(path: Path, mode: int) -> None:
    """mkdir -p where every directory made gets `mode` (less the umask); no process-wide umask
    change, which would race with other threads."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass


def _pump(stream: Iterable[str], out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _shell_code(rc: int) -> int:
    """subprocess says -N for a signal; a shell (and the SSH node) says 128 + N."""
    return 128 - rc if rc < 0 else rc


def _drain(proc: subprocess.Popen[str]) -> str:
    """stderr of a command just killed, read for at most DRAIN_S. A process that left the group
    (its own session, or stopped while it holds our pipes) may keep them open forever: then give
    up on them rather than wait, which once hung a relaunch for as long as its shell was stopped."""
    try:
        return proc.communicate(timeout=DRAIN_S)[1] or ""
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        try:
            proc.wait(timeout=DRAIN_S)
        except subprocess.TimeoutExpired:
            pass  # unkillable (uninterruptible I/O): the kernel ends it, nobody waits on it
        return ""


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
