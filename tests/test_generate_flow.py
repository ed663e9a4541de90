"""The `generate` action end to end: bring-up, the detached runner, watching, re-attaching, fetch.

Real parts: the Prefect test server, sim servers, the runner process, the real sshd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import RAMDISK
from fleet.node import LocalNode
from test_bringup import port_block, sim_config

pytestmark = pytest.mark.usefixtures("prefect_api")


def prompts(path: Path, n: int, bad_lines: int = 0) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n")
        for _ in range(bad_lines):
            f.write("{not json\n")
    return path


@pytest.fixture
def stop_everything():
    cfgs = []
    yield cfgs.append
    from fleet.node import connect
    from fleet.servers import stop_servers

    for cfg in cfgs:
        for n in cfg.nodes:
            with connect(n) as node:   # the runner first: a live runner relaunches a server stopped under it
                node.run(["sh", "-c", 'for p in "$1"/jobs/*/runner.pid; do [ -f "$p" ] && { read -r pid _ < "$p"; kill -9 "$pid"; }; done; true',
                          "x", n.workdir], check=False)
                stop_servers(node, cfg, n)


def shard_ids(out: Path) -> list[str]:
    return [i for p in sorted((out / "shards").glob("*.parquet")) for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]


def test_generate_local_end_to_end(tmp_path: Path, stop_everything) -> None:
    from flows.fleet import fleet

    cfg = sim_config(tmp_path, port_block(2), n=2, generation={"max_tokens": 32})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 300, bad_lines=2)
    out = tmp_path / "out"
    state = fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), res
    assert (res["completed"], res["errors"], res["rejects"]) == (300, 0, 2)
    ids = shard_ids(out)
    assert len(ids) == len(set(ids)) == 300
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["checks"] and manifest["throughput"]
    # running it again is a no-op resume: nothing sent twice
    state = fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
    assert state.is_completed() and sorted(shard_ids(out)) == sorted(ids)


@pytest.mark.ssh
def test_generate_over_ssh_runner_on_node_then_fetch(tmp_path: Path, sshd, stop_everything) -> None:
    """On an SSH node the runner runs from its own venv and a zip of fleet; `fleet fetch` brings the data back."""
    from fleet.generation.job.remote import fetch
    from fleet.node.ssh import SSHNode
    from flows.fleet import fleet

    node = sshd.node_config(name="remote", workdir=str(tmp_path / "rwork"))
    cfg = sim_config(tmp_path, port_block(2), n=2, node=node.model_dump(mode="json"), generation={"max_tokens": 16})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 120)
    remote_out = str(tmp_path / "remote-out")
    state = fleet(config=cfg, action="generate", input=str(inp), output=remote_out, return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), res
    assert res["completed"] == 120
    local = tmp_path / "fetched"
    files = fetch(SSHNode.from_config(node), remote_out, local)
    assert "manifest.json" in files and any(f.startswith("shards/") for f in files)
    assert len(shard_ids(local)) == 120


def test_flow_killed_runner_goes_on_then_reattached(tmp_path: Path, stop_everything) -> None:
    """SIGKILL of the controlling `fleet generate` mid-job: the runner keeps going; running the command again
    re-attaches to it (no second runner) and ends with every id exactly once."""
    from fleet.demo import to_toml
    from fleet.jobs import job_dir

    # ~10 rows/s (4 slots per server, 0.8 s per answer): the job outlives the first command's death
    cfg = sim_config(tmp_path, port_block(2), n=2,
                     engine={"sim": {"startup_s": 0.3, "tokens_per_s": 20, "max_running_requests": 4}},
                     generation={"max_tokens": 16})
    stop_everything(cfg)
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    inp = prompts(tmp_path / "in.jsonl", 300)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "flows.cli", "generate", "-c", str(path), "--input", str(inp), "--output", str(out)]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    progress = out / "progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if progress.exists() and json.loads(progress.read_text()).get("rows_done", 0) > 20:
            break
        assert first.poll() is None, first.stdout.read().decode()[-3000:]
        time.sleep(0.2)
    else:
        pytest.fail("the job never made progress")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    runner_pid = int(Path(job_dir(cfg.nodes[0], cfg, str(out)), "runner.pid").read_text().split()[0])
    assert LocalNode().is_alive(runner_pid), "the runner died with the flow"
    # Hold the runner still (alive, as a busy one is) until the second command has re-attached:
    # that command first starts Prefect's temporary server and re-runs the bring-up, 30+ s on a
    # loaded 2-core machine, and a job that finished meanwhile leaves nothing to re-attach to.
    os.kill(runner_pid, signal.SIGSTOP)
    second_log = tmp_path / "second.log"
    attached = f"re-attached to runner pid {runner_pid}"
    try:
        with second_log.open("wb") as f:
            second = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while attached not in second_log.read_text(errors="replace") and second.poll() is None:
            assert time.monotonic() < deadline, "the second command never re-attached"
            time.sleep(0.2)
    finally:
        os.kill(runner_pid, signal.SIGCONT)
    try:
        rc = second.wait(timeout=300)
    finally:
        if second.poll() is None:
            second.kill()
    output = second_log.read_text(errors="replace")
    assert rc == 0, output[-6000:]
    assert attached in output
    ids = shard_ids(out)
    assert len(ids) == len(set(ids)) == 300


def test_the_flows_generate_action_goes_on_under_a_larger_limit(tmp_path: Path, stop_everything) -> None:
    """Fault: a job finished under `limit = 100` answered a later run with `limit = 200` "nothing to do:
    100 rows already done" (Completed), 100 of 300 rows done. Now the flow's generate action goes on to
    200, each id once; a smaller limit after that is "nothing to do" naming the 200 rows."""
    from flows.fleet import fleet

    cfg = sim_config(tmp_path, port_block(1), n=1, generation={"max_tokens": 16, "limit": 100})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 300)
    out = tmp_path / "out"

    def generate(limit: int) -> tuple[str, dict]:
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.generation.limit = limit
        state = fleet(config=run_cfg, action="generate", input=str(inp), output=str(out), return_state=True)
        res = state.result(raise_on_failure=False)
        assert state.is_completed(), (state.message, res)
        return str(state.message), res

    message, _ = generate(100)
    assert sorted(shard_ids(out)) == sorted(f"r{i}" for i in range(100)), message
    message, res = generate(200)
    assert "nothing to do" not in message and "generated 100 row(s) in this run" in message, message
    ids = shard_ids(out)
    assert len(ids) == len(set(ids)) and set(ids) == {f"r{i}" for i in range(200)}
    message, res = generate(150)
    assert message.startswith(f"nothing to do: 200 rows already done in {out}"), message
    assert sorted(shard_ids(out)) == sorted(ids)


def test_fleet_generate_without_limit_goes_on_after_a_limited_job(tmp_path: Path, stop_everything, capsys) -> None:
    """Fault: `fleet generate --limit 100` then the same command without `--limit` printed "nothing to do:
    100 rows already done", exit 0, with 100 of 300 rows done: a user believed the set complete. Now the
    second command generates the other 200 (each id once) and only a third says "nothing to do: 300".
    (The generating command runs as a process: Prefect's log handler must not bind to a captured stream.)"""
    from fleet.demo import to_toml
    from flows.cli import main

    cfg = sim_config(tmp_path, port_block(1), n=1, generation={"max_tokens": 16})
    stop_everything(cfg)
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    inp = prompts(tmp_path / "in.jsonl", 300)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "flows.cli", "generate", "-c", str(path), "--input", str(inp), "--output", str(out)]
    for extra, want in ((["--limit", "100"], 100), ([], 300)):
        r = subprocess.run(argv + extra, capture_output=True, text=True, timeout=400)
        text = r.stdout + r.stderr
        assert r.returncode == 0, text[-4000:]
        assert "nothing to do" not in text, text[-4000:]
        ids = shard_ids(out)
        assert len(ids) == len(set(ids)) == want, text[-4000:]
    assert "going on with the job" in text and "this run asks for every row" in text, text[-4000:]
    assert "generated 200 row(s) in this run" in text, text[-4000:]
    assert main(["generate", "-c", str(path), "--input", str(inp), "--output", str(out)]) == 0
    assert f"nothing to do: 300 rows already done in {out}" in capsys.readouterr().out


