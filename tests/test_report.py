"""`fleet report` reads what a run recorded, from a running Prefect API or from the embedded
server's database directly, and renders it at full width.

Real parts: the session's Prefect test server (a real server and its SQLite database), a real
flow run named like fleet's, real table and markdown artifacts.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("prefect_api")

WIDE = [f"column_number_{i}" for i in range(14)]  # ≈ 250 columns of header: far past 80


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    """One flow run `bringup-rep` of flow `fleet` with a wide table and a markdown artifact."""
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    @flow(name="fleet", flow_run_name="bringup-rep")
    def fake() -> str:
        create_table_artifact(key="rep-summary", table=[{c: f"v{i}-{c}" for c in WIDE} for i in range(3)],
                              description="rep: 3 server(s) up")
        create_markdown_artifact(key="rep-local-server-0-launch", markdown="## launch server 0: OK\n\n"
                                 "**Result**\n\n```json\n{\n  \"port\": 31000\n}\n```\n",
                                 description="launch local server 0 — OK")
        return "ok"

    state = fake(return_state=True)
    return {"run_id": str(state.state_details.flow_run_id)}


def _sources() -> dict[str, dict[str, str]]:
    """The environment that makes `fleet report` read the API, or the database directly."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL

    db = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    db = db.get_secret_value() if hasattr(db, "get_secret_value") else str(db)
    return {"api": {"PREFECT_API_URL": str(PREFECT_API_URL.value())},
            "sqlite": {"PREFECT_API_URL": "", "PREFECT_API_DATABASE_CONNECTION_URL": db}}


def run_report(monkeypatch: pytest.MonkeyPatch, source: str, *args: Any) -> str:
    from flows.report import report

    for k, v in _sources()[source].items():
        if v:
            monkeypatch.setenv(k, v)
        else:
            monkeypatch.delenv(k, raising=False)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert report(*args) == 0
    monkeypatch.undo()
    return out.getvalue()


@pytest.mark.parametrize("source", ["api", "sqlite"])
def test_report_renders_the_run_summary_at_full_width(monkeypatch: pytest.MonkeyPatch, recorded: dict[str, Any],
                                                      source: str) -> None:
    """Protects against what `prefect artifact inspect` showed in a terminal: a table cut at 80
    columns and markdown as escaped JSON. The whole header row is on one line; the markdown's
    text is rendered (no literal \\n, no quotes around it)."""
    text = run_report(monkeypatch, source, None, "bringup-rep", None, False, True)
    assert text.startswith("bringup-rep  Completed")
    assert recorded["run_id"] in text
    header = next(ln for ln in text.splitlines() if "column_number_0" in ln)
    assert all(c in header for c in WIDE), header  # not cut, not wrapped
    assert len(header) > 200
    assert "v2-column_number_13" in text
    assert "launch server 0: OK" in text and '"port": 31000' in text
    assert "\\n" not in text and '"## launch' not in text
    assert all(len(ln) == len(ln.rstrip()) for ln in text.splitlines())  # no padding to a fixed width


@pytest.mark.parametrize("source", ["api", "sqlite"])
def test_report_one_artifact_by_key_and_the_run_list(monkeypatch: pytest.MonkeyPatch, recorded: dict[str, Any],
                                                     source: str) -> None:
    text = run_report(monkeypatch, source, None, "last", "rep-local-server-0-launch", False, False)
    assert "from run bringup-rep" in text and "launch server 0: OK" in text
    assert "column_number_0" not in text
    listing = run_report(monkeypatch, source, None, "last", None, True, False)
    assert "bringup-rep" in listing and "Completed" in listing


def test_report_of_a_missing_run_is_one_line_with_the_remedy(monkeypatch: pytest.MonkeyPatch,
                                                             recorded: dict[str, Any]) -> None:
    from flows.report import ReportError

    for k, v in _sources()["sqlite"].items():
        monkeypatch.setenv(k, v) if v else monkeypatch.delenv(k, raising=False)
    from flows.report import report

    with pytest.raises(ReportError, match="no fleet run named 'bringup-nope'") as e:
        report(None, "bringup-nope", None, False, False)
    assert "fleet report --list" in e.value.one_line()


