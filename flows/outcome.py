"""How a fleet run ends Failed on purpose: a clear message, its table kept, no engine traceback.

A flow run that returns `Failed(...)` makes Prefect's engine re-raise "the state's
exception" once the run has ended, and under a worker (or `flow.serve`) the engine logs
that re-raise as "Engine execution exited with unexpected exception" with a traceback.
With `data=<list of rows>` it is worse: the engine cannot turn a list into an exception
and logs `TypeError: Unexpected result for failed state … cannot be resolved into an
exception` instead of the message. Both read like a crash and hide the real message.

So every deliberate failure is `failed(message, data)` (`tasks.states`, where tasks and flows
both find it): a Failed state whose data is a `RunFailed` exception carrying the message and
the run's result (summary rows, job summary). The engine re-raises exactly that exception, and `quiet_expected_failures`
drops the engine's duplicate report of it (only of a `RunFailed`: a real crash keeps
its traceback). The table itself lives in an artifact; `run_data(state)` gives callers
in the same process (`fleet up`, tests) the rows of a run whichever way it ended.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.client.schemas.objects import State

from fleet.errors import FleetError
from tasks.states import RunFailed

# What prefect.flow_engine.run_flow logs (through the flow run's logger) when the final state's
# exception is re-raised at the end of a run; checked on Prefect 3.9.1.
_ENGINE_REPORT = "Engine execution exited with unexpected exception"
_FLOW_RUN_LOGGERS = ("prefect.flow_runs", "prefect.engine")


def run_data(state: State) -> Any:
    """What a finished run produced: its return value, or the data of a deliberate failure.

    A failure that was not deliberate (a bug: any other exception) is raised, so it shows
    its traceback; a FleetError is returned as it is (the caller prints its one line).
    """
    data = state.result(raise_on_failure=False)
    if isinstance(data, RunFailed):
        return data.data
    if isinstance(data, BaseException) and not isinstance(data, FleetError):
        raise data
    return data


class _QuietExpectedFailures(logging.Filter):
    """Drop the engine's traceback for a run that ended with `failed(...)`: the state says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, RunFailed) and str(record.msg).startswith(
            (_ENGINE_REPORT, "Execution of flow run")))


_FILTER = _QuietExpectedFailures()

# What prefect.task_engine logs for a task that raised (checked on Prefect 3.9.1): the exception's
# repr with its traceback, then the final state, whose message is str(exception) inside a repr.
_TASK_RAISED = "Task run failed with exception"
_TASK_FINISHED = "Finished in state Failed('Task run encountered an exception "


class _QuietLoggedTaskErrors(logging.Filter):
    """A failed launch logged the engine's traceback three times: fleet's own line, then Prefect's
    `Task run failed with exception: ServerFailed('…')` with a Python traceback, then `Finished in
    state Failed('…')`, both as one escaped string. Prefect's report of an error fleet already
    logged is dropped; its final state line keeps only the error's first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FleetError) and exc.logged and str(record.msg).startswith(_TASK_RAISED):
            return False
        msg = record.getMessage()
        if msg.startswith(_TASK_FINISHED) and "\\n" in msg:
            record.msg, record.args = msg.split("\\n", 1)[0] + " …' (the error is logged above)", None
        return True


_TASK_FILTER = _QuietLoggedTaskErrors()


def quiet_expected_failures() -> None:
    """Install the filters on the loggers the engine reports a run's end through (idempotent)."""
    for name in _FLOW_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    task_logger = logging.getLogger("prefect.task_runs")
    if _TASK_FILTER not in task_logger.filters:
        task_logger.addFilter(_TASK_FILTER)
