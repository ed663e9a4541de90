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
