"""How a task or a run ends Failed on purpose, and how a flow reads a task's end (Prefect states).

`failed(message, data)` is a Failed state whose data is a `RunFailed` exception carrying the
message and what the task or run produced (summary rows, a check, a job summary), so the
engine can resolve it into an exception (never a bare list) and a caller still gets the rows.
`outcome(future)` turns a finished task future into (result, None) or (result or None, one
line saying why), never raising. Tasks return these states and flows read them, so they live
in the task layer; `flows.outcome` keeps what only the flow's engine needs (run_data, the
filters that keep a deliberate failure from reading like a crash).
"""

from __future__ import annotations

from typing import Any, TypeVar

from prefect.client.schemas.objects import State
from prefect.futures import PrefectFuture
from prefect.states import Failed

from fleet.errors import FatalError, FleetError

__all__ = ["RunFailed", "failed", "outcome"]


class RunFailed(FatalError):
    """A fleet run (or one of its tasks) ended Failed on purpose; `data` is what it produced."""

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (result persistence, process boundaries)
        return (type(self), (self.reason, self.data))


def failed(message: str, data: Any = None) -> State:
    """A Failed state with `message` that the engine can resolve into an exception (never a bare list)."""
    return Failed(message=message, data=RunFailed(message, data))


R = TypeVar("R")


def outcome(fut: PrefectFuture[R]) -> tuple[R, None] | tuple[R | None, str]:
    """(result, None) when the task completed; else (its result or None, one line saying why). Never
    raises. A task that ended through `failed(message, result)` gives back its result (the task's
    return type) and message; a fleet error's one line keeps its remedy (which setting to change),
    not just the reason."""
    fut.wait()  # bounded: a task's own waits all have timeouts (tests/test_waits.py)
    state = fut.state
    if state.is_completed():
        # bounded: the future is done (waited for above)
        return fut.result(), None
    # bounded: the future is done (waited for above)
    data = fut.result(raise_on_failure=False)
    if isinstance(data, RunFailed) and data.data is not None:
        result: R = data.data
        return result, state.message or data.reason
    if isinstance(data, FleetError):
        return None, data.one_line()[:800]
    if isinstance(data, BaseException):
        return None, (str(data).splitlines() or [type(data).__name__])[0][:800]
    return None, f"task ended {state.name}"
