"""Node access: one seam (`Node`), two transports (local subprocess, SSH via paramiko)."""

from __future__ import annotations

from fleet.config import NodeConfig
from fleet.node.base import Detached, Node, PortForward, RunResult, StopResult, describe
from fleet.node.credentials import CredentialSource
from fleet.node.local import LocalNode

__all__ = ["Detached", "LocalNode", "Node", "PortForward", "RunResult", "StopResult", "connect", "describe"]


def connect(cfg: NodeConfig, credentials: CredentialSource | None = None) -> Node:
    """A Node for this config (SSH connects lazily, on first use). A block or key secret the
    config names is read from `credentials`, else from the store installed in this process."""
    if cfg.kind == "local":
        return LocalNode(cfg.name)
    from fleet.node.ssh import SSHNode

    return SSHNode.from_config(cfg, credentials)
