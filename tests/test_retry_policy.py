"""One retry policy per layer: the core's waits are single attempts that honour their timeout;
the Prefect tasks retry only what is transient and worth retrying (tasks/policy.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.errors import CommandTimeout, ConfigError, ConnectionLost, NodeUnreachable, ServerFailed, ServerNotReady
from tasks.policy import worth_retrying
from test_bringup import port_block, run, sim_config, teardown_after  # noqa: F401  (fixture re-used)


def test_the_task_policy_retries_only_transient_errors_worth_retrying() -> None:
    """A dropped connection or an unreachable node is retried; a bad config, a dead server and
    a server that used up servers.ready_timeout_s are not."""
    for exc in (ConnectionLost("x"), NodeUnreachable("x"), CommandTimeout("x")):
        assert worth_retrying(exc), exc
    for exc in (ServerNotReady("x"), ConfigError("x"), ServerFailed("x"), ValueError("x"), None):
        assert not worth_retrying(exc), exc


@pytest.mark.usefixtures("prefect_api")
def test_a_server_never_ready_is_waited_on_once(tmp_path: Path, teardown_after: Any,  # noqa: F811
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: ServerNotReady is transient and the launch task retried it twice, so a server alive
    but never ready was waited on 3 x servers.ready_timeout_s (45 min by default) although the
    config promises ready_timeout_s is the longest a bring-up waits. Now: one wait, then Failed."""
    import fleet.bringup   # the launch task's body (shared with `fleet up`'s adopt-only path), where it is called

    waits: list[float | None] = []
    real = fleet.bringup.wait_ready

    def counted(*args: Any, **kw: Any) -> Any:
        waits.append(args[1].servers.ready_timeout_s)
        return real(*args, **kw)

    monkeypatch.setattr(fleet.bringup, "wait_ready", counted)
    cfg = sim_config(tmp_path, port_block(1), n=1, engine={"sim": {"startup_s": 3600}},
                     servers={"ready_timeout_s": 2})
    teardown_after(cfg)
    ok, rows, message = run(cfg)
    assert not ok and "not ready after" in message, message
    assert waits == [2]


def test_one_backoff_rule() -> None:
    """The smoke client, the SSH connect retries and the dispatcher share one rule: exponential,
    capped, jitter only ever lengthens a delay (by at most its share)."""
    import random

    from fleet.backoff import backoff_delay

    assert [backoff_delay(n, 1.0, max_s=5.0) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert [backoff_delay(n, 0.2, factor=3.0) for n in (1, 2)] == pytest.approx([0.2, 0.6])
    rng = random.Random(7)
    for n in range(1, 8):
        d = backoff_delay(n, 0.5, max_s=4.0, jitter=0.5, rng=rng)
        plain = min(4.0, 0.5 * 2 ** (n - 1))
        assert plain <= d <= plain * 1.5
