"""Opening one SSH connection: TCP socket, handshake, host key, authentication, fast retries.

`open_transport(target, host)` returns a live `paramiko.Transport` and the socket under it (the
caller keeps the socket: `Transport.close()` skips it once the transport died). Errors:

    socket refused / reset / DNS / TCP timeout  -> NodeUnreachable (fast ones retried here)
    host key unknown or changed                 -> HostKeyError (`hostkey.py`)
    key refused, no key to offer                -> AuthFailed
    no common algorithms                        -> ConfigError

Why a subclass of paramiko's Transport (the one patch of paramiko internals in fleet):
sshd reports a command killed by a signal with an 'exit-signal' channel request and no
'exit-status'. paramiko's client handles only 'exit-status' (`Channel._handle_request`
answers anything else as unhandled), so `exit_status` stayed -1 and the command looked like
a lost connection. paramiko has no public hook for channel requests on the client side (its
`ServerInterface` serves the server side only), so `_ExitSignalTransport` puts a handler in
front of `Channel._handle_request` through the per-class dispatch table
`Transport._channel_handler_table` (unchanged since paramiko 1.x), and gives the command
the shell's code 128+N. Fetching both private names with `getattr` at import makes a
paramiko that renamed them fail at once, not silently.
`tests/test_ssh_faults.py::test_command_killed_by_signal_reports_128_plus_signal` protects it.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import paramiko
from paramiko.common import MSG_CHANNEL_REQUEST
from paramiko.ssh_exception import IncompatiblePeer

from fleet.backoff import backoff_delay
from fleet.errors import AuthFailed, ConfigError, NodeUnreachable
from fleet.node.ssh.hostkey import prefer_known_key_type, verify_host_key
from fleet.node.ssh.keys import fingerprint, load_private_key
from fleet.node.ssh.target import SSHTarget

log = logging.getLogger("fleet.node.ssh")


def _not_a_refused_channel(record: logging.LogRecord) -> bool:
    """paramiko logs every refused channel at ERROR ("Secsh channel 7 open FAILED: …"); the seam asks
    again (SSHNode._open_session) and says it in its own error when it gives up."""
    return "open FAILED" not in record.getMessage()


logging.getLogger("paramiko.transport").addFilter(_not_a_refused_channel)

__all__ = ["CONNECT_ATTEMPTS", "dead", "open_transport"]

CONNECT_ATTEMPTS = 3
RETRY_BASE_S, RETRY_FACTOR = 0.2, 3.0   # 0.2 s, then 0.6 s
_DEFAULT_KEY_FILES = ("id_ed25519", "id_ecdsa", "id_rsa")


def dead(transport: paramiko.Transport | None) -> bool:
    # paramiko closes the channels of a dying transport before it clears `active`, so a
    # channel can look closed while the transport still looks alive: saved_exception tells.
    # Except a ChannelException: paramiko saves one there too when the node refuses a channel
    # (sshd's MaxSessions), and leaves it when another thread's open took the wake-up; the
    # connection is fine, and taking it for dead dropped every command running on it.
    if transport is None or not transport.is_active():
        return True
    saved = transport.saved_exception
    return saved is not None and not isinstance(saved, paramiko.ChannelException)


# -- exit-signal (see the module docstring) -----------------------------------------------------

_ChannelHandler = Callable[[paramiko.Channel, paramiko.Message], None]
_channel_handle_request: _ChannelHandler = getattr(paramiko.Channel, "_handle_request")
_base_handler_table: dict[int, _ChannelHandler] = getattr(paramiko.Transport, "_channel_handler_table")


def _handle_channel_request(chan: paramiko.Channel, m: paramiko.Message) -> None:
    """paramiko ignores 'exit-signal'; turn it into the shell's 128+N so a killed command has a code."""
    start = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()  # want_reply: never for exit-signal
        signum = getattr(signal, "SIG" + m.get_text(), None)
        chan.exit_status = 128 + int(signum) if signum is not None else 255
        chan.status_event.set()
        return
    m.packet.seek(start)
    _channel_handle_request(chan, m)


class _ExitSignalTransport(paramiko.Transport):
    _channel_handler_table = {**_base_handler_table, MSG_CHANNEL_REQUEST: _handle_channel_request}


# -- connecting ---------------------------------------------------------------------------------

