"""One command on an SSH session channel: the argv actually run (env and the remote `timeout`
around it, quoted once by the caller), feeding stdin, and reading the output against a
deadline without letting either pipe fill and stall the command."""

from __future__ import annotations

import codecs
import selectors
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import paramiko

from fleet.config import ENV_NAME
from fleet.errors import ConfigError

__all__ = ["CLIENT_GRACE_S", "REMOTE_KILL_AFTER_S", "bounded_request", "collect", "quietly", "read_lines", "remote_argv",
           "send_input"]

# The client-side deadline trails the remote `timeout` so the remote kill (TERM, then
# KILL 5 s later) normally wins and we get its exit code and output.
CLIENT_GRACE_S = 15.0
REMOTE_KILL_AFTER_S = 5
BUF = 65536


def remote_argv(argv: Sequence[str], *, timeout: float | None = None,
                env: Mapping[str, str] | None = None) -> list[str]:
    """The argv actually run on the node: env vars and the remote `timeout` wrapped around it.

    env goes through `env K=V` rather than SSH env requests: sshd drops those unless
    AcceptEnv lists them. `timeout` (without --foreground) kills the command's whole
    process group, so children die with it.
    """
    out = [str(a) for a in argv]
    if timeout is not None:
        out = ["timeout", f"--kill-after={REMOTE_KILL_AFTER_S}", _seconds(timeout), *out]
    if env:
        bad = [k for k in env if not ENV_NAME.match(k)]
        if bad:
            raise ConfigError(f"invalid environment variable names: {bad}",
                              remedy="use names made of letters, digits and '_', not starting with a digit")
        out = ["env", *[f"{k}={v}" for k, v in env.items()], *out]
    return out


def _seconds(value: float) -> str:
    # `timeout 0` means "no limit", so never round down to 0.
    return f"{max(value, 0.001):.3f}".rstrip("0").rstrip(".")


def quietly(close: Callable[[], object]) -> None:
    """Run a close/shutdown call on a connection that may already be gone."""
    try:
        close()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def bounded_request(chan: paramiko.Channel, request: Callable[[], object], seconds: float) -> bool:
    """Run a channel request (`exec_command`, `invoke_subsystem`) that waits for the node's reply.
    paramiko waits for that reply with no timeout: a node whose sshd is stopped or wedged, with its
    kernel still acking TCP, held the caller forever. Past `seconds` the channel is closed, which
    ends paramiko's wait with an error; returns False when that happened (the caller says why)."""
    fired = threading.Event()

    def expire() -> None:
        fired.set()
        quietly(chan.close)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        request()
    except (paramiko.SSHException, EOFError, OSError):
        if fired.is_set():
            return False
        raise
    finally:
        timer.cancel()
    return not fired.is_set()


def send_input(chan: paramiko.Channel, data: str) -> None:
    """Send stdin then EOF, in a thread: the command may fill its stdout (and our window) before it
    reads all its input. (A command run without input has /dev/null for stdin: SSHNode._start.)"""

    def feed() -> None:
        try:
            chan.sendall(data.encode())
            chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command exited without reading all its input

    threading.Thread(target=feed, name="fleet-ssh-stdin", daemon=True).start()


class _Waiter:
    """Waits for data or EOF on a channel (paramiko signals stdout and stderr on one pipe)."""

    def __init__(self, chan: paramiko.Channel, deadline: float | None) -> None:
        self.deadline = deadline
        self._sel = selectors.DefaultSelector()
        self._sel.register(chan, selectors.EVENT_READ)

    def wait(self) -> bool:
        """False once the deadline has passed."""
        remaining = 1.0 if self.deadline is None else self.deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._sel.select(min(remaining, 1.0))
        return True

    def close(self) -> None:
        self._sel.close()


def collect(chan: paramiko.Channel, deadline: float | None) -> tuple[bytes | None, bytes]:
    """All stdout and stderr, read together so neither pipe can fill and stall the command.
    stdout is None when the deadline passed."""
    out, err = bytearray(), bytearray()
    waiter = _Waiter(chan, deadline)
    try:
        while True:
            # EOF arrives after all data, so data seen once EOF is flagged is complete.
            done = chan.eof_received or chan.closed
            while chan.recv_ready():
                out += chan.recv(BUF)  # bounded: data is ready
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(BUF)  # bounded: data is ready
            if done:
                return bytes(out), bytes(err)
            if not waiter.wait():  # bounded: one second at most, then the deadline is checked
                return None, bytes(err)
    finally:
        waiter.close()


def read_lines(chan: paramiko.Channel, deadline: float | None) -> Iterator[str | None]:
    """Lines of stdout as they arrive; a final None means the deadline passed."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending = ""
    waiter = _Waiter(chan, deadline)
    try:
        while True:
            done = chan.eof_received or chan.closed
            while chan.recv_ready():
                pending += decoder.decode(chan.recv(BUF))  # bounded: data is ready
                *lines, pending = pending.split("\n")
                yield from lines
            if done:
                break
            if not waiter.wait():  # bounded: one second at most, then the deadline is checked
                yield None
                return
    finally:
        waiter.close()
    pending += decoder.decode(b"", final=True)
    if pending:
        yield pending

