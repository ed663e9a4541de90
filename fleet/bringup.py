"""The bring-up's stage bodies, Prefect-free: what each task of the `fleet` flow does on a node.

Two callers run them: the flow's tasks (tasks/bringup.py, inside Prefect's engine) and the adopt-only
`fleet up` (flows/quickup.py, which records the same run through Prefect's REST API without importing
Prefect). One body for both, so the results — and the artifacts made from them — cannot drift apart.

`adopt_only=True` is the second caller's: a stage that would change anything on the node (build a
venv, copy a model, launch, replace or retire a server) raises `NotAdopted` before it does, and the
command takes the flow's own path instead, which does that work under Prefect as always.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from fleet import torndown
from fleet.config import FleetConfig, SmokeConfig
from fleet.engines import ServerSpec, get_profile
from fleet.errors import FleetError, NodeUnreachable, PreflightFailed
from fleet.jobs import JobProof, job_proof
from fleet.node import Node
from fleet.preflight import gather
from fleet.servers import (adopted, excerpt, launch, read_record, record_smoke, retire_unplanned, server_paths,
                           wait_ready)
from fleet.smoke import ServerWatch, fetch_server_info, max_running_requests, smoke
from fleet.stages import Launched, ModelPlace, Provisioned, Smoked
from fleet.staging import NotStaged, stage_model
from fleet.venv import VenvResult, adopted_venv, ensure_venv


class NotAdopted(Exception):
    """An adopt-only bring-up met a stage with work to do (nothing was changed): take the flow's path."""


class Logger(Protocol):
    def info(self, msg: str, *args: Any) -> None: ...

    def warning(self, msg: str, *args: Any) -> None: ...


def provision_body(node: Node, cfg: FleetConfig, node_name: str) -> tuple[Provisioned, str | None]:
    """Preflight the node; hard failures stop this node here, with the reason."""
    node_cfg = cfg.node(node_name)
    report = gather(node, cfg, node_cfg)
    if not report.reachable:
        raise NodeUnreachable(f"node {node_name} unreachable: {report.error}", host=report.host)
    failures = report.failures()
    if failures:
        raise PreflightFailed("; ".join(f"{c.name}: {c.detail}" for c in failures), host=report.host,
                              remedy=" / ".join(c.remedy for c in failures if c.remedy))
    # A bring-up means the fleet should be up again: revalidation checks this node from now on.
    torndown.clear(node, node_cfg, cfg.name)
    return Provisioned.of(report, node_cfg), None


def venv_body(node: Node, cfg: FleetConfig, node_name: str, provisioned: Provisioned, logger: Logger,
              adopt_only: bool = False) -> tuple[VenvResult, str | None]:
    """Create or adopt the engine venv on local disk; time the engine import."""
    node_cfg = cfg.node(node_name)
    module = cfg.engine.import_check or get_profile(cfg.engine.kind).default_import
    found = None if not adopt_only or provisioned.venv_network_fs else adopted_venv(node, cfg, node_cfg, module)
    if adopt_only and found is None:
        raise NotAdopted(f"venv {node_name}: to build")
    res = found or ensure_venv(node, cfg, node_cfg, module, network_fs=provisioned.venv_network_fs)
    if res.slow_import:
        logger.warning("import of %s took %.1f s (> %.0f s): is the venv on a slow disk?",
                       module, res.import_seconds, cfg.venv.slow_import_s)
    return res, None


def stage_body(node: Node, cfg: FleetConfig, node_name: str, adopt_only: bool = False) -> tuple[ModelPlace, str | None]:
    """Copy the model once to the node's RAM disk (or serve it from its source when staging is off)."""
    node_cfg = cfg.node(node_name)
    if not cfg.model.stage or not cfg.model.source:
        return ModelPlace(cfg.model.source), None
    try:
        res = stage_model(node, source=cfg.model.source, ramdisk=node_cfg.ramdisk, fleet=cfg.name,
                          workdir=node_cfg.workdir, streams=cfg.model.copy_streams, verify=cfg.model.verify,
                          margin_bytes=int(cfg.model.stage_margin_gb * 1e9), adopt_only=adopt_only)
    except NotStaged as exc:
        raise NotAdopted(str(exc)) from exc
    if adopt_only and not res.adopted:   # the plan said nothing to copy, yet the copy did work: say so
        raise NotAdopted(f"stage {node_name}: copied")
    return ModelPlace(res.dst, res), None


