"""The quick `fleet generate` re-attach (flows/quickgen.py): the flow's records without Prefect's engine,
and the flow's own path for anything that is not a one-node, local-output re-attach to a live runner.

Fault (issue 37, item 2): a `fleet generate` that re-attached to a running job imported Prefect and ran
its flow engine for an adopt-only bring-up and a follow: ≈ 6.5× a `fleet status` on a loaded 2-core
machine (bench/RESULTS.md).

The jobs here run on real sim servers through the real detached runner; the runner is frozen
(SIGSTOP) once it has shown both servers generating, so a job outlives every check without a race,
and thawed (SIGCONT) when the test lets it finish.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_until
from fleet.config import FleetConfig
from test_quickup import _api, _diff, _env, _norm, _runs

pytestmark = pytest.mark.usefixtures("prefect_api")

ROOT = Path(__file__).resolve().parents[1]
ROWS = 200
_GLYPHS = "▁▂▃▄▅▆▇█▏▎▍▌▋▊▉─"

# The command as `fleet` runs it (argv from sys.argv: it takes over Ctrl-C), then whether it imported
# Prefect; a command stopped by a signal says it in the file QUICKGEN_TEST_MARKER names (its output is
# silenced by then), from a cleanup of its own.
_CODE = ("import os, sys, flows.cli\n"
         "from fleet.interrupt import on_interrupt\n"
         "said = lambda: 'PREFECT-IMPORTED' if 'prefect' in sys.modules else 'PREFECT-NOT-IMPORTED'\n"
         "on_interrupt('test marker', lambda: open(os.environ['QUICKGEN_TEST_MARKER'], 'w').write(said()))\n"
         "sys.argv[0] = 'fleet'; rc = flows.cli.main()\n"
         "print(said(), flush=True); sys.exit(rc)")


def _cfg(tmp_path: Path, name: str, **kw: Any) -> tuple[FleetConfig, Path]:
    from fleet.demo import to_toml
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(2), n=2, name=name,
                     engine={"kind": "sim", "sim": {"startup_s": 0.3, "tokens_per_s": 200,
                                                    "max_running_requests": 8}},
                     generation={"max_tokens": 64, "max_concurrency_per_server": 2},
                     smoke={"first_timeout_s": 30, "timeout_s": 30, "attempts": 2, "backoff_s": 0.1,
                            "job_proof_s": 0}, **kw)
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    return cfg, path


def _rows(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
                                + "\n" for i in range(ROWS)))
    return path


class Gen:
    """`fleet generate` as a command in its own session, its output in a file."""

    def __init__(self, tmp_path: Path, path: Path, out: Path, log: str, **env: str) -> None:
        self.log = tmp_path / log
        self.marker = tmp_path / f"{log}.marker"
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CODE, "generate", "-c", str(path), "--input", str(_rows(tmp_path)),
                 "--output", str(out)], cwd=ROOT, env={**_env(), "QUICKGEN_TEST_MARKER": str(self.marker), **env},
                stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = 300) -> None:
        def seen() -> bool:
            if needle in self.text():
                return True
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {needle!r}:\n{self.text()[-4000:]}"
            return False

        wait_until(seen, timeout=timeout, interval=0.1, what=f"{needle!r} from fleet generate")

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"fleet generate did not end:\n{self.text()[-4000:]}") from None

    @property
    def imported_prefect(self) -> bool:
        said = self.text() + (self.marker.read_text() if self.marker.exists() else "")
        assert "PREFECT-" in said, said[-3000:]
        return "PREFECT-IMPORTED" in said


def _job_pid(cfg: FleetConfig, out: Path) -> int:
    from fleet.jobs import job_dir

    jdir = Path(job_dir(cfg.nodes[0], cfg, str(out)))
    return int((jdir / "runner.pid").read_text().split()[0])


def _progress(out: Path) -> dict[str, Any] | None:
    try:
        got = json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def frozen_job(tmp_path: Path, cfg: FleetConfig, path: Path, out: Path, log: str) -> int:
    """A job started by `fleet generate` (the flow), its runner frozen once both servers have generated,
    the command stopped (Ctrl-C: the runner is detached). Returns the runner's pid."""
    first = Gen(tmp_path, path, out, log, FLEET_QUICK_UP="0")
    try:
        first.wait_for("started runner pid")

        def generating() -> bool:
            p = _progress(out)
            assert first.proc.poll() is None, first.text()[-4000:]
            return bool(p and len(p.get("servers") or []) == 2
                        and all(s.get("served_s") is not None for s in p["servers"]))

        wait_until(generating, timeout=240, interval=0.1, what="both servers generating")
        pid = _job_pid(cfg, out)
        os.kill(pid, signal.SIGSTOP)
        p = _progress(out)
        assert p and p.get("state") != "done" and (p.get("rows_done") or 0) < ROWS, p
    finally:
        os.killpg(first.proc.pid, signal.SIGINT)
        first.finish()
    return pid


