"""The SSH node: `Node` over one paramiko connection per machine; thread-safe.

The connection is opened lazily on first use and reopened on the next call after it drops
(`connection.py`). Every command is one `exec` session channel carrying `shlex.join(argv)`
(quoted exactly once, here). Timeouts are enforced twice: remotely by wrapping the argv in
`timeout --kill-after=5`, so the command dies with its deadline, and locally by a deadline
15 s later, in case the node stops answering (`commands.py`). Files go over SFTP
(`transfer.py`); ports are forwarded over the same connection (`forward.py`).

Errors here, besides those of connecting (see `connection.py`):

    connection dropped while a command ran      -> ConnectionLost (next call reconnects)
    past the deadline / exit 124 from `timeout` -> CommandTimeout
    no free session slot within the deadline    -> CommandTimeout
"""

from __future__ import annotations

import logging
import shlex
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from fleet.errors import CommandFailed, CommandTimeout, ConnectionLost
from fleet.node.base import Node, PortForward, RunResult
from fleet.node.credentials import CredentialSource
from fleet.node.ssh.commands import (CLIENT_GRACE_S, bounded_request, collect, quietly, read_lines, remote_argv,
                                     send_input)
from fleet.node.ssh.connection import dead, open_transport
from fleet.node.ssh.forward import Forwarder
from fleet.node.ssh.target import SSHTarget, resolve
from fleet.node.ssh.transfer import get as sftp_get
from fleet.node.ssh.transfer import put as sftp_put

if TYPE_CHECKING:
    from fleet.config import NodeConfig

log = logging.getLogger("fleet.node.ssh")

__all__ = ["MAX_SESSIONS", "SSHNode"]

# OpenSSH's default MaxSessions is 10 per connection; past it sshd refuses new channels.
MAX_SESSIONS = 8
SESSION_REFUSED_S = 10.0   # how long a refused channel (on a live connection) is asked for again


