"""What an SSH node connects to: `SSHTarget`, resolved once from the node config, the
credential store it names (a fleet-node block, a key secret) and key files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from fleet.errors import ConfigError
from fleet.node.credentials import CredentialSource
from fleet.node.credentials import current as current_credentials
from fleet.node.ssh.keys import load_private_key

if TYPE_CHECKING:
    from fleet.config import NodeConfig

__all__ = ["SSHTarget", "resolve"]


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


def resolve(cfg: NodeConfig, credentials: CredentialSource | None = None) -> tuple[SSHTarget, str]:
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

