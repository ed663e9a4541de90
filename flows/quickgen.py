"""`fleet generate` that re-attaches to a runner already running: the flow run recorded without Prefect.

A re-attach did seconds of work (an adopt-only bring-up, then following the detached runner) in
≈ 6.5× a `fleet status` on a loaded 2-core machine: importing Prefect and running its flow engine.
For one node, a local output and a runner of this very job alive, this path runs what the flow
runs — the bring-up adopt-only through flows/quickup.py's machinery, under the node lock with the
flow's purpose (`generate-bringup`), the lock given back, the summary table — then follows the
runner with the `generate` task's own code (fleet/generation/job/follow.py), its records posted
through Prefect's REST API: the flow run `generate-<fleet>` (parameters, states, message), one task
run per stage and the `generate` task run, every artifact (stage markdowns, summary, progress moved
as the job moves, the per-server table every 60 s, the throughput chart, the generate stage), the
log lines (printed live as Prefect prints them), and a failed job's states, cause tag and event.

Anything else takes the flow's path (`refusal`, flows/quickup.py's rules plus these): several nodes,
a store URL, [[endpoints]], store credentials from Prefect blocks, no live runner of this job. And so
does any doubt before the follow starts (a stage with work to do, the runner gone meanwhile, a write
the server refuses): what this try wrote is undone and the flow runs, which re-attaches or starts.
`FLEET_QUICK_UP=0` sends both `fleet up` and `fleet generate` down the flow's path.

Ctrl-C, SIGTERM and SIGHUP are the command's clean stop (fleet/interrupt.py): the lock back if held,
the run marked Crashed, the runner left running. A Cancel of the run (its state set Cancelling, from
the UI or the API) stops the follow: the run ends Cancelled (flows/cancel.py's message), the runner
goes on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fleet.config import FleetConfig
from flows.quickup import (Api, Fallback, Line, QuickRun, TaskRec, _close, _crashed, _print_lines, _state,
                           attach_running, best_effort, completed, post_lines, prefect_home, task_keys, write_summary)
from flows.quickup import refusal as up_refusal

GENERATE_PARAMS = {"action": "generate", "free_ramdisk": False, "node_wait_s": 3600.0}


def refusal(cfg: FleetConfig, input: str, output: str, environ: Mapping[str, str], cwd: Path,
            home: Path) -> str | None:
    """Why this `fleet generate` must take the flow's path before anything is looked at on a node, or None."""
    from blocks.credentials import STORE_BLOCK_ENVS
    from fleet.generation.data.objstore import is_url

    why = up_refusal(cfg, environ, cwd, home)
    if why is not None:
        return why
    if len(cfg.nodes) != 1:
        return f"{len(cfg.nodes)} nodes (one job over several nodes: flows/multinode.py)"
    if is_url(output) or is_url(input):
        return "the input or output is a store URL"
    if cfg.endpoints:
        return "the config has [[endpoints]]"
    for name in STORE_BLOCK_ENVS:
        if environ.get(name):
            return f"{name} is set"
    return None


class _Records:
    """The follow's records (fleet/generation/job/follow.py `Records`) in the `generate` task run,
    through the REST API; each line printed and sent as it is said."""

    def __init__(self, run: QuickRun, task: TaskRec) -> None:
        self.run, self.task, self.api = run, task, run.api

    def _post(self, art: dict[str, Any]) -> str:
        made = self.api.call("POST", "/artifacts/", {**art, "flow_run_id": self.run.id, "task_run_id": self.task.id})
        self.run.artifact_ids.append(str(made["id"]))
        return str(made["id"])

    def info(self, message: str) -> None:
        self.run.say(20, message, self.task)
        flush(self.run)

    def error(self, message: str) -> None:
        self.run.say(40, message, self.task)
        flush(self.run)

    def progress(self, key_parts: tuple[object, ...], description: str) -> Callable[[float], None]:
        from fleet.artifacts import artifact_key

        art_id = self._post({"key": artifact_key(self.run.cfg, *key_parts), "type": "progress",
                             "description": description, "data": 0.0})
        last = [0.0]

        def move(percent: float) -> None:
            if percent != last[0]:   # the same value again changes nothing the server keeps
                self.api.call("PATCH", f"/artifacts/{art_id}", {"data": percent})
                last[0] = percent
        return move

    def table(self, key_parts: tuple[object, ...], rows: list[dict[str, Any]], description: str) -> None:
        self._post(self.run.table(key_parts, rows, description))

    def throughput(self, series: list[dict[str, Any]], per_server: dict[str, Any],
                   key_parts: tuple[object, ...]) -> None:
        from fleet.artifacts import artifact_key
        from tasks.charts import throughput_markdown

        title = "Generation throughput"
        self._post({"key": artifact_key(self.run.cfg, *key_parts), "type": "markdown", "description": title,
                    "data": throughput_markdown(series, per_server, title)})

    def stage(self, key_parts: tuple[object, ...], title: str, *, ok: bool, seconds: float,
              result: dict[str, Any], log: str | None) -> None:
        self._post(self.run.markdown(key_parts, title, seconds, result, log, ok=ok))