def retire_body(node: Node, cfg: FleetConfig, node_name: str, planned: list[int], logger: Logger,
                adopt_only: bool = False) -> list[dict[str, Any]]:
    """Stop the node's recorded servers whose slot the config no longer plans."""
    retired = retire_unplanned(node, cfg, cfg.node(node_name), set(planned), dry_run=adopt_only)
    if adopt_only and retired:
        raise NotAdopted(f"retire {node_name}: {len(retired)} server(s) to stop")
    for r in retired:
        logger.info("%s server %s (port %s, pid %s): no longer in the config: stopped", r["node"],
                    r["index"], r["port"], r["pid"] if r["pid"] is not None else "none alive")
    return retired


def launch_body(node: Node, cfg: FleetConfig, spec: ServerSpec, adopt_only: bool = False) -> tuple[Launched, str | None]:
    """Start (or adopt) one server and wait until it is ready."""
    found = adopted(node, cfg, spec) if adopt_only else None
    if adopt_only and found is None:
        raise NotAdopted(f"launch {spec.node} server {spec.index}: to start or replace")
    started = found or launch(node, cfg, spec)
    ready = wait_ready(node, cfg, spec, started.pid)
    return Launched(started, ready), ready.log_excerpt


def smoke_body(node: Node, cfg: FleetConfig, spec: ServerSpec, launched: Launched,
               logger: Logger) -> tuple[Smoked, str | None]:
    """One chat completion (first-request timeout, backoff with jitter), then the server's own info —
    unless a live job's progress proves the adopted server serves (`job_proof_of`)."""
    proof = job_proof_of(node, cfg, spec, launched, logger)
    if proof is not None and proof.proven:
        return Smoked(None, launched.fact_int("max_running_requests"), job=proof), None
    url = launched.url
    model = get_profile(cfg.engine.kind).request_model(spec)
    # Watch the process and its log as readiness did: a server dying on its first request
    # fails here at once with its log, not after every attempt against a dead port.
    watch = ServerWatch.start(node, launched.pid, server_paths(spec.workdir, cfg.name, spec.index).log,
                              get_profile(cfg.engine.kind).classify, index=spec.index, port=spec.port,
                              secrets=[spec.api_key])
    res = smoke(url, model, smoke_settings(cfg, node, spec, launched), node=spec.node, index=spec.index,
                api_key=spec.api_key, temperature=cfg.generation.temperature, watch=watch)
    info = fetch_server_info(url, spec.api_key)
    record_smoke(node, cfg, spec, {"ok": True, "at": time.time(), "latency_s": res.latency_s})
    return Smoked(res, max_running_requests(info, launched.facts), info, job=proof), log_excerpt_of(node, cfg, spec)


def job_proof_of(node: Node, cfg: FleetConfig, spec: ServerSpec, launched: Launched, logger: Logger) -> JobProof | None:
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
        logger.warning("smoke %s server %s: the live jobs could not be read (%s): smoke request sent",
                       spec.node, spec.index, exc.one_line())
        return None
    if proof is not None:
        logger.info("smoke %s server %s: %s: %s", spec.node, spec.index, proof.describe(),
                    "no smoke request sent" if proof.proven else "smoke request sent")
    return proof


def smoke_settings(cfg: FleetConfig, node: Node, spec: ServerSpec, launched: Launched) -> SmokeConfig:
    """An adopted server that passed a smoke before is warm: no first-request allowance (5 min by
    default), so a hung one fails in its attempts × smoke.timeout_s and its peers go on (issue 23)."""
    if not launched.adopted:
        return cfg.smoke
    last = read_record(node, server_paths(spec.workdir, cfg.name, spec.index)).get("smoke") or {}
    if not last.get("ok"):
        return cfg.smoke   # launched by a bring-up that never smoked it: it may still be cold
    return cfg.smoke.model_copy(update={"first_timeout_s": cfg.smoke.timeout_s})


def log_excerpt_of(node: Node, cfg: FleetConfig, spec: ServerSpec) -> str:
    return excerpt(node.read_text(server_paths(spec.workdir, cfg.name, spec.index).log, tail_bytes=200_000),
                   secrets=[spec.api_key])
