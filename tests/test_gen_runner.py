"""The generation runner end to end: real store, real sim servers, the runner as a process.

What these protect: a SIGKILL mid-run loses nothing and duplicates nothing after resume;
SIGTERM is a clean stop; a crashed server is relaunched with its launch spec and
re-admitted; with every server down the job says "paused" in progress.json and finishes
once one comes back; the manifest carries counts, throughput, cost and data checks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from fleet.config import FleetConfig
from fleet.generation.data.checks import account
from fleet.generation.job.runner import ServerEntry, run_local
from fleet.generation.data.results import read_errors, read_rejects, shard_paths
from test_gen_dispatch import Sim, sims  # noqa: F401  (the fixture is re-used)
from conftest import start_local_servers, wait_until

ROOT = Path(__file__).resolve().parents[1]


def write_input(path: Path, n: int, *, bad_lines: tuple[int, ...] = (), long_prompt_at: int | None = None) -> int:
    """n requests (ids r0..), a malformed line at each of `bad_lines` (0-based positions); returns rows."""
    lines = []
    for i in range(n):
        if i in bad_lines:
            lines.append('{"id": "broken", "messages": [')
        content = "word " * 400 if i == long_prompt_at else f"question {i}"
        lines.append(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": content}]}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    return wait_until(check, timeout=timeout, what=what, interval=interval)


def progress(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return None


def job_file(tmp: Path, inp: Path, out: Path, servers: list[Sim], **kw: Any) -> Path:
    job = {
        "config": {"name": "t", "engine": {"kind": "sim"}, "generation": {"max_tokens": 48, "max_attempts": 3},
                   **kw.pop("config", {})},
        "input": str(inp), "output": str(out),
        "servers": [{"node": "local", "index": i, "url": s.url, "model": "sim-model"} for i, s in enumerate(servers)],
        "flush_interval_s": 0.3, "progress_interval_s": 0.2, "console_interval_s": 1, "stop_grace_s": 10, **kw,
    }
    p = tmp / "job.json"
    p.write_text(json.dumps(job))
    return p


def start_runner(job: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "fleet.generation.job.runner", "--job", str(job)], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def result_ids(out: Path) -> list[str]:
    ids: list[str] = []
    for p in shard_paths(out):
        ids += pq.read_table(p, columns=["id"]).column("id").to_pylist()
    return ids


# Servers slow enough that a poll arriving late on a busy machine still finds the job mid-run
# (~33 rows/s: 1200 rows would take 36 s), restarted fast on the same ports for the resume.
SLOW = ("--tokens-per-s", "100", "--max-running-requests", "8")
FAST = ("--tokens-per-s", "100000", "--max-running-requests", "8")


def test_sigkill_mid_run_then_resume_exact_counts(tmp_path: Path, sims) -> None:
    """Fault guarded in the test itself: at ~250 rows/s the kill sometimes landed after the last
    row on a loaded CI machine; the first run now cannot finish before the poll sees it."""
    a = sims(*SLOW, "--context-length", "256")
    b = sims(*SLOW, "--context-length", "256")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 1200, bad_lines=(5, 700), long_prompt_at=11)
    job = job_file(tmp_path, inp, out, [a, b])
    log = tmp_path / "runner.log"

    first = start_runner(job, log)
    try:
        wait_for(lambda: (p := progress(out)) and (p.get("committed") or 0) >= 100, 60, "a few committed shards")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    killed_at = progress(out)
    assert killed_at["state"] == "running" and killed_at["rows_done"] < rows, "killed mid-run"
    assert (out / ".lock").exists()
    for sim in (a, b):
        sim.kill()
        sim.start(*FAST, "--context-length", "256")

    second = start_runner(job, log)
    assert second.wait(timeout=60) == 0, log.read_text()[-3000:]

    ids = result_ids(out)
    assert len(ids) == len(set(ids)), "an id is in two shards"
    errors, rejects = list(read_errors(out)), list(read_rejects(out))
    assert [e["id"] for e in errors] == ["r11"] and errors[0]["attempts"] == 1 and errors[0]["status"] == 400
    assert "context length" in errors[0]["error"]
    assert len(rejects) == 2, "malformed lines are rejected once, not once per run"
    assert len(ids) + len(errors) + len(rejects) == rows
    acc = account(inp, out)
    assert acc["ok"], acc

    final = progress(out)
    assert final["state"] == "done" and final["rows_done"] == final["rows_total"] == rows
    assert final["this_run"]["fed"] <= rows - killed_at["committed"], "the resume skipped what was committed"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "done" and manifest["complete"] and manifest["accounted"] == rows
    assert manifest["counts"]["completed"] == len(ids) and manifest["checks"]["rows"] == len(ids)
    assert manifest["throughput"]["completion_tok_s"] > 0 and len(manifest["servers"]) == 2
    assert len(manifest["runs"]) == 1, "the killed run wrote no manifest; the resume is the first"
    assert final["manifest"] == str(out / "manifest.json")


def test_sigterm_stops_cleanly_then_resume_finishes(tmp_path: Path, sims) -> None:
    a = sims(*SLOW)   # 400 rows take 25 s: the SIGTERM lands mid-run however busy the machine
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 400)
    job = job_file(tmp_path, inp, out, [a], config={"generation": {"max_tokens": 48, "price_per_gpu_hour": 2.5}})
    log = tmp_path / "runner.log"
    proc = start_runner(job, log)
    wait_for(lambda: (p := progress(out)) and p["completed"] >= 40, 60, "some rows done")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    p = progress(out)
    assert p["state"] == "stopped" and p["in_flight"] == 0 and p["completed"] < rows
    assert p["completed"] == len(result_ids(out)), "everything finished before the stop is committed"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "stopped" and not manifest["complete"]
    assert manifest["cost"]["usd_per_m_completion_tokens"] > 0 and manifest["cost"]["gpus"] == 1

    a.kill()
    a.start(*FAST)
    proc = start_runner(job, log)
    assert proc.wait(timeout=60) == 0
    ids = result_ids(out)
    assert sorted(ids) == sorted(f"r{i}" for i in range(rows)) and len(ids) == len(set(ids))
    manifest = json.loads((out / "manifest.json").read_text())
    assert [r["state"] for r in manifest["runs"]] == ["stopped", "done"]
    assert manifest["overall"]["completion_tokens"] == sum(r["completion_tokens"] for r in manifest["runs"])
    assert manifest["overall"]["cost"]["usd_per_m_completion_tokens"] > 0


def sim_fleet(tmp_path: Path, base_port: int, n: int, **servers: Any) -> FleetConfig:
    return FleetConfig(
        name="gen", nodes=[{"name": "local", "workdir": str(tmp_path / "work")}],
        engine={"kind": "sim", "sim": {"startup_s": 0.2, "tokens_per_s": 600, "max_running_requests": 8}},
        model={"source": "/dev/null/sim-model", "served_name": "sim-model"},
        servers={"count": n, "base_port": base_port, "ready_timeout_s": 30, "stop_grace_s": 1, **servers},
        smoke={"first_timeout_s": 10, "timeout_s": 5, "attempts": 2, "backoff_s": 0.1},
        generation={"max_tokens": 48},
    )


@pytest.mark.parametrize("how", ["in-process", "pyz"])
def test_crashed_server_is_relaunched_with_its_spec_and_nothing_is_lost(tmp_path: Path, how: str) -> None:
    """`pyz`: the runner as SSH nodes run it (fleet shipped as one zip, fleet.generation.job.remote),
    where fleet/sim's modules are not files on disk.

    Protects: a server that dies mid-job is relaunched with its own launch spec, smoked, and
    re-admitted, and no row is lost or written twice. The numbers make this independent of
    timing (it flaked under CPU load when they did not): the relaunch keeps --crash-after, so
    server 1 may take only rows enough for one crash — ROWS <= (CRASH_AT - 8) + (CRASH_AT - 3):
    at least CRASH_AT - 8 rows done before the first crash (up to 7 others in flight die with
    it), at most CRASH_AT - 3 after the relaunch (the smoke's up to 2 requests count) — and
    server 0 is slow (one row at a time, ~2 s each), so the rows left at the crash last it
    ~100 s alone: the relaunch (seconds) always ends before the job does. With 600 rows and
    equal servers it crashed two or three times and the job sometimes ended mid-relaunch, its
    launch record not yet smoked (or, with a slow first relaunch, before server 1 served again).
    """
    import dataclasses
    from conftest import port_block
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    crash_at, n_rows = 70, 120
    assert n_rows <= (crash_at - 8) + (crash_at - 3), "server 1 could crash a second time"
    base = port_block(2)
    cfg = sim_fleet(tmp_path, base, 2, extra_args_by_index={
        0: ["--max-running-requests", "1", "--tokens-per-s", "24"],   # 48 tokens: ~2 s a row
        1: ["--crash-after", str(crash_at)]})
    node = LocalNode("local")
    try:
        entries = start_local_servers(cfg)
        inp, out = tmp_path / "in.jsonl", tmp_path / "out"
        rows = write_input(inp, n_rows)
        if how == "in-process":
            rc = run_local(cfg, inp, out, entries, flush_interval_s=0.5, progress_interval_s=0.2)
        else:
            from fleet.generation.job.remote import build_pyz

            pyz = tmp_path / "fleet-runner.pyz"
            pyz.write_bytes(build_pyz())
            job = tmp_path / "job.json"
            job.write_text(json.dumps({
                "config": cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), "input": str(inp),
                "output": str(out), "servers": [dataclasses.asdict(e) for e in entries],
                "flush_interval_s": 0.5, "progress_interval_s": 0.2}))
            r = subprocess.run([sys.executable, str(pyz), "--job", str(job)], cwd=tmp_path, capture_output=True,
                               text=True, timeout=120)
            rc = r.returncode
            assert rc == 0, r.stderr[-3000:]
            assert "relaunched" in r.stderr
        assert rc == 0
        ids = result_ids(out)
        assert len(ids) == rows == len(set(ids)) and not list(read_errors(out))
        manifest = json.loads((out / "manifest.json").read_text())
        by = {s["name"]: s for s in manifest["servers"]}
        assert by["local/1"]["restarts"] >= 1 and by["local/1"]["downs"] >= 1 and by["local/0"]["restarts"] == 0
        assert by["local/1"]["requests"] > crash_at, "the relaunched server was re-admitted and served again"
        log = Path(cfg.nodes[0].workdir) / "servers" / "gen-1.log"
        assert "# fleet launch:" in log.read_text() and (log.parent / "gen-1.log.prev").exists()
        record = json.loads((log.parent / "gen-1.json").read_text())
        assert record["smoke"]["ok"], "the relaunch was smoked before re-admission"
    finally:
        stop_servers(node, cfg, cfg.nodes[0])


def test_all_servers_down_shows_paused_then_finishes(tmp_path: Path, sims) -> None:
    s = sims(*SLOW)   # 300 rows take 18 s: the kill lands mid-run however busy the machine
    cfg = FleetConfig(engine={"kind": "sim"}, generation={"max_tokens": 48},
                      smoke={"first_timeout_s": 5, "timeout_s": 5, "attempts": 1})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 300)
    entry = ServerEntry(node="local", index=0, url=s.url, model="sim-model")
    rc: list[int] = []
    fast = {"recovery_backoff_s": 0.1, "recovery_backoff_max_s": 0.3}
    t = threading.Thread(target=lambda: rc.append(run_local(cfg, inp, out, [entry], progress_interval_s=0.1,
                                                            flush_interval_s=0.5, dispatch=fast)))
    t.start()
    try:
        wait_for(lambda: (p := progress(out)) and p["completed"] >= 30, 60, "rows done before the kill")
        s.kill()
        paused = wait_for(lambda: (p := progress(out)) and p["state"] == "paused" and p, 60, "paused state")
        assert paused["detail"] == "paused: all servers down" and paused["servers_up"] == 0
        assert paused["servers"][0]["state"] in ("down", "recovering")
        time.sleep(0.5)
        assert progress(out)["errors"] == 0, "nothing goes to errors while paused"
        s.start(*FAST)
        t.join(timeout=60)
        assert not t.is_alive()
    finally:
        s.kill()
        t.join(timeout=5)
    assert rc == [0]
    final = progress(out)
    assert final["state"] == "done" and final["completed"] == rows and final["errors"] == 0
    assert len(result_ids(out)) == rows


def test_bad_job_file_and_locked_output_exit_2(tmp_path: Path, sims) -> None:
    from fleet.generation.data.store import ResultStore

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runner = [sys.executable, "-m", "fleet.generation.job.runner", "--job"]
    r = subprocess.run([*runner, str(tmp_path / "missing.json")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "cannot read the job file" in r.stderr

    a = sims()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_input(inp, 5)
    job = job_file(tmp_path, inp, out, [a])
    with ResultStore(out):
        r = subprocess.run([*runner, str(job)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "in use by another generation runner" in r.stderr


def test_sigstopped_server_is_detected_relaunched_and_readmitted(tmp_path: Path) -> None:
    """Fault: `kill -STOP` of one server mid-job (the process lives, answers nothing). Before
    the watchdog: progress stuck at "in flight 16" for hours, or with a short request timeout
    the server was marked down but never relaunched and healthy rows ended in errors. Now: no
    row finished for stall_s → its generation probe times out → down; its rows go back
    uncharged; the runner sees the process stopped, stops it (SIGCONT + TERM), relaunches it
    with its launch spec, smokes it and re-admits it; every row ends exactly once, no errors.
    Server 0 is slow (one row at a time) so the job outlasts the relaunch whatever the load."""
    from conftest import port_block
    from fleet.node import LocalNode
    from fleet.servers import stop_servers

    n_rows = 160
    base = port_block(2)
    cfg = sim_fleet(tmp_path, base, 2, extra_args_by_index={0: ["--max-running-requests", "1", "--tokens-per-s", "24"]})
    cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"stall_s": 1.0})})
    node = LocalNode("local")
    pids: list[int] = []
    try:
        entries = start_local_servers(cfg, pids)
        inp, out = tmp_path / "in.jsonl", tmp_path / "out"
        rows = write_input(inp, n_rows)
        stopped: dict[str, float] = {}

        def stop_server_1() -> None:
            def served() -> bool:
                p = progress(out)
                return bool(p and p.get("servers") and p["servers"][1]["requests"] >= 20)
            wait_for(served, 60, "server 1 serving")
            os.kill(pids[1], signal.SIGSTOP)
            stopped["at"] = time.monotonic()

        t = threading.Thread(target=stop_server_1, daemon=True)
        t.start()
        rc = run_local(cfg, inp, out, entries, flush_interval_s=0.5, progress_interval_s=0.1,
                       dispatch={"stall_probe_timeout_s": 1.0, "stall_poll_s": 0.1})
        t.join(5)
        assert rc == 0 and "at" in stopped
        ids = result_ids(out)
        assert len(ids) == rows == len(set(ids)) and not list(read_errors(out))
        attempts = [a for p in shard_paths(out) for a in pq.read_table(p, columns=["attempts"]).column(0).to_pylist()]
        assert set(attempts) == {1}, "no row was charged for the stopped server"
        manifest = json.loads((out / "manifest.json").read_text())
        s1 = {s["name"]: s for s in manifest["servers"]}["local/1"]
        assert s1["downs"] == 1 and s1["restarts"] == 1 and s1["stalls"] >= 1
        assert s1["requests"] > 20 and s1["state"] == "up", "relaunched, re-admitted, served again"
        new_pid = int((Path(cfg.nodes[0].workdir) / "servers" / "gen-1.pid").read_text().split()[0])
        assert new_pid != pids[1]
        record = json.loads((Path(cfg.nodes[0].workdir) / "servers" / "gen-1.json").read_text())
        assert record["smoke"]["ok"], "the relaunch was smoked before re-admission"
    finally:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGCONT)
            except OSError:
                pass
        stop_servers(node, cfg, cfg.nodes[0])


def test_liveness_reads_pid_files_that_carry_the_start_time(tmp_path: Path) -> None:
    """Fault: pid files became "PID STARTTIME" and the runner's liveness check, which read a bare
    number, answered "cannot tell" for every server: a crashed server was then only noticed
    after connection failures. It must read the first field: alive, dead, and unknown."""
    from fleet.generation.hotpath.dispatch import Endpoint
    from fleet.generation.job.relaunch import JobServers
    from fleet.servers import server_paths

    cfg = FleetConfig(name="live", nodes=[{"name": "local", "workdir": str(tmp_path)}])
    entry = ServerEntry(node="local", index=0, url="http://127.0.0.1:1", model="m",
                        spec={"workdir": str(tmp_path), "index": 0})
    servers = JobServers(cfg, [entry], relaunch=False)
    ep = Endpoint(name=entry.name, url=entry.url, model="m")
    pid_path = Path(server_paths(str(tmp_path), "live", 0).pid)
    pid_path.parent.mkdir(parents=True, exist_ok=True)
    assert servers.is_alive(ep) is None, "no pid file: cannot tell"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid_path.write_text(f"{proc.pid} 123456\n")
        assert servers.is_alive(ep) is True
    finally:
        proc.kill()
        proc.wait()
    assert servers.is_alive(ep) is False


def test_a_runner_does_not_relaunch_a_server_of_a_fleet_torn_down_on_its_node(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Teardown stops the fleet's live runners before its servers, but a runner can still be
    alive afterwards: a multi-node controller hands the stopped chunk back to the queue and starts
    the next runner on the node, which found every server down and relaunched each one — after
    `fleet down` the GPUs were serving (and billed) again. With the teardown marker on the node
    (written once every server is stopped; a bring-up removes it) the runner relaunches nothing."""
    import fleet.servers
    from fleet.generation.hotpath.dispatch import Endpoint
    from fleet.generation.job.relaunch import JobServers

    cfg = FleetConfig(name="torn", nodes=[{"name": "local", "workdir": str(tmp_path)}])
    spec = {"node": "local", "index": 0, "gpus": [], "host": "127.0.0.1", "port": 1, "model_path": "/m",
            "served_name": "m", "python": sys.executable, "workdir": str(tmp_path)}
    entry = ServerEntry(node="local", index=0, url="http://127.0.0.1:1", model="m", spec=spec)
    servers = JobServers(cfg, [entry], relaunch=True)
    ep = Endpoint(name=entry.name, url=entry.url, model="m")
    (tmp_path / "teardown").mkdir()
    (tmp_path / "teardown" / "torn.json").write_text(json.dumps({"fleet": "torn", "at": time.time(),
                                                                 "by": "fleet down", "stopped": 1}))
    launched: list[Any] = []

    class Launched(Exception):
        pass

    def launch(*args: Any, **kw: Any) -> Any:
        launched.append(args)
        raise Launched

    monkeypatch.setattr(fleet.servers, "launch", launch)
    try:
        ok = servers._relaunch(ep, entry)
    except Launched:
        ok = None
    assert launched == [], "a server of a torn-down fleet was relaunched"
    assert ok is False


def test_the_runner_process_writes_its_shards_without_loading_pandas(tmp_path: Path, sims) -> None:
    """Cost: pyarrow imported pandas on the runner's first list conversion (a shard's columns), ≈ 0.3 s of
    CPU a runner start for nothing. The real runner process (`python -m`, through runpy as the module's
    own `__main__`) finishes a job with shards, errors and rejects written, and pandas was never loaded;
    pandas asked for in that process says why it is refused."""
    a = sims()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 30, bad_lines=(4,))
    job = job_file(tmp_path, inp, out, [a], config={"engine": {"kind": "sim"},
                                                  "generation": {"max_tokens": 48, "max_attempts": 1}})
    probe = ("import atexit, runpy, sys\n"
             "def seen():\n"
             "    try:\n"
             "        import pandas  # noqa: F401\n"
             "        asked = 'loaded'\n"
             "    except ModuleNotFoundError as exc:\n"
             "        asked = str(exc)\n"
             "    print('PANDAS-LOADED' if 'pandas.core' in sys.modules else 'PANDAS-NOT-LOADED', asked)\n"
             "atexit.register(seen)\n"
             "sys.argv = ['runner', '--job', sys.argv[1]]\n"
             "runpy.run_module('fleet.generation.job.runner', run_name='__main__', alter_sys=True)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", probe, str(job)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PANDAS-NOT-LOADED" in r.stdout and "does not load pandas" in r.stdout, r.stdout
    ids = result_ids(out)
    errors, rejects = list(read_errors(out)), list(read_rejects(out))
    assert len(ids) == len(set(ids)) and len(ids) + len(errors) + len(rejects) == rows
    assert len(rejects) == 1 and len(ids) >= 28
    assert account(inp, out)["ok"]
