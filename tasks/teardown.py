"""Teardown: stop every server of the fleet on every node (pid files, whole process groups),
after the fleet's generation runners there (a clean SIGTERM stop: a live runner would relaunch
the servers; the same `fleet generate` resumes the job).

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
from fleet.stages import TeardownRow
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS


@task(name="stop-servers", task_run_name="stop-servers-{node_name}", **TASK_OPTS)
def stop_node(cfg: FleetConfig, node_name: str) -> list[TeardownRow]:
    from prefect.runtime import flow_run

    node_cfg = cfg.node(node_name)
    node = node_for(cfg, node_name)
    return torndown.tear_down(node, cfg, node_cfg, by=flow_run.name)


def teardown(cfg: FleetConfig) -> list[TeardownRow]:
    futs = [stop_node.submit(cfg, n.name) for n in cfg.nodes]
    return [row for fut in futs for row in fut.result()]  # bounded: a task's own waits all have timeouts (tests/test_waits.py)
