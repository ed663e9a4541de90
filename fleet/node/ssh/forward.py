"""Local port forwarding over the node's one SSH connection (`SSHNode.forward_port`).

A loopback listener; each accepted connection becomes one `direct-tcpip` channel on the
node's transport, pumped both ways by a thread (half-close aware).

Why hand-written: paramiko offers the channel (`Transport.open_channel("direct-tcpip")`)
but no listener: its local-forward example lives in its demos, not in the package. The
tunnel libraries built on it (sshtunnel and its forks) open a second SSH connection of
their own per forward, with their own host-key and key handling, and do not reconnect when
it drops. Here every forward shares the node's connection, so it gets fleet's host-key
checks, its credentials and its reconnect: each new client connection asks the node for a
live transport (`_open_direct` reconnects after a drop), so a forward outlives an outage
and the generation runner's next request goes through. Tests that protect this:
`tests/test_node.py::test_forward_port_serves_many_concurrent_requests` (a pool of 32
keep-alive connections and bursts of fresh ones), `tests/test_ssh_faults.py::
test_forward_to_a_closed_remote_port` and `::test_forward_outlives_a_dropped_connection`.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Protocol

import paramiko

from fleet.errors import CommandFailed, FleetError
from fleet.node.ssh.commands import BUF, quietly

log = logging.getLogger("fleet.node.ssh")

__all__ = ["Forwarder"]


class _Node(Protocol):
    """What a forward needs from its node."""

    host: str

    def _open_direct(self, remote_host: str, remote_port: int, src: tuple[str, int]) -> paramiko.Channel: ...

    def _forget(self, fwd: Forwarder) -> None: ...


class Forwarder:
    """A loopback listener; each accepted connection becomes one direct-tcpip channel."""

    def __init__(self, node: _Node, remote_host: str, remote_port: int, local_port: int) -> None:
        self.node, self.remote_host, self.remote_port = node, remote_host, remote_port
        self._closed = threading.Event()
        self._tunnels: set[tuple[socket.socket, paramiko.Channel]] = set()
        self._tlock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind(("127.0.0.1", local_port))
        except OSError as exc:
            self._listener.close()
            raise CommandFailed(f"cannot listen on 127.0.0.1:{local_port}: {exc.strerror}", host=node.host,
                                command=["forward", str(local_port), f"{remote_host}:{remote_port}"],
                                remedy="pick another local port, or 0 for any free one") from exc
        self._listener.listen(256)  # HTTP clients open whole pools at once
        self.local_port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"fleet-fwd-{self.local_port}", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, addr = self._listener.accept()  # bounded: close() shuts the listener down
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # e.g. out of file descriptors: back off rather than spin
                continue
            threading.Thread(target=self._serve, args=(client, addr), name="fleet-fwd-conn", daemon=True).start()

    def _serve(self, client: socket.socket, addr: tuple[str, int]) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            chan = self.node._open_direct(self.remote_host, self.remote_port, addr)
        except FleetError as exc:
            log.warning("%s", exc.one_line())
            client.close()
            return
        pair = (client, chan)
        with self._tlock:
            if self._closed.is_set():
                client.close()
                quietly(chan.close)
                return
            self._tunnels.add(pair)
        try:
            _pump(client, chan, self._closed)
        finally:
            with self._tlock:
                self._tunnels.discard(pair)
            quietly(chan.close)
            client.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        self._listener.close()
        with self._tlock:
            tunnels = list(self._tunnels)
        for client, chan in tunnels:
            try:
                client.shutdown(socket.SHUT_RDWR)  # wakes its pump (the socket turns readable)
            except OSError:
                pass
            quietly(chan.close)
        self.node._forget(self)


def _pump(client: socket.socket, chan: paramiko.Channel, closed: threading.Event) -> None:
    """Copy bytes both ways until both sides finish (half-close aware) or the forward closes."""
    with selectors.DefaultSelector() as sel:
        sel.register(client, selectors.EVENT_READ)
        sel.register(chan, selectors.EVENT_READ)
        open_sides = 2
        while open_sides and not closed.is_set():
            for key, _ in sel.select(timeout=1.0):
                try:
                    if key.fileobj is client:
                        data = client.recv(BUF)  # bounded: select said readable
                        if data:
                            chan.sendall(data)
                            continue
                        chan.shutdown_write()
                    else:
                        data = chan.recv(BUF)  # bounded: select said readable
                        if data:
                            client.sendall(data)
                            continue
                        if chan.closed and not chan.eof_received:
                            return  # the transport dropped: nothing more will come either way
                        client.shutdown(socket.SHUT_WR)
                except (OSError, EOFError, paramiko.SSHException):
                    return
                try:
                    sel.unregister(key.fileobj)
                except (KeyError, ValueError):
                    return  # a closed channel's fileno no longer maps to its key: that side is done
                open_sides -= 1
