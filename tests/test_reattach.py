"""A bring-up while a generation job runs — above all the one a re-attaching `fleet generate` runs
first — takes the live job's recent progress through a server as proof that it serves, instead
of a smoke request that waits for a slot behind the job's rows (issue 21 item 2: 1-2.5 s of a
3 s command on an idle machine). A server the job has not seen generate lately is smoked as
before, and the log says why.

Real parts: the Prefect test server, sim servers (which count the requests they receive by
their max_tokens: the smoke's is its own), the detached runner, the `fleet generate` command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from fleet.config import FleetConfig
from fleet.jobs import LiveJob, judge_proof
from test_bringup import port_block, run, run_logs, sim_config
from test_generate_flow import prompts

SMOKE_TOKENS = 7   # the smoke's max_tokens: no row of the job asks for it


@pytest.fixture
def stop_everything() -> Iterator[Callable[[FleetConfig], None]]:
    """The job's runner first (SIGKILL), then the servers: a live runner relaunches a server that
    is stopped under it, and that one would outlive the test."""
    cfgs: list[FleetConfig] = []
    yield cfgs.append
    from fleet.node import connect
    from fleet.servers import stop_servers

    for cfg in cfgs:
        for n in cfg.nodes:
            with connect(n) as node:
                node.run(["sh", "-c", 'for p in "$1"/jobs/*/runner.pid; do [ -f "$p" ] && { read -r pid _ < "$p"; '
                          'kill -9 "$pid"; }; done; true', "x", n.workdir], check=False)
                stop_servers(node, cfg, n)


def smokes(cfg: FleetConfig) -> list[int]:
    """Smoke requests each sim server has received so far."""
    base = cfg.servers.base_port
    assert base is not None and cfg.servers.count is not None
    return [int(httpx.get(f"http://127.0.0.1:{base + i}/sim/requests", timeout=10).json()["by_max_tokens"]
                .get(str(SMOKE_TOKENS), 0)) for i in range(cfg.servers.count)]


def job_cfg(tmp_path: Path, job_proof_s: float) -> FleetConfig:
    # ~2 rows/s over 2 servers, 5,000 rows: the job outlives the test (the fixture kills it)
    return sim_config(tmp_path, port_block(2), n=2,
                      engine={"sim": {"startup_s": 0.3, "tokens_per_s": 20, "max_running_requests": 8}},
                      generation={"max_tokens": 64, "max_concurrency_per_server": 2},
                      smoke={"max_tokens": SMOKE_TOKENS, "job_proof_s": job_proof_s})


def start_job(tmp_path: Path, cfg: FleetConfig) -> tuple[list[str], Path, dict[str, Any]]:
    """`fleet generate` until the runner has reported both servers generating, then SIGKILL the
    command (the runner goes on, detached). Returns the command, the output and that progress."""
    from fleet.demo import to_toml

    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "flows.cli", "generate", "-c", str(path), "--input",
            str(prompts(tmp_path / "in.jsonl", 5000)), "--output", str(out)]
    log = tmp_path / "first.log"
    with log.open("wb") as f:
        first = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while True:
            p = _progress(out)
            if p and len(p.get("servers") or []) == 2 and all(s.get("served_s") is not None for s in p["servers"]):
                return argv, out, p
            assert first.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the job never showed both servers generating"
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def _progress(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return None


def reattach(argv: list[str], log: Path) -> str:
    """The same `fleet generate` again, until it says it re-attached; then Ctrl-C. Its output."""
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    try:
        while "re-attached to runner pid" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "the command never re-attached"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return log.read_text(errors="replace")


@pytest.mark.usefixtures("prefect_api")
def test_reattach_sends_no_smoke_request_to_the_servers_the_live_job_is_using(tmp_path: Path,
                                                                                 stop_everything) -> None:
    """`fleet generate` re-attaching to a live runner brings the fleet up first, and its servers
    are busy with that very job: a smoke request waited for a free slot behind the job's rows.
    Counted at the sim servers: the re-attach sends none, says what proved each server instead,
    and so does a `fleet up` while the job runs (its summary's `proof` column)."""
    # the window is wide so a slow machine's runner still counts: the mechanism is tested here,
    # the window by the tests of judge_proof below
    cfg = job_cfg(tmp_path, job_proof_s=600)
    stop_everything(cfg)
    argv, _, _ = start_job(tmp_path, cfg)
    before = smokes(cfg)
    assert all(n >= 1 for n in before), before   # the first bring-up smoked each server
    output = reattach(argv, tmp_path / "second.log")
    assert smokes(cfg) == before, output[-4000:]
    for i in (0, 1):
        assert f"smoke local server {i}: the live job writing" in output and "no smoke request sent" in output, \
            output[-4000:]
    ok, rows, msg = run(cfg)
    assert ok, msg
    assert [r["proof"].startswith("live job: generated") for r in rows] == [True, True], rows
    assert [r["smoke_latency_s"] for r in rows] == [None, None], rows
    assert smokes(cfg) == before


@pytest.mark.usefixtures("prefect_api")
def test_a_server_the_live_job_has_not_seen_generate_lately_is_still_smoked(tmp_path: Path,
                                                                            stop_everything) -> None:
    """The live job's progress is proof only while it is recent: with the runner stopped, its
    progress ages past smoke.job_proof_s, and the bring-up smokes every server again (the log
    says the job uses it but saw it generate too long ago)."""
    from fleet.jobs import job_dir

    cfg = job_cfg(tmp_path, job_proof_s=1)
    stop_everything(cfg)
    _, out, _ = start_job(tmp_path, cfg)
    runner = int(Path(job_dir(cfg.nodes[0], cfg, str(out)), "runner.pid").read_text().split()[0])
    before = smokes(cfg)
    os.kill(runner, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        # the stopped runner writes no more progress: wait until what it wrote is old enough
        while time.time() - float((_progress(out) or {}).get("updated_at") or 0) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with run_logs() as logs:
            ok, rows, msg = run(cfg)
    finally:
        os.kill(runner, signal.SIGCONT)
    assert ok, msg
    assert [r["proof"] for r in rows] == ["smoke", "smoke"], rows
    assert smokes(cfg) == [n + 1 for n in before]
    said = "\n".join(logs)
    assert said.count("uses it, but it last saw it generate") == 2 and "smoke request sent" in said, said[-3000:]


def _job(servers: list[dict[str, Any]] | None = None) -> LiveJob:
    return LiveJob("local", 4242, "/w/jobs/t-1", "/data/out",
                   servers or [{"node": "local", "index": 0, "url": "http://127.0.0.1:30000"}])


def _progress_text(pid: int = 4242, updated_at: float = 1000.0, **srv: Any) -> str:
    server = {"name": "local/0", "state": "up", "suspect": False, "served_s": 1.5, "completion_tokens": 900,
              "requests": 12, **srv}
    return json.dumps({"pid": pid, "updated_at": updated_at, "servers": [server]})


def test_a_live_jobs_recent_progress_proves_its_server() -> None:
    """The proof's arithmetic: progress.json's age on the node's clock plus the server's served_s."""
    proof = judge_proof(_job(), "local/0", _progress_text(), node_now=1002.0, window_s=15)
    assert proof.proven and proof.seen_s == 3.5 and proof.completion_tokens == 900
    assert "saw it generate 3.5 s ago" in proof.describe()


@pytest.mark.parametrize("text,now,why", [
    (_progress_text(), 1014.0, "last saw it generate 16 s ago"),                 # progress too old
    (_progress_text(served_s=14.0), 1002.0, "last saw it generate 16 s ago"),    # quiet server
    (_progress_text(served_s=None), 1000.0, "has not seen it generate"),         # a runner that does not say
    (_progress_text(state="down", down_reason="3 connection failures"), 1000.0, "has it down (3 connection"),
    (_progress_text(suspect=True), 1000.0, "suspects it of a stall"),
    (_progress_text(pid=99), 1000.0, "another runner's (pid 99)"),               # a previous runner's file
    (_progress_text(name="local/1"), 1000.0, "does not list the server"),
    ("", 1000.0, "missing or unreadable"),
])
def test_a_live_jobs_progress_is_no_proof_when_it_does_not_show_the_server_generating_lately(
        text: str, now: float, why: str) -> None:
    """Each way the job's progress can fail to prove a server: it is then smoked, and why is said."""
    proof = judge_proof(_job(), "local/0", text, node_now=now, window_s=15)
    assert not proof.proven and why in (proof.why_not or ""), proof


def test_only_the_jobs_entry_for_that_server_and_port_counts() -> None:
    """An [[endpoints]] entry, another index or another port is not the server being smoked."""
    assert _job().uses("local", 0, 30000)
    assert not _job().uses("local", 0, 30001)
    assert not _job().uses("local", 1, 30000)
    assert not _job().uses("other", 0, 30000)
    assert not _job([{"node": "endpoint", "index": 0, "label": "endpoint/r", "url": "http://x:30000"}]).uses(
        "local", 0, 30000)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.mark.usefixtures("prefect_api")
def test_fleet_down_stops_the_live_runner_first_so_no_server_comes_back(tmp_path: Path, stop_everything) -> None:
    """`fleet down` while a generation job ran stopped only the servers, and the live runner
    relaunched each one it saw go down: the operator was told the fleet was down while its
    GPUs were serving (and billed) again. Now the fleet's runners are stopped first, cleanly
    (SIGTERM: committed rows stay, the same `fleet generate` resumes), then the servers; when
    `fleet down` returns nothing of the fleet is alive, and the table says which runner it stopped."""
    cfg = job_cfg(tmp_path, job_proof_s=600)
    stop_everything(cfg)
    argv, out, progress = start_job(tmp_path, cfg)
    runner_pid = int(progress["pid"])
    assert _alive(runner_pid)
    from fleet.node import connect
    from fleet.servers import records, server_paths

    n = cfg.nodes[0]

    def server_pids() -> list[int | None]:
        with connect(n) as node:
            return [node.read_pid(server_paths(n.workdir, cfg.name, i).pid) for i in range(2)]

    before = server_pids()
    assert all(p is not None and _alive(p) for p in before), before
    down = subprocess.run([sys.executable, "-m", "flows.cli", "down", "-c", argv[argv.index("-c") + 1]],
                          capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"runner writing {out}" in down.stdout and str(runner_pid) in down.stdout, down.stdout
    assert not _alive(runner_pid), down.stdout
    assert not any(p is not None and _alive(p) for p in before), before
    after = server_pids()   # a relaunched server would have written its pid file again
    assert not any(p is not None and _alive(p) for p in after), (after, down.stdout)
    for i in range(2):   # nothing listens on the servers' ports: no relaunch slipped in
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{cfg.servers.base_port + i}/health", timeout=5)
    final = json.loads((out / "progress.json").read_text())
    assert final["state"] == "stopped", final   # the runner's clean stop, not a kill


def test_teardown_stops_only_its_own_fleets_runner_not_one_whose_name_extends_it(tmp_path: Path) -> None:
    """Fleets "t" and "t-b" share a node's workdir. live_jobs globbed "<workdir>/jobs/t-*", which is
    also "t-b"'s job directory (t-b-<key>): `fleet down` of "t" (stop_jobs) SIGTERMed the other
    fleet's live runner. Only a directory named <fleet>-<10 hex> (job_dir) is this fleet's."""
    from fleet.jobs import job_dir, live_jobs
    from fleet.node import LocalNode
    from fleet.servers import stop_jobs

    cfg = sim_config(tmp_path, port_block(1), n=1)   # fleet "t"
    other = cfg.model_copy(update={"name": "t-b"})
    n = cfg.nodes[0]
    jdir = Path(job_dir(n, other, str(tmp_path / "other-out")))
    jdir.mkdir(parents=True)
    (jdir / "job.json").write_text(json.dumps({"output": str(tmp_path / "other-out"), "servers": [],
                                              "stop_grace_s": 1}))
    node = LocalNode("local")
    det = node.start_detached(["sleep", "300"], log_path=str(jdir / "runner.log"), pid_path=str(jdir / "runner.pid"))
    try:
        assert [j.pid for j in live_jobs(node, n.workdir, "t-b")] == [det.pid]   # its own fleet sees it
        assert live_jobs(node, n.workdir, "t") == []
        assert stop_jobs(node, cfg, n) == []
        assert _alive(det.pid), "fleet t's teardown stopped fleet t-b's runner"
    finally:
        node.stop(det.pid, grace_s=1)


def test_teardown_marks_the_node_before_it_stops_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker stops runners relaunching the fleet's servers (relaunch.py). Written only after
    the servers were stopped, it left a window: a runner started meanwhile (a multi-node
    controller starts the next chunk's as soon as the stopped one exits) found a server already
    stopped and relaunched it. It is there before the runners and servers are stopped; a teardown
    that fails removes it again."""
    import fleet.torndown as torndown
    from fleet.node import LocalNode

    cfg = sim_config(tmp_path, port_block(1), n=1)
    n = cfg.nodes[0]
    Path(n.workdir).mkdir(parents=True, exist_ok=True)
    node = LocalNode("local")
    seen: list[bool] = []

    def stop_servers(*args: Any) -> list[dict[str, Any]]:
        seen.append(Path(torndown.marker_path(n, cfg.name)).exists())
        return [{"node": "local", "index": 0, "port": 1, "pid": None, "action": "error: it would not stop"}]

    monkeypatch.setattr(torndown, "stop_servers", stop_servers)
    rows = torndown.tear_down(node, cfg, n, by="fleet down")
    assert seen == [True], "the servers were stopped before the node was marked torn down"
    assert [r.failed for r in rows] == [True]
    assert not Path(torndown.marker_path(n, cfg.name)).exists(), "a failed teardown kept its marker"


def test_teardown_refuses_a_runner_pid_planted_in_a_workdir_others_can_write(tmp_path: Path) -> None:
    """stop_jobs signalled whatever a runner.pid under <workdir>/jobs named, without the check that
    guards every other pid file (fleet.workdir: a workdir another user can write is theirs to
    forge): one planted there, naming any process of ours with its start time, had its whole process
    group SIGTERMed (then SIGKILLed) by `fleet down`. It is refused before anything is signalled."""
    from fleet.errors import ConfigError
    from fleet.jobs import job_dir
    from fleet.node import LocalNode
    from fleet.servers import stop_jobs

    cfg = sim_config(tmp_path, port_block(1), n=1)
    n = cfg.nodes[0]
    jdir = Path(job_dir(n, cfg, "/planted"))
    jdir.mkdir(parents=True)
    (jdir / "job.json").write_text(json.dumps({"output": "/planted", "servers": [], "stop_grace_s": 1}))
    node = LocalNode("local")
    victim = node.start_detached(["sleep", "300"], log_path=str(tmp_path / "victim.log"),
                                 pid_path=str(jdir / "runner.pid"))   # "PID STARTTIME", as a forger writes it
    os.chmod(jdir.parent, 0o777)   # the jobs directory: anyone may plant there
    try:
        with pytest.raises(ConfigError):
            stop_jobs(node, cfg, n)
        assert _alive(victim.pid), "a pid planted in a workdir others can write was killed"
    finally:
        os.chmod(jdir.parent, 0o700)
        node.stop(victim.pid, grace_s=1)


def test_teardown_stops_a_sigstopped_runner_cleanly_not_by_kill_after_the_grace(tmp_path: Path) -> None:
    """A stopped (SIGSTOP) runner acts on SIGTERM only once continued: stop_jobs sent TERM alone,
    so teardown sat out the runner's whole stop_grace_s + 15 s and then SIGKILLed it (no clean
    stop, no final manifest). It is continued first: it stops cleanly at once."""
    from fleet.jobs import job_dir
    from fleet.node import LocalNode
    from fleet.servers import stop_jobs

    cfg = sim_config(tmp_path, port_block(1), n=1)
    n = cfg.nodes[0]
    jdir = Path(job_dir(n, cfg, str(tmp_path / "out")))
    jdir.mkdir(parents=True)
    (jdir / "job.json").write_text(json.dumps({"output": str(tmp_path / "out"), "servers": [], "stop_grace_s": 5}))
    clean = tmp_path / "stopped-cleanly"
    node = LocalNode("local")
    code = ("import pathlib, signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(clean)!r}).write_text('yes'), sys.exit(0)))\n"
            "pathlib.Path(sys.argv[1]).write_text('ready')\n"
            "while True: time.sleep(0.05)\n")
    ready = tmp_path / "ready"
    det = node.start_detached([sys.executable, "-c", code, str(ready)], log_path=str(jdir / "runner.log"),
                              pid_path=str(jdir / "runner.pid"))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, (jdir / "runner.log").read_text()
            time.sleep(0.05)
        os.kill(det.pid, signal.SIGSTOP)
        (row,) = stop_jobs(node, cfg, n)
        assert row["action"] == "stopped" and clean.exists(), row
    finally:
        try:
            os.killpg(det.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
