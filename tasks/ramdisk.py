"""Free the RAM-disk copy of the model (teardown with free_ramdisk=True): the Prefect task over
`fleet.staging.unstage`, which says what it removes and what it keeps."""

from __future__ import annotations

from prefect import task

from fleet.config import FleetConfig
from fleet.stages import TeardownRow
from fleet.staging import free_ramdisk as free_ramdisk_on
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS


@task(name="free-ramdisk", task_run_name="free-ramdisk-{node_name}", **TASK_OPTS)
def free_ramdisk(cfg: FleetConfig, node_name: str) -> TeardownRow:
    node_cfg = cfg.node(node_name)
    res = free_ramdisk_on(node_for(cfg, node_name), source=cfg.model.source, stage=cfg.model.stage,
                          ramdisk=node_cfg.ramdisk, fleet=cfg.name)
    return TeardownRow.of_ramdisk(node_name, res)