def flush(run: QuickRun) -> None:
    """The lines said since the last flush: printed as Prefect prints them, and sent."""
    new: list[Line] = run.lines[run.posted:]
    run.posted += len(new)
    _print_lines(run, new)
    post_lines(run, new)


def quick_generate(cfg: FleetConfig, input: str, output: str, retry_errors: bool,
                   environ: Mapping[str, str] = os.environ) -> tuple[bool, str, Any] | None:
    """Re-attach to this job's live runner and follow it, recorded as the flow records it: (ok, message,
    the result data `fleet generate` prints); None: take the flow's path (what this try wrote undone)."""
    why = refusal(cfg, input, output, environ, Path.cwd(), prefect_home(environ))
    keys = task_keys() if why is None else None
    if keys is None or "generate" not in keys:   # learned from the flow's path (flows/quickup.py)
        _debug(environ, why or "no task keys learned from a run of this code yet")
        return None
    from fleet.generation.job.follow import input_on_node
    from fleet.generation.job.remote import _attach
    from fleet.jobs import job_dir
    from fleet.node import connect

    node_cfg = cfg.nodes[0]
    nodes: dict[str, Any] = {}
    try:
        nodes[node_cfg.name] = node = connect(node_cfg)
        node_input = input_on_node(node, node_cfg, input)
        jdir = job_dir(node_cfg, cfg, output)

        def runner() -> Any:   # start_job would re-attach (not start) exactly when this finds the runner
            return _attach(node, cfg, node_cfg, jdir, output, node_input, retry_errors)

        alive = runner() is not None
    except Exception as exc:   # a conflict, a node that does not answer: the flow's path says it properly
        _debug(environ, exc)
        _close(nodes)
        return None
    if not alive:
        _close(nodes)
        _debug(environ, "no runner of this job is alive")
        return None
    return _run(cfg, keys, nodes, runner, input, output, retry_errors, environ)


def _debug(environ: Mapping[str, str], why: object) -> None:
    if environ.get("FLEET_QUICK_UP_DEBUG"):
        print(f"fleet generate: the flow's path: {why}", file=sys.stderr)


def _run(cfg: FleetConfig, keys: dict[str, str], nodes: dict[str, Any], runner: Callable[[], Any], input: str,
         output: str, retry_errors: bool, environ: Mapping[str, str]) -> tuple[bool, str, Any] | None:
    from fleet.interrupt import on_interrupt
    from flows.api import prefect_env
    from flows.quickup import Lock, _bringup, open_run, warm_imports

    prefect_env()
    api = Api(attach_running())
    run = QuickRun(cfg, api, keys, action="generate")
    lock = Lock(api, cfg, run, purpose="generate-bringup")
    unregister: Callable[[], None] = lambda: None
    try:
        unregister = on_interrupt("mark the flow run crashed", lambda: _crashed(run, lock), order=50)
        opening = open_run(run, lock, {**GENERATE_PARAMS, "input": input, "output": output,
                                       "retry_errors": retry_errors})
        warm_imports()
        t0 = opening.result()
        rows, up = _bringup(run, lock, nodes, t0)
        lock.release()
        handle = runner()
        if handle is None:
            raise Fallback("the runner ended during the bring-up")
        write_summary(run, rows, up, t0)
        run.writer.shutdown(wait=True)
        gen = run.task("generate", f"generate-{cfg.nodes[0].name}", cfg=[], node_name=[], specs=[], facts=[],
                       input_path=[], output=[], retry_errors=[])
        api.call("POST", "/task_runs/", run.task_body(gen))
        flush(run)   # the bring-up's lines, now that it is known to be adopt-only
    except Exception as exc:   # Fallback; NotAdopted (a stage with work to do); a write refused; a bug
        best_effort(run.opened, lock.release, run.undo, unregister, lambda: _close(nodes), api.close)
        _debug(environ, exc)
        return None
    try:
        return _follow(run, gen, nodes[cfg.nodes[0].name], handle)
    except Exception as exc:
        # A write the server refused (or a bug) while following a runner that still runs: this try's
        # records are undone and the flow runs, which re-attaches to it and records it all. (Once the
        # runner has ended, the flow would start another: the error is raised instead.)
        if runner() is None:
            raise
        best_effort(run.undo, unregister)
        _debug(environ, exc)
        return None
    finally:
        best_effort(unregister, lambda: _close(nodes), api.close)


