"""The Prefect layer's retry policy: what a task retries, how often, how long it waits.

The core's waits are single attempts bounded by their own timeouts; a task retries only an
error that is transient (`fleet.errors.is_transient`): a dropped connection, an unreachable
node. Every task shares these options.
"""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from fleet.errors import is_transient


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except Exception as exc:  # the task's own exception
        return is_transient(exc)
    return False


TASK_OPTS: dict[str, Any] = dict(
    retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_jitter_factor=0.5,
    retry_condition_fn=_retry_transient, cache_policy=NO_CACHE, persist_result=False,
)
