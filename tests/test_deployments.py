"""deployments/ against a real `prefect server start`: deploy the YAML, a process worker,
`prefect deployment run ... --watch`, the failure automation, and teardown leaving nothing.

Real parts: the Prefect server (SQLite, temp PREFECT_HOME, random port), the CLI as an
operator types it, a process worker, sim servers, a webhook receiver on 127.0.0.1.
One server for the module (≈ 5–10 s to start); the whole module takes about a minute.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.node import LocalNode
from conftest import free_port, processes, scaled, seed_prefect_home
from conftest import wait_until as poll

pytestmark = pytest.mark.prefect

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# A wait on the Prefect server asks it every half second, not every 20 ms (wait_until's default): each
# request costs the server and this process CPU (at 20 ms, up to 50 requests a second for minutes).
API_POLL_S = 0.5






@dataclass
class PrefectServer:
    api: str
    home: Path
    env: dict[str, str]

    def cli(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run([PY, "-m", "prefect", *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                             timeout=scaled(timeout))
        if check and res.returncode != 0:
            pytest.fail(f"prefect {' '.join(args)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def get(self, path: str) -> Any:
        return self.call("GET", path).json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.call("POST", path, body).json()

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, *, ok: tuple[int, ...] = ()
             ) -> httpx.Response:
        """One request as Prefect's client (and so the CLI) sends it: a 503, which the server answers at once
        while another writer holds the SQLite database ("database is locked"), is sent again (for up to
        120 s, as the client's retries); any other error fails, but those in `ok`, which are returned."""
        deadline = time.monotonic() + 120
        while True:
            r = httpx.request(method, self.api + path, json=body, timeout=30)
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if r.status_code not in ok:
            r.raise_for_status()
        return r


def stop_group(proc: subprocess.Popen, *, sigints: int = 1, wait_s: float = 20) -> bool:
    """SIGINT the process group (`sigints` times, a few seconds apart), then SIGKILL; True if it
    exited before SIGKILL."""
    for i in range(sigints):
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            return True
        try:
            proc.wait(timeout=wait_s if i == sigints - 1 else 3)
            return True
        except subprocess.TimeoutExpired:
            continue
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return False


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    home = seed_prefect_home(tmp_path_factory.mktemp("prefect-server"))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"),
               # the worker looks for runs every 2 s, not 10 (test pace); each look costs the server
               # ≈ 35 ms of CPU: at 1 s an idle worker and its server took 4.9 s of CPU a minute, 2.6 at 5 s
               PREFECT_WORKER_QUERY_SECONDS="2",
               PREFECT_LOGGING_EXTRA_LOGGERS="fleet",
               # the scheduler service inserts a fresh schedule's runs within seconds, not a minute
               PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2")
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen([PY, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prefect server exited {proc.returncode}:\n{(home / 'server.log').read_text()[-3000:]}")
        try:
            return httpx.get(api + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:   # a server that never answers is stopped too (it outlived the failed test run before)
        poll(healthy, timeout=300, interval=API_POLL_S, what="prefect server /api/health")   # ≈ 5–10 s idle; 84 s seen at load 13
        yield PrefectServer(api=api, home=home, env=env)
    finally:
        stop_group(proc)
        log.close()


class Hook:
    """A webhook receiver on 127.0.0.1: what the notification block posts lands in `bodies`."""

    def __init__(self) -> None:
        self.bodies: queue.Queue[dict[str, Any]] = queue.Queue()
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                data = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    bodies.put(json.loads(data))
                except ValueError:
                    bodies.put({"raw": data.decode(errors="replace")})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, *needles: str, timeout: float = 45) -> dict[str, Any]:
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                body = self.bodies.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(body)
            if all(n in json.dumps(body) for n in needles):
                return body
        pytest.fail(f"no notification with {needles} within {timeout:g} s; got {seen}")


@pytest.fixture(scope="module")
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.server.shutdown()


@pytest.fixture(scope="module")
def deployed(prefect_server: PrefectServer, hook: Hook) -> Iterator[PrefectServer]:
    """The work pool, the four deployments from the YAML, the automation, and a running worker."""
    s = prefect_server
    s.cli("work-pool", "create", "fleet-pool", "--type", "process")
    s.cli("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    res = subprocess.run([PY, "deployments/automation.py", "--webhook-url", hook.url], cwd=ROOT, env=s.env,
                         capture_output=True, text=True, timeout=scaled(120))
    assert res.returncode == 0, res.stderr
    log = open(s.home / "worker.log", "wb")
    worker = subprocess.Popen([PY, "-m", "prefect", "worker", "start", "--pool", "fleet-pool"], cwd=ROOT, env=s.env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    poll(lambda: worker.poll() is None and s.post("/work_pools/fleet-pool/workers/filter", {}), timeout=60,
         interval=API_POLL_S, what="the worker to register with fleet-pool")
    try:
        yield s
    finally:
        # A process worker ignores the first SIGINT for a long time: the second one stops it.
        clean = stop_group(worker, sigints=2)
        log.close()
        assert clean, "the worker needed SIGKILL: " + (s.home / "worker.log").read_text()[-2000:]


def run_deployment_cli(s: PrefectServer, name: str, *params: str, timeout: float = 150) -> tuple[int, dict[str, Any]]:
    """`prefect deployment run NAME --param ... --watch` as typed; (exit code, the flow run)."""
    args = ["deployment", "run", name, *[a for p in params for a in ("--param", p)], "--watch",
            "--watch-timeout", str(int(timeout))]
    res = s.cli(*args, timeout=timeout + 30, check=False)
    m = re.search(r"UUID: ([0-9a-f-]{36})", res.stdout)
    assert m, f"no flow run id in:\n{res.stdout}\n{res.stderr}"
    return res.returncode, s.get(f"/flow_runs/{m.group(1)}")


def start_deployment(s: PrefectServer, name: str, *params: str) -> dict[str, Any]:
    """What `prefect deployment run NAME --param K=V ...` asks of the API (each value JSON if it parses,
    else a string; the server adds the deployment's other parameters): the new flow run, Scheduled now.
    Through the API, not the CLI: each `prefect` command is a Python process importing Prefect (≈ 3 s of
    CPU on the 2-core CI machine); the CLI's own path is walked by test_bringup_revalidate_teardown_through_a_worker
    here and by every README walk in test_fresh_clone.py."""
    def value(v: str) -> Any:
        try:
            return json.loads(v)
        except ValueError:
            return v

    dep = s.get(f"/deployments/name/{name}")
    parameters = {k: value(v) for k, v in (p.split("=", 1) for p in params)}
    return s.post(f"/deployments/{dep['id']}/create_flow_run", {"parameters": parameters})


FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def run_deployment(s: PrefectServer, name: str, *params: str, timeout: float = 150) -> dict[str, Any]:
    """`start_deployment`, then the flow run once it has ended (what `--watch` waits for)."""
    run_id = start_deployment(s, name, *params)["id"]
    return poll(lambda: (fr := s.get(f"/flow_runs/{run_id}"))["state"]["type"] in FINAL and fr,
                timeout=timeout, interval=API_POLL_S, what=f"the {name} run to end")


def cancel_flow_run(s: PrefectServer, run_id: str) -> None:
    """Prefect's Cancel as the UI's button and `prefect flow-run cancel` send it: propose Cancelling."""
    res = s.post(f"/flow_runs/{run_id}/set_state", {"state": {"type": "CANCELLING"}})
    assert res["status"] != "ABORT", res   # (the CLI's one error)


def sim_toml(tmp_path: Path, n: int = 3) -> tuple[Path, dict[str, Any]]:
    from conftest import port_block
    from fleet.demo import to_toml

    model = tmp_path / "models" / "sim-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"w" * 50_000)
    (tmp_path / "ram").mkdir()
    data = {
        "name": "dep",
        "nodes": [{"name": "local", "workdir": str(tmp_path / "work"), "ramdisk": str(tmp_path / "ram")}],
        "engine": {"kind": "sim", "sim": {"startup_s": 0.3, "tokens_per_s": 5000}},
        "model": {"source": str(model), "stage_margin_gb": 0.0},
        "venv": {"path": str(tmp_path / "venv")},
        "servers": {"count": n, "base_port": port_block(n),
                    "ready_timeout_s": 60, "stop_grace_s": 2},
        "smoke": {"first_timeout_s": 10, "timeout_s": 3, "attempts": 2, "backoff_s": 0.1},
    }
    path = tmp_path / "dep.toml"
    path.write_text(to_toml(data))
    return path, data


def processes_mentioning(text: str) -> list[int]:
    return [p.pid for p in processes() if text in " ".join(p.argv) and LocalNode().is_alive(p.pid)]


def test_the_yaml_declares_four_deployments(deployed: PrefectServer) -> None:
    # every deployment on the server but those `fleet deploy` registered (tagged with their fleet): the
    # tests of that command may have run first on this server (another xdist group on this worker)
    deps = {d["name"]: d for d in deployed.post("/deployments/filter", {})
            if not any(t.startswith("fleet:") for t in d["tags"])}
    assert set(deps) == {"bringup", "revalidate", "generate", "teardown"}
    for name, d in deps.items():
        assert d["work_pool_name"] == "fleet-pool" and d["entrypoint"] == "flows/fleet.py:fleet"
        assert d["parameters"]["action"] == name
        assert d["parameters"]["config"] == "deployments/configs/local-sim.toml"
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    (sched,) = deps["revalidate"]["schedules"]
    assert sched["schedule"]["interval"] == 1800 and sched["active"]
    assert deps["revalidate"]["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert not any(d["schedules"] for n, d in deps.items() if n != "revalidate")
    # the automation exists and points at a notification block
    autos = deployed.post("/automations/filter", {})
    (auto,) = [a for a in autos if a["name"] == "fleet-run-failed"]
    assert set(auto["trigger"]["expect"]) == {"fleet.flow-run.failed", "prefect.flow-run.Crashed"}
    assert auto["trigger"]["match_related"] == {"prefect.resource.role": "flow", "prefect.resource.name": "fleet"}
    assert auto["actions"][0]["type"] == "send-notification"


def test_bringup_revalidate_teardown_through_a_worker(deployed: PrefectServer, hook: Hook, tmp_path: Path) -> None:
    s = deployed
    cfg_path, data = sim_toml(tmp_path)
    workdir = Path(data["nodes"][0]["workdir"])

    rc, fr = run_deployment_cli(s, "fleet/bringup", f"config={cfg_path}")
    assert rc == 0 and fr["state"]["type"] == "COMPLETED", fr["state"]
    assert fr["name"] == "bringup-dep" and fr["state"]["message"].startswith("3 server(s) up")
    records = [json.loads((workdir / "servers" / f"dep-{i}.json").read_text()) for i in range(3)]
    pids = [r["pid"] for r in records]
    assert all(LocalNode().is_alive(p) for p in pids)  # detached: they outlive the flow run's process

    os.killpg(pids[1], signal.SIGKILL)
    rc, fr = run_deployment_cli(s, "fleet/revalidate", f"config={cfg_path}")
    assert rc == 1 and fr["state"]["type"] == "FAILED"
    port1 = data["servers"]["base_port"] + 1
    assert f"local server 1 (port {port1}): process {pids[1]} is not running" in fr["state"]["message"]
    assert fr["state"]["message"].startswith("1 server(s) unhealthy, 2 healthy")
    arts = s.post("/artifacts/latest/filter", {"artifacts": {"key": {"any_": ["dep-revalidate"]}}})
    table = json.loads(arts[0]["data"])
    assert [(r["server"], r["state"]) for r in table] == [(0, "healthy"), (1, "unhealthy"), (2, "healthy")]
    # the automation fired and the notification block posted to our receiver
    note = hook.wait_for("revalidate-dep", "Failed", f"process {pids[1]} is not running")
    assert note["subject"] == "fleet: revalidate-dep Failed"

    rc, fr = run_deployment_cli(s, "fleet/teardown", f"config={cfg_path}", "free_ramdisk=true")
    assert rc == 0 and fr["state"]["type"] == "COMPLETED", fr["state"]
    assert "stopped 2 server(s), freed" in fr["state"]["message"]
    assert not any(LocalNode().is_alive(p) for p in pids)
    assert processes_mentioning(str(workdir)) == []  # nothing of the fleet left, whatever its pid
    assert list((tmp_path / "ram").iterdir()) == []


def executed_events(s: PrefectServer, flow_run_id: str) -> list[dict[str, Any]]:
    body = {"filter": {"event": {"name": ["prefect.worker.executed-flow-run"]},
                       "related": {"id": [f"prefect.flow-run.{flow_run_id}"]}}}
    return s.post("/events/filter", body)["events"]


def run_logs(s: PrefectServer, flow_run_id: str) -> list[dict[str, Any]]:
    return s.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})


def test_failed_bringup_under_a_worker_logs_its_message_not_an_engine_traceback(
        deployed: PrefectServer, tmp_path: Path) -> None:
    """Fault: a failed run under a worker used to log "Engine execution exited with unexpected
    exception … TypeError: Unexpected result for failed state … list cannot be resolved into an
    exception" (the flow returned Failed(data=rows)): it read like a crash and hid the message.
    Now the run ends Failed with its one-line message, the summary table is an artifact, and
    neither the worker's output nor the run's logs carry a traceback."""
    s = deployed
    cfg_path, data = sim_toml(tmp_path, n=2)
    data["name"] = "dep-fail"
    data["servers"]["extra_args_by_index"] = {1: ["--oom-at-start"]}
    from fleet.demo import to_toml
    cfg_path.write_text(to_toml(data))
    worker_log = s.home / "worker.log"
    seen = worker_log.stat().st_size
    try:
        fr = run_deployment(s, "fleet/bringup", f"config={cfg_path}")
        assert fr["state"]["type"] == "FAILED", fr["state"]
        msg = fr["state"]["message"]
        assert msg.startswith("1 server(s) up; 1 failed: local server 1") and "Not enough memory" in msg
        # The worker emits this once the run's process has ended and its output is in the log.
        (done,) = poll(lambda: executed_events(s, fr["id"]), timeout=60, interval=API_POLL_S,
                       what="the worker's executed-flow-run event")
        status = {r["prefect.resource.role"]: r for r in done["related"]}["flow-run"]
        assert status["prefect.infrastructure.status-code"] == "0", done
        out = worker_log.read_text()[seen:]
        # (the server's own log, quoted in the launch error, holds SGLang's indented traceback: fine)
        python_traceback = re.compile(r"^Traceback \(most recent call last\)", re.M)
        for bad in ("cannot be resolved into an exception", "Engine execution exited", "exited with unexpected exception"):
            assert bad not in out, f"{bad!r} in the worker's output:\n{out[-4000:]}"
        assert not python_traceback.search(out), out[-4000:]
        logs = run_logs(s, fr["id"])
        assert any(lg["message"].startswith("Finished in state Failed('1 server(s) up; 1 failed") for lg in logs)
        for lg in logs:
            assert "Engine execution" not in lg["message"] and not python_traceback.search(lg["message"]), lg
        (summary,) = s.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [fr["id"]]},
                                                                "type": {"any_": ["table"]}}})
        rows = json.loads(summary["data"])
        assert [(r["server"], r["state"]) for r in rows] == [(0, "up"), (1, "launch failed")]
    finally:
        run_deployment(s, "fleet/teardown", f"config={cfg_path}")


