"""Where an SSH node's connection and key come from when the config names a store.

The core never reads a credential store itself: a node config may name a stored node
(`block = "gpu-1"`) or a stored key (`key_secret = "gpu-1-key"`), and the layer that
runs fleet supplies a `CredentialSource` that can look those names up (the Prefect layer
reads its blocks: `blocks/credentials.py`). It is passed to `fleet.node.connect`, or
installed once per process with `install` by the entry point (`flows/cli.py`, the tasks).
Without one, a config that names a store is refused with one clear line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fleet.errors import ConfigError

__all__ = ["CredentialSource", "StoredNode", "current", "install"]


@dataclass(frozen=True)
class StoredNode:
    """What a stored node (a fleet-node block) supplies; the config's own fields override it."""

    host: str
    port: int = 22
    user: str | None = None
    private_key: str | None = None      # key text; None: the config's key_file / key_secret, or the agent
    host_key: str | None = None         # pinned 'ssh-ed25519 AAAA…'
    known_hosts_path: str | None = None
    workdir: str | None = None


class CredentialSource(Protocol):
    """Looks up a node or a key by the name a config gives. Raises ConfigError when it cannot."""

    def node(self, name: str) -> StoredNode: ...

    def secret(self, name: str) -> str: ...


class _NoStore:
    """The default: nothing installed, so a named store cannot be read."""

    def node(self, name: str) -> StoredNode:
        raise ConfigError(f"the node config names the fleet-node block {name!r}, but no credential store is set up "
                          "in this process", remedy="run it through the `fleet` command or a Prefect task "
                                                    "(they read Prefect blocks), or give host/key_file in the config")

    def secret(self, name: str) -> str:
        raise ConfigError(f"the node config names the key secret {name!r}, but no credential store is set up "
                          "in this process", remedy="run it through the `fleet` command or a Prefect task "
                                                    "(they read Prefect blocks), or give key_file in the config")


_installed: CredentialSource = _NoStore()


def install(source: CredentialSource) -> None:
    """Make `source` the credential store of this process (the entry point calls this once)."""
    global _installed
    _installed = source


def current() -> CredentialSource:
    return _installed
