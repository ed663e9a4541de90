"""The generate stage: start (or re-attach to) the detached runner on the node and watch it.

The task only watches: the runner writes the data and outlives this task, the flow and the
SSH connection. Killing the flow mid-job and running it again re-attaches to the same
runner (its pid file), never a second one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from fleet.config import FleetConfig
from fleet.engines import ServerSpec
from fleet.errors import FatalError, InputChanged, JobConflict
from fleet.generation.job.endpoints import endpoint_keys
from fleet.generation.job.progress import Progress
from fleet.jobs import job_dir
from fleet.generation.job.remote import outcome, start_job, watch_job
from fleet.node import LocalNode
from fleet.stages import Generated
from tasks.audit import artifact_key, write_stage, write_table
from tasks.charts import write_throughput_artifact
from tasks.nodes import node_for
from tasks.policy import TASK_OPTS

TABLE_EVERY_S = 60.0


def node_input(cfg: FleetConfig, node_name: str, input_path: str) -> str:
    """The input as a path on the node: a local file is uploaded to SSH nodes (once per size+mtime)."""
    node = node_for(cfg, node_name)
    local = Path(input_path)
    if isinstance(node, LocalNode) or not local.is_file():
        return input_path  # local node, or already a path on the node
    node_cfg = cfg.node(node_name)
    st = local.stat()
    remote = f"{node_cfg.workdir.rstrip('/')}/inputs/{st.st_size}-{int(st.st_mtime)}-{local.name}"
    if not node.exists(remote):
        node.put(local, remote)
    return remote


@task(name="generate", task_run_name="generate-{node_name}", **TASK_OPTS)
def generate(cfg: FleetConfig, node_name: str, specs: list[ServerSpec], facts: dict[int, dict[str, Any]],
             input_path: str, output: str, retry_errors: bool = False) -> Generated:
    logger = get_run_logger()
    node = node_for(cfg, node_name)
    node_cfg = cfg.node(node_name)
    t0 = time.monotonic()
    remote_input = node_input(cfg, node_name, input_path)
    handle = start_job(node, cfg, node_cfg, input_path=remote_input, output=output, specs=specs,
                       retry_errors=retry_errors, facts=facts, endpoint_keys=endpoint_keys(cfg))
    logger.info("%s runner pid %d on %s (output %s, log %s)",
                "re-attached to" if handle.attached else "started", handle.pid, node_name, output, handle.log)
    # Called from sync code it returns the id (its type also covers async callers' coroutine).
    progress_id = cast(UUID, create_progress_artifact(0.0, key=artifact_key(cfg, node_name, "generate-progress"),
                                                      description=f"generation on {node_name} → {output}"))
    series: list[dict[str, Any]] = []
    last_table = 0.0
    last_log = 0.0
    had_eta = False

    def on_progress(p: dict[str, Any]) -> None:
        nonlocal last_table, last_log, had_eta
        update_progress_artifact(progress_id, float(p.get("percent") or 0.0))
        if p.get("tok_s") is not None:
            series.append({"t": p.get("elapsed_s", time.monotonic() - t0), "tok_s": p["tok_s"]})
        now = time.monotonic()
        # every 30 s, and at once when the rate first gives an ETA: a job of long rows says it is
        # alive as soon as it can, not half a minute later
        has_eta = p.get("eta_s") is not None
        if now - last_log > 30 or (has_eta and not had_eta):
            last_log = now
            had_eta = has_eta
            logger.info("%s", _line(node_name, p))
        if now - last_table > TABLE_EVERY_S and p.get("servers"):
            last_table = now
            write_table(cfg, (node_name, "generate-servers"), _server_rows(p), "per-server generation stats")

    final = watch_job(node, handle, on_progress=on_progress)
    manifest_text = node.read_text(f"{output.rstrip('/')}/manifest.json")
    manifest = json.loads(manifest_text) if manifest_text else {}
    if final.get("servers"):
        write_table(cfg, (node_name, "generate-servers"), _server_rows(final), "per-server generation stats")
        write_throughput_artifact(cfg, series, {s["name"]: s.get("completion_tokens", 0) for s in final["servers"]},
                                  key_parts=(node_name, "generate-throughput"))
    ok, cause, remedy = outcome(final, handle)
    result = Generated(
        node=node_name, output=output, job_dir=job_dir(node_cfg, cfg, output), pid=handle.pid,
        attached=handle.attached, state=final.get("state"), detail=final.get("detail"),
        rows_total=final.get("rows_total"), completed=final.get("completed"), errors=final.get("errors"),
        rejects=final.get("rejects"), quality_rejects=final.get("quality_rejects"),
        this_run=final.get("this_run") or {}, throughput=manifest.get("throughput"), cost=manifest.get("cost"),
        checks=manifest.get("checks"), quality=manifest.get("quality"), seconds=round(time.monotonic() - t0, 1),
        error=None if ok else {"cause": cause, "remedy": remedy})
    write_stage(cfg, (node_name, "generate"), f"generate on {node_name}", ok=ok, seconds=time.monotonic() - t0,
                result=result.as_dict(), log=None if ok else final.get("log_tail"))
    if not ok:
        logger.error("generation on %s failed: %s\nremedy: %s\nrunner log (tail):\n%s", node_name, cause, remedy,
                     final.get("log_tail") or "")
        # a runner refused the directory (another runner holds it): a second job, not a failed one
        failure = (final.get("exit") or {}).get("failure") or final.get("error") or {}
        err = JobConflict if failure.get("kind") == "conflict" else \
            InputChanged if failure.get("kind") == "input_changed" else FatalError
        raise err(f"generation on {node_name} failed: {cause}", host=node.host, remedy=remedy)
    return result


def _line(node_name: str, p: dict[str, Any]) -> str:
    """The runner's own progress line (one function builds it), named for the node; a progress
    file that lacks a field (a runner of another version) gets a plain line."""
    try:
        return Progress.line(p, prefix=f"{node_name}:")
    except (KeyError, TypeError, ValueError):
        return f"{node_name}: {p.get('rows_done')}/{p.get('rows_total')} rows — {p.get('detail') or p.get('state')}"


def _server_rows(p: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ["name", "state", "requests", "completion_tokens", "tok_s", "errors", "in_flight", "accept_len",
            "restarts", "readmissions", "down_reason"]
    return [{k: s.get(k) for k in keys} for s in p.get("servers", [])]