def test_generate_deployment_errors_name_parameters_not_cli_options(deployed: PrefectServer, tmp_path: Path) -> None:
    """Fault: a generate run started from a deployment failed with the CLI's words ("pass an existing
    --input file"), an option that run does not have. Under a deployment the message names the
    parameter (`input`); `fleet generate`, which has the option, keeps `--input`."""
    cfg_path, _ = sim_toml(tmp_path, n=1)
    fr = run_deployment(deployed, "fleet/generate", f"config={cfg_path}", f"input={tmp_path / 'missing.jsonl'}",
                            f"output={tmp_path / 'out'}", timeout=90)
    msg = fr["state"]["message"]
    assert fr["state"]["type"] == "FAILED", fr["state"]
    assert "does not exist" in msg and "pass an existing `input` file" in msg and "--input" not in msg, msg


def test_fleet_deploy_one_config_block_four_deployments_schedules_act_on_that_fleet(
        deployed: PrefectServer, tmp_path: Path) -> None:
    """Fault: `config` was a plain parameter per deployment: `prefect deploy --all --param` ignored
    it, schedules could not pass one, so the scheduled revalidate checked the default config, and a
    `variable:` config renamed the runs. Now `fleet deploy -c FILE` saves the config as the block
    fleet-config/NAME (secrets masked in the API/UI) and registers four deployments reading it by
    name; their runs, with no parameter given, act on that fleet and are named after it; after
    its teardown, revalidate ends Completed "nothing is up"."""
    s = deployed
    cfg_path, data = sim_toml(tmp_path, n=2)
    data["name"] = "dep-block"
    data["servers"]["api_key"] = "sk-block-secret-123"
    from fleet.demo import to_toml
    cfg_path.write_text(to_toml(data))
    res = subprocess.run([PY, "-m", "flows.cli", "deploy", "-c", str(cfg_path), "--revalidate-every", "3600"],
                         cwd=tmp_path, env=s.env, capture_output=True, text=True, timeout=scaled(180))
    assert res.returncode == 0, res.stderr
    assert "config saved as block fleet-config/dep-block" in res.stdout

    deps = {d["name"]: d for d in s.post("/deployments/filter", {}) if d["name"].endswith("-dep-block")}
    assert set(deps) == {f"{a}-dep-block" for a in ("bringup", "revalidate", "generate", "teardown")}
    from flows.deploy import CHECKOUT

    for name, d in deps.items():
        # run from another directory than the checkout: the code is still found (a worker runs each
        # flow in a fresh temporary directory; without this pull step every run Crashed there)
        assert d["entrypoint"] == "flows/fleet.py:fleet"
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(CHECKOUT)}}]
        assert d["parameters"]["config"] == "block:fleet-config/dep-block"
        assert d["parameters"]["action"] == name.removesuffix("-dep-block")
        assert d["work_pool_name"] == "fleet-pool" and "fleet:dep-block" in d["tags"]
    (sched,) = deps["revalidate-dep-block"]["schedules"]
    assert sched["schedule"]["interval"] == 3600 and sched["active"]
    # the block: the whole config in Prefect, the API key masked unless asked for
    (doc,) = s.post("/block_documents/filter", {"block_documents": {"name": {"any_": ["dep-block"]}},
                                                 "include_secrets": False})
    assert doc["block_type"]["slug"] == "fleet-config"
    assert doc["data"]["config"]["servers"]["base_port"] == data["servers"]["base_port"]
    assert "sk-block-secret-123" not in json.dumps(doc)

    workdir = Path(data["nodes"][0]["workdir"])
    try:
        fr = run_deployment(s, "fleet/bringup-dep-block")
        assert fr["state"]["type"] == "COMPLETED", fr["state"]["message"]
        assert fr["name"] == "bringup-dep-block" and fr["state"]["message"].startswith("2 server(s) up")
        assert (workdir / "servers" / "dep-block-0.json").exists()  # the block's workdir: that fleet
        fr = run_deployment(s, "fleet/revalidate-dep-block")  # what the schedule runs: no parameter
        assert fr["state"]["type"] == "COMPLETED" and fr["name"] == "revalidate-dep-block", fr["state"]
        assert fr["state"]["message"].startswith("2 server(s) healthy")
        fr = run_deployment(s, "fleet/teardown-dep-block")
        assert fr["state"]["type"] == "COMPLETED" and "stopped 2 server(s)" in fr["state"]["message"]
        fr = run_deployment(s, "fleet/revalidate-dep-block")
        assert fr["state"]["type"] == "COMPLETED", fr["state"]["message"]
        assert fr["state"]["message"].startswith("nothing is up (torn down at ")
    except BaseException:   # (after a pass its teardown run stopped everything)
        run_deployment(s, "fleet/teardown-dep-block")
        raise


