"""Thin Prefect tasks over the core: call it, retry what is transient, write the artifacts.

No task caching: re-runs are cheap because every stage adopts what is already in place
(venv hash stamp, staging manifest, live server with the same launch hash).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from prefect import get_run_logger, task

from fleet.config import FleetConfig, SmokeConfig
from fleet.engines import ServerSpec, get_profile
from fleet.errors import FleetError, PreflightFailed
from fleet.node import Node
from fleet.preflight import gather
from fleet.servers import excerpt, launch, read_record, record_smoke, retire_unplanned, server_paths, wait_ready
from fleet.smoke import ServerWatch, fetch_server_info, max_running_requests, smoke
from fleet import torndown
from fleet.jobs import JobProof, job_proof
from fleet.stages import Launched, ModelPlace, Provisioned, Smoked, StageOutcome
from fleet.staging import stage_model
from fleet.venv import VenvResult, ensure_venv
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
    def body() -> tuple[Provisioned, str | None]:
        node_cfg = cfg.node(node_name)
        report = gather(node_for(cfg, node_name), cfg, node_cfg)
        if not report.reachable:
            from fleet.errors import NodeUnreachable
            raise NodeUnreachable(f"node {node_name} unreachable: {report.error}", host=report.host)
        failures = report.failures()
        if failures:
            raise PreflightFailed("; ".join(f"{c.name}: {c.detail}" for c in failures), host=report.host,
                                  remedy=" / ".join(c.remedy for c in failures if c.remedy))
        # A bring-up means the fleet should be up again: revalidation checks this node from now on.
        torndown.clear(node_for(cfg, node_name), node_cfg, cfg.name)
        return Provisioned.of(report, node_cfg), None
    return _audited(cfg, (node_name, "provision"), f"provision {node_name}", body)


@task(name="venv", task_run_name="venv-{node_name}", **TASK_OPTS)
def venv(cfg: FleetConfig, node_name: str, provisioned: Provisioned) -> VenvResult:
    """Create or adopt the engine venv on local disk; time the engine import."""
    def body() -> tuple[VenvResult, str | None]:
        node_cfg = cfg.node(node_name)
        module = cfg.engine.import_check or get_profile(cfg.engine.kind).default_import
        res = ensure_venv(node_for(cfg, node_name), cfg, node_cfg, module,
                          network_fs=provisioned.venv_network_fs)
        if res.slow_import:
            get_run_logger().warning("import of %s took %.1f s (> %.0f s): is the venv on a slow disk?",
                                     module, res.import_seconds, cfg.venv.slow_import_s)
        return res, None
    return _audited(cfg, (node_name, "venv"), f"venv {node_name}", body)


@task(name="stage", task_run_name="stage-{node_name}", **TASK_OPTS)
def stage(cfg: FleetConfig, node_name: str, provisioned: Provisioned) -> ModelPlace:
    """Copy the model once to the node's RAM disk (or serve it from its source when staging is off)."""
    def body() -> tuple[ModelPlace, str | None]:
        node_cfg = cfg.node(node_name)
        if not cfg.model.stage or not cfg.model.source:
            return ModelPlace(cfg.model.source), None
        res = stage_model(node_for(cfg, node_name), source=cfg.model.source, ramdisk=node_cfg.ramdisk, fleet=cfg.name,
                          workdir=node_cfg.workdir, streams=cfg.model.copy_streams, verify=cfg.model.verify,
                          margin_bytes=int(cfg.model.stage_margin_gb * 1e9))
        return ModelPlace(res.dst, res), None
    return _audited(cfg, (node_name, "stage"), f"stage {node_name}", body)


@task(name="retire", task_run_name="retire-{node_name}", **TASK_OPTS)
def retire(cfg: FleetConfig, node_name: str, planned: list[int]) -> list[dict[str, Any]]:
    """Stop the node's recorded servers whose slot the config no longer plans (before any launch:
    their GPUs and ports may be the new slots')."""
    retired = retire_unplanned(node_for(cfg, node_name), cfg, cfg.node(node_name), set(planned))
    for r in retired:
        get_run_logger().info("%s server %s (port %s, pid %s): no longer in the config: stopped", r["node"],
                              r["index"], r["port"], r["pid"] if r["pid"] is not None else "none alive")
    return retired


