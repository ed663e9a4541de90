"""One generation job over every node: a Prefect task per node pulls chunks; a task run per chunk attempt.

Why one long-lived task per node that pulls (rather than one task per chunk under a per-node
concurrency limit): pulling is what makes a faster node take more chunks, and the loss and
rejoin of a node is a state of that node, not of a chunk — a per-chunk task would have to be
re-routed to another node's limit after it was queued on the lost one. Each chunk attempt is
still a task run of its own (`chunk-00007@gpu2`), so the UI shows every chunk's state,
timing and failure, and `fleet-progress` artifacts show the job as a whole.

The controller (this flow run) is disposable: chunk plan and assignments are on disk
(`fleet.generation.multinode.chunks`), the runners are detached. Kill the flow and run it again: the
node tasks claim their own running chunks first and re-attach to those runners.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from fleet.config import FleetConfig
from fleet.generation.job.progress import fmt_s
from fleet.generation.multinode.controller import Controller
from fleet.generation.multinode.progress import format_line
from tasks.audit import artifact_key, write_table

PROGRESS_EVERY_S = 5.0
TABLE_EVERY_S = 60.0


def say(level: int, msg: str) -> None:
    """The controller's lines, into the run's log (the task's or the flow's, whichever is current)."""
    try:
        get_run_logger().log(level, msg)
    except Exception:   # no run context (a thread of our own): still say it
        print(msg, flush=True)


@task(name="chunk", task_run_name="chunk-{index:05d}@{node_name}", cache_policy=NO_CACHE, persist_result=False)
def run_chunk(ctl: Controller, node_name: str, index: int) -> dict[str, Any]:
    """One chunk attempt on one node: Completed when the chunk is done, Failed (node lost / runner ended) else."""
    return ctl.run_chunk(node_name, index)


@task(name="node-check", task_run_name="check-{node_name}", cache_policy=NO_CACHE, persist_result=False)
def check_node(cfg: FleetConfig, node_name: str, input: str, output: str) -> str | None:
    """Whether node `node_name` can do the job's store access with its runner's environment: None, or the cause."""
    from fleet.generation.multinode.nodecheck import check_node as check

    return check(cfg, cfg.node(node_name), input, output)


@task(name="node-worker", task_run_name="node-{node_name}", cache_policy=NO_CACHE, persist_result=False)
def node_worker(ctl: Controller, node_name: str) -> dict[str, Any]:
    def run(name: str, index: int) -> dict[str, Any]:
        # return_state: the chunk's failure is handled here (requeue), not re-raised by Prefect
        state = run_chunk(ctl, name, index, return_state=True)
        if state.is_completed():
            return state.result()
        try:
            state.result(raise_on_failure=True)
        except BaseException as exc:
            raise exc from None
        raise RuntimeError(f"chunk {index} on {name} ended {state.name}")

    return ctl.node_loop(node_name, run_chunk=run)


def watch_progress(cfg: FleetConfig, ctl: Controller, finished: Any) -> None:
    """Until `finished()`: the job's progress.json, the Prefect progress artifact and the console line,
    every few seconds (in the flow's thread: artifacts need its run context)."""
    logger = get_run_logger()
    pid = create_progress_artifact(0.0, key=artifact_key(cfg, "job", "progress"),
                                   description=f"multi-node generation → {ctl.output}")
    last_table = 0.0
    last_line = ""
    while True:
        end = finished(PROGRESS_EVERY_S)
        try:
            p = ctl.write_progress()
        except Exception as exc:   # progress must never stop the job
            logger.warning("progress: %s", exc)
            p = None
        if p is not None:
            update_progress_artifact(pid, float(p.get("percent") or 0.0))
            line = format_line(p)
            if line != last_line:
                print(line, flush=True)
                last_line = line
            now = time.monotonic()
            if now - last_table > TABLE_EVERY_S or end:
                last_table = now
                write_table(cfg, ("job", "nodes"), p["nodes"], f"{p['rows_done']:,}/{p['rows_total']:,} rows, "
                                                               f"ETA {fmt_s(p.get('eta_s'))}")
        if end:
            return