def stop_all(cfg: FleetConfig) -> None:
    """Every runner of the fleet (thawed first: a stopped process holds SIGTERM), then its servers."""
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    for pid_file in Path(cfg.nodes[0].workdir).glob("jobs/*/runner.pid"):
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass
    stop_servers(LocalNode(), cfg, cfg.nodes[0])


def _records(api: Any, run: dict[str, Any], subs: dict[str, str]) -> dict[str, Any]:
    """A run's records as test_quickup compares them, with progress lines as a set (how many the follow
    logs depends on when its polls fall) and the job's own paths made one."""
    rid = run["id"]
    tasks = api.post("task_runs/filter", json={"flow_runs": {"id": {"any_": [rid]}}}).json()
    arts = api.post("artifacts/filter", json={"flow_runs": {"id": {"any_": [rid]}}}).json()
    logs = api.post("logs/filter", json={"logs": {"flow_run_id": {"any_": [rid]}}}).json()
    by_id = {t["id"]: t["name"] for t in tasks}

    def n(text: Any) -> str:
        text = json.dumps(text) if not isinstance(text, str) else text
        for a, b in subs.items():
            text = text.replace(a, b)
        # the manifest's measured series (pairs of numbers) are as long as the job's timing made them
        # and the throughput chart's glyphs and widths are the measured rates
        text = re.sub(r"(\[\s*N,\s*N\s*\],?\s*)+", "[pairs]", _norm(text))
        return re.sub(r" {2,}", " ", re.sub(f"[{_GLYPHS} ]*[{_GLYPHS}][{_GLYPHS} ]*", "#", text))

    return {
        "name": run["name"], "state": run["state_name"], "message": n(run["state"]["message"]),
        "parameters": n(run["parameters"]), "tags": run["tags"], "flow_version": run["flow_version"],
        "tasks": sorted((t["name"], t["state_name"], t["task_key"], t["empirical_policy"]["retries"],
                         n(t["state"]["message"])) for t in tasks),
        "artifacts": sorted((a["key"], a["type"], by_id.get(a["task_run_id"]), n(a["description"]),
                             n(a["data"]) if a["type"] != "progress" else a["data"] == 100.0) for a in arts
                            if a["key"] and not a["key"].endswith("generate-servers")),
        "servers-tables": sorted({n(a["description"]) for a in arts if (a["key"] or "").endswith("generate-servers")}),
        "logs": sorted({(lg["name"], lg["level"], by_id.get(lg["task_run_id"]), n(lg["message"])) for lg in logs}),
    }