def test_fleet_deploy_says_when_the_first_revalidation_runs_and_can_start_one_now(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    """Fault (issue 37): `fleet deploy` created the revalidation schedule without saying so, and its
    first run came 30 minutes later. It now prints the schedule and when its first run is, and
    `--revalidate-now` creates a revalidation run at once (on a pool with no worker here: the run
    waits, Scheduled, due now)."""
    from datetime import datetime, timezone

    s = prefect_server
    cfg_path, data = sim_toml(tmp_path, n=1)
    data["name"] = "dep-now"
    from fleet.demo import to_toml
    cfg_path.write_text(to_toml(data))
    t0 = datetime.now(timezone.utc)
    res = subprocess.run([PY, "-m", "flows.cli", "deploy", "-c", str(cfg_path), "--pool", "fleet-idle-pool",
                          "--revalidate-every", "1800", "--revalidate-now"],
                         cwd=tmp_path, env=s.env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.search(r"revalidation: fleet/revalidate-dep-now every 1800 s; the schedule's first run at "
                  r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC \(in (\d+) min\); and one now: flow run (\S+), "
                  r"for a worker on fleet-idle-pool", res.stdout)
    assert m, res.stdout
    first = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    assert 1790 <= (first - t0).total_seconds() <= 1800 + 180 and m[2] in ("29", "30"), res.stdout
    (dep,) = [d for d in s.post("/deployments/filter", {}) if d["name"] == "revalidate-dep-now"]
    runs = s.post("/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})
    now_run = [r for r in runs if r["name"] == m[3]]
    assert now_run and now_run[0]["state"]["type"] in ("SCHEDULED", "PENDING"), runs
    due = datetime.fromisoformat(now_run[0]["expected_start_time"].replace("Z", "+00:00"))
    assert (due - t0).total_seconds() < 120   # due now, not in 30 minutes


def test_alert_for_a_run_of_a_fresh_schedule_comes_at_once(deployed: PrefectServer, hook: Hook,
                                                           tmp_path: Path) -> None:
    """Fault: runs that a schedule creates right after a deploy (or a new schedule) have no
    prefect.flow-run.Scheduled event; Prefect held their Failed event ≈ 15 minutes waiting for it,
    so the automation alerted that late. The automation now follows fleet.flow-run.failed, which
    the run emits and which follows nothing: the first scheduled run of a brand-new schedule (a
    revalidate of a fleet never brought up, so Failed) is notified as soon as it ends."""
    s = deployed
    cfg_path, data = sim_toml(tmp_path, n=1)
    data["name"] = "dep-late"
    from fleet.demo import to_toml
    cfg_path.write_text(to_toml(data))
    res = subprocess.run([PY, "-m", "flows.cli", "deploy", "-c", str(cfg_path), "--revalidate-every", "30"],
                         cwd=tmp_path, env=s.env, capture_output=True, text=True, timeout=scaled(180))
    assert res.returncode == 0, res.stderr
    try:
        def first_run_ended() -> dict[str, Any] | None:
            runs = s.post("/flow_runs/filter", {"flow_runs": {"name": {"any_": ["revalidate-dep-late"]}}})
            return next((r for r in runs if r["state"]["type"] == "FAILED"), None)

        run = poll(first_run_ended, timeout=180, interval=API_POLL_S,
                   what="the schedule's first revalidate run to end Failed")
        assert run["auto_scheduled"]  # created by the schedule, not by hand
        events = s.post("/events/filter", {"filter": {"event": {"name": ["prefect.flow-run.Scheduled"]},
                                                      "resource": {"id": [f"prefect.flow-run.{run['id']}"]}}})
        assert events["events"] == []  # the missing Scheduled event this alert must not wait for
        note = hook.wait_for("revalidate-dep-late", "never launched", timeout=60)
        assert note["subject"] == "fleet: revalidate-dep-late Failed"
    finally:
        for action in ("bringup", "revalidate", "generate", "teardown"):   # what `prefect deployment delete` sends
            r = s.call("GET", f"/deployments/name/fleet/{action}-dep-late", ok=(404,))
            if r.status_code == 200:
                s.call("DELETE", f"/deployments/{r.json()['id']}")


def test_default_config_is_read_relative_to_the_repo(deployed: PrefectServer) -> None:
    """`prefect deployment run fleet/revalidate` with the YAML's default, a relative TOML path:
    the run is named after the fleet in that file, so the worker read it from the repo root."""
    fr = run_deployment(deployed, "fleet/revalidate", timeout=90)
    assert fr["name"] == "revalidate-local-sim"
    assert fr["state"]["type"] in ("COMPLETED", "FAILED") and "config file" not in (fr["state"]["message"] or "")


def test_serve_builds_the_deployments_the_yaml_declares() -> None:
    """flows/serve.py (no work pool) and deployments/prefect.yaml must not drift apart."""
    import yaml

    from flows.serve import build

    declared = {d["name"]: d for d in yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]}
    served = {d.name: d for d in build("deployments/configs/local-sim.toml")}
    assert set(served) == set(declared)
    for name, d in served.items():
        assert d.parameters == declared[name]["parameters"], name
        assert d.tags == declared[name]["tags"]
        assert bool(d.schedules) == bool(declared[name].get("schedules")), name
    assert served["revalidate"].schedules[0].schedule.interval.total_seconds() == 1800
    assert served["revalidate"].concurrency_limit == 1
    assert served["revalidate"].concurrency_options.collision_strategy == "CANCEL_NEW"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_up_on_a_real_server_leaves_no_lock(prefect_server: PrefectServer, tmp_path: Path,
                                                        sig: int) -> None:
    """The lock heals on a real `prefect server start` too (where the dead run's Prefect lease
    still lives in the server and must be revoked, not counted twice): Ctrl-C gives the slot
    back itself; after kill -9 the next `fleet up` reclaims it at once, naming the dead run."""
    from test_interrupt import Cmd

    cfg_path, _ = sim_toml(tmp_path, n=2)
    env = dict(prefect_server.env)
    try:
        first = Cmd(env, tmp_path / "first.txt", "up", "-c", str(cfg_path))
        first.wait_for_text("holding")
        took = first.signal_group(sig)
        print(f"\nfleet up (real server) exited {took:.2f} s after {signal.Signals(sig).name}")
        if sig == signal.SIGINT:
            assert first.proc.returncode == 130 and "Traceback" not in first.text()
        second = Cmd(env, tmp_path / "second.txt", "up", "-c", str(cfg_path))
        assert second.finish() == 0, second.text()[-3000:]
        out = second.text()
        assert "waiting" not in out
        assert ("reclaimed the lock fleet-node-" in out) == (sig == signal.SIGKILL), out[-3000:]
        limit = prefect_server.get(f"/v2/concurrency_limits/{'fleet-node-local-' + socket.gethostname().lower()}")
        assert limit["active_slots"] == 0  # neither leaked nor freed twice
        killed = [r for r in prefect_server.post("/flow_runs/filter", {"flow_runs": {"name": {"any_": ["bringup-dep"]}}})
                  if r["state"]["type"] != "COMPLETED"]
        assert killed and all(r["state"]["type"] == "CRASHED" for r in killed)  # nothing left "Running"
    finally:
        subprocess.run([PY, "-m", "flows.cli", "down", "-c", str(cfg_path)], cwd=ROOT, env=env, capture_output=True,
                       timeout=scaled(120))


def slots(s: PrefectServer, limit: str) -> int:
    """Active slots of a global concurrency limit (0 before its first use creates it)."""
    r = s.call("GET", f"/v2/concurrency_limits/{limit}", ok=(404,))
    return 0 if r.status_code == 404 else int(r.json()["active_slots"])


def test_a_cancel_whose_task_thread_still_runs_is_not_set_cancelled_by_the_run(monkeypatch) -> None:
    """Fault: `end_cancelled` joined the task threads for up to JOIN_S, then set the run Cancelled
    whether they had ended or not: a task stuck in a node command that does not look at the stop flag
    still ran while the run showed Cancelled ("stopped"), and for a multi-node job the node lock was
    already back, so a re-run at once wrote beside it. Now a thread still alive after the join leaves
    the run to Prefect's path (Cancelled once the process is gone): nothing is proposed. A task runner
    whose `cancel_all` waits on a task that never ends (until the test lets it go); the Prefect client
    and run context are stand-ins (this is the decision only; the real Cancel is the test below)."""
    import prefect.client.orchestration as orchestration
    import prefect.context

    import flows.cancel as cancel

    stuck, proposed = threading.Event(), []

    class Runner:
        def cancel_all(self) -> None:
            stuck.wait(600)

    class Client:
        def __enter__(self) -> Client:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def read_flow_run(self, run_id: str) -> Any:
            from prefect.states import Cancelling
            return type("Run", (), {"state": Cancelling()})()

        def set_flow_run_state(self, run_id: str, state: Any) -> Any:
            proposed.append(state)
            return type("Result", (), {"state": state})()

    ctx = type("Ctx", (), {"flow_run": type("Run", (), {"id": "r", "state": None})(), "task_runner": Runner()})()
    monkeypatch.setattr(prefect.context.FlowRunContext, "get", classmethod(lambda cls: ctx))
    monkeypatch.setattr(orchestration, "get_client", lambda sync_client=False: Client())
    monkeypatch.setattr(cancel, "JOIN_S", 0.2)
    try:
        assert cancel.end_cancelled() is False and proposed == []
    finally:
        stuck.set()
    ctx.task_runner = type("Done", (), {"cancel_all": lambda self: None})()   # every task ended: set
    assert cancel.end_cancelled() is True and [s.type.value for s in proposed] == ["CANCELLED"]


@pytest.mark.timeout(900)
def test_prefect_cancel_of_a_bringup_under_a_worker_ends_cancelled_by_its_own_process_with_the_lock_back(
        deployed: PrefectServer, tmp_path: Path) -> None:
    """Issue 23: Prefect's Cancel (the UI's button, `prefect flow-run cancel`) reaches a flow run
    under a process worker as SIGTERM. It must end the run Cancelled — not Crashed, not Running
    for ever — with the per-node lock given back (the next bring-up neither waits nor reclaims),
    while the servers it launched keep running (detached, as after Ctrl-C; `fleet down` or the
    teardown deployment stops them). The servers here take minutes to start: the run is
    cancelled while its launch tasks wait for them.

    And it must end promptly: the launch threads' readiness waits give up at the cancel (their
    tasks end Failed, "asked to stop", reported by the run's own process), so the run is Cancelled
    long before the readiness deadline those waits had. Before, the threads went on waiting; the
    engine joined them, Prefect's runner SIGKILLed the process after its 30 s grace (57 s from
    Cancel to Cancelled) and the launch task runs were left Running.

    And the run's own process sets it Cancelled (flows/cancel.py), once the lock is back and every
    task has ended. Before, Cancelled came from Prefect's runner only after the process was gone
    and a new Python process had imported Prefect and loaded the flow to look for on_cancellation
    hooks: 13–18 s after Cancelling at load 10 (bench/bench_cancel.py), with the run shown
    Cancelling all along. The first Cancelled state of the run's history carries fleet's message;
    the runner's own Cancelled comes after it and changes only the message."""
    from flows.cancel import CANCELLED_MESSAGE

    s = deployed
    cfg_path, data = sim_toml(tmp_path, n=2)
    data["name"] = "dep-cancel"
    data["engine"]["sim"]["startup_s"] = 600
    ready_timeout_s = data["servers"]["ready_timeout_s"] = 900
    from fleet.demo import to_toml
    cfg_path.write_text(to_toml(data))
    workdir = Path(data["nodes"][0]["workdir"])
    limit = "fleet-node-local-" + re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-")
    try:
        run_id = start_deployment(s, "fleet/bringup", f"config={cfg_path}")["id"]

        def launching() -> bool:
            fr = s.get(f"/flow_runs/{run_id}")
            assert fr["state"]["type"] in ("SCHEDULED", "PENDING", "RUNNING"), fr["state"]["message"]
            return slots(s, limit) == 1 and all(
                (workdir / "servers" / f"dep-cancel-{i}.pid").exists() for i in range(2))

        poll(launching, timeout=180, interval=0.2, what="the bring-up to hold the lock and launch its servers")
        pids = [int((workdir / "servers" / f"dep-cancel-{i}.pid").read_text().split()[0]) for i in range(2)]
        t0 = time.monotonic()
        cancel_flow_run(s, run_id)
        fr = poll(lambda: (f := s.get(f"/flow_runs/{run_id}"))["state"]["type"] not in ("RUNNING", "CANCELLING")
                  and f, timeout=120, interval=0.2, what="the cancelled run to end")
        print(f"\ncancelled run ended {fr['state']['type']} {time.monotonic() - t0:.1f} s after the cancel")
        assert fr["state"]["type"] == "CANCELLED", fr["state"]
        # read at once, no waiting: what the run's process did before it set Cancelled
        held = slots(s, limit)
        launches = [t for t in s.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
                    if t["name"].startswith("launch-")]
        history = sorted(s.get(f"/flow_run_states/?flow_run_id={run_id}"), key=lambda st: st["timestamp"])
        types = [st["type"] for st in history]
        first = next(st for st in history if st["type"] == "CANCELLED")
        assert first["message"] == CANCELLED_MESSAGE, [(st["type"], st["message"]) for st in history]
        assert "CRASHED" not in types, types   # the failure automation alerts on a Crashed run
        assert held == 0, "the node lock is given back before the run is Cancelled"
        assert len(launches) == 2, [t["name"] for t in launches]
        for t in launches:   # the waits gave up at the cancel: the run's own process said so
            assert t["state"]["type"] == "FAILED" and "asked to stop" in (t["state"]["message"] or ""), t["state"]
        cancelling = datetime.fromisoformat(next(st for st in history if st["type"] == "CANCELLING")["timestamp"])
        gave_up = max(datetime.fromisoformat(t["end_time"]) for t in launches) - cancelling
        print(f"the launch waits gave up {gave_up.total_seconds():.1f} s after Cancelling, the run was Cancelled "
              f"{(datetime.fromisoformat(first['timestamp']) - cancelling).total_seconds():.1f} s after it")
        started = min(datetime.fromisoformat(t["start_time"]) for t in launches)
        ended = datetime.fromisoformat(first["timestamp"])
        assert ended < started + timedelta(seconds=ready_timeout_s), (started, ended)
        assert all(LocalNode().is_alive(p) for p in pids), "the launched servers keep running (detached)"
    finally:
        fr = run_deployment(s, "fleet/teardown", f"config={cfg_path}")
    assert fr["state"]["type"] == "COMPLETED" and "reclaimed" not in json.dumps(run_logs(s, fr["id"])), fr["state"]


def test_prefect_cancel_of_a_scheduled_bringup_ends_cancelled_at_once_without_a_process(
        deployed: PrefectServer, tmp_path: Path) -> None:
    """README (Ctrl-C and SIGTERM): a Cancel of a run still Scheduled ends it Cancelled at once —
    no process starts for it, so nothing of fleet's (flows/cancel.py) is needed. Protects that
    claim: a run left Cancelling with no process to finish it would be Cancelling for ever."""
    s = deployed
    cfg_path, _ = sim_toml(tmp_path, n=1)
    dep = s.get("/deployments/name/fleet/bringup")
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    fr = s.post(f"/deployments/{dep['id']}/create_flow_run",
                {"parameters": {"config": str(cfg_path)},
                 "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": later}}})
    cancel_flow_run(s, fr["id"])
    fr = s.get(f"/flow_runs/{fr['id']}")
    assert fr["state"]["type"] == "CANCELLED", fr["state"]
    history = sorted(s.get(f"/flow_run_states/?flow_run_id={fr['id']}"), key=lambda st: st["timestamp"])
    assert [st["type"] for st in history] == ["SCHEDULED", "CANCELLED"], history   # never Pending nor Running
    assert fr["infrastructure_pid"] is None, fr


def test_first_after_is_the_next_interval_after_now_never_the_anchor() -> None:
    from flows.deploy import first_after

    a = datetime(2026, 1, 1, tzinfo=timezone.utc)
    iv = timedelta(minutes=30)
    assert first_after(a, iv, a) == a + iv                      # just deployed: 30 minutes from now
    assert first_after(a, iv, a + timedelta(minutes=29)) == a + iv
    assert first_after(a, iv, a + iv) == a + 2 * iv
    assert first_after(a, iv, a + timedelta(hours=5, minutes=1)) == a + 11 * iv
