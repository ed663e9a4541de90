"""The suite's own harness (tests/harness.py, conftest.py): deadlines scaled by one slowdown factor, and
shared starts that retry once and then fail only the tests that use them, with the start's log tail.

The fault it protects against: a busy CI run (load 8–30) where one Prefect server took longer than
its 120 s to answer, and the session fixture's `RuntimeError: Timed out while attempting to connect to
ephemeral Prefect API server` errored every test of that worker that needed a Prefect API (76 errors
in a quarter of the modules), with nothing of the server's own log to say why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_the_factor_is_the_variable_when_set_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(harness.ENV, "2.5")
    assert harness.measure() == harness.factor() == 2.5 and harness.scaled(10) == 25
    monkeypatch.setenv(harness.ENV, "0.1")   # never shorter than an idle machine's deadline
    assert harness.factor() == 1.0
    monkeypatch.setenv(harness.ENV, "1000")   # something broken still fails in bounded time
    assert harness.factor() == harness.CAP
    monkeypatch.setenv(harness.ENV, "fast")
    with pytest.raises(pytest.UsageError, match="FLEET_TEST_SLOWDOWN='fast' is not a number"):
        harness.measure()


def test_unset_the_factor_is_the_measured_one_or_the_load_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(harness.ENV, raising=False)
    monkeypatch.setenv(harness.MEASURED_ENV, "3")
    monkeypatch.setattr(harness, "load_factor", lambda: 1.2)
    assert harness.factor() == 3.0
    monkeypatch.setattr(harness, "load_factor", lambda: 4.5)   # busier now than at the start
    assert harness.factor() == 4.5
    monkeypatch.setattr(harness, "probe_factor", lambda: 2.0)
    assert harness.measure() == 4.5


def test_a_wait_that_runs_out_says_what_it_waited_for_and_the_last_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(harness.ENV, "2")
    seen = iter(range(10**6))
    with pytest.raises(pytest.fail.Exception) as e:
        harness.wait_until(lambda: None, timeout=0.01, what="the node marked lost",
                           state=lambda: {"rows_done": next(seen)})
    msg = str(e.value)
    assert "timed out after 0.02 s (0.01 s × slowdown 2) waiting for the node marked lost" in msg
    assert "last seen: {'rows_done': " in msg
    with pytest.raises(pytest.fail.Exception, match=r"last seen: \[\]"):   # no state(): the check's last value
        harness.wait_until(lambda: [], timeout=0.01, what="backups out")
    assert harness.wait_until(lambda: "ok", timeout=0.01) == "ok"


def test_a_start_is_tried_again_with_a_longer_wait_then_fails_with_its_log_tail(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(harness.ENV, "1")
    limits: list[float] = []
    cleaned: list[int] = []

    def flaky(limit: float) -> str:
        limits.append(limit)
        if len(limits) == 1:
            raise RuntimeError("not yet")
        return "up"

    assert harness.start_twice(flaky, what="x", timeout=10, log_tail=lambda: "", cleanup=lambda: cleaned.append(1)) == "up"
    assert limits == [10, 20] and cleaned == [1]

    log = tmp_path / "server.log"
    log.write_text("starting\nsqlite3.OperationalError: unable to open database file\n")

    def never(limit: float) -> str:
        pytest.fail("a check inside the start")   # pytest.fail too is a failed attempt, not the end

    with pytest.raises(harness.StartFailed) as e:
        harness.start_twice(never, what="the thing", timeout=1, log_tail=lambda: harness.tail_of(log))
    msg = str(e.value)
    assert msg.startswith("the thing did not start, tried twice — attempt 1 (1 s)")
    assert "attempt 2 (2 s)" in msg and msg.endswith("sqlite3.OperationalError: unable to open database file")


# In the sub-run's processes: a Prefect server (uvicorn's `…:create_app`) exits at once, as one that
# cannot open its database or import its app does; every other process runs as usual.
BROKEN_SERVER = """
import os, sys
if any("create_app" in a for a in sys.orig_argv):
    sys.stderr.write("stand-in fault: this Prefect server cannot start (tests/test_harness.py)\\n")
    sys.stderr.flush()
    os._exit(1)
"""


def test_a_prefect_server_that_cannot_start_fails_only_its_tests_with_its_log(tmp_path: Path) -> None:
    """End to end through conftest.py's own `prefect_api` in a pytest run of its own, where every
    Prefect server exits as it starts: the two tests that use it fail, each with both attempts and the
    server's own log line, and the one beside them passes. (Before: Prefect's harness polled a server
    that had exited for its whole 120 s and raised `RuntimeError: Timed out while attempting to connect
    to ephemeral Prefect API server`, with nothing of the server's log, in every test that used it.)"""
    (tmp_path / "test_sub.py").write_text(
        "def test_one(prefect_api):\n    pass\n\n"
        "def test_two(prefect_api):\n    pass\n\n"
        "def test_beside_them():\n    pass\n")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BROKEN_SERVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTEST_", "FLEET_TEST_", "SUITE_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(TESTS), str(ROOT)]), FLEET_TEST_SLOWDOWN="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "0",
                        "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_sub.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=harness.scaled(600))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "1 passed, 2 errors" in out, out
    errors = [block for block in out.split("_ ERROR at setup of ")[1:]]
    assert len(errors) == 2 and [e.split(" ")[0] for e in errors] == ["test_one", "test_two"], out
    for e in errors:   # each: both attempts, the server's own log tail, and not the harness's traceback
        assert "the session's Prefect server (flows/localserver.py) did not start, tried twice" in e, e
        assert "attempt 1 (45 s)" in e and "attempt 2 (90 s)" in e, e
        assert "--- its log, last lines ---\nstand-in fault: this Prefect server cannot start" in e, e
        assert "conftest.py:" not in e and "harness.py:" not in e, e