def _finished_logged(api: Any, run_id: str) -> bool:
    logs = api.post("logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}}).json()
    return any(lg["message"].startswith("Finished in state") and lg["task_run_id"] is None for lg in logs)


def _rows_once(out: Path) -> list[str]:
    from test_generate_flow import shard_ids

    return [str(i) for i in shard_ids(out)]


@pytest.mark.timeout(900)
def test_a_reattach_writes_the_records_the_flow_writes_without_importing_prefect(tmp_path: Path) -> None:
    """The same re-attach through the flow's path (FLEET_QUICK_UP=0) and the quick one, each to the job's
    end, on one Prefect server: the same flow run (name, state, message, parameters, tags, version), task
    runs (names, states, keys, retry policy, messages), artifacts (keys, types, task, description, text;
    the progress artifact at 100; the per-server tables' versions by their descriptions, as many as the
    polls made), log lines (as a set: the progress lines are as many as the polls); the quick command
    imports no Prefect, prints what `fleet generate` prints, and the node lock is back."""
    cfg, path = _cfg(tmp_path, "qgeq")
    out_a, out_b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    try:
        runner = frozen_job(tmp_path, cfg, path, out_a, "start-a.log")
        flow = Gen(tmp_path, path, out_a, "flow.log", FLEET_QUICK_UP="0")
        flow.wait_for("re-attached to runner pid")
        os.kill(runner, signal.SIGCONT)
        assert flow.finish() == 0, flow.text()[-4000:]
        assert flow.imported_prefect

        runner = frozen_job(tmp_path, cfg, path, out_b, "start-b.log")
        quick = Gen(tmp_path, path, out_b, "quick.log")
        quick.wait_for("re-attached to runner pid")
        assert _progress(out_b)["state"] != "done"   # type: ignore[index]
        os.kill(runner, signal.SIGCONT)
        assert quick.finish() == 0, quick.text()[-4000:]
        said = quick.text()
        assert not quick.imported_prefect, said[-4000:]
        assert f"Task run 'generate-local' - re-attached to runner pid {runner}" in said, said[-4000:]
        printed = json.loads(said[said.index("\n{") + 1:said.index("\n}\n") + 2])
        assert printed["state"] == "done" and printed["completed"] == ROWS, printed
        assert re.search(r"^fleet generate: generated [\d,]+ row\(s\) in this run", said, re.M), said[-2000:]
        assert sorted(_rows_once(out_b)) == sorted(f"r{i}" for i in range(ROWS))

        from fleet.jobs import job_dir

        subs = {str(out_b): str(out_a), job_dir(cfg.nodes[0], cfg, str(out_b)): job_dir(cfg.nodes[0], cfg, str(out_a))}
        with _api() as api:
            runs = _flow_then_quick(api, "generate-qgeq", "Completed")
            want, got = _records(api, runs[1], subs), _records(api, runs[3], subs)
            for what in want:   # one field at a time: a difference shows as itself
                if isinstance(want[what], list):
                    for g, w in zip(got[what], want[what]):
                        assert g == w, (what, _diff(g, w))
                assert got[what] == want[what], (what, _diff(got[what], want[what]))
            assert any(a[0] == "qgeq-local-generate-progress" and a[4] is True for a in got["artifacts"])
            from tasks.locks import lock_names, record_name

            for name in lock_names(cfg):
                assert api.get(f"v2/concurrency_limits/{name}").json()["active_slots"] == 0
                assert api.get(f"variables/name/{record_name(name)}").status_code == 404
    finally:
        stop_all(cfg)


def _flow_then_quick(api: Any, name: str, end: str) -> list[dict[str, Any]]:
    """The four runs of `name` (each path's frozen job's start, Crashed at its freeze, then its re-attach,
    ended `end`), once each re-attach's last line is logged."""
    runs = _runs(api, name)
    assert [r["state_name"] for r in runs] == ["Crashed", end, "Crashed", end], \
        [(r["state_name"], r["state"]["message"]) for r in runs]
    for r in (runs[1], runs[3]):
        wait_until(lambda r=r: _finished_logged(api, r["id"]), timeout=60, what=f"{r['name']}'s last line")
    return runs


def _reattached(tmp_path: Path, cfg: FleetConfig, path: Path, out: Path, name: str, **env: str) -> tuple[Gen, int]:
    """A frozen job, and a `fleet generate` that has re-attached to its runner."""
    runner = frozen_job(tmp_path, cfg, path, out, f"start-{name}.log")
    cmd = Gen(tmp_path, path, out, f"{name}.log", **env)
    cmd.wait_for("re-attached to runner pid")
    return cmd, runner


@pytest.mark.timeout(900)
def test_a_job_that_fails_while_followed_ends_the_run_failed_as_the_flow_does(tmp_path: Path) -> None:
    """The runner killed (SIGKILL) while each path follows it: both commands exit 1 with the same
    `FAILED:` line; both runs end Failed with the same message, the same cause tag and the same
    `generate` task run (Failed, its message), stage artifact (FAILED) and log lines."""
    from fleet.jobs import job_dir

    cfg, path = _cfg(tmp_path, "qgfail")
    out_a, out_b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    subs = {str(out_b): str(out_a), job_dir(cfg.nodes[0], cfg, str(out_b)): job_dir(cfg.nodes[0], cfg, str(out_a))}
    said = {}
    try:
        for out, name, env in ((out_a, "flow", {"FLEET_QUICK_UP": "0"}), (out_b, "quick", {})):
            cmd, runner = _reattached(tmp_path, cfg, path, out, name, **env)
            os.kill(runner, signal.SIGKILL)
            assert cmd.finish() == 1, cmd.text()[-4000:]
            assert cmd.imported_prefect == (name == "flow"), cmd.text()[-4000:]
            text = cmd.text()
            for a, b in subs.items():
                text = text.replace(a, b)
            said[name] = [_norm(ln) for ln in text.splitlines() if ln.startswith("fleet generate: FAILED: ")]
        assert said["quick"] == said["flow"] and len(said["flow"]) == 1, said
        assert "died without a final state" in said["flow"][0], said
        with _api() as api:
            runs = _flow_then_quick(api, "generate-qgfail", "Failed")
            for r in (runs[1], runs[3]):
                wait_until(lambda r=r: any(t.startswith("failed: ")
                                           for t in api.get(f"flow_runs/{r['id']}").json()["tags"]),
                           timeout=60, what="the cause tag")
            want, got = _records(api, api.get(f"flow_runs/{runs[1]['id']}").json(), subs), \
                _records(api, api.get(f"flow_runs/{runs[3]['id']}").json(), subs)
            # Prefect's own report of the task's exception carries the flow path's traceback
            for rec in (want, got):
                rec["logs"] = [lg for lg in rec["logs"] if not lg[3].startswith("Task run failed with exception")]
            for what in want:
                assert got[what] == want[what], (what, _diff(got[what], want[what]))
    finally:
        stop_all(cfg)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "fleet: interrupted."),
                                              (signal.SIGHUP, 129, "fleet: stopped (SIGHUP).")])
