"""One Node per fleet node per process, shared by the tasks of a run (one SSH connection, its forwards)."""

from __future__ import annotations

import threading

from blocks.credentials import PrefectCredentials
from fleet.config import FleetConfig
from fleet.node import Node, connect
from fleet.node.credentials import install

# Every process that runs a fleet flow reads node blocks and key secrets from Prefect, including
# the core code the flows call directly (the multi-node controller connects on its own).
install(PrefectCredentials())

_lock = threading.Lock()
_nodes: dict[tuple[str, str], Node] = {}


def node_for(cfg: FleetConfig, name: str) -> Node:
    key = (cfg.fingerprint(), name)
    with _lock:
        node = _nodes.get(key)
        if node is None:
            node_cfg = cfg.node(name)
            node = _nodes[key] = connect(node_cfg, PrefectCredentials())
        return node


def close_all() -> None:
    with _lock:
        for node in _nodes.values():
            node.close_forwards()
            node.close()
        _nodes.clear()
