"""Prefect's Cancel under a worker: the run is Cancelled as soon as its own process has stopped.

What Prefect 3.9 does on Cancel (the UI's button, `prefect flow-run cancel ID`), read from its
source (prefect/runner/_cancellation_manager.py, _process_manager.py, _workspace_hook_runner.py)
and timed with bench/bench_cancel.py:
1. the server sets the run Cancelling;
2. the worker's cancellation observer sees it; the runner sends a cancel intent over its control
   channel, then SIGTERM to the run's process, and looks every 3 s (a tenth of its 30 s kill grace)
   whether the process is gone;
3. then it starts a new Python process (`_workspace_runtime_bootstrap.py hook cancellation`) that
   imports Prefect and loads the flow from its entrypoint only to look for on_cancellation hooks —
   whatever the flow has (fleet has none: there is nothing to opt out of);
4. only then does it set the run Cancelled.
Step 3 is most of the wait: ≈ 10 s at load 10 even for a flow that imports nothing, and the runner
runs it for every cancel. So the run's own process, once it has stopped cleanly — every wait of the
run gave up (fleet/interrupt.py), the task threads are joined (their task runs ended, "asked to
stop"), the node lock is given back (tasks/locks.py: `hold_nodes` unwound) — sets the run Cancelled
itself, as the flow function unwinds. A task thread still running after JOIN_S (a node command that
does not look at the stop flag) leaves the run to Prefect's path: Cancelled once the process is gone. The runner's steps 3–4 still happen (nothing in the flow can
skip them); its own Cancelled lands on a Cancelled run and changes only the message.

Cancelling → Cancelled is the one transition Prefect's orchestration allows out of Cancelling
(EnforceCancellingToCancelledTransition); it is proposed without force, and only when the server
says the run is Cancelling: a SIGTERM that is not a Cancel (`kill` by hand, a worker that dies)
leaves the state to Prefect (Crashed), as before. A Cancel of a Scheduled run never reaches a
process (the server sets it Cancelled at once); one of a Pending run, whose flow has not started,
takes Prefect's path above.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

CANCEL_POLL_S = 2.0   # how often a command's run asks whether it was cancelled (poll_cancel: both paths)
CANCELLED_MESSAGE = ("Flow run was cancelled: its own process stopped its waits and gave back any node lock it held; "
                     "servers and a generation runner it started keep running (README: Ctrl-C, SIGTERM and SIGHUP)")
JOIN_S = 20.0  # the task threads' end, bounded well inside Prefect's 30 s kill grace


def end_cancelled() -> bool:
    """In the flow's process, as a BaseException (Prefect's TerminationSignal) unwinds the flow: if
    the run is Cancelling, join the task threads (bounded) and set it Cancelled; True when set.
    Call after every wait was told to stop (`request_stop`) and the node lock was given back."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.states import Cancelled

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return False
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(ctx.flow_run.id).state
            if state is None or not state.is_cancelling():
                return False
            if not _join_tasks(ctx.task_runner, JOIN_S):
                # a task still runs (a node command that does not look at the stop flag): "stopped"
                # now would be false, and a re-run could write beside it; Prefect's runner sets
                # Cancelled once this process is gone (step 4)
                return False
            result: Any = client.set_flow_run_state(ctx.flow_run.id, Cancelled(message=CANCELLED_MESSAGE))
    except Exception:  # the API is away: Prefect's runner still sets Cancelled after it (step 4)
        return False
    if result.state is None or not result.state.is_cancelled():
        return False
    # The engine reads its own copy of the run: a final state there keeps it from reporting a
    # crash over this one (it does when the runner's cancel intent was not acknowledged in time).
    ctx.flow_run.state = result.state
    return True


def _join_tasks(task_runner: Any, timeout: float) -> bool:
    """Wait up to `timeout` for the flow's task threads to end (what the engine does next, unbounded);
    True when they all ended (`cancel_all` shuts the runner's pool down and waits for its threads)."""
    cancel_all = getattr(task_runner, "cancel_all", None)
    if cancel_all is None:
        return True
    t = threading.Thread(target=cancel_all, name="fleet-join-tasks", daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


# The runs whose Cancel `watch_command_run` saw in this process: each ends Cancelled (flows/fleet.py).
_seen: set[str] = set()


def cancel_seen() -> bool:
    """True when the current flow run was started by a command and cancelled from Prefect (`watch_command_run`)."""
    from prefect.runtime import flow_run

    return bool(_seen) and str(flow_run.id) in _seen


def poll_cancel(is_cancelling: Callable[[], bool], on_cancel: Callable[[], None],
                every_s: float = CANCEL_POLL_S) -> Callable[[], None]:
    """A thread (in the caller's context: its settings name the API) that asks `is_cancelling()`
    every `every_s` and calls `on_cancel()` once it says yes; a failed look is not a Cancel, the
    next one looks again. Returns the function that stops it (call it when the run has ended)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            try:
                if not is_cancelling():
                    continue
            except Exception:
                continue
            on_cancel()
            return

    threading.Thread(target=contextvars.copy_context().run, args=(watch,), name="fleet-cancel-watch",
                     daemon=True).start()
    return done.set


def watch_command_run(run_ids: list[Any], every_s: float = CANCEL_POLL_S) -> Callable[[], None]:
    """A run that a `fleet` command started in its own process has no worker watching it: a Cancel
    (the UI's button, `prefect flow-run cancel`) only set it Cancelling, the command went on (a
    generation followed to its end) and the engine then failed to finish it (UnfinishedRun, a
    traceback, the run left Cancelling). This asks the server every `every_s` whether the run
    (`run_ids[-1]`, once the run has begun) is Cancelling; if so, every wait of the process is told
    to give up (`request_stop`: the node lock is given back as `hold_nodes` unwinds, a followed
    runner keeps running) and the flow ends Cancelled with CANCELLED_MESSAGE. Returns the stop
    function (call it when the run has ended). flows/quickgen.py polls the same way over REST."""
    from fleet.interrupt import request_stop

    def is_cancelling() -> bool:
        from prefect.client.orchestration import get_client

        if not run_ids:
            return False
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run_ids[-1]).state
        return state is not None and state.is_cancelling()

    def on_cancel() -> None:
        _seen.add(str(run_ids[-1]))
        request_stop()

    return poll_cancel(is_cancelling, on_cancel, every_s)