def test_report_never_imports_prefect(recorded: dict[str, Any]) -> None:
    """The report must stay fast on a busy machine: importing Prefect alone took 7 s there."""
    import subprocess

    code = ("import sys\nfrom flows.report import report\nreport(None, 'last', None, True, False)\n"
            "assert not [m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')], 'prefect imported'")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(_sources()["sqlite"])
    del env["PREFECT_API_URL"]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert "bringup-rep" in res.stdout


@pytest.fixture(scope="module")
def retried() -> dict[str, Any]:
    """One run `bringup-retried` whose first attempt fails with a summary of its own and whose
    retry (Prefect keeps the run and its id) completes with another."""
    from prefect import flow
    from prefect.artifacts import create_table_artifact

    tries: list[int] = []

    @flow(name="fleet", flow_run_name="bringup-retried", retries=1, retry_delay_seconds=0)
    def flaky() -> str:
        tries.append(1)
        n = len(tries)
        create_table_artifact(key="retried-summary", table=[{"server": "0", "state": f"attempt-{n}-table"}],
                              description=f"try {n}")
        if n == 1:
            raise RuntimeError("server 0 failed: first-try-cause")
        return "ok"

    state = flaky(return_state=True)
    assert state.is_completed() and len(tries) == 2
    return {"run_id": str(state.state_details.flow_run_id)}


@pytest.mark.parametrize("source", ["api", "sqlite"])
def test_report_of_a_retried_run_labels_each_attempt_latest_first(monkeypatch: pytest.MonkeyPatch,
                                                                 retried: dict[str, Any], source: str) -> None:
    """A retried run kept both tries' artifacts under one run: the report showed the first try's
    failing summary beside the new one with no label. Each try is labelled, the latest first,
    with the state that ended it."""
    text = run_report(monkeypatch, source, None, "bringup-retried", None, False, False)
    second, first = text.find("attempt 2 of 2 (latest)"), text.find("attempt 1 of 2")
    assert 0 <= second < first, text
    assert second < text.find("attempt-2-table") < first < text.find("attempt-1-table"), text
    assert "first-try-cause" in text[first:text.find("attempt-1-table")], text
    assert text.count("attempt-1-table") == 1 and text.count("attempt-2-table") == 1


def test_report_of_a_run_tried_once_has_no_attempt_labels(monkeypatch: pytest.MonkeyPatch,
                                                          recorded: dict[str, Any]) -> None:
    """A run tried once reads as before: no attempt rule."""
    text = run_report(monkeypatch, "sqlite", None, "bringup-rep", None, False, False)
    assert "attempt " not in text and "rep-summary" in text


def test_cause_tag_names_the_server_and_the_cause_in_one_short_line() -> None:
    """The tag the UI shows at a glance: the message without the repeated `[host] server N on port P:`
    and the log line's timing, one line, capped."""
    from flows.alerts import CAUSE_TAG_CHARS, cause_tag

    msg = ("1 server(s) up; 1 failed: local server 1 (port 31001): [localhost] server 1 on port 31001: fatal log "
           "line after 1.4 s: kv-no-memory: RuntimeError: Not enough memory. Please try to increase "
           "--mem-fraction-static.\n  stderr: tail — read /x/servers/b-1.log on the node; fix the cause and re-run")
    tag = cause_tag(msg)
    assert tag.startswith("failed: local server 1 (port 31001): kv-no-memory: RuntimeError"), tag
    assert "\n" not in tag and "[localhost]" not in tag and tag.endswith("…")
    assert len(tag) == len("failed: ") + CAUSE_TAG_CHARS
    assert cause_tag("generation: disk full") == "failed: generation: disk full"
