"""Host-key checking: a pinned `host_key`, else known_hosts (with optional trust on first use).

A changed or unknown key is fatal (`HostKeyError`), never retried: it is either a reinstalled
node, which a person must confirm out of band, or someone intercepting the connection.
"""

from __future__ import annotations

import logging
from pathlib import Path

import paramiko

from fleet.errors import HostKeyError
from fleet.node.ssh.keys import (algorithms_for, fingerprint, fingerprint_b64, known_hosts_name,
                                 parse_public_key)
from fleet.node.ssh.target import SSHTarget

log = logging.getLogger("fleet.node.ssh")

__all__ = ["prefer_known_key_type", "verify_host_key"]


def known_hosts_path(target: SSHTarget) -> Path:
    return Path(target.known_hosts or "~/.ssh/known_hosts").expanduser()


def known_keys(target: SSHTarget, host: str) -> dict[str, paramiko.PKey]:
    path = known_hosts_path(target)
    keys = paramiko.HostKeys()
    if path.exists():
        try:
            keys.load(str(path))
        except OSError as exc:
            raise HostKeyError(f"cannot read known_hosts {path}: {exc.strerror}", host=host,
                               remedy="fix the file's permissions or point known_hosts at another file") from exc
    entry = keys.lookup(known_hosts_name(target.host, target.port))
    return dict(entry) if entry is not None else {}


def prefer_known_key_type(target: SSHTarget, host: str, transport: paramiko.Transport) -> None:
    # Ask the server for the key type we can verify; otherwise a host with several host
    # keys may offer another type and look "changed".
    if target.host_key:
        wanted = parse_public_key(target.host_key, source="host_key")[0]
    else:
        known = known_keys(target, host)
        if not known:
            return
        wanted = next(iter(known))
    opts = transport.get_security_options()
    first = [a for a in algorithms_for(wanted) if a in opts.key_types]
    opts.key_types = first + [a for a in opts.key_types if a not in first]


def verify_host_key(target: SSHTarget, host: str, key: paramiko.PKey) -> None:
    t = target
    name = known_hosts_name(t.host, t.port)
    offered = f"{fingerprint(key)} ({key.get_name()})"
    if t.host_key:
        key_type, b64 = parse_public_key(t.host_key, source="host_key")
        if key.get_name() != key_type or key.get_base64() != b64:
            raise HostKeyError(
                f"host key for {name} does not match the pinned host_key: pinned {fingerprint_b64(b64)} ({key_type}), "
                f"server offered {offered}", host=host,
                remedy="if the node was reinstalled or its host key rotated, check the new fingerprint out of band "
                       "(ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub on the node) and update host_key; "
                       "otherwise someone may be intercepting the connection")
        return
    path = known_hosts_path(target)
    known = known_keys(target, host)
    if not known:
        if t.trust_on_first_use:
            _remember(host, path, name, key)
            return
        raise HostKeyError(
            f"host key for {name} is unknown (server offered {offered}) and trust_on_first_use is off",
            host=host,
            remedy=f"check the fingerprint out of band, then add it: ssh-keyscan -p {t.port} {t.host} >> {path}; "
                   "or set host_key = '<key type> <base64>' in the node config, or trust_on_first_use = true once")
    expected = known.get(key.get_name())
    if expected is None or expected.get_base64() != key.get_base64():
        shown = expected or next(iter(known.values()))
        raise HostKeyError(
            f"host key for {name} does not match {path}: known {fingerprint(shown)} ({shown.get_name()}), "
            f"server offered {offered}", host=host,
            remedy=f"if the node was reinstalled or its host key rotated, check the new fingerprint out of band, "
                   f"then remove the old entry (ssh-keygen -R '{name}' -f {path}) and reconnect; "
                   "otherwise someone may be intercepting the connection")


def _remember(host: str, path: Path, name: str, key: paramiko.PKey) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        with path.open("a") as fh:  # one short append: safe next to other writers
            fh.write(("\n" if needs_newline else "") + f"{name} {key.get_name()} {key.get_base64()}\n")
    except OSError as exc:
        raise HostKeyError(f"cannot record the host key in {path}: {exc.strerror}", host=host,
                           remedy="make the known_hosts file writable or pin host_key in the config") from exc
    log.warning("[%s] trusting new host key %s %s on first use; recorded in %s",
                host, key.get_name(), fingerprint(key), path)
