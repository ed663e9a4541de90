"""Teardown: stop every server of the fleet on every node (pid files, whole process groups).

A teardown leaves a marker on each node, `<workdir>/teardown/<fleet>.json` (when, which
run); bring-up removes it (tasks/bringup.py provision). Revalidation of a node that holds
the marker and runs none of the fleet's servers reports "nothing is up (torn down at …)"
and ends Completed: the revalidate schedule goes on, and says why there is nothing to
check, instead of alerting every 30 minutes about servers that were stopped on purpose.
"""

from __future__ import annotations

import json
import posixpath
import time
from typing import Any

from prefect import task

from fleet.config import FleetConfig, NodeConfig
from fleet.node import Node
from fleet.servers import stop_servers
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS


def marker_path(node_cfg: NodeConfig, fleet: str) -> str:
    # Not under servers/: launch records are globbed there as `<fleet>-*.json`.
    return posixpath.join(node_cfg.workdir, "teardown", f"{fleet}.json")


def mark_torn_down(node: Node, node_cfg: NodeConfig, fleet: str, stopped: int) -> None:
    from prefect.runtime import flow_run

    node.write_text(marker_path(node_cfg, fleet), json.dumps({"fleet": fleet, "at": time.time(), "by": flow_run.name, "stopped": stopped}))


def clear_torn_down(node: Node, node_cfg: NodeConfig, fleet: str) -> None:
    node.run(["rm", "-f", marker_path(node_cfg, fleet)], check=False, timeout=30)


def torn_down(node: Node, node_cfg: NodeConfig, fleet: str) -> dict[str, Any] | None:
    """The node's teardown marker for this fleet ({"at", "by", ...}), or None."""
    text = node.read_text(marker_path(node_cfg, fleet))
    try:
        marker = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("at"), int | float) else None


def describe(marker: dict[str, Any]) -> str:
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(marker["at"]))
    return f"torn down at {at}" + (f" by {marker['by']}" if marker.get("by") else "")


@task(name="stop-servers", task_run_name="stop-servers-{node_name}", **TASK_OPTS)
def stop_node(cfg: FleetConfig, node_name: str) -> list[dict[str, Any]]:
    node_cfg = cfg.node(node_name)
    node = node_for(cfg, node_name)
    rows = stop_servers(node, cfg, node_cfg)
    if not any(str(r["action"]).startswith("error") for r in rows):
        mark_torn_down(node, node_cfg, cfg.name, sum(1 for r in rows if r["action"] in ("stopped", "killed")))
    return rows


def teardown(cfg: FleetConfig) -> list[dict[str, Any]]:
    futs = [stop_node.submit(cfg, n.name) for n in cfg.nodes]
    return [row for f in futs for row in f.result()]
