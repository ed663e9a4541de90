"""Teardown: stop every server of the fleet on every node (pid files, whole process groups)."""

from __future__ import annotations

from typing import Any

from prefect import task

from fleet.config import FleetConfig
from fleet.servers import stop_servers
from tasks.bringup import TASK_OPTS
from tasks.nodes import node_for


@task(name="stop-servers", task_run_name="stop-servers-{node_name}", **TASK_OPTS)
def stop_node(cfg: FleetConfig, node_name: str) -> list[dict[str, Any]]:
    node_cfg = next(n for n in cfg.nodes if n.name == node_name)
    return stop_servers(node_for(cfg, node_name), cfg, node_cfg)


def teardown(cfg: FleetConfig) -> list[dict[str, Any]]:
    futs = [stop_node.submit(cfg, n.name) for n in cfg.nodes]
    return [row for f in futs for row in f.result()]