def open_transport(target: SSHTarget, host: str) -> tuple[paramiko.Transport, socket.socket]:
    """A connected, authenticated transport and its socket; fast failures are retried."""
    for attempt in range(CONNECT_ATTEMPTS):
        started = time.monotonic()
        try:
            return _connect_once(target, host)
        except NodeUnreachable as exc:
            # Only fast failures (refused, reset) are retried here: a slow one (a timeout)
            # would multiply the wait; the caller's own retries cover those.
            if attempt == CONNECT_ATTEMPTS - 1 or time.monotonic() - started > 2.0:
                raise
            delay = backoff_delay(attempt + 1, RETRY_BASE_S, factor=RETRY_FACTOR)
            log.info("[%s] %s; retrying in %.1f s", host, exc.reason, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _connect_once(target: SSHTarget, host: str) -> tuple[paramiko.Transport, socket.socket]:
    t = target
    sock = _open_socket(target, host)
    transport = _ExitSignalTransport(sock)
    try:
        transport.banner_timeout = transport.handshake_timeout = t.connect_timeout_s
        transport.auth_timeout = t.connect_timeout_s
        prefer_known_key_type(target, host, transport)
        try:
            transport.start_client(timeout=t.connect_timeout_s)
        except IncompatiblePeer as exc:
            raise ConfigError(f"cannot agree on SSH algorithms with {t.host}:{t.port}: {exc}",
                              host=host, remedy="upgrade paramiko or the node's OpenSSH") from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise _unreachable(target, host, f"SSH handshake with {t.host}:{t.port} failed: "
                                             f"{exc or type(exc).__name__}", exc) from exc
        try:
            server_key = transport.get_remote_server_key()
        except paramiko.SSHException as exc:   # "No existing session": it went away right after the key exchange
            # (an SSH outage killing sshd's children); raised bare, it ended the multi-node node loop's thread
            raise _unreachable(target, host, f"connection to {t.host}:{t.port} dropped after the key exchange: "
                                             f"{exc}", exc) from exc
        verify_host_key(target, host, server_key)
        _authenticate(target, host, transport)
        if t.keepalive_s:
            transport.set_keepalive(t.keepalive_s)
        return transport, sock
    except BaseException:
        transport.close()
        sock.close()
        raise


def _open_socket(target: SSHTarget, host: str) -> socket.socket:
    t = target
    try:
        sock = socket.create_connection((t.host, t.port), timeout=t.connect_timeout_s)
    except socket.gaierror as exc:
        raise _unreachable(target, host, f"cannot resolve {t.host}: {exc.strerror}", exc) from exc
    except OSError as exc:
        raise _unreachable(target, host, f"cannot connect to {t.host}:{t.port}: {exc.strerror or exc}", exc) from exc
    # paramiko leaves Nagle on: every command would wait ~40 ms for delayed ACKs.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _unreachable(target: SSHTarget, host: str, reason: str, exc: BaseException) -> NodeUnreachable:
    t = target
    return NodeUnreachable(reason, host=host,
                           remedy=f"check that {t.host} is up, sshd listens on port {t.port} and no firewall blocks it; "
                                  "fleet retries this")


# -- auth ---------------------------------------------------------------------------------------

def _candidate_keys(target: SSHTarget) -> list[paramiko.PKey]:
    if target.key is not None:
        return [target.key]
    keys: list[paramiko.PKey] = []
    try:
        keys.extend(paramiko.Agent().get_keys())
    except paramiko.SSHException:
        pass
    for fname in _DEFAULT_KEY_FILES:
        path = Path.home() / ".ssh" / fname
        if path.is_file():
            try:
                keys.append(load_private_key(path.read_text(), source=str(path)))
            except (ConfigError, OSError):
                continue
    return keys


def _authenticate(target: SSHTarget, host: str, transport: paramiko.Transport) -> None:
    t = target
    keys = _candidate_keys(target)
    if not keys:
        raise AuthFailed(f"no SSH private key to offer {t.user}@{t.host}:{t.port}", host=host,
                         remedy="set key_file, key_secret or block in the node config (or load a key into ssh-agent)")
    for key in keys:
        try:
            transport.auth_publickey(t.user, key)
        except paramiko.AuthenticationException as exc:
            # paramiko raises this one exception for a refused key, for a connection that dropped
            # mid-auth ("transport shut down or saw EOF") and for an answer that did not come within
            # auth_timeout: only the first is the key's fault. The other two are a node that went
            # away or is too busy to answer (an sshd child killed mid-auth, a loaded machine), and
            # were reported as "refused the key", a fatal error that set the node aside for good.
            if not transport.is_active() or "timeout" in str(exc).lower():
                raise _unreachable(target, host, f"connection to {t.host}:{t.port} dropped or went silent during "
                                                 f"authentication: {exc}", exc) from exc
            continue
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise _unreachable(target, host, f"connection to {t.host}:{t.port} dropped during authentication: {exc}",
                               exc) from exc
        if transport.is_authenticated():
            return
    shown = f" {fingerprint(keys[0])}" if len(keys) == 1 else "s"
    raise AuthFailed(
        f"{t.user}@{t.host}:{t.port} refused the key{shown} from {t.key_source}", host=host,
        remedy=f"add the public key of {t.key_source} to ~{t.user}/.ssh/authorized_keys on {t.host}, "
               "or fix user/key_file/key_secret in the node config")
