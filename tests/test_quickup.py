"""The adopt-only `fleet up` (flows/quickup.py): the flow's records without Prefect's engine, and the
flow's own path for anything that is not adopt-only.

Fault (issue 37, item 2): `fleet up` on a fleet already up imported Prefect and ran its flow engine
for seconds of adopt checks: 8.75 s against `fleet status`'s 1.47 s on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_until

from fleet.config import FleetConfig

pytestmark = pytest.mark.usefixtures("prefect_api")

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """The environment of a fresh command: this PREFECT_HOME's local server found by its record, not
    through the PREFECT_API_URL an earlier in-process flow of this test process exported."""
    return {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_URL")}


def _api() -> Any:
    import httpx

    from flows.localserver import attach

    return httpx.Client(base_url=attach().rstrip("/") + "/", timeout=60)


def _runs(api: Any, name: str) -> list[dict[str, Any]]:
    runs = api.post("flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}},
                                              "sort": "EXPECTED_START_TIME_ASC"}).json()
    assert isinstance(runs, list), runs
    return runs


_NUM = re.compile(r"\d+")


def _norm(text: str | None) -> str:
    """Timings, counters, the run's id and the servers' growing logs aside."""
    text = (text or "").split("**Log excerpt**")[0]
    text = re.sub(r"flow run `[0-9a-f]{8}`", "flow run `ID`", text)
    return _NUM.sub("N", text)


def _diff(got: Any, want: Any) -> str:
    import difflib

    return "\n".join(difflib.unified_diff(str(want).replace("\\n", "\n").splitlines(),
                                           str(got).replace("\\n", "\n").splitlines(), "flow", "quick", lineterm=""))


def _records(api: Any, run: dict[str, Any]) -> dict[str, Any]:
    rid = run["id"]
    tasks = api.post("task_runs/filter", json={"flow_runs": {"id": {"any_": [rid]}}}).json()
    arts = api.post("artifacts/filter", json={"flow_runs": {"id": {"any_": [rid]}}}).json()
    logs = api.post("logs/filter", json={"logs": {"flow_run_id": {"any_": [rid]}}}).json()
    by_id = {t["id"]: t["name"] for t in tasks}
    return {
        "name": run["name"], "state": run["state_name"], "message": _norm(run["state"]["message"]),
        "parameters": run["parameters"], "tags": run["tags"], "flow_version": run["flow_version"],
        "tasks": sorted((t["name"], t["state_name"], t["task_key"], t["empirical_policy"]["retries"]) for t in tasks),
        "artifacts": sorted((a["key"], a["type"], by_id.get(a["task_run_id"]), _norm(a["description"]),
                             _norm(a["data"]), "**Log excerpt**" in (a["data"] or "")) for a in arts),
        "logs": sorted((lg["name"], lg["level"], by_id.get(lg["task_run_id"]), _norm(lg["message"])) for lg in logs),
    }


def _sim(tmp_path: Path, name: str, n: int = 2) -> FleetConfig:
    from test_bringup import port_block, sim_config

    return sim_config(tmp_path, port_block(n), n=n, name=name)


def test_an_adopt_only_fleet_up_writes_the_records_the_flow_writes(tmp_path: Path) -> None:
    """Both paths against the session's Prefect server: the flow's adopt run and the quick one have the
    same flow run (name, state, message, parameters, tags, version), task runs (names, states, keys,
    retry policy), artifacts (keys, types, task, description and text) and log lines; the node lock is
    given back and its holder record removed."""
    from flows.cli import run_bringup
    from flows.quickup import quick_up
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    from prefect.settings import PREFECT_UI_URL, temporary_settings

    cfg = _sim(tmp_path, "qeq")
    try:
        # As a command on this PREFECT_HOME's local server runs it: no UI to link to (flows/api.py `_use_api`;
        # a PREFECT_UI_URL or another server's address sends a command down the flow's path).
        with temporary_settings(updates={PREFECT_UI_URL: ""}):
            assert run_bringup(cfg)[0]          # launches
            ok, rows, _ = run_bringup(cfg)      # the flow's adopt run
        assert ok and [r["state"] for r in rows] == ["adopted"] * 2
        quick = quick_up(cfg, environ=_env())
        assert quick is not None, "the adopt-only fleet up took the flow's path"
        assert quick[0] and [r["state"] for r in quick[1]] == ["adopted"] * 2
        assert [r["pid"] for r in quick[1]] == [r["pid"] for r in rows]
        with _api() as api:
            runs = _runs(api, "bringup-qeq")
            assert len(runs) == 3, [r["state_name"] for r in runs]

            def finished_logged(run: dict[str, Any]) -> bool:
                """The run's last log line is in: the flow's log worker sends its lines in batches, after the
                run (a loaded fresh-clone run compared before its "Finished in state" line had arrived). The
                flow run's own line, not a task's: each task run logs one too, and a run of the suite beside
                other tests compared once a task's had arrived, before the run's last three lines."""
                logs = api.post("logs/filter", json={"logs": {"flow_run_id": {"any_": [run["id"]]}}}).json()
                return any(lg["message"].startswith("Finished in state") and lg["task_run_id"] is None for lg in logs)

            for r in runs[1:]:
                wait_until(lambda: finished_logged(r), timeout=60, what=f"{r['name']}'s last log line")
            flow_adopt, quick_adopt = _records(api, runs[1]), _records(api, runs[2])
            for what in flow_adopt:   # one field at a time: a difference shows as itself
                if what in ("artifacts", "tasks", "logs"):
                    for got, want in zip(quick_adopt[what], flow_adopt[what], strict=True):
                        assert got == want, (what, _diff(got, want))
                assert quick_adopt[what] == flow_adopt[what], what
            assert len(quick_adopt["tasks"]) == 8 and len(quick_adopt["artifacts"]) == 8   # 6 stages' + 2 smokes'
            from tasks.locks import lock_names, record_name

            for name in lock_names(cfg):
                limit = api.get(f"v2/concurrency_limits/{name}").json()
                assert limit["active_slots"] == 0 and limit["limit"] == 1
                assert api.get(f"variables/name/{record_name(name)}").status_code == 404

            # A write refused at the run's end (its log lines): the try is undone — no flow run, every
            # key's latest artifact the previous run's again — and the caller runs the flow.
            def refuse_logs(self: Any, method: str, path: str, body: Any = None, ok: tuple[int, ...] = ()) -> Any:
                if path == "/logs/":
                    raise quickup.ApiError(500, "refused")
                return real(self, method, path, body, ok)

            import flows.quickup as quickup

            real = quickup.Api.call
            def latest_ids() -> dict[str, str]:
                got = api.post("artifacts/latest/filter", json={"artifacts": {"key": {"like_": "qeq-"}}}).json()
                return {a["key"]: a["id"] for a in got if a["key"].startswith("qeq-")}

            latest = latest_ids()
            assert len(latest) == 8, latest
            quickup.Api.call = refuse_logs   # type: ignore[method-assign]
            try:
                assert quick_up(cfg, environ=_env()) is None
            finally:
                quickup.Api.call = real   # type: ignore[method-assign]
            assert len(_runs(api, "bringup-qeq")) == 3
            assert latest_ids() == latest
            assert all(api.get(f"v2/concurrency_limits/{n}").json()["active_slots"] == 0 for n in lock_names(cfg))
    finally:
        stop_servers(LocalNode(), cfg, cfg.nodes[0])


def test_a_node_held_by_another_run_takes_the_flows_path_and_leaves_no_run_behind(tmp_path: Path) -> None:
    """The quick path never waits for a lock (the flow's path names the holder, waits and reclaims):
    with the slot taken it stops, gives nothing back that it did not take, and deletes its flow run."""
    from prefect.client.orchestration import get_client

    from flows.quickup import quick_up, save_task_keys
    from tasks.locks import ensure_limits, lock_names

    cfg = _sim(tmp_path, "qheld")
    save_task_keys()
    names = lock_names(cfg)
    ensure_limits(names)
    with get_client(sync_client=True) as client, _api() as api:
        lease = client.increment_concurrency_slots_with_lease(names, 1, "concurrency", 60).json()["lease_id"]
        try:
            assert quick_up(cfg, environ=_env()) is None
            assert _runs(api, "bringup-qheld") == []
            assert all(api.get(f"v2/concurrency_limits/{n}").json()["active_slots"] == 1 for n in names)
        finally:
            client.release_concurrency_slots_with_lease(lease)


def _fleet_up(path: Path) -> tuple[subprocess.CompletedProcess[str], bool]:
    """`fleet up -c PATH` as a fresh command; and whether it imported Prefect."""
    code = ("import sys, flows.cli; rc = flows.cli.main(['up', '-c', sys.argv[1]]); "
            "print('PREFECT-IMPORTED' if 'prefect' in sys.modules else 'PREFECT-NOT-IMPORTED'); sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                         env=_env(), cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res, "PREFECT-IMPORTED" in res.stdout


@pytest.mark.timeout(900)   # three `fleet up` commands on a shared 2-core machine
def test_fleet_up_adopts_without_prefect_and_a_server_down_takes_the_flows_path(tmp_path: Path) -> None:
    """`fleet up` (launch: the flow), again (every server up: no Prefect imported, the servers adopted),
    then with one server killed: the flow's path relaunches it; the quick attempt leaves no flow run."""
    import psutil

    from fleet.demo import to_toml
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    cfg = _sim(tmp_path, "qcli")
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    try:
        first, _ = _fleet_up(path)
        assert "2 server(s) up" in first.stdout
        quick, imported = _fleet_up(path)
        assert not imported, quick.stdout + quick.stderr
        assert quick.stdout.count("adopted") == 2 and "fleet up: 2 server(s) up in" in quick.stdout
        assert "Task run 'smoke-local-1' - Finished in state Completed()" in quick.stderr
        pids = [int(p) for p in re.findall(r"adopted\s+-\s+-\s+\d+\s+(\d+)", quick.stdout)]
        assert len(pids) == 2
        psutil.Process(pids[0]).kill()
        psutil.Process(pids[0]).wait(30)
        third, imported = _fleet_up(path)
        assert imported, third.stdout + third.stderr
        states = re.findall(r"^local\s+\d\s+(\w+)", third.stdout, re.M)
        assert sorted(states) == ["adopted", "up"], third.stdout
        with _api() as api:
            runs = _runs(api, "bringup-qcli")
        assert [r["state_name"] for r in runs] == ["Completed"] * 3, [(r["state_name"], r["state"]["message"])
                                                                       for r in runs]
    finally:
        stop_servers(LocalNode(), cfg, cfg.nodes[0])


@pytest.mark.parametrize("change, why", [
    ({"env": {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}}, "PREFECT_API_URL is set"),
    ({"env": {"PREFECT_PROFILE": "work"}}, "PREFECT_PROFILE is set"),
    ({"env": {"PREFECT_UI_URL": "http://127.0.0.1:4200"}}, "PREFECT_UI_URL is set"),
    ({"env": {"FLEET_QUICK_UP": "0"}}, "FLEET_QUICK_UP=0"),
    ({"file": "prefect.toml"}, "Prefect settings in"),
    ({"file": ".env"}, "Prefect settings in"),
    ({"profiles": "[profiles.default]\nPREFECT_API_URL = 'http://x'\n"}, "Prefect profile settings"),
    ({"node": {"block": "gpu-1"}}, "reads its credentials from Prefect blocks"),
    ({"node": {"key_secret": "k"}}, "reads its credentials from Prefect blocks"),
    ({"count": 0}, "no servers to bring up"),
    ({}, None),
])
def test_what_takes_the_flows_path(tmp_path: Path, change: dict[str, Any], why: str | None) -> None:
    from flows.quickup import refusal

    node: dict[str, Any] = {"name": "n", "workdir": str(tmp_path / "w")}
    if "node" in change:
        node |= {"kind": "ssh", "host": None if "block" in change["node"] else "10.0.0.5", "user": "u",
                 **change["node"]}
        if "key_secret" in change["node"]:
            node["host"] = "127.0.0.1"
    data: dict[str, Any] = {"name": "f", "nodes": [node], "engine": {"kind": "sim"},
                            "servers": {"count": 2, "base_port": 30000}}
    cfg = FleetConfig(**data)
    if "count" in change:
        cfg.servers.count = change["count"]
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    if "file" in change:
        (cwd / change["file"]).write_text("PREFECT_API_URL=http://127.0.0.1:4200/api\n")
    if "profiles" in change:
        (home / "profiles.toml").write_text(change["profiles"])
    (cwd / "pyproject.toml").write_text("[project]\nname = 'x'\n")   # not Prefect's: no reason
    got = refusal(cfg, change.get("env", {}), cwd, home)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_the_task_keys_are_the_tasks_own_and_follow_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick path records its task runs under the keys Prefect gives the tasks; keys learned from
    other task code (or none learned yet) send it down the flow's path."""
    import flows.quickup as quickup
    from tasks.bringup import TASKS
    from tasks.generate import generate

    monkeypatch.setattr(quickup, "keys_file", lambda: tmp_path / "task-keys.json")
    assert quickup.task_keys() is None
    quickup.save_task_keys()
    assert quickup.task_keys() == {**{k: t.task_key for k, t in TASKS.items()}, "generate": generate.task_key}
    data = json.loads((tmp_path / "task-keys.json").read_text())
    (tmp_path / "task-keys.json").write_text(json.dumps({**data, "source": "other-code"}))
    assert quickup.task_keys() is None


@pytest.mark.timeout(900)
def test_ctrl_c_during_a_quick_fleet_up_gives_the_lock_back_and_marks_the_run(tmp_path: Path) -> None:
    """As the flow's path does (flows/api.py, tasks/locks.py): a Ctrl-C while the quick path smokes
    ends the command (130), its run Crashed ("interrupted …"), the node's slot and holder record gone."""
    import signal
    import time

    from fleet.demo import to_toml
    from fleet.node import LocalNode
    from fleet.servers import stop_servers
    from flows.quickup import save_task_keys
    from tasks.locks import lock_names, record_name

    from test_bringup import port_block, sim_config

    # One token a second, every answer max_tokens long: the smoke (16 tokens) takes ≈ 16 s.
    cfg = sim_config(tmp_path, port_block(1), n=1, name="qint",
                     engine={"kind": "sim", "sim": {"startup_s": 0.3, "tokens_per_s": 1.0},
                             "extra_args": ["--lengths", "lognormal:1000:0"]},
                     smoke={"first_timeout_s": 120, "timeout_s": 120, "attempts": 1})
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    save_task_keys()
    try:
        _fleet_up(path)   # launches (the flow)
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "up", "-c", str(path)], env=_env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with _api() as api:
            deadline = time.monotonic() + 240

            def smoking() -> dict[str, Any] | None:
                for run in _runs(api, "bringup-qint"):
                    if run["state_name"] == "Running":
                        tasks = api.post("task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}).json()
                        if any(t["name"] == "launch-local-0" and t["state_name"] == "Completed" for t in tasks):
                            return run
                return None

            run = smoking()
            while run is None and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                run = smoking()
            assert run is not None, proc.communicate(timeout=60)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 130, out + err
            assert "Beginning flow run" not in err, err   # the quick path prints the run's lines only at its end
            ended = api.get(f"flow_runs/{run['id']}").json()
            assert ended["state_name"] == "Crashed" and ended["state"]["message"].startswith("interrupted"), ended
            for name in lock_names(cfg):
                assert api.get(f"v2/concurrency_limits/{name}").json()["active_slots"] == 0
                assert api.get(f"variables/name/{record_name(name)}").status_code == 404
    finally:
        stop_servers(LocalNode(), cfg, cfg.nodes[0])
