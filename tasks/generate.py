"""The generate stage: start (or re-attach to) the detached runner on the node and watch it.

The task only watches (fleet/generation/job/follow.py, which the quick `fleet generate` of
flows/quickgen.py shares): the runner writes the data and outlives this task, the flow and the
SSH connection. Killing the flow mid-job and running it again re-attaches to the same
runner (its pid file), never a second one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from fleet.config import FleetConfig
from fleet.engines import ServerSpec
from fleet.generation.job.endpoints import endpoint_keys
from fleet.generation.job.follow import follow, input_on_node
from fleet.generation.job.remote import start_job
from fleet.stages import Generated
from tasks.audit import artifact_key, write_stage, write_table
from tasks.charts import write_throughput_artifact
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS


def node_input(cfg: FleetConfig, node_name: str, input_path: str) -> str:
    """The input as a path on the node: a local file is uploaded to SSH nodes (once per size+mtime)."""
    return input_on_node(node_for(cfg, node_name), cfg.node(node_name), input_path)


class _TaskRecords:
    """A follow's records inside the task run: Prefect's logger and artifact API."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg, self.logger = cfg, get_run_logger()

    def info(self, message: str) -> None:
        self.logger.info("%s", message)

    def error(self, message: str) -> None:
        self.logger.error("%s", message)

    def progress(self, key_parts: tuple[object, ...], description: str) -> Callable[[float], None]:
        # Called from sync code it returns the id (its type also covers async callers' coroutine).
        progress_id = cast(UUID, create_progress_artifact(0.0, key=artifact_key(self.cfg, *key_parts),
                                                          description=description))

        def move(percent: float) -> None:
            update_progress_artifact(progress_id, percent)
        return move

    def table(self, key_parts: tuple[object, ...], rows: list[dict[str, Any]], description: str) -> None:
        write_table(self.cfg, key_parts, rows, description)

    def throughput(self, series: list[dict[str, Any]], per_server: dict[str, Any],
                   key_parts: tuple[object, ...]) -> None:
        write_throughput_artifact(self.cfg, series, per_server, key_parts=key_parts)

    def stage(self, key_parts: tuple[object, ...], title: str, *, ok: bool, seconds: float,
              result: dict[str, Any], log: str | None) -> None:
        write_stage(self.cfg, key_parts, title, ok=ok, seconds=seconds, result=result, log=log)


@task(name="generate", task_run_name="generate-{node_name}", **TASK_OPTS)
def generate(cfg: FleetConfig, node_name: str, specs: list[ServerSpec], facts: dict[int, dict[str, Any]],
             input_path: str, output: str, retry_errors: bool = False) -> Generated:
    node = node_for(cfg, node_name)
    node_cfg = cfg.node(node_name)
    t0 = time.monotonic()
    remote_input = node_input(cfg, node_name, input_path)
    handle = start_job(node, cfg, node_cfg, input_path=remote_input, output=output, specs=specs,
                       retry_errors=retry_errors, facts=facts, endpoint_keys=endpoint_keys(cfg))
    return follow(cfg, node, node_name, handle, output, t0, _TaskRecords(cfg))