@task(name="launch", task_run_name="launch-{spec.node}-{spec.index}", **TASK_OPTS)
def launch_server(cfg: FleetConfig, spec: ServerSpec) -> Launched:
    """Start (or adopt) one server and wait until it is ready, failing at once on death or a fatal line."""
    def body() -> tuple[Launched, str | None]:
        node = node_for(cfg, spec.node)
        started = launch(node, cfg, spec)
        ready = wait_ready(node, cfg, spec, started.pid)
        return Launched(started, ready), ready.log_excerpt
    return _audited(cfg, (spec.node, "server", spec.index, "launch"), f"launch {spec.node} server {spec.index}", body)


@task(name="smoke", task_run_name="smoke-{spec.node}-{spec.index}", **TASK_OPTS)
def smoke_server(cfg: FleetConfig, spec: ServerSpec, launched: Launched) -> Smoked:
    """One chat completion (first-request timeout, backoff with jitter), then the server's own info —
    unless a live job's progress proves the adopted server serves (`_job_proof`)."""
    def body() -> tuple[Smoked, str | None]:
        node = node_for(cfg, spec.node)
        proof = _job_proof(cfg, node, spec, launched)
        if proof is not None and proof.proven:
            return Smoked(None, launched.fact_int("max_running_requests"), job=proof), None
        url = launched.url
        model = get_profile(cfg.engine.kind).request_model(spec)
        # Watch the process and its log as readiness did: a server dying on its first request
        # fails here at once with its log, not after every attempt against a dead port.
        watch = ServerWatch.start(node, launched.pid, server_paths(spec.workdir, cfg.name, spec.index).log,
                                  get_profile(cfg.engine.kind).classify, index=spec.index, port=spec.port,
                                  secrets=[spec.api_key])
        res = smoke(url, model, _smoke_settings(cfg, node, spec, launched), node=spec.node, index=spec.index,
                    api_key=spec.api_key, temperature=cfg.generation.temperature, watch=watch)
        info = fetch_server_info(url, spec.api_key)
        record_smoke(node, cfg, spec, {"ok": True, "at": time.time(), "latency_s": res.latency_s})
        return Smoked(res, max_running_requests(info, launched.facts), info, job=proof), log_excerpt_of(cfg, spec)
    return _audited(cfg, (spec.node, "server", spec.index, "smoke"), f"smoke {spec.node} server {spec.index}", body)


def _job_proof(cfg: FleetConfig, node: Node, spec: ServerSpec, launched: Launched) -> JobProof | None:
    """An adopted server a live job of this fleet uses: does the job's progress prove it serves?

    A re-attaching `fleet generate` brings the fleet up first, and its servers are busy with the
    very job it re-attaches to: a smoke request waited for a free slot behind the job's rows
    (1-2.5 s of a 3 s command on an idle machine). A server the job saw generate within
    `smoke.job_proof_s` is proven by that; one it did not (down, suspected, quiet, an older
    runner that does not say) is smoked as any other, and the log says why."""
    if not launched.adopted or cfg.smoke.job_proof_s <= 0:
        return None
    try:
        proof = job_proof(node, spec.workdir, cfg.name, spec.node, spec.index, spec.port, cfg.smoke.job_proof_s)
    except FleetError as exc:   # no proof read: the smoke decides, as it would without a job
        get_run_logger().warning("smoke %s server %s: the live jobs could not be read (%s): smoke request sent",
                                 spec.node, spec.index, exc.one_line())
        return None
    if proof is not None:
        get_run_logger().info("smoke %s server %s: %s: %s", spec.node, spec.index, proof.describe(),
                              "no smoke request sent" if proof.proven else "smoke request sent")
    return proof


def _smoke_settings(cfg: FleetConfig, node: Node, spec: ServerSpec, launched: Launched) -> SmokeConfig:
    """An adopted server that passed a smoke before is warm: no first-request allowance (5 min by
    default), so a hung one fails in its attempts × smoke.timeout_s and its peers go on (issue 23)."""
    if not launched.adopted:
        return cfg.smoke
    last = read_record(node, server_paths(spec.workdir, cfg.name, spec.index)).get("smoke") or {}
    if not last.get("ok"):
        return cfg.smoke   # launched by a bring-up that never smoked it: it may still be cold
    return cfg.smoke.model_copy(update={"first_timeout_s": cfg.smoke.timeout_s})


def log_excerpt_of(cfg: FleetConfig, spec: ServerSpec) -> str:
    node = node_for(cfg, spec.node)
    return excerpt(node.read_text(server_paths(spec.workdir, cfg.name, spec.index).log, tail_bytes=200_000),
                   secrets=[spec.api_key])
