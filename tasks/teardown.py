"""Teardown: stop every server of the fleet on every node (pid files, whole process groups).

A teardown leaves a marker on each node (fleet/torndown.py); bring-up removes it
(tasks/bringup.py provision). Revalidation of a node that holds the marker and runs none
of the fleet's servers reports "nothing is up (torn down at …)" and ends Completed: the
revalidate schedule goes on, and says why there is nothing to check, instead of alerting
every 30 minutes about servers that were stopped on purpose.
"""

from __future__ import annotations

from prefect import task

from fleet import torndown
from fleet.config import FleetConfig
from fleet.servers import stop_servers
from fleet.stages import TeardownRow
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS


@task(name="stop-servers", task_run_name="stop-servers-{node_name}", **TASK_OPTS)
def stop_node(cfg: FleetConfig, node_name: str) -> list[TeardownRow]:
    from prefect.runtime import flow_run

    node_cfg = cfg.node(node_name)
    node = node_for(cfg, node_name)
    rows = [TeardownRow.of_server(r) for r in stop_servers(node, cfg, node_cfg)]
    if not any(r.failed for r in rows):
        torndown.mark(node, node_cfg, cfg.name, stopped=sum(1 for r in rows if r.stopped), by=flow_run.name)
    return rows


def teardown(cfg: FleetConfig) -> list[TeardownRow]:
    futs = [stop_node.submit(cfg, n.name) for n in cfg.nodes]
    return [row for fut in futs for row in fut.result()]  # bounded: a task's own waits all have timeouts (tests/test_waits.py)
