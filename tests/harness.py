"""The suite's own machinery for a busy machine: one slowdown factor for every deadline, and shared
starts (a Prefect server, an sshd) that retry once and then fail only the tests that use them.

Why a factor and not bigger constants: CI's 2-core machine is not guaranteed idle. At load 8–30 (two
CPU burners, other runs beside it) waits of 120 s ran out on things that were merely slow, and one
Prefect server that took longer than its 120 s to answer errored every test of its worker that
needed it (76 errors, a quarter of the modules). A deadline is there to end a test of something
broken, so it may grow with how busy the machine is: it costs nothing when the condition comes true.

The factor (≥ 1) is `FLEET_TEST_SLOWDOWN` when set (fixed: what you give is what every deadline is
multiplied by); otherwise the harness measures it once at session start (`measure`: the load
average per core, and how much of a short busy loop's wall time this process actually got the CPU)
and hands it to the workers and every subprocess in `FLEET_TEST_SLOWDOWN_MEASURED`; a wait that
starts when the machine is busier than that takes the larger of the two (`factor`). Capped at
`CAP`, so that something broken still fails in bounded time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

CAP = 6.0
ENV = "FLEET_TEST_SLOWDOWN"
MEASURED_ENV = "FLEET_TEST_SLOWDOWN_MEASURED"
PROBE_S = 0.2

T = TypeVar("T")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_factor() -> float:
    """The 1-minute load average per core the process may run on (1 on an idle machine)."""
    return os.getloadavg()[0] / _cpus()


def probe_factor(seconds: float = PROBE_S) -> float:
    """Wall time over CPU time of a short busy loop: how many times slower than its own CPU
    this process ran just now (≈ 1 idle; ≈ 3 when it got a third of a core)."""
    w0, c0 = time.monotonic(), time.process_time()
    x = 0
    while time.process_time() - c0 < seconds:
        x += 1
    wall, cpu = time.monotonic() - w0, time.process_time() - c0
    return wall / cpu if cpu > 0 else 1.0


def clamp(f: float) -> float:
    return min(CAP, max(1.0, f))


def measure() -> float:
    """The session's factor: the user's `FLEET_TEST_SLOWDOWN`, else the larger of load and probe."""
    given = os.environ.get(ENV)
    if given:
        try:
            return clamp(float(given))
        except ValueError:
            raise pytest.UsageError(f"{ENV}={given!r} is not a number: set it to a factor such as 2, "
                                    "or unset it to let the suite measure the machine") from None
    return clamp(max(load_factor(), probe_factor()))


def factor() -> float:
    """The factor for a deadline that starts now (see the module docstring)."""
    given = os.environ.get(ENV)
    if given:
        return measure()
    try:
        session = float(os.environ.get(MEASURED_ENV) or 1.0)
    except ValueError:
        session = 1.0
    return clamp(max(session, load_factor()))


def scaled(seconds: float) -> float:
    """`seconds` of an idle machine as a deadline on this one."""
    return seconds * factor()


def describe(value: Any, limit: int = 600) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} chars)"


def wait_until(check: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.02,
               what: str = "condition", state: Callable[[], Any] | None = None, scale: bool = True) -> T:
    """Poll `check` until it returns a truthy value (returned) or fail after `timeout` s of an idle
    machine, scaled by the slowdown factor at the start of the wait.

    A wait that runs out says what it waited for, for how long, and the last state it saw: `state()`
    when given (what the check looks at: a progress file, a process list), else the last value the
    check returned. The timeout is a deadline for something broken, not a speed check. `scale=False`:
    `timeout` is already this machine's (`start_twice` scaled it)."""
    limit = scaled(timeout) if scale else timeout
    deadline = time.monotonic() + limit
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            try:
                last = describe(state()) if state is not None else describe(value)
            except Exception as exc:  # the description must not hide the timeout
                last = f"(state() raised {type(exc).__name__}: {exc})"
            scaling = f" ({timeout:g} s × slowdown {limit / timeout:.2g})" if scale and limit != timeout else ""
            pytest.fail(f"timed out after {limit:g} s{scaling} waiting for {what}; last seen: {last}", pytrace=False)
        time.sleep(interval)


class StartFailed(Exception):
    """A shared start that failed twice; its message carries the start's own log tail."""


def start_twice(start: Callable[[float], T], *, what: str, timeout: float,
                log_tail: Callable[[], str], cleanup: Callable[[], None] | None = None) -> T:
    """`start(deadline_s)` once with `timeout` scaled, and once more with twice that when the first
    fails (a busy machine, a port taken meanwhile); then StartFailed with both reasons and the log tail.
    `cleanup` runs after a failed attempt (stop what it left behind)."""
    reasons = []
    for attempt, limit in enumerate((scaled(timeout), 2 * scaled(timeout)), 1):
        try:
            return start(limit)
        except (Exception, pytest.fail.Exception) as exc:   # pytest.fail: a check inside the start
            reasons.append(f"attempt {attempt} ({limit:g} s): {type(exc).__name__}: {str(exc)[:500]}")
            if cleanup is not None:
                cleanup()
    tail = log_tail().strip()
    raise StartFailed(f"{what} did not start, tried twice — " + "; ".join(reasons)
                      + (f"\n--- its log, last lines ---\n{tail}" if tail else "\n(its log is empty)"))


def tail_of(path: os.PathLike[str] | str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return ""
