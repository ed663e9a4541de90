"""Generation over servers fleet did not start (`[[endpoints]]`): the config, a stand-in that goes
away and comes back, and one job mixing fleet-launched servers and an endpoint.

Every endpoint here is a real `fleet sim` process the test starts itself (with
`--openai-only` it is a plain OpenAI-compatible server: no /health, /metrics or /server_info);
waits poll with deadlines, never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from conftest import free_port, wait_until
from fleet.config import FleetConfig, load_config
from fleet.errors import ConfigError


class StandIn:
    """`fleet sim` on a fixed port, started by the test, that can be killed and started again."""

    def __init__(self, tmp: Path, *flags: str, key: str | None = None, port: int | None = None) -> None:
        self.tmp, self.flags, self.key = tmp, flags, key
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> StandIn:
        self.starts += 1
        env = dict(os.environ)
        if self.key:
            env["FLEET_ENGINE_API_KEY"] = self.key   # how the sim takes a key without argv
        log = (self.tmp / f"standin-{self.port}-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "sim", "--port", str(self.port),
                                      "--startup-s", "0", *self.flags], stdout=log, stderr=subprocess.STDOUT, env=env)
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return httpx.get(self.url + "/v1/models", headers=headers, timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(up, timeout=60, what=f"stand-in on {self.url}")
        return self

    def log(self) -> str:
        return (self.tmp / f"standin-{self.port}-{self.starts}.log").read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def standins(tmp_path: Path):
    made: list[StandIn] = []

    def make(*flags: str, **kw: Any) -> StandIn:
        s = StandIn(tmp_path, *flags, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.kill()


def prompts(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n")
    return path


def shard_rows(out: Path) -> list[dict[str, Any]]:
    return [r for p in sorted((out / "shards").glob("*.parquet"))
            for r in pq.read_table(p, columns=["id", "server"]).to_pylist()]


# ---------------------------------------------------------------------------- the config

def test_endpoint_config_is_checked_before_anything_runs(tmp_path: Path) -> None:
    """What a config may say of an endpoint: a trailing /v1 is dropped (users paste the OpenAI
    base URL); credentials in the URL are refused without echoing them (the URL is written to
    job.json, progress and every row); servers.count = 0 needs endpoints; endpoints join a
    one-node job; one key source; a key variable not set is one clear error naming it."""
    from fleet.generation.job.endpoints import endpoint_keys

    cfg = FleetConfig(servers={"count": 0}, endpoints=[{"name": "router", "url": "http://10.0.0.5:30000/v1/"}])
    assert cfg.endpoints[0].url == "http://10.0.0.5:30000" and not cfg.launches_servers
    assert FleetConfig().launches_servers and not FleetConfig().endpoints
    path = tmp_path / "c.toml"
    path.write_text('[[endpoints]]\nname = "x"\nurl = "http://user:sk-hush-77@h:1"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "credentials" in str(err.value) and "sk-hush-77" not in str(err.value)
    with pytest.raises(ValueError, match="servers.count = 0"):
        FleetConfig(servers={"count": 0})
    with pytest.raises(ValueError, match="one-node job"):
        FleetConfig(nodes=[{"name": "a"}, {"name": "b"}], endpoints=[{"name": "x", "url": "http://h:1"}])
    with pytest.raises(ValueError, match="not both"):
        FleetConfig(endpoints=[{"name": "x", "url": "http://h:1", "api_key_env": "K", "api_key_secret": "k"}])
    with pytest.raises(ValueError, match="unique"):
        FleetConfig(endpoints=[{"name": "x", "url": "http://h:1"}, {"name": "x", "url": "http://h:2"}])
    keyed = FleetConfig(endpoints=[{"name": "x", "url": "http://h:1", "api_key_env": "ROUTER_KEY"}])
    with pytest.raises(ConfigError, match="ROUTER_KEY is not set"):
        endpoint_keys(keyed, environ={})
    assert endpoint_keys(keyed, environ={"ROUTER_KEY": "k1"}) == {"ENDPOINT_API_KEY_0": "k1"}
    secret = FleetConfig(endpoints=[{"name": "x", "url": "http://h:1", "api_key_secret": "router-key"}])
    assert endpoint_keys(secret, load_secret={"router-key": "k2"}.__getitem__) == {"ENDPOINT_API_KEY_0": "k2"}


# ---------------------------------------------------------------------------- down and back

def test_an_openai_only_endpoint_that_goes_away_and_comes_back_is_readmitted_rows_exactly_once(
        tmp_path: Path, standins) -> None:
    """A server fleet did not start has no launch spec: when it goes away (killed mid-job) the
    runner must not try to relaunch it, must not lose or double the rows it held, and must take
    it back once it answers again. It is a plain OpenAI server (no /health, /metrics or
    /server_info: health is /v1/models, the model is read from there, progress is its streamed
    chunks) behind a key. With it the job's only server, the job pauses while it is away and
    finishes only if it was re-admitted."""
    from fleet.generation.job.endpoints import endpoint_entries
    from fleet.generation.job.runner import run_local

    key = "sk-standin-31f0"
    # slow enough (about 9 s for the job) that it is killed mid-job, not after it
    standin = standins("--openai-only", "--tokens-per-s", "40", "--model-name", "their-model", key=key).start()
    # max_in_flight is the endpoint's own (a router's sum over its workers): above the per-server cap
    cfg = FleetConfig(servers={"count": 0}, engine={"kind": "sim"},
                      generation={"max_tokens": 24, "max_concurrency_per_server": 4},
                      smoke={"first_timeout_s": 10, "timeout_s": 5, "attempts": 2, "backoff_s": 0.1},
                      endpoints=[{"name": "standin", "url": standin.url, "api_key_env": "STANDIN_KEY",
                                  "max_in_flight": 8}])
    inp, out = prompts(tmp_path / "in.jsonl", 240), tmp_path / "out"
    result: list[int] = []
    job = threading.Thread(target=lambda: result.append(run_local(
        cfg, inp, out, endpoint_entries(cfg), progress_interval_s=0.1, flush_interval_s=0.5,
        endpoint_keys={"ENDPOINT_API_KEY_0": key},
        dispatch={"down_after": 2, "probe_interval_s": 0.1, "recovery_backoff_s": 0.2,
                  "recovery_backoff_max_s": 0.5})))
    job.start()

    def server() -> dict[str, Any]:
        try:
            p = json.loads((out / "progress.json").read_text())
        except (OSError, ValueError):
            return {}
        return next((s for s in p.get("servers") or [] if s["name"] == "endpoint/standin"), {})
    try:
        wait_until(lambda: server().get("requests", 0) >= 30, timeout=120, what="rows through the stand-in")
        standin.kill()
        wait_until(lambda: server().get("state") in ("down", "recovering"), timeout=60, what="stand-in taken out")
        done_while_away = server()["requests"]
        standin.start()
    finally:
        job.join(timeout=300)
    assert result == [0], (out / "progress.json").read_text()
    rows = shard_rows(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 240
    assert {r["server"] for r in rows} == {"endpoint/standin"}
    manifest = json.loads((out / "manifest.json").read_text())
    final = next(s for s in json.loads((out / "progress.json").read_text())["servers"]
                 if s["name"] == "endpoint/standin")
    assert final["downs"] >= 1 and final["requests"] > done_while_away, final
    # issue 34: fleet did not start it and restarted nothing: a re-admission, not a restart
    assert final["restarts"] == 0 and final["readmissions"] >= 1, final
    (recorded,) = manifest["servers"]
    assert recorded["restarts"] == 0 and recorded["readmissions"] >= 1, recorded
    assert final["progress"] == "stream", final   # no /metrics: its streamed chunks are the progress
    assert final["concurrency"] == 8, final
    assert manifest["counts"]["completed"] == 240 and not manifest["counts"].get("errors"), manifest["counts"]
    # the model name, not in the config, was read from its /v1/models
    assert [s["model"] for s in manifest["servers"]] == ["their-model"]


# ---------------------------------------------------------------------------- mixed

@pytest.mark.usefixtures("prefect_api")
def test_one_job_mixes_fleet_launched_servers_and_an_endpoint(tmp_path: Path, standins) -> None:
    """The flow's generate action brings up the servers fleet launches and sends the same job
    through them and an endpoint it did not start (a `fleet sim` the test runs, with its own
    concurrency): one queue, both kinds of server take rows, every row exactly once."""
    from flows.fleet import fleet
    from test_bringup import port_block, sim_config

    ext = standins("--tokens-per-s", "2000", "--model-name", "ext-model").start()
    cfg = sim_config(tmp_path, port_block(1), n=1, generation={"max_tokens": 24},
                     endpoints=[{"name": "ext", "url": ext.url, "max_in_flight": 16}])
    inp, out = prompts(tmp_path / "in.jsonl", 300), tmp_path / "out"
    try:
        state = fleet(config=cfg, action="generate", input=str(inp), output=str(out), return_state=True)
        res = state.result(raise_on_failure=False)
        assert state.is_completed(), res
        assert (res["completed"], res["errors"]) == (300, 0)
    finally:
        fleet(config=cfg, action="teardown", return_state=True)
    rows = shard_rows(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 300
    by_server = {s: sum(1 for r in rows if r["server"] == s) for s in {r["server"] for r in rows}}
    assert set(by_server) == {"local/0", "endpoint/ext"} and min(by_server.values()) > 0, by_server
    manifest = json.loads((out / "manifest.json").read_text())
    urls = {s["name"]: s.get("url") for s in manifest["servers"]}
    assert urls["endpoint/ext"] == ext.url, urls


@pytest.mark.usefixtures("prefect_api")
def test_bringup_of_an_endpoints_only_config_builds_nothing(tmp_path: Path) -> None:
    """servers.count = 0 launches no server: `fleet up` on such a config must not build a venv,
    stage the model into the RAM disk or write launch records for servers that will never run."""
    from flows.fleet import fleet

    cfg = FleetConfig(name="t", nodes=[{"name": "local", "workdir": str(tmp_path / "work"),
                                        "ramdisk": str(tmp_path / "shm")}],
                      venv={"path": str(tmp_path / "venv")}, model={"source": str(tmp_path / "model")},
                      servers={"count": 0}, endpoints=[{"name": "x", "url": "http://127.0.0.1:9"}])
    state = fleet(config=cfg, action="bringup", return_state=True)
    assert state.is_completed() and "nothing to bring up" in (state.message or ""), state.message
    assert not any(p.exists() for p in (tmp_path / "work", tmp_path / "shm", tmp_path / "venv"))


@pytest.mark.usefixtures("prefect_api")
def test_an_endpoint_key_comes_from_a_prefect_secret_block() -> None:
    """`api_key_secret` names a Secret block: the flow's process reads it through its installed
    credential store (the Prefect one) and hands it to the runner under the endpoint's variable;
    a block that is not there is one clear error naming it, before any job starts."""
    from prefect.blocks.system import Secret

    import tasks.nodes  # noqa: F401  (installs the Prefect credential store, as the flow's tasks do)
    from fleet.generation.job.endpoints import endpoint_keys

    Secret(value="sk-from-block-4d2").save("endpoint-key-test", overwrite=True)
    cfg = FleetConfig(endpoints=[{"name": "a", "url": "http://h:1"},
                                 {"name": "b", "url": "http://h:2", "api_key_secret": "endpoint-key-test"}])
    assert endpoint_keys(cfg) == {"ENDPOINT_API_KEY_1": "sk-from-block-4d2"}
    missing = FleetConfig(endpoints=[{"name": "b", "url": "http://h:2", "api_key_secret": "no-such-block"}])
    with pytest.raises(ConfigError, match="no-such-block"):
        endpoint_keys(missing)
