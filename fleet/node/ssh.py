"""The SSH node: paramiko on a socket we open ourselves.

One `paramiko.Transport` per node, opened lazily on first use and reopened on the next
call after it drops. Every command is one `exec` channel carrying `shlex.join(argv)`
(quoted exactly once, here). Timeouts are enforced twice: remotely by wrapping the
argv in `timeout --kill-after=5`, so the command dies with its deadline, and locally
by a deadline 15 s later, in case the node stops answering.

Errors leave this module only as fleet errors (see `fleet.errors`):

    socket refused / reset / DNS / TCP timeout  -> NodeUnreachable (after fast retries)
    host key unknown or changed                 -> HostKeyError
    key refused                                 -> AuthFailed
    bad key text, bad pinned host key           -> ConfigError
    connection dropped while a command ran      -> ConnectionLost (next call reconnects)
    past the deadline / exit 124 from `timeout` -> CommandTimeout
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import io
import logging
import os
import posixpath
import re
import selectors
import shlex
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paramiko
from paramiko.common import MSG_CHANNEL_REQUEST

from fleet.backoff import backoff_delay
from fleet.errors import (
    AuthFailed,
    CommandFailed,
    CommandTimeout,
    ConfigError,
    ConnectionLost,
    FleetError,
    HostKeyError,
    NodeUnreachable,
)
from fleet.node.base import Node, PortForward, RunResult
from fleet.node.credentials import CredentialSource
from fleet.node.credentials import current as current_credentials

if TYPE_CHECKING:
    from fleet.config import NodeConfig

log = logging.getLogger("fleet.node.ssh")

__all__ = ["SSHNode", "SSHTarget", "fingerprint", "load_private_key", "remote_argv"]

# The client-side deadline trails the remote `timeout` so the remote kill (TERM, then
# KILL 5 s later) normally wins and we get its exit code and output.
CLIENT_GRACE_S = 15.0
REMOTE_KILL_AFTER_S = 5
# OpenSSH's default MaxSessions is 10 per connection; past it sshd refuses new channels.
MAX_SESSIONS = 8
CONNECT_ATTEMPTS = 3
RETRY_BASE_S, RETRY_FACTOR = 0.2, 3.0   # 0.2 s, then 0.6 s
_BUF = 65536
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY_CLASSES: tuple[type[paramiko.PKey], ...] = (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey)
_DEFAULT_KEY_FILES = ("id_ed25519", "id_ecdsa", "id_rsa")


# -- pure helpers ---------------------------------------------------------------------------

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
        bad = [k for k in env if not _ENV_KEY.match(k)]
        if bad:
            raise ConfigError(f"invalid environment variable names: {bad}",
                              remedy="use names made of letters, digits and '_', not starting with a digit")
        out = ["env", *[f"{k}={v}" for k, v in env.items()], *out]
    return out


def _seconds(value: float) -> str:
    # `timeout 0` means "no limit", so never round down to 0.
    return f"{max(value, 0.001):.3f}".rstrip("0").rstrip(".")


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style fingerprint, e.g. 'SHA256:abc…' (what `ssh-keygen -lf` prints)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _fingerprint_b64(b64: str) -> str:
    digest = hashlib.sha256(base64.b64decode(b64)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_private_key(text: str, *, source: str) -> paramiko.PKey:
    """Parse an ed25519, ECDSA or RSA private key (OpenSSH or PEM text)."""
    # Keys pasted into env vars or UI fields often arrive with literal "\n" or CRLF.
    if "\\n" in text and "\n" not in text.strip():
        text = text.replace("\\n", "\n")
    text = text.replace("\r\n", "\n").strip() + "\n"
    for cls in _KEY_CLASSES:
        try:
            return cls.from_private_key(io.StringIO(text))
        except paramiko.PasswordRequiredException:
            raise ConfigError(f"the private key from {source} is encrypted with a passphrase",
                              remedy="give fleet an unencrypted key (e.g. a deploy key kept in a Prefect Secret)") from None
        except (paramiko.SSHException, ValueError, TypeError, IndexError):
            continue
    raise ConfigError(f"cannot parse the private key from {source} (tried ed25519, ecdsa, rsa)",
                      remedy="give the full private key text, '-----BEGIN … PRIVATE KEY-----' through the END line")


def _parse_public_key(text: str, *, source: str) -> tuple[str, str]:
    """(key type, base64) from 'ssh-ed25519 AAAA… [comment]' or a known_hosts line."""
    tokens = text.split()
    for i, tok in enumerate(tokens[:-1]):
        if tok.startswith(("ssh-", "ecdsa-", "sk-")):
            b64 = tokens[i + 1]
            try:
                base64.b64decode(b64, validate=True)
            except ValueError:
                break
            return tok, b64
    raise ConfigError(f"cannot parse the host key {text!r} from {source}",
                      remedy="give it as 'ssh-ed25519 AAAA…' (a line of the host's /etc/ssh/ssh_host_*_key.pub)")


def _known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _algorithms_for(key_type: str) -> list[str]:
    # An RSA host key is offered under the rsa-sha2-* signature names.
    return ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if key_type == "ssh-rsa" else [key_type]


# -- what to connect to ------------------------------------------------------------------------

@dataclass(frozen=True)
class SSHTarget:
    """Everything needed to open the connection, resolved from config, secrets and blocks."""

    host: str
    port: int = 22
    user: str = ""
    key: paramiko.PKey | None = None  # None: try ssh-agent, then ~/.ssh/id_{ed25519,ecdsa,rsa}
    key_source: str = "ssh-agent / ~/.ssh default keys"
    host_key: str | None = None  # pinned 'ssh-ed25519 AAAA…'
    known_hosts: Path | None = None
    trust_on_first_use: bool = False
    connect_timeout_s: float = 15.0
    keepalive_s: int = 15


def _local_user() -> str:
    import getpass

    return getpass.getuser()


def _resolve(cfg: NodeConfig, credentials: CredentialSource | None = None) -> tuple[SSHTarget, str]:
    """The SSH target and node workdir for a config (asks `credentials` when it names a block or secret)."""
    store = credentials or current_credentials()
    host, port, user, host_key = cfg.host, cfg.port, cfg.user, cfg.host_key
    known_hosts, workdir = cfg.known_hosts, cfg.workdir
    key: paramiko.PKey | None = None
    key_source = "ssh-agent / ~/.ssh default keys"
    if cfg.block:
        block = store.node(cfg.block)
        # The block supplies the connection; a field set explicitly in the config overrides it.
        host = cfg.host or block.host
        port = cfg.port if "port" in cfg.model_fields_set else block.port
        user = cfg.user or block.user
        host_key = cfg.host_key or block.host_key
        known_hosts = cfg.known_hosts or (Path(block.known_hosts_path) if block.known_hosts_path else None)
        if "workdir" not in cfg.model_fields_set and block.workdir:
            workdir = block.workdir
        if block.private_key is not None and not (cfg.key_file or cfg.key_secret):
            key_source = f"fleet-node block {cfg.block!r}"
            key = load_private_key(block.private_key, source=key_source)
    if cfg.key_file:
        key_source = f"key file {cfg.key_file}"
        key = load_private_key(_read_key_file(Path(cfg.key_file).expanduser()), source=key_source)
    elif cfg.key_secret:
        key_source = f"Prefect Secret block {cfg.key_secret!r}"
        key = load_private_key(store.secret(cfg.key_secret), source=key_source)
    if not host:
        raise ConfigError(f"node {cfg.name!r} has no SSH host", remedy="set 'host' in the node config or its fleet-node block")
    target = SSHTarget(host=host, port=port, user=user or _local_user(), key=key, key_source=key_source,
                       host_key=host_key, known_hosts=known_hosts, trust_on_first_use=cfg.trust_on_first_use,
                       connect_timeout_s=cfg.connect_timeout_s, keepalive_s=cfg.keepalive_s)
    return target, workdir


def _read_key_file(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the SSH key file {path}: {exc.strerror}",
                          remedy="check key_file in the node config points to a readable private key") from exc


# -- exit-signal ------------------------------------------------------------------------------

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
    paramiko.Channel._handle_request(chan, m)


class _Transport(paramiko.Transport):
    _channel_handler_table = {**paramiko.Transport._channel_handler_table,
                              MSG_CHANNEL_REQUEST: _handle_channel_request}


# -- the node ---------------------------------------------------------------------------------

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
        self._forwards: set[_Forwarder] = set()

    @classmethod
    def from_config(cls, cfg: NodeConfig, credentials: CredentialSource | None = None) -> SSHNode:
        """Build from a NodeConfig (a block or secret it names comes from `credentials`, else the
        installed store; no connection yet)."""
        target, workdir = _resolve(cfg, credentials)
        return cls(target, name=cfg.name, workdir=workdir)

    def __repr__(self) -> str:
        t = self.target
        return f"SSHNode({self.name!r}, {t.user}@{t.host}:{t.port})"

    # -- connection ------------------------------------------------------------------------
    def connect(self) -> paramiko.Transport:
        """The live transport, (re)connecting when there is none or it dropped."""
        with self._lock:
            if not _dead(self._transport):
                assert self._transport is not None
                return self._transport
            self._drop_transport()
            self._transport, self._sock = self._connect_with_retries()
            return self._transport

    @property
    def connected(self) -> bool:
        return not _dead(self._transport)

    def _connect_with_retries(self) -> tuple[paramiko.Transport, socket.socket]:
        for attempt in range(CONNECT_ATTEMPTS):
            started = time.monotonic()
            try:
                return self._connect_once()
            except NodeUnreachable as exc:
                # Only fast failures (refused, reset) are retried here: a slow one (a timeout)
                # would multiply the wait; the caller's own retries cover those.
                if attempt == CONNECT_ATTEMPTS - 1 or time.monotonic() - started > 2.0:
                    raise
                delay = backoff_delay(attempt + 1, RETRY_BASE_S, factor=RETRY_FACTOR)
                log.info("[%s] %s; retrying in %.1f s", self.host, exc.reason, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _connect_once(self) -> tuple[paramiko.Transport, socket.socket]:
        t = self.target
        sock = self._open_socket()
        transport = _Transport(sock)
        try:
            transport.banner_timeout = transport.handshake_timeout = t.connect_timeout_s
            transport.auth_timeout = t.connect_timeout_s
            self._prefer_known_key_type(transport)
            try:
                transport.start_client(timeout=t.connect_timeout_s)
            except paramiko.IncompatiblePeer as exc:
                raise ConfigError(f"cannot agree on SSH algorithms with {t.host}:{t.port}: {exc}",
                                  host=self.host, remedy="upgrade paramiko or the node's OpenSSH") from exc
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise self._unreachable(f"SSH handshake with {t.host}:{t.port} failed: {exc or type(exc).__name__}",
                                        exc) from exc
            self._verify_host_key(transport.get_remote_server_key())
            self._authenticate(transport)
            if t.keepalive_s:
                transport.set_keepalive(t.keepalive_s)
            return transport, sock
        except BaseException:
            transport.close()
            sock.close()
            raise

    def _open_socket(self) -> socket.socket:
        t = self.target
        try:
            sock = socket.create_connection((t.host, t.port), timeout=t.connect_timeout_s)
        except socket.gaierror as exc:
            raise self._unreachable(f"cannot resolve {t.host}: {exc.strerror}", exc) from exc
        except OSError as exc:
            raise self._unreachable(f"cannot connect to {t.host}:{t.port}: {exc.strerror or exc}", exc) from exc
        # paramiko leaves Nagle on: every command would wait ~40 ms for delayed ACKs.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _unreachable(self, reason: str, exc: BaseException) -> NodeUnreachable:
        t = self.target
        return NodeUnreachable(reason, host=self.host,
                               remedy=f"check that {t.host} is up, sshd listens on port {t.port} and no firewall blocks it; "
                                      "fleet retries this")

    # -- host key ------------------------------------------------------------------------------
    def _known_hosts_path(self) -> Path:
        return Path(self.target.known_hosts or "~/.ssh/known_hosts").expanduser()

    def _known_keys(self) -> dict[str, paramiko.PKey]:
        path = self._known_hosts_path()
        keys = paramiko.HostKeys()
        if path.exists():
            try:
                keys.load(str(path))
            except OSError as exc:
                raise HostKeyError(f"cannot read known_hosts {path}: {exc.strerror}", host=self.host,
                                   remedy="fix the file's permissions or point known_hosts at another file") from exc
        entry = keys.lookup(_known_hosts_name(self.target.host, self.target.port))
        return dict(entry) if entry is not None else {}

    def _prefer_known_key_type(self, transport: paramiko.Transport) -> None:
        # Ask the server for the key type we can verify; otherwise a host with several host
        # keys may offer another type and look "changed".
        if self.target.host_key:
            wanted = _parse_public_key(self.target.host_key, source="host_key")[0]
        else:
            known = self._known_keys()
            if not known:
                return
            wanted = next(iter(known))
        opts = transport.get_security_options()
        first = [a for a in _algorithms_for(wanted) if a in opts.key_types]
        opts.key_types = first + [a for a in opts.key_types if a not in first]

    def _verify_host_key(self, key: paramiko.PKey) -> None:
        t = self.target
        name = _known_hosts_name(t.host, t.port)
        offered = f"{fingerprint(key)} ({key.get_name()})"
        if t.host_key:
            key_type, b64 = _parse_public_key(t.host_key, source="host_key")
            if key.get_name() != key_type or key.get_base64() != b64:
                raise HostKeyError(
                    f"host key for {name} does not match the pinned host_key: pinned {_fingerprint_b64(b64)} ({key_type}), "
                    f"server offered {offered}", host=self.host,
                    remedy="if the node was reinstalled or its host key rotated, check the new fingerprint out of band "
                           "(ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub on the node) and update host_key; "
                           "otherwise someone may be intercepting the connection")
            return
        path = self._known_hosts_path()
        known = self._known_keys()
        if not known:
            if t.trust_on_first_use:
                self._remember(path, name, key)
                return
            raise HostKeyError(
                f"host key for {name} is unknown (server offered {offered}) and trust_on_first_use is off",
                host=self.host,
                remedy=f"check the fingerprint out of band, then add it: ssh-keyscan -p {t.port} {t.host} >> {path}; "
                       "or set host_key = '<key type> <base64>' in the node config, or trust_on_first_use = true once")
        expected = known.get(key.get_name())
        if expected is None or expected.get_base64() != key.get_base64():
            shown = expected or next(iter(known.values()))
            raise HostKeyError(
                f"host key for {name} does not match {path}: known {fingerprint(shown)} ({shown.get_name()}), "
                f"server offered {offered}", host=self.host,
                remedy=f"if the node was reinstalled or its host key rotated, check the new fingerprint out of band, "
                       f"then remove the old entry (ssh-keygen -R '{name}' -f {path}) and reconnect; "
                       "otherwise someone may be intercepting the connection")

    def _remember(self, path: Path, name: str, key: paramiko.PKey) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            needs_newline = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
            with path.open("a") as fh:  # one short append: safe next to other writers
                fh.write(("\n" if needs_newline else "") + f"{name} {key.get_name()} {key.get_base64()}\n")
        except OSError as exc:
            raise HostKeyError(f"cannot record the host key in {path}: {exc.strerror}", host=self.host,
                               remedy="make the known_hosts file writable or pin host_key in the config") from exc
        log.warning("[%s] trusting new host key %s %s on first use; recorded in %s",
                    self.host, key.get_name(), fingerprint(key), path)

    # -- auth ------------------------------------------------------------------------------------
    def _candidate_keys(self) -> list[paramiko.PKey]:
        if self.target.key is not None:
            return [self.target.key]
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

    def _authenticate(self, transport: paramiko.Transport) -> None:
        t = self.target
        keys = self._candidate_keys()
        if not keys:
            raise AuthFailed(f"no SSH private key to offer {t.user}@{t.host}:{t.port}", host=self.host,
                             remedy="set key_file, key_secret or block in the node config (or load a key into ssh-agent)")
        for key in keys:
            try:
                transport.auth_publickey(t.user, key)
            except paramiko.AuthenticationException:
                continue
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise self._unreachable(f"connection to {t.host}:{t.port} dropped during authentication: {exc}", exc) from exc
            if transport.is_authenticated():
                return
        shown = f" {fingerprint(keys[0])}" if len(keys) == 1 else "s"
        raise AuthFailed(
            f"{t.user}@{t.host}:{t.port} refused the key{shown} from {t.key_source}", host=self.host,
            remedy=f"add the public key of {t.key_source} to ~{t.user}/.ssh/authorized_keys on {t.host}, "
                   "or fix user/key_file/key_secret in the node config")

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
                _quietly(chan.close)  # must not mask the error that ended the command
        finally:
            self._sessions.release()

    def _open_session(self, argv: Sequence[str]) -> paramiko.Channel:
        for attempt in range(2):
            transport = self.connect()
            try:
                return transport.open_session(timeout=self.target.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                # Nothing ran yet, so a transport that died since the check may be replaced once.
                if _dead(transport) and attempt == 0:
                    continue
                raise ConnectionLost(f"cannot open an SSH session: {exc or type(exc).__name__}", host=self.host,
                                     command=argv,
                                     remedy="the node refused a new channel (sshd MaxSessions?); fleet retries this") from exc
        raise AssertionError("unreachable")

    def _start(self, chan: paramiko.Channel, command: list[str], argv: Sequence[str]) -> None:
        line = shlex.join(command)
        log.debug("[%s] $ %s", self.host, line)
        try:
            chan.exec_command(line)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(argv, exc) from exc

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
            self._start(chan, command, argv)
            _send_input(chan, input)
            out, err = _collect(chan, deadline)
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
        if _dead(chan.get_transport()):
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
            _quietly(chan.shutdown_write)  # a dropped connection shows up in _lines / _exit_code
            for line in _lines(chan, deadline):
                if line is None:
                    raise self._timeout(argv, timeout, stderr="\n".join(tail))
                tail.append(line)
                yield line
            code = self._exit_code(chan, argv, deadline, timeout, "\n".join(tail))
        if timeout is not None and (code == 124 or (code == 137 and time.monotonic() - t0 >= timeout)):
            raise self._timeout(argv, timeout, stderr="\n".join(tail))
        self.raise_for(RunResult(self.host, tuple(argv), code, "", "\n".join(tail), time.monotonic() - t0))

    # -- files ---------------------------------------------------------------------------------
    @contextmanager
    def _sftp(self, what: Sequence[str]) -> Iterator[paramiko.SFTPClient]:
        with self._session(what, None) as chan:
            try:
                chan.invoke_subsystem("sftp")
                sftp = paramiko.SFTPClient(chan)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise self._lost(what, exc) from exc
            try:
                yield sftp
            except FleetError:
                raise
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if not self.connected:
                    raise self._lost(what, exc) from exc
                raise CommandFailed(f"{what[0]} failed: {exc}", host=self.host, command=what,
                                    remedy="check the paths exist and are writable on both sides") from exc
            finally:
                _quietly(sftp.close)

    def put(self, local: str | Path, remote: str) -> None:
        what = ["sftp-put", str(local), remote]
        local = Path(local)
        if not local.is_file():
            raise CommandFailed(f"cannot copy {local} to {remote}: no such local file", host=self.host, command=what,
                                remedy="check the local path")
        parent = posixpath.dirname(remote)
        if parent:
            self.run(["sh", "-c", 'umask 077 && mkdir -p -- "$1"', "fleet-mkdir", parent], timeout=60)
        tmp = f"{remote}.{_part_suffix()}"
        with self._sftp(what) as sftp:
            # Upload beside the target, then rename: a reader (or a concurrent upload of the
            # same file) never sees half a file.
            try:
                sftp.put(str(local), tmp)
                # fleet's files are 0600 (0700 when executable): never readable by others
                sftp.chmod(tmp, 0o700 if local.stat().st_mode & 0o111 else 0o600)
                try:
                    sftp.posix_rename(tmp, remote)
                except OSError:  # a server without the posix-rename extension
                    _remove_quietly(sftp, remote)
                    sftp.rename(tmp, remote)
            except BaseException:
                _remove_quietly(sftp, tmp)
                raise

    def get(self, remote: str, local: str | Path) -> None:
        what = ["sftp-get", remote, str(local)]
        local = Path(local)
        tmp = local.with_name(f"{local.name}.{_part_suffix()}")
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            with self._sftp(what) as sftp:
                sftp.get(remote, str(tmp))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    # -- ports ------------------------------------------------------------------------------------
    def forward_port(self, remote_port: int, remote_host: str = "127.0.0.1", local_port: int = 0) -> PortForward:
        fwd = _Forwarder(self, remote_host, remote_port, local_port)
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
                if _dead(transport) and attempt == 0:
                    continue
                raise self._lost(what, exc) from exc
        raise AssertionError("unreachable")

    def _forget(self, fwd: _Forwarder) -> None:
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


# -- channel I/O --------------------------------------------------------------------------------

def _dead(transport: paramiko.Transport | None) -> bool:
    # paramiko closes the channels of a dying transport before it clears `active`, so a
    # channel can look closed while the transport still looks alive: saved_exception tells.
    return transport is None or not transport.is_active() or transport.saved_exception is not None


def _quietly(close: Any) -> None:
    """Run a close/shutdown call on a connection that may already be gone."""
    try:
        close()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def _send_input(chan: paramiko.Channel, data: str | None) -> None:
    """Send stdin then EOF. In a thread when there is data: the command may fill its stdout
    (and our window) before it reads all its input."""
    if data is None:
        _quietly(chan.shutdown_write)  # a dropped connection shows up in _collect / _exit_code
        return

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


def _collect(chan: paramiko.Channel, deadline: float | None) -> tuple[bytes | None, bytes]:
    """All stdout and stderr, read together so neither pipe can fill and stall the command.
    stdout is None when the deadline passed."""
    out, err = bytearray(), bytearray()
    waiter = _Waiter(chan, deadline)
    try:
        while True:
            # EOF arrives after all data, so data seen once EOF is flagged is complete.
            done = chan.eof_received or chan.closed
            while chan.recv_ready():
                out += chan.recv(_BUF)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(_BUF)
            if done:
                return bytes(out), bytes(err)
            if not waiter.wait():
                return None, bytes(err)
    finally:
        waiter.close()


def _lines(chan: paramiko.Channel, deadline: float | None) -> Iterator[str | None]:
    """Lines of stdout as they arrive; a final None means the deadline passed."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending = ""
    waiter = _Waiter(chan, deadline)
    try:
        while True:
            done = chan.eof_received or chan.closed
            while chan.recv_ready():
                pending += decoder.decode(chan.recv(_BUF))
                *lines, pending = pending.split("\n")
                yield from lines
            if done:
                break
            if not waiter.wait():
                yield None
                return
    finally:
        waiter.close()
    pending += decoder.decode(b"", final=True)
    if pending:
        yield pending


def _part_suffix() -> str:
    return f"fleet-part-{os.getpid()}-{threading.get_ident()}"


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except (OSError, EOFError, paramiko.SSHException):
        pass


# -- port forwarding ----------------------------------------------------------------------------

class _Forwarder:
    """A loopback listener; each accepted connection becomes one direct-tcpip channel."""

    def __init__(self, node: SSHNode, remote_host: str, remote_port: int, local_port: int) -> None:
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
                client, addr = self._listener.accept()
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
                _quietly(chan.close)
                return
            self._tunnels.add(pair)
        try:
            _pump(client, chan, self._closed)
        finally:
            with self._tlock:
                self._tunnels.discard(pair)
            _quietly(chan.close)
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
            _quietly(chan.close)
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
                        data = client.recv(_BUF)
                        if data:
                            chan.sendall(data)
                            continue
                        chan.shutdown_write()
                    else:
                        data = chan.recv(_BUF)
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