class SSHNode(Node):
    """A machine reached over SSH (paramiko). Connects on first use; thread-safe."""

    def __init__(self, target: SSHTarget, *, name: str | None = None, workdir: str = "/tmp/fleet") -> None:
        self.target = target
        self.name = name or target.host
        self.host = target.host
        self.workdir = workdir
        self._lock = threading.Lock()  # around connect/close
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)
        self._transport: paramiko.Transport | None = None
        self._sock: socket.socket | None = None
        self._forwards: set[Forwarder] = set()

    @classmethod
    def from_config(cls, cfg: NodeConfig, credentials: CredentialSource | None = None) -> SSHNode:
        """Build from a NodeConfig (a block or secret it names comes from `credentials`, else the
        installed store; no connection yet)."""
        target, workdir = resolve(cfg, credentials)
        return cls(target, name=cfg.name, workdir=workdir)

    def __repr__(self) -> str:
        t = self.target
        return f"SSHNode({self.name!r}, {t.user}@{t.host}:{t.port})"

    # -- connection ------------------------------------------------------------------------
    def connect(self) -> paramiko.Transport:
        """The live transport, (re)connecting when there is none or it dropped."""
        with self._lock:
            if not dead(self._transport):
                assert self._transport is not None
                return self._transport
            self._drop_transport()
            self._transport, self._sock = open_transport(self.target, self.host)
            return self._transport

    @property
    def connected(self) -> bool:
        return not dead(self._transport)

    # -- sessions ----------------------------------------------------------------------------
    @contextmanager
    def _session(self, argv: Sequence[str], timeout: float | None) -> Iterator[paramiko.Channel]:
        """An open session channel (a slot under sshd's MaxSessions), closed afterwards."""
        if not self._sessions.acquire(timeout=60 if timeout is None else timeout + CLIENT_GRACE_S):
            raise CommandTimeout(f"no free SSH session slot ({MAX_SESSIONS} in use)", host=self.host, command=argv,
                                 remedy="too many commands or streams run at once on this node; wait or close some")
        try:
            chan = self._open_session(argv)
            try:
                yield chan
            finally:
                quietly(chan.close)  # must not mask the error that ended the command
        finally:
            self._sessions.release()

    def _open_session(self, argv: Sequence[str]) -> paramiko.Channel:
        """A new session channel. Nothing has run yet, so a transport that died since the check is
        replaced once, and a channel the node refused on a live connection is asked for again for up
        to SESSION_REFUSED_S: sshd counts a session against MaxSessions until it has finished closing
        it, so quick commands back to back are refused now and then ("no more sessions" in its log;
        paramiko's ChannelException, or "Unable to open channel." when another thread's open took it)."""
        replaced = False
        give_up = time.monotonic() + max(SESSION_REFUSED_S, self.target.connect_timeout_s)
        delay = 0.02
        while True:
            transport = self.connect()
            try:
                return transport.open_session(timeout=self.target.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if dead(transport):
                    if not replaced:
                        replaced = True
                        continue
                elif time.monotonic() + delay < give_up:
                    time.sleep(delay)   # bounded: give_up
                    delay = min(delay * 2, 0.5)
                    continue
                raise ConnectionLost(f"cannot open an SSH session: {exc or type(exc).__name__}", host=self.host,
                                     command=argv,
                                     remedy="the node refused a new channel (sshd MaxSessions?); fleet retries this") from exc

    def _start(self, chan: paramiko.Channel, command: list[str], argv: Sequence[str], *, stdin: bool = False) -> None:
        """Run `command` on `chan`. Without `stdin` its standard input is /dev/null on the node and no
        EOF is sent: a lone EOF from this thread can reach sshd after the CLOSE paramiko's thread sends
        for a command that already ended, and sshd then drops the whole connection ("ieof packet
        referred to nonexistent channel"), every command on it with it."""
        line = shlex.join(command) + ("" if stdin else " </dev/null")
        log.debug("[%s] $ %s", self.host, line)
        try:
            # bounded: bounded_request closes the channel past connect_timeout_s
            answered = bounded_request(chan, lambda: chan.exec_command(line), self.target.connect_timeout_s)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(argv, exc) from exc
        if not answered:
            raise CommandTimeout(f"the node did not answer the request to run the command within "
                                 f"{self.target.connect_timeout_s:g} s", host=self.host, command=argv,
                                 remedy="the node or its sshd is stopped or overloaded; fleet retries this")

    def _lost(self, argv: Sequence[str], exc: BaseException | None = None, stderr: str = "") -> ConnectionLost:
        why = f": {exc}" if exc else ""
        t = self.target
        return ConnectionLost(f"SSH connection to {t.host}:{t.port} dropped during the command{why}",
                              host=self.host, command=argv, stderr=stderr,
                              remedy="fleet reconnects on the next call; if the command was not idempotent, "
                                     "check its effect on the node")

    def _timeout(self, argv: Sequence[str], timeout: float | None, stderr: str = "") -> CommandTimeout:
        return CommandTimeout(f"command timed out after {timeout:g} s", host=self.host, command=argv, stderr=stderr,
                              remedy="raise the timeout or check why the command hangs")

    # -- transport primitives ----------------------------------------------------------------
    def _exec(self, argv: Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None,
              input: str | None) -> RunResult:
        argv = [str(a) for a in argv]
        command = remote_argv(argv, timeout=timeout, env=env)
        deadline = None if timeout is None else time.monotonic() + timeout + CLIENT_GRACE_S
        t0 = time.monotonic()
        with self._session(argv, timeout) as chan:
            self._start(chan, command, argv, stdin=input is not None)
            if input is not None:
                send_input(chan, input)
            out, err = collect(chan, deadline)
            if out is None:
                raise self._timeout(argv, timeout, stderr=err.decode("utf-8", "replace"))
            code = self._exit_code(chan, argv, deadline, timeout, err.decode("utf-8", "replace"))
        seconds = time.monotonic() - t0
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        if timeout is not None and (code == 124 or (code == 137 and seconds >= timeout)):
            raise self._timeout(argv, timeout, stderr=stderr or stdout)
        return RunResult(self.host, tuple(argv), code, stdout, stderr, seconds)

    def _exit_code(self, chan: paramiko.Channel, argv: Sequence[str], deadline: float | None,
                   timeout: float | None, output: str) -> int:
        # The exit status can trail the end of output by a packet.
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        arrived = chan.status_event.wait(wait)
        if chan.exit_status != -1:
            return chan.exit_status
        if dead(chan.get_transport()):
            raise self._lost(argv, stderr=output)
        if not arrived:
            raise self._timeout(argv, timeout, stderr=output)
        return -1  # the server closed the channel without an exit status

    def stream(self, argv: Sequence[str], *, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> Iterator[str]:
        argv = [str(a) for a in argv]
        # 2>&1 inside one process keeps stdout/stderr in their true order; combine_stderr
        # also catches what the env/timeout wrappers themselves print.
        command = remote_argv(["sh", "-c", 'exec "$@" 2>&1', "fleet-stream", *argv], timeout=timeout, env=env)
        deadline = None if timeout is None else time.monotonic() + timeout + CLIENT_GRACE_S
        t0 = time.monotonic()
        tail: deque[str] = deque(maxlen=20)
        with self._session(argv, timeout) as chan:
            chan.set_combine_stderr(True)
            self._start(chan, command, argv)
            for line in read_lines(chan, deadline):
                if line is None:
                    raise self._timeout(argv, timeout, stderr="\n".join(tail))
                tail.append(line)
                yield line
            code = self._exit_code(chan, argv, deadline, timeout, "\n".join(tail))
        if timeout is not None and (code == 124 or (code == 137 and time.monotonic() - t0 >= timeout)):
            raise self._timeout(argv, timeout, stderr="\n".join(tail))
        self.raise_for(RunResult(self.host, tuple(argv), code, "", "\n".join(tail), time.monotonic() - t0))

    # -- files (over SFTP: transfer.py) --------------------------------------------------------
    def put(self, local: str | Path, remote: str) -> None:
        sftp_put(self, local, remote)

    def get(self, remote: str, local: str | Path) -> None:
        sftp_get(self, remote, local)

    # -- ports ------------------------------------------------------------------------------------
    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1", local_port: int = 0) -> PortForward:
        fwd = Forwarder(self, remote_host, remote_port, local_port)
        with self._lock:
            self._forwards.add(fwd)
        log.info("[%s] forwarding 127.0.0.1:%d -> %s:%d", self.host, fwd.local_port, remote_host, remote_port)
        return PortForward(local_port=fwd.local_port, remote_host=remote_host, remote_port=remote_port, _closer=fwd)

    def _open_direct(self, remote_host: str, remote_port: int, src: tuple[str, int]) -> paramiko.Channel:
        what = ["direct-tcpip", f"{remote_host}:{remote_port}"]
        for attempt in range(2):
            transport = self.connect()
            try:
                return transport.open_channel("direct-tcpip", (remote_host, remote_port), src,
                                              timeout=self.target.connect_timeout_s)
            except paramiko.ChannelException as exc:
                raise CommandFailed(f"the node cannot connect to {remote_host}:{remote_port}: {exc.text}",
                                    host=self.host, command=what,
                                    remedy="check the server listens there (and sshd allows TCP forwarding)") from exc
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if dead(transport) and attempt == 0:
                    continue
                raise self._lost(what, exc) from exc
        raise AssertionError("unreachable")

    def _forget(self, fwd: Forwarder) -> None:
        with self._lock:
            self._forwards.discard(fwd)

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Close forwards and the connection. Detached processes keep running."""
        with self._lock:
            forwards = list(self._forwards)
        for fwd in forwards:
            fwd.close()  # takes the lock itself (to forget the forward)
        with self._lock:
            self._drop_transport()

    def _drop_transport(self) -> None:
        transport, sock = self._transport, self._sock
        self._transport = self._sock = None
        if transport is not None:
            transport.close()
        if sock is not None:
            sock.close()  # Transport.close() skips the socket once the transport died
