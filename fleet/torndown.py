"""The teardown marker: "this fleet was stopped on purpose on this node, at …, by …".

`<workdir>/teardown/<fleet>.json`, written by a teardown (the `teardown` action, `fleet down`)
before it stops anything, kept once every runner and server of the fleet on the node is stopped
(removed when one could not be), removed by a bring-up. While it is there no generation runner
relaunches a server of the fleet on the node (fleet.generation.job.relaunch). Revalidation
reads it: a node that holds it and runs none of the fleet's servers has nothing to check,
and says so instead of reporting every server as down (tasks/revalidate.py).
"""

from __future__ import annotations

import json
import posixpath
import time
from typing import Any

from fleet.config import FleetConfig, NodeConfig
from fleet.node import Node
from fleet.servers import stop_jobs, stop_servers
from fleet.stages import TeardownRow


def marker_path(node_cfg: NodeConfig, fleet: str) -> str:
    # Not under servers/: launch records are globbed there as `<fleet>-*.json`.
    return posixpath.join(node_cfg.workdir, "teardown", f"{fleet}.json")


def mark(node: Node, node_cfg: NodeConfig, fleet: str, *, stopped: int, by: str | None) -> None:
    node.write_text(marker_path(node_cfg, fleet),
                    json.dumps({"fleet": fleet, "at": time.time(), "by": by, "stopped": stopped}))


def tear_down(node: Node, cfg: FleetConfig, node_cfg: NodeConfig, *, by: str | None) -> list[TeardownRow]:
    """The teardown of one node (the `teardown` action and `fleet down` alike): the fleet's
    generation runners first (a live runner relaunches a server stopped under it), then every
    server; the marker is kept only when nothing failed.

    The marker is written first too: no runner relaunches a server of the fleet while it is there
    (fleet.generation.job.relaunch), and a runner can start while the servers are being stopped
    (a multi-node controller hands the stopped chunk back and starts the next one on the node)."""
    mark(node, node_cfg, cfg.name, stopped=0, by=by)
    try:
        rows = [TeardownRow.of_job(r) for r in stop_jobs(node, cfg, node_cfg)]
        rows += [TeardownRow.of_server(r) for r in stop_servers(node, cfg, node_cfg)]
    except Exception:
        clear(node, node_cfg, cfg.name)
        raise
    if any(r.failed for r in rows):
        clear(node, node_cfg, cfg.name)
    else:
        mark(node, node_cfg, cfg.name, stopped=sum(1 for r in rows if r.is_server and r.stopped), by=by)
    return rows


def clear(node: Node, node_cfg: NodeConfig, fleet: str) -> None:
    node.run(["rm", "-f", marker_path(node_cfg, fleet)], check=False, timeout=30)


def read(node: Node, node_cfg: NodeConfig, fleet: str) -> dict[str, Any] | None:
    """The node's marker for this fleet ({"at", "by", ...}), or None."""
    text = node.read_text(marker_path(node_cfg, fleet))
    try:
        marker = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("at"), int | float) else None


def describe(marker: dict[str, Any]) -> str:
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(marker["at"]))
    return f"torn down at {at}" + (f" by {marker['by']}" if marker.get("by") else "")
