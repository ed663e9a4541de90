"""Follow a started (or re-attached) runner to its end and record what it did, Prefect-free.

The `generate` task (tasks/generate.py) and the quick `fleet generate` (flows/quickgen.py) both
follow a runner this way; only where the records go differs: Prefect's artifact and logging API
inside the flow's task run, or the same records posted through the REST API. `Records` is that
seam: one log line, a progress artifact (created, then moved), a table, the throughput chart, the
stage artifact. What the follow writes, and when (a progress line every 30 s and at the first ETA,
the per-server table every 60 s), is decided here once for both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fleet.config import FleetConfig, NodeConfig
from fleet.errors import FatalError, InputChanged, JobConflict
from fleet.generation.job.progress import Progress
from fleet.generation.job.remote import JobHandle, outcome, watch_job
from fleet.jobs import job_dir
from fleet.node import LocalNode, Node
from fleet.stages import Generated

TABLE_EVERY_S = 60.0
LOG_EVERY_S = 30.0


class Records(Protocol):
    """Where a follow's records go (the task run's, through Prefect or its REST API)."""

    def info(self, message: str) -> None: ...

    def error(self, message: str) -> None: ...

    def progress(self, key_parts: tuple[object, ...], description: str) -> Callable[[float], None]:
        """Create the progress artifact at 0 %; the function moves it."""
        ...

    def table(self, key_parts: tuple[object, ...], rows: list[dict[str, Any]], description: str) -> None: ...

    def throughput(self, series: list[dict[str, Any]], per_server: dict[str, Any],
                   key_parts: tuple[object, ...]) -> None: ...

    def stage(self, key_parts: tuple[object, ...], title: str, *, ok: bool, seconds: float,
              result: dict[str, Any], log: str | None) -> None: ...


def input_on_node(node: Node, node_cfg: NodeConfig, input_path: str) -> str:
    """The input as a path on the node: a local file is uploaded to SSH nodes (once per size+mtime)."""
    local = Path(input_path)
    if isinstance(node, LocalNode) or not local.is_file():
        return input_path  # local node, or already a path on the node
    st = local.stat()
    remote = f"{node_cfg.workdir.rstrip('/')}/inputs/{st.st_size}-{int(st.st_mtime)}-{local.name}"
    if not node.exists(remote):
        node.put(local, remote)
    return remote


def attached_line(handle: JobHandle, node_name: str, output: str) -> str:
    return (f"{'re-attached to' if handle.attached else 'started'} runner pid {handle.pid} on {node_name} "
            f"(output {output}, log {handle.log})")


def follow(cfg: FleetConfig, node: Node, node_name: str, handle: JobHandle, output: str, t0: float,
           rec: Records, poll_s: float = 5.0) -> Generated:
    """Watch the runner until it exits, recording as it goes; the Generated result, or the job's
    failure raised (JobConflict, InputChanged, FatalError) with its cause and remedy."""
    rec.info(attached_line(handle, node_name, output))
    move = rec.progress((node_name, "generate-progress"), f"generation on {node_name} → {output}")
    series: list[dict[str, Any]] = []
    last_table = 0.0
    last_log = 0.0
    had_eta = False

    def on_progress(p: dict[str, Any]) -> None:
        nonlocal last_table, last_log, had_eta
        move(float(p.get("percent") or 0.0))
        if p.get("tok_s") is not None:
            series.append({"t": p.get("elapsed_s", time.monotonic() - t0), "tok_s": p["tok_s"]})
        now = time.monotonic()
        # every 30 s, and at once when the rate first gives an ETA: a job of long rows says it is
        # alive as soon as it can, not half a minute later
        has_eta = p.get("eta_s") is not None
        if now - last_log > LOG_EVERY_S or (has_eta and not had_eta):
            last_log = now
            had_eta = has_eta
            rec.info(progress_line(node_name, p))
        if now - last_table > TABLE_EVERY_S and p.get("servers"):
            last_table = now
            rec.table((node_name, "generate-servers"), server_rows(p), "per-server generation stats")

    final = watch_job(node, handle, poll_s=poll_s, on_progress=on_progress)
    manifest_text = node.read_text(f"{output.rstrip('/')}/manifest.json")
    manifest = json.loads(manifest_text) if manifest_text else {}
    if final.get("servers"):
        rec.table((node_name, "generate-servers"), server_rows(final), "per-server generation stats")
        rec.throughput(series, {s["name"]: s.get("completion_tokens", 0) for s in final["servers"]},
                       (node_name, "generate-throughput"))
    ok, cause, remedy = outcome(final, handle)
    node_cfg = cfg.node(node_name)
    result = Generated(
        node=node_name, output=output, job_dir=job_dir(node_cfg, cfg, output), pid=handle.pid,
        attached=handle.attached, state=final.get("state"), detail=final.get("detail"),
        rows_total=final.get("rows_total"), completed=final.get("completed"), errors=final.get("errors"),
        rejects=final.get("rejects"), quality_rejects=final.get("quality_rejects"),
        this_run=final.get("this_run") or {}, throughput=manifest.get("throughput"), cost=manifest.get("cost"),
        checks=manifest.get("checks"), quality=manifest.get("quality"), seconds=round(time.monotonic() - t0, 1),
        error=None if ok else {"cause": cause, "remedy": remedy})
    rec.stage((node_name, "generate"), f"generate on {node_name}", ok=ok, seconds=time.monotonic() - t0,
              result=result.as_dict(), log=None if ok else final.get("log_tail"))
    if not ok:
        rec.error(f"generation on {node_name} failed: {cause}\nremedy: {remedy}\nrunner log (tail):\n"
                  f"{final.get('log_tail') or ''}")
        # a runner refused the directory (another runner holds it): a second job, not a failed one
        failure = (final.get("exit") or {}).get("failure") or final.get("error") or {}
        err = JobConflict if failure.get("kind") == "conflict" else \
            InputChanged if failure.get("kind") == "input_changed" else FatalError
        raise err(f"generation on {node_name} failed: {cause}", host=node.host, remedy=remedy)
    return result


def progress_line(node_name: str, p: dict[str, Any]) -> str:
    """The runner's own progress line (one function builds it), named for the node; a progress
    file that lacks a field (a runner of another version) gets a plain line."""
    try:
        return Progress.line(p, prefix=f"{node_name}:")
    except (KeyError, TypeError, ValueError):
        return f"{node_name}: {p.get('rows_done')}/{p.get('rows_total')} rows — {p.get('detail') or p.get('state')}"


def server_rows(p: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ["name", "state", "requests", "completion_tokens", "tok_s", "errors", "in_flight", "accept_len",
            "restarts", "readmissions", "down_reason"]
    return [{k: s.get(k) for k in keys} for s in p.get("servers", [])]
