"""Small edges of the command line an operator meets in the first hour (issue 12, "small ones")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.cli import export_dest, main
from fleet.generation.data.store import ResultStore
from test_gen_dispatch import sims  # noqa: F401  (the fixture is re-used)

ROOT = Path(__file__).parent.parent


def fleet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=120,
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


def test_dev_sh_without_arguments_prints_its_usage_only() -> None:
    """Fault: `./dev.sh` with no command printed `set -euo pipefail` as part of its usage."""
    r = subprocess.run(["bash", str(ROOT / "dev.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "set -euo" not in r.stdout
    assert r.stdout.splitlines()[0] == "One entry point for a fresh machine." and "./dev.sh test" in r.stdout
    bad = subprocess.run(["bash", str(ROOT / "dev.sh"), "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr and "set -euo" not in bad.stderr


def test_dev_sh_finds_a_user_installed_uv_instead_of_reinstalling(tmp_path: Path) -> None:
    """Fault: dev.sh installed uv with `pip install --user` into ~/.local/bin, which is not on
    PATH, so every later call installed it again (with pip's root warning). A uv in the user
    base's bin must be found and used."""
    home = tmp_path / "home"
    bin_dir = home / ".local" / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "uv-calls"
    (bin_dir / "uv").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "uv").chmod(0o755)
    venv = tmp_path / "venv"   # a stand-in venv: its python "has torch", so only fleet is installed
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "FLEET_PYTHON": sys.executable, "FLEET_VENV": str(venv),
           "FLEET_WHEELS": str(tmp_path / "no-wheels")}
    r = subprocess.run(["bash", str(ROOT / "dev.sh"), "setup"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "installing uv" not in r.stderr and "pip" not in r.stderr
    assert "pip install --quiet --compile-bytecode -e .[transformers,test]" in calls.read_text()
    assert (venv / ".fleet-setup").exists()
    # once set up, a second call does nothing at all (not even looking for uv)
    calls.unlink()
    r = subprocess.run(["bash", str(ROOT / "dev.sh"), "setup"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stderr == "" and not calls.exists()


def test_runner_final_line_and_manifest_give_the_same_tok_s(tmp_path: Path, sims,  # noqa: F811
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Fault: the runner's log said 12,194 tok/s and the manifest 22,359 for the same run: the
    log showed the last minute's rate, the manifest the run's average, both called "tok/s".
    Now running lines name both ("now", "avg") and the final line's avg is the manifest's."""
    from fleet.config import FleetConfig
    from fleet.generation.job.progress import Progress
    from fleet.generation.job.runner import run_local

    sim = sims("--tokens-per-s", "5000")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                           for i in range(30)))
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={"max_tokens": 32})
    assert run_local(cfg, inp, out, [{"node": "local", "index": 0, "url": sim.url, "model": "sim-model"}],
                     console=True, relaunch=False) == 0
    last = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[fleet generate]")][-1]
    manifest = json.loads((out / "manifest.json").read_text())
    avg = manifest["throughput"]["completion_tok_s"]
    assert avg > 0 and f"| avg {avg:,.0f} tok/s |" in last, last
    assert json.loads((out / "progress.json").read_text())["tok_s_avg"] == avg
    running = Progress.line({**json.loads((out / "progress.json").read_text()), "state": "running",
                              "tok_s": 12194.0, "tok_s_avg": 22359.0})
    assert "| 12,194 tok/s now, avg 22,359 |" in running