def test_a_stop_while_following_is_clean_and_the_next_generate_finishes_the_job(tmp_path: Path, sig: int, code: int,
                                                                               said: str) -> None:
    """Ctrl-C (to the group) or SIGHUP while the quick path follows: the command's clean stop (its exit
    code, the paragraph, no traceback), the run Crashed with the stop named, the runner still running;
    the next `fleet generate` re-attaches (quick again) and finishes with every row exactly once."""
    from fleet.node import LocalNode

    from flows.quickup import save_task_keys

    cfg, path = _cfg(tmp_path, "qgstop")
    out = tmp_path / "out"
    save_task_keys()   # as a completed flow run of this code leaves them (flows/cli.py)
    try:
        cmd, runner = _reattached(tmp_path, cfg, path, out, "quick")
        os.killpg(cmd.proc.pid, sig)
        assert cmd.finish() == code, cmd.text()[-4000:]
        text = cmd.text()
        assert said in text and "Traceback" not in text and not cmd.imported_prefect, text[-4000:]
        para = text[text.index(said):]
        assert "the same `fleet generate` command again" in para or code == 129, para
        assert LocalNode().is_alive(runner)   # the job goes on without the command
        with _api() as api:
            runs = _runs(api, "generate-qgstop")
            assert runs[-1]["state_name"] == "Crashed", runs[-1]
            assert runs[-1]["state"]["message"].startswith(said.removeprefix("fleet: ").rstrip(".")), runs[-1]
        again = Gen(tmp_path, path, out, "again.log")
        again.wait_for("re-attached to runner pid")
        os.kill(runner, signal.SIGCONT)
        assert again.finish() == 0, again.text()[-4000:]
        assert not again.imported_prefect, again.text()[-3000:]
        ids = _rows_once(out)
        assert sorted(ids) == sorted(f"r{i}" for i in range(ROWS)), (len(ids), len(set(ids)))
    finally:
        stop_all(cfg)


@pytest.mark.parametrize("change, why", [
    ({"nodes": 2}, "2 nodes"),
    ({"output": "s3://bucket/out"}, "store URL"),
    ({"input": "s3://bucket/in.jsonl"}, "store URL"),
    ({"endpoints": True}, "[[endpoints]]"),
    ({"env": {"FLEET_QUICK_UP": "0"}}, "FLEET_QUICK_UP=0"),
    ({"env": {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}}, "PREFECT_API_URL is set"),
    ({"store_block_env": True}, "is set"),
    ({}, None),
])
def test_what_takes_the_flows_path(tmp_path: Path, change: dict[str, Any], why: str | None) -> None:
    from blocks.credentials import STORE_BLOCK_ENVS
    from flows.quickgen import refusal

    nodes = [{"name": f"n{i}", "workdir": str(tmp_path / f"w{i}")} for i in range(change.get("nodes", 1))]
    data: dict[str, Any] = {"name": "f", "nodes": nodes, "engine": {"kind": "sim"},
                            "servers": {"count": change.get("count", 2), "base_port": 30000}}
    if change.get("endpoints"):
        data["endpoints"] = [{"name": "e", "url": "http://127.0.0.1:9/v1", "model": "m"}]
    cfg = FleetConfig(**data)
    env = dict(change.get("env", {}))
    if change.get("store_block_env"):   # the store's credentials from a Prefect block
        env = {STORE_BLOCK_ENVS[0]: "aws"}
    got = refusal(cfg, change.get("input", "/data/in.jsonl"), change.get("output", "/data/out"), env, tmp_path,
                  tmp_path)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_no_live_runner_takes_the_flows_path_and_writes_nothing(tmp_path: Path) -> None:
    """A job whose runner is not running (never started, or ended): start_job would start one, which is
    the flow's to do and record; the quick path stops before it creates a flow run."""
    from flows.quickgen import quick_generate
    from flows.quickup import save_task_keys

    cfg, _ = _cfg(tmp_path, "qgnone")
    save_task_keys()
    assert quick_generate(cfg, str(_rows(tmp_path)), str(tmp_path / "out"), False, environ=_env()) is None
    with _api() as api:
        assert _runs(api, "generate-qgnone") == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path_name, env", [("quick", {}), ("flow", {"FLEET_QUICK_UP": "0"})])
