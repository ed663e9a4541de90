"""The Prefect layer's retry policy: what a task retries, how often, how long it waits.

One policy per layer. The core's waits are single attempts bounded by their own timeouts
(`wait_ready` by servers.ready_timeout_s, a smoke by its attempts). A task retries only an
error that is transient and worth retrying (`worth_retrying`): a dropped connection, an
unreachable node, a command that ran past its deadline. A server still not ready after
servers.ready_timeout_s is transient in the error tree but is not retried here: the wait
already took the longest a bring-up waits for a server, and a retry would wait that long
again (3 x ready_timeout_s with two retries). Every task shares these options.
"""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from fleet.errors import ServerNotReady, is_transient

# Transient, yet retrying repeats a wait that already used its whole budget.
NOT_RETRIED: tuple[type[BaseException], ...] = (ServerNotReady,)


def worth_retrying(exc: BaseException | None) -> bool:
    return is_transient(exc) and not isinstance(exc, NOT_RETRIED)


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except Exception as exc:  # the task's own exception
        return worth_retrying(exc)
    return False


TASK_OPTS: dict[str, Any] = dict(
    retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_jitter_factor=0.5,
    retry_condition_fn=_retry_transient, cache_policy=NO_CACHE, persist_result=False,
)
