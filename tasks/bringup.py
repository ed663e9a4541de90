"""Thin Prefect tasks over the core: call it, retry what is transient, write the artifacts.

No task caching: re-runs are cheap because every stage adopts what is already in place
(venv hash stamp, staging manifest, live server with the same launch hash).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from prefect import get_run_logger, task

from fleet import bringup as steps
from fleet.config import FleetConfig
from fleet.engines import ServerSpec
from fleet.errors import FleetError
from fleet.stages import Launched, ModelPlace, Provisioned, Smoked, StageOutcome
from fleet.venv import VenvResult
from tasks.audit import write_stage
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS

R = TypeVar("R", bound=StageOutcome)


def _audited(cfg: FleetConfig, key_parts: tuple[object, ...], title: str,
             body: Callable[[], tuple[R, str | None]]) -> R:
    """Run a stage; write its artifact (from its result, timed) whether it succeeds or fails."""
    logger = get_run_logger()
    t0 = time.monotonic()
    try:
        result, log = body()
    except FleetError as exc:
        seconds = time.monotonic() - t0
        write_stage(cfg, key_parts, title, ok=False, seconds=seconds, error=str(exc))
        logger.error("%s failed after %.1f s: %s", title, seconds, exc)
        exc.logged = True
        raise
    seconds = time.monotonic() - t0
    write_stage(cfg, key_parts, title, ok=True, seconds=seconds,
                result=result.as_dict() | {"seconds": round(seconds, 3)}, log=log)
    logger.info("%s: done in %.2f s%s", title, seconds, " (adopted what was in place)" if result.adopted else "")
    return result


@task(name="provision", task_run_name="provision-{node_name}", **TASK_OPTS)
def provision(cfg: FleetConfig, node_name: str) -> Provisioned:
    """Preflight the node; hard failures stop this node here, with the reason."""
    return _audited(cfg, (node_name, "provision"), f"provision {node_name}",
                    lambda: steps.provision_body(node_for(cfg, node_name), cfg, node_name))


@task(name="venv", task_run_name="venv-{node_name}", **TASK_OPTS)
def venv(cfg: FleetConfig, node_name: str, provisioned: Provisioned) -> VenvResult:
    """Create or adopt the engine venv on local disk; time the engine import."""
    return _audited(cfg, (node_name, "venv"), f"venv {node_name}",
                    lambda: steps.venv_body(node_for(cfg, node_name), cfg, node_name, provisioned, get_run_logger()))


@task(name="stage", task_run_name="stage-{node_name}", **TASK_OPTS)
def stage(cfg: FleetConfig, node_name: str, provisioned: Provisioned) -> ModelPlace:
    """Copy the model once to the node's RAM disk (or serve it from its source when staging is off)."""
    return _audited(cfg, (node_name, "stage"), f"stage {node_name}",
                    lambda: steps.stage_body(node_for(cfg, node_name), cfg, node_name))


@task(name="retire", task_run_name="retire-{node_name}", **TASK_OPTS)
def retire(cfg: FleetConfig, node_name: str, planned: list[int]) -> list[dict[str, Any]]:
    """Stop the node's recorded servers whose slot the config no longer plans (before any launch:
    their GPUs and ports may be the new slots')."""
    return steps.retire_body(node_for(cfg, node_name), cfg, node_name, planned, get_run_logger())


@task(name="launch", task_run_name="launch-{spec.node}-{spec.index}", **TASK_OPTS)
def launch_server(cfg: FleetConfig, spec: ServerSpec) -> Launched:
    """Start (or adopt) one server and wait until it is ready, failing at once on death or a fatal line."""
    return _audited(cfg, (spec.node, "server", spec.index, "launch"), f"launch {spec.node} server {spec.index}",
                    lambda: steps.launch_body(node_for(cfg, spec.node), cfg, spec))


@task(name="smoke", task_run_name="smoke-{spec.node}-{spec.index}", **TASK_OPTS)
def smoke_server(cfg: FleetConfig, spec: ServerSpec, launched: Launched) -> Smoked:
    """One chat completion (first-request timeout, backoff with jitter), then the server's own info —
    unless a live job's progress proves the adopted server serves (fleet/bringup.py `job_proof_of`)."""
    return _audited(cfg, (spec.node, "server", spec.index, "smoke"), f"smoke {spec.node} server {spec.index}",
                    lambda: steps.smoke_body(node_for(cfg, spec.node), cfg, spec, launched, get_run_logger()))


# The task functions' Prefect keys (name and code hash), for the adopt-only `fleet up`, which records
# its task runs without importing Prefect (flows/quickup.py reads them from a file the flow's path writes).
TASKS = {"provision": provision, "venv": venv, "stage": stage, "retire": retire, "launch": launch_server,
         "smoke": smoke_server}