@pytest.mark.transformers
def test_generate_with_real_transformers_servers_readable_by_pandas(tmp_path: Path, stop_everything) -> None:
    """A small real job: two `transformers serve` on CPU, the tiny local model, the output read by pandas."""
    import pandas as pd

    from fleet.config import FleetConfig
    from fleet.tinymodel import build_tiny_model
    from flows.fleet import fleet

    model = build_tiny_model(tmp_path / "models" / "tiny-chat")
    cfg = FleetConfig(
        name="tfgen", nodes=[{"name": "local", "workdir": str(tmp_path / "work"), "ramdisk": RAMDISK}],
        engine={"kind": "transformers", "device": "cpu", "continuous_batching": False},
        model={"source": str(model), "stage_margin_gb": 0.0},
        venv={"path": sys.prefix, "use_existing": True},
        servers={"count": 2, "base_port": port_block(2), "ready_timeout_s": 120, "stop_grace_s": 5},
        smoke={"first_timeout_s": 60, "attempts": 2, "max_tokens": 8},
        generation={"max_tokens": 12, "temperature": 0.6, "max_concurrency_per_server": 4},
    )
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 24)
    out = tmp_path / "out"
    state = fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), res
    df = pd.read_parquet(out / "shards")
    assert len(df) == 24 and df["id"].is_unique and set(df["id"]) == {f"r{i}" for i in range(24)}
    assert (df["completion_tokens"] > 0).all() and (df["completion_tokens"] <= 12).all()
    assert set(df["server"]) <= {"local/0", "local/1"} and df["finish_reason"].isin(["stop", "length"]).all()