def _follow(run: QuickRun, gen: TaskRec, node: Any, handle: Any) -> tuple[bool, str, Any]:
    """The `generate` task's follow, then the run's end: Completed, Failed as the flow fails it, or
    Cancelled when the run was cancelled; a Ctrl-C parks (the interrupt's cleanups end the process).
    A record it could not write raises (the caller undoes the try)."""
    from fleet.errors import FleetError, InputChanged, JobConflict, Stopped
    from fleet.generation.job.follow import follow
    from fleet.interrupt import interrupted, park

    from fleet.interrupt import request_stop
    from flows.cancel import poll_cancel

    cancelled = threading.Event()

    def on_cancel() -> None:   # the run set Cancelling (the UI, the API): the follow's waits give up
        cancelled.set()
        request_stop()

    stop_watch = poll_cancel(lambda: (run.api.call("GET", f"/flow_runs/{run.id}")["state"] or {}).get("type")
                             == "CANCELLING", on_cancel)
    t0 = time.monotonic()
    try:
        res = follow(run.cfg, node, gen.name.removeprefix("generate-"), handle, handle.output, t0,
                     _Records(run, gen))
    except Stopped as exc:
        if interrupted():
            park()   # Ctrl-C, SIGTERM, SIGHUP: the cleanups mark the run and end the process (130/143/129)
        if cancelled.is_set():
            return _cancelled(run, gen, exc)
        raise
    except FleetError as exc:   # the job failed (its cause and remedy): the run fails as the flow fails it
        data: Any = {"conflict": True} if isinstance(exc, JobConflict) else \
            {"could_not_run": True} if isinstance(exc, InputChanged) else None
        failure = f"generation: {exc.one_line()}"
        _task_failed(run, gen, exc)
        _failed(run, failure)
        return False, failure, data
    finally:
        stop_watch()
    run.say(20, "Finished in state Completed()", gen)
    run.api.call("POST", f"/task_runs/{gen.id}/set_state", {"state": _state("COMPLETED", ""), "force": False})
    message: str = res.message()
    completed(run, message)
    return True, message, res.as_dict()


def _task_failed(run: QuickRun, gen: TaskRec, exc: BaseException) -> None:
    """The task run's end as Prefect's task engine writes a task that raised (retries exhausted: a
    fatal error is not retried), its final line cut to one line as flows/outcome.py cuts it."""
    message = f"Task run encountered an exception {type(exc).__name__}: {exc}"
    run.say(40, f"Task run failed with exception: {exc!r} - Retries are exhausted", gen)
    final = f"Finished in state Failed({message!r})"
    if "\\n" in final:
        final = final.split("\\n", 1)[0] + " …' (the error is logged above)"
    run.say(40, final, gen)
    # forced: the engine's task states go through events, past the server's retry rule (which would
    # make a first failure AwaitingRetry: the policy allows retries of transient errors)
    run.api.call("POST", f"/task_runs/{gen.id}/set_state", {"state": _state("FAILED", message), "force": True})


def _failed(run: QuickRun, message: str) -> None:
    """The run Failed as flows/fleet.py ends it, with the on-failure hook's event and cause tag (flows/alerts.py)."""
    from flows.alerts import FAILED_EVENT, cause_tag

    api = run.api
    run.say(20, "Running hook 'announce_failure' in response to entering state 'Failed'")
    run.say(20, "Hook 'announce_failure' finished running successfully")
    run.say(20, f"Finished in state Failed({message!r})")
    flush(run)
    state = _state("FAILED", message)
    api.call("POST", f"/flow_runs/{run.id}/set_state", {"state": state, "force": False})
    flow_run = api.call("GET", f"/flow_runs/{run.id}")
    try:
        import uuid
        from datetime import datetime, timezone

        api.call("POST", "/events", [{
            "id": str(uuid.uuid4()), "occurred": datetime.now(timezone.utc).isoformat(), "event": FAILED_EVENT,
            "resource": {"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.name": run.name,
                         "prefect.state-name": "Failed", "prefect.state-type": "FAILED"},
            "related": [{"prefect.resource.id": f"prefect.flow.{flow_run['flow_id']}",
                         "prefect.resource.role": "flow", "prefect.resource.name": "fleet"}],
            "payload": {"message": message[:4000]}}])
    except Exception:   # as the hook: an alert never turns a Failed run into a crash
        pass
    try:
        kept = [t for t in flow_run.get("tags") or [] if not t.startswith("failed: ")]
        api.call("PATCH", f"/flow_runs/{run.id}", {"tags": [*kept, cause_tag(message)]})
    except Exception:
        pass


def _cancelled(run: QuickRun, gen: TaskRec, exc: BaseException) -> tuple[bool, str, Any]:
    """A Cancel: the follow gave up (the runner goes on). The task run ends as a worker's run's task does
    when its wait is told to stop (it raised Stopped), the run Cancelled as flows/cancel.py ends one."""
    from flows.cancel import CANCELLED_MESSAGE

    _task_failed(run, gen, exc)
    run.say(20, f"Finished in state Cancelled({CANCELLED_MESSAGE!r})")
    flush(run)
    run.api.call("POST", f"/flow_runs/{run.id}/set_state", {"state": _state("CANCELLED", CANCELLED_MESSAGE),
                                                            "force": False})
    return False, CANCELLED_MESSAGE, None


__all__ = ["quick_generate", "refusal"]