def test_a_cancel_of_the_run_stops_the_follow_and_ends_it_cancelled(tmp_path: Path, path_name: str,
                                                                    env: dict[str, str]) -> None:
    """A Cancel from Prefect (the run set Cancelling through the API, as the UI's button does) while
    `fleet generate` follows, on either path: the follow stops within a poll, the run ends Cancelled
    with flows/cancel.py's message (what a worker's run ends with), the command exits 1 saying so, no
    traceback, and the runner keeps running. Fault on the flow's path: for a run `fleet generate`
    started, nothing watched for a Cancel: it kept following and ended in a traceback (UnfinishedRun),
    the run left Cancelling (now flows/cancel.py `watch_command_run`)."""
    from fleet.node import LocalNode
    from flows.cancel import CANCELLED_MESSAGE
    from flows.quickup import save_task_keys

    cfg, path = _cfg(tmp_path, f"qgcancel{path_name}")
    save_task_keys()
    try:
        cmd, runner = _reattached(tmp_path, cfg, path, tmp_path / "out", path_name, **env)
        with _api() as api:
            run = _runs(api, f"generate-qgcancel{path_name}")[-1]
            assert run["state_name"] == "Running", run
            api.post(f"flow_runs/{run['id']}/set_state", json={"state": {"type": "CANCELLING", "name": "Cancelling"},
                                                              "force": True}).raise_for_status()
            assert cmd.finish() == 1, cmd.text()[-4000:]
            text = cmd.text()
            assert f"fleet generate: FAILED: {CANCELLED_MESSAGE}" in text and "Traceback" not in text, text[-4000:]
            assert cmd.imported_prefect == (path_name == "flow")
            ended = api.get(f"flow_runs/{run['id']}").json()
            assert ended["state_name"] == "Cancelled" and ended["state"]["message"] == CANCELLED_MESSAGE, ended
            tasks = api.post("task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}).json()
            gen = [t for t in tasks if t["name"] == "generate-local"]
            assert len(gen) == 1 and gen[0]["state_type"] == "FAILED", gen
        assert LocalNode().is_alive(runner)   # the job goes on
    finally:
        stop_all(cfg)


@pytest.mark.timeout(900)
def test_a_write_refused_while_following_undoes_the_try_and_the_flow_takes_over(tmp_path: Path) -> None:
    """A record the server refuses while the quick path follows a runner that still runs (its progress
    artifact's update here): what the try wrote is undone (no flow run of it left, every key's latest
    artifact what it was before) and `fleet generate` runs the flow, which re-attaches to the runner."""
    import flows.quickup as quickup
    from flows.quickgen import quick_generate
    from flows.quickup import save_task_keys

    cfg, path = _cfg(tmp_path, "qgrefuse")
    save_task_keys()
    out = tmp_path / "out"
    real = quickup.Api.call

    def refuse_progress(self: Any, method: str, path_: str, body: Any = None, ok: tuple[int, ...] = ()) -> Any:
        if method == "PATCH" and path_.startswith("/artifacts/"):
            raise quickup.ApiError(500, "refused")
        return real(self, method, path_, body, ok)

    try:
        runner = frozen_job(tmp_path, cfg, path, out, "start.log")
        with _api() as api:
            before = {a["key"]: a["id"] for a in api.post("artifacts/latest/filter", json={
                "artifacts": {"key": {"like_": "qgrefuse-"}}}).json()}
            quickup.Api.call = refuse_progress   # type: ignore[method-assign]
            try:
                assert quick_generate(cfg, str(_rows(tmp_path)), str(out), False, environ=_env()) is None
            finally:
                quickup.Api.call = real   # type: ignore[method-assign]
            assert [r["state_name"] for r in _runs(api, "generate-qgrefuse")] == ["Crashed"]   # the starter's
            after = {a["key"]: a["id"] for a in api.post("artifacts/latest/filter", json={
                "artifacts": {"key": {"like_": "qgrefuse-"}}}).json()}
            assert after == before
        again = Gen(tmp_path, path, out, "again.log")
        again.wait_for("re-attached to runner pid")
        os.kill(runner, signal.SIGCONT)
        assert again.finish() == 0, again.text()[-4000:]
    finally:
        stop_all(cfg)
