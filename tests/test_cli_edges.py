"""Small edges of the command line an operator meets in the first hour (issue 12, "small ones")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.cli import export_dest, main
from fleet.generation.store import ResultStore

ROOT = Path(__file__).parent.parent


def fleet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("fmt, name", [("jsonl", "export.jsonl"), ("openai-batch", "export.openai-batch.jsonl"),
                                       ("sharegpt", "export.sharegpt.jsonl")])
def test_export_default_dest_names(fmt: str, name: str) -> None:
    """Fault: `fleet export DIR --format jsonl` wrote DIR/export.jsonl.jsonl."""
    assert export_dest("/data/out/", fmt) == f"/data/out/{name}"


def test_cli_export_jsonl_writes_export_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fault: the default jsonl export file was named export.jsonl.jsonl (end to end through the CLI)."""
    out = tmp_path / "job"
    with ResultStore(out, shard_rows=2) as s:
        s.add_result({"id": "a", "messages": [{"role": "user", "content": "hi"}], "completion": "hello",
                      "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 1, "server": "n/0",
                      "attempts": 1, "latency_s": 0.1, "started_at": 1.0, "finished_at": 2.0})
    assert main(["export", str(out), "--format", "jsonl"]) == 0
    assert f"to {out}/export.jsonl\n" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("export*")) == ["export.jsonl"]
    assert json.loads((out / "export.jsonl").read_text())["id"] == "a"


def test_sim_help_says_fleet_sim() -> None:
    """Fault: `fleet sim --help` printed `usage: sim-sglang`, a command that does not exist."""
    r = fleet("sim", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: fleet sim ") and "sim-sglang" not in r.stdout


def test_inspect_log_engine_has_help_text() -> None:
    """Fault: `inspect-log --help` listed `--engine {…}` with no explanation."""
    r = fleet("inspect-log", "--help")
    assert r.returncode == 0
    options = r.stdout.split("options:", 1)[1]
    text = " ".join(options.split("--engine", 1)[1].split("--json")[0].split())
    assert "engine whose log lines" in text


def test_status_and_down_call_the_column_server_like_up(tmp_path: Path) -> None:
    """Fault: `fleet up`'s summary calls the server column `server`, `fleet status` and `fleet down`
    called it `index`: one name in every table (and in status --json)."""
    from flows.fleet import SUMMARY_COLUMNS

    assert "server" in SUMMARY_COLUMNS and "index" not in SUMMARY_COLUMNS
    work = tmp_path / "work"
    (work / "servers").mkdir(parents=True)
    # a recorded server that is not running (no pid file): status and down still list it
    (work / "servers" / "edges-0.json").write_text(json.dumps({"fleet": "edges", "node": "local", "index": 0,
                                                               "port": 39999, "gpus": [], "started_at": 1.0}))
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'name = "edges"\n[[nodes]]\nname = "local"\nkind = "local"\nworkdir = "{work}"\n')
    st = fleet("status", "-c", str(cfg))
    assert st.stdout.split()[:3] == ["node", "server", "state"], st.stdout + st.stderr
    js = json.loads(fleet("status", "-c", str(cfg), "--json").stdout)
    assert js["servers"][0]["server"] == 0 and "index" not in js["servers"][0]
    down = fleet("down", "-c", str(cfg))
    assert down.returncode == 0 and down.stdout.split()[:3] == ["node", "server", "port"], down.stdout + down.stderr
