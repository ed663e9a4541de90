"""revalidate, teardown extras and the per-node lock, through the `fleet` flow in-process.

Real parts: the Prefect test server (`prefect_api`), the sim server processes, the local node.
The same actions through deployments and a worker are in test_deployments.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

from fleet.config import FleetConfig
from fleet.node import LocalNode
from fleet.servers import server_paths

pytestmark = pytest.mark.usefixtures("prefect_api")


def sim_config(tmp_path: Path, *, n: int = 3, **kw: Any) -> FleetConfig:
    from conftest import port_block

    model = tmp_path / "src" / "sim-model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"w" * 50_000)
    (tmp_path / "ram").mkdir(exist_ok=True)
    data: dict[str, Any] = {
        "name": "rv",
        "nodes": [{"name": "local", "workdir": str(tmp_path / "work"), "ramdisk": str(tmp_path / "ram")}],
        "engine": {"kind": "sim", "sim": {"startup_s": 0.2, "tokens_per_s": 5000}},
        "model": {"source": str(model), "stage_margin_gb": 0.0},
        "venv": {"path": str(tmp_path / "venv")},
        "servers": {"count": n, "base_port": port_block(n),
                    "ready_timeout_s": 60, "stop_grace_s": 2},
        "smoke": {"first_timeout_s": 10, "timeout_s": 2, "attempts": 2, "backoff_s": 0.1},
    }
    for k, v in kw.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return FleetConfig(**data)


def run(cfg: FleetConfig | str, action: str, **params: Any):
    from flows.fleet import fleet

    return fleet(config=cfg, action=action, return_state=True, **params)


def rows_of(state) -> dict[Any, dict[str, Any]]:
    from flows.outcome import run_data

    rows = run_data(state)
    assert isinstance(rows, list), rows
    return {r.get("server", r.get("what")): r for r in rows}


def pid_of(cfg: FleetConfig, index: int) -> int:
    return int(Path(server_paths(cfg.nodes[0].workdir, cfg.name, index).pid).read_text().split()[0])


def record_of(cfg: FleetConfig, index: int) -> dict[str, Any]:
    return json.loads(Path(server_paths(cfg.nodes[0].workdir, cfg.name, index).record).read_text())


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def read_artifacts(keys: list[str]) -> dict[str, Any]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def go():
        async with get_client() as client:
            arts = await client.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
            return {a.key: a for a in arts}

    return asyncio.run(go())


def flow_run_name(state) -> str:
    import asyncio

    from prefect.client.orchestration import get_client

    async def go():
        async with get_client() as client:
            return (await client.read_flow_run(state.state_details.flow_run_id)).name

    return asyncio.run(go())


@pytest.fixture
def stop_after():
    cfgs: list[FleetConfig] = []
    yield cfgs.append
    from fleet.servers import stop_servers

    for cfg in cfgs:
        for n in cfg.nodes:
            stop_servers(LocalNode(), cfg, n)


def test_revalidate_names_every_unhealthy_server_and_relaunches_nothing(tmp_path: Path, stop_after) -> None:
    """A killed server and one that crashes on its next request are both named; healthy peers
    pass; nothing is relaunched; the artifacts say why."""
    # server 2 dies at its 3rd generation: bring-up smoke (1), first revalidate (2), second (3).
    cfg = sim_config(tmp_path, n=3, servers={"extra_args_by_index": {2: ["--crash-after", "3"]}})
    stop_after(cfg)
    assert run(cfg, "bringup").is_completed()

    ok = run(cfg, "revalidate")
    assert ok.is_completed(), ok.message
    assert [r["state"] for r in rows_of(ok).values()] == ["healthy"] * 3
    assert flow_run_name(ok) == "revalidate-rv"
    assert record_of(cfg, 0)["smoke"]["by"] == "revalidate"

    killed = pid_of(cfg, 1)
    os.killpg(killed, signal.SIGKILL)
    # kill() returns before the process is gone: wait for that, or a busy machine revalidates a
    # server that is still dying (seen once at load 19) and the test blames the product
    wait_until(lambda: not LocalNode().is_alive(killed), what=f"pid {killed} to be gone after SIGKILL")
    bad = run(cfg, "revalidate")
    assert bad.is_failed()
    msg = bad.message or ""
    assert msg.startswith("2 server(s) unhealthy, 1 healthy")
    assert f"local server 1 (port {cfg.servers.port_for(1)}): process {killed} is not running" in msg
    assert f"local server 2 (port {cfg.servers.port_for(2)})" in msg and "during the smoke" in msg
    assert msg.endswith("remedy: run the bring-up to relaunch them (`fleet up -c FILE`, or the fleet's bringup "
                        f"deployment); each server's log excerpt is in `fleet report --run revalidate-{cfg.name}`")
    rows = rows_of(bad)
    assert rows[0]["state"] == "healthy" and rows[1]["process"] == "dead"
    assert rows[2]["state"] == "unhealthy" and rows[2]["log_verdict"] == "failed"  # the crash's log line
    assert "fatal log line" in rows[2]["problem"]

    # no relaunch: the killed server stays dead, its port closed, its record unchanged
    assert not LocalNode().is_alive(killed) and not listening(cfg.servers.port_for(1))
    assert record_of(cfg, 1)["pid"] == killed

    arts = read_artifacts(["rv-revalidate", "rv-local-server-1-revalidate", "rv-local-server-2-revalidate"])
    assert len(arts) == 3
    table = json.loads(arts["rv-revalidate"].data)
    assert [r["state"] for r in table] == ["healthy", "unhealthy", "unhealthy"]
    assert "process" in arts["rv-local-server-1-revalidate"].data and "FAILED" in arts["rv-local-server-1-revalidate"].data
    assert "Scheduler hit an exception" in arts["rv-local-server-2-revalidate"].data  # log excerpt


def test_revalidate_of_a_fleet_never_brought_up(tmp_path: Path) -> None:
    cfg = sim_config(tmp_path, n=2)
    st = run(cfg, "revalidate")
    assert st.is_failed()
    assert "local server 0" in st.message and "local server 1" in st.message and "never launched" in st.message


def test_teardown_stops_everything_frees_ramdisk_and_is_idempotent(tmp_path: Path, stop_after) -> None:
    cfg = sim_config(tmp_path, n=2)
    stop_after(cfg)
    assert run(cfg, "bringup").is_completed()
    pids = [pid_of(cfg, i) for i in range(2)]
    root = tmp_path / "ram" / f"fleet-{os.getuid()}" / cfg.name   # this user's copies of this fleet
    (staged,) = root.iterdir()
    assert (staged / ".fleet-stage.json").exists() and staged.name.startswith("sim-model-")

    st = run(cfg, "teardown", free_ramdisk=True)
    assert st.is_completed(), st.message
    rows = rows_of(st)
    assert {rows["server 0"]["action"], rows["server 1"]["action"]} <= {"stopped", "killed"}
    assert rows[f"ramdisk {root}"]["action"] == "freed" and rows[f"ramdisk {root}"]["bytes"] > 50_000
    assert not staged.exists() and not root.exists()
    assert not any(LocalNode().is_alive(p) for p in pids)
    assert "stopped 2 server(s), freed" in st.message
    assert "rv-teardown" in read_artifacts(["rv-teardown"])

    again = run(cfg, "teardown", free_ramdisk=True)
    assert again.is_completed()
    rows = rows_of(again)
    assert rows["server 0"]["action"] == "none" and rows[f"ramdisk {root}"]["action"] == "already gone"


def test_revalidate_after_teardown_says_nothing_is_up_until_the_next_bringup(tmp_path: Path, stop_after) -> None:
    """Fault: every scheduled revalidate after a teardown used to end Failed ("2 server(s)
    unhealthy … stopped (teardown…)") and alert until someone paused the schedule. Now a
    torn-down fleet revalidates Completed, "nothing is up (torn down at …)"; a bring-up makes it
    checked again, and a server dead after that bring-up fails it as before."""
    cfg = sim_config(tmp_path, n=2)
    stop_after(cfg)
    assert run(cfg, "bringup").is_completed()
    assert run(cfg, "teardown").is_completed()

    st = run(cfg, "revalidate")
    assert st.is_completed(), st.message
    assert re.fullmatch(r"nothing is up \(torn down at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC by teardown-rv\)",
                        st.message), st.message
    assert [r["state"] for r in rows_of(st).values()] == ["torn down"]
    # the summary now says the fleet is down: no older "up" reads as current
    summary = json.loads(read_artifacts(["rv-summary"])["rv-summary"].data)
    assert {r["state"] for r in summary} == {"stopped by teardown"}

    assert run(cfg, "bringup").is_completed()
    st = run(cfg, "revalidate")
    assert st.is_completed() and "2 server(s) healthy" in st.message
    os.killpg(pid_of(cfg, 0), signal.SIGKILL)
    st = run(cfg, "revalidate")
    assert st.is_failed() and "process" in st.message and "not running" in st.message


def test_revalidate_after_fleet_down_says_nothing_is_up(tmp_path: Path, stop_after) -> None:
    """`fleet down` is a teardown too: it leaves the same marker, so the scheduled revalidate
    does not alert about servers an operator stopped from the shell."""
    from fleet.cli import main
    from fleet.demo import to_toml

    cfg = sim_config(tmp_path, n=1)
    stop_after(cfg)
    path = tmp_path / "rv.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json")))
    assert run(str(path), "bringup").is_completed()
    assert main(["down", "-c", str(path)]) == 0
    st = run(str(path), "revalidate")
    assert st.is_completed() and st.message.startswith("nothing is up (torn down at ") and "by fleet down" in st.message


def test_artifacts_name_their_run_and_unreached_stages_say_not_run(tmp_path: Path, stop_after) -> None:
    """Fault: the artifacts page shows each key's newest version across runs, so an older run's
    `server-1-smoke` OK sat beside the latest run's `server-1-launch` FAILED. Every artifact's
    description now names its run and time, and a stage the latest run did not reach is
    re-written NOT RUN by that run."""
    cfg = sim_config(tmp_path, n=2)
    stop_after(cfg)
    assert run(cfg, "bringup").is_completed()
    old = read_artifacts(["rv-local-server-1-smoke"])["rv-local-server-1-smoke"]
    assert old.description.startswith("OK: smoke local server 1 — bringup-rv, ")
    assert "Run **bringup-rv**" in old.data or "Run [bringup-rv](" in old.data

    assert run(cfg, "teardown").is_completed()
    broken = cfg.model_copy(update={"servers": cfg.servers.model_copy(
        update={"extra_args_by_index": {1: ["--oom-at-start"]}})})
    st = run(broken, "bringup")
    assert st.is_failed()
    arts = read_artifacts(["rv-local-server-1-launch", "rv-local-server-1-smoke", "rv-summary"])
    assert arts["rv-local-server-1-launch"].description.startswith("FAILED: launch local server 1 — bringup-rv, ")
    smoke = arts["rv-local-server-1-smoke"]
    assert smoke.description.startswith("NOT RUN: smoke local server 1 (its launch failed) — bringup-rv, ")
    assert "NOT RUN" in smoke.data and smoke.latest_id != old.latest_id
    assert arts["rv-summary"].description.startswith("rv: 1 server(s) up, 1 failure(s)")


def test_unstage_keeps_a_copy_in_use_or_not_made_by_fleet(tmp_path: Path) -> None:
    """free_ramdisk must never pull a model from under a live server (another fleet's, say),
    nor delete a directory fleet did not stage."""
    from fleet.staging import unstage

    node = LocalNode()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    assert unstage(node, str(foreign))["action"].startswith("kept: no .fleet-stage.json")
    assert foreign.exists()

    staged = tmp_path / "model"
    staged.mkdir()
    (staged / ".fleet-stage.json").write_text("{}")
    user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--model-path", str(staged)])
    try:
        res = unstage(node, str(staged))
        assert res["action"] == f"kept: in use by pid {user.pid}" and staged.exists()
    finally:
        user.kill()
        user.wait()
    assert unstage(node, str(staged))["action"] == "freed" and not staged.exists()


def test_second_run_waits_for_the_node_then_gives_up(tmp_path: Path, stop_after) -> None:
    """While another run holds the node's concurrency limit, a bring-up waits; past node_wait_s
    it ends Failed saying the node is busy, having launched nothing."""
    from prefect.concurrency.sync import concurrency

    from tasks.locks import ensure_limits, lock_names

    cfg = sim_config(tmp_path, n=1)
    stop_after(cfg)
    names = lock_names(cfg)
    assert names == [f"fleet-node-local-{socket.gethostname().lower()}"]
    ensure_limits(names)
    with concurrency(names, strict=True):
        st = run(cfg, "bringup", node_wait_s=1.0)
    assert st.is_failed()
    assert "node busy" in st.message and names[0] in st.message
    assert not Path(server_paths(cfg.nodes[0].workdir, cfg.name, 0).record).exists()  # nothing launched
    assert run(cfg, "bringup").is_completed()  # the slot was released


def test_config_by_path_block_or_variable(tmp_path: Path) -> None:
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    from fleet.demo import to_toml
    from fleet.errors import ConfigError
    from flows.params import resolve_config

    cfg = sim_config(tmp_path, n=1)
    data = cfg.model_dump(mode="json")
    path = tmp_path / "f.toml"
    path.write_text(to_toml(data))
    assert resolve_config(str(path)) == cfg
    Secret(value=data).save("fleet-rv-json", overwrite=True)
    Secret(value=to_toml(data)).save("fleet-rv-toml", overwrite=True)
    Variable.set("fleet_rv", data, overwrite=True)
    assert resolve_config("block:secret/fleet-rv-json") == cfg
    assert resolve_config("block:fleet-rv-toml") == cfg  # a bare name is a Secret
    assert resolve_config("variable:fleet_rv") == cfg
    with pytest.raises(ConfigError, match="no Prefect block"):
        resolve_config("block:secret/absent")
    with pytest.raises(ConfigError, match="no Prefect variable"):
        resolve_config("variable:absent")
    Secret(value="[[nodes]\nbroken").save("fleet-rv-bad", overwrite=True)
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve_config("block:fleet-rv-bad")


def test_fleet_config_block_keeps_secrets_and_runs_are_named_after_the_fleet(tmp_path: Path) -> None:
    """The fleet-config block (what `fleet deploy` saves) gives back the config with its secrets (API key,
    engine.env), which the API shows masked;
    a run whose config is a block or a variable is named after the fleet, not the reference
    (a `variable:` config used to rename the runs after the variable)."""
    from prefect.variables import Variable

    from flows.deploy import save_config_block
    from flows.params import resolve_config

    from prefect.client.orchestration import get_client

    cfg = sim_config(tmp_path, n=1, servers={"api_key": "sk-rv-secret"}, engine={"env": {"HF_TOKEN": "hf-rv-456"}})
    assert save_config_block(cfg) == "fleet-config/rv"
    back = resolve_config("block:fleet-config/rv")
    assert back == cfg and back.api_key() == "sk-rv-secret"
    assert back.engine.env["HF_TOKEN"].get_secret_value() == "hf-rv-456"
    # what the UI reads: no secret in clear (a SecretStr inside a dict is not masked by Prefect)
    with get_client(sync_client=True) as client:
        doc = client.read_block_document_by_name("rv", "fleet-config", include_secrets=False)
    shown = json.dumps(doc.data, default=str)
    assert "sk-rv-secret" not in shown and "hf-rv-456" not in shown and "HF_TOKEN" in shown
    Variable.set("some_variable", sim_config(tmp_path, n=1).model_dump(mode="json"), overwrite=True)
    for ref in ("variable:some_variable", "block:fleet-config/rv"):
        st = run(ref, "revalidate")
        assert flow_run_name(st) == "revalidate-rv", ref
