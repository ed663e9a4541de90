"""The smaller items of issue 23: what a refused second job exits with and says, the rows a full disk
keeps, durations that a clock step cannot move, and engine flags that read a file of settings.

Real parts: the runner as a process, sim servers, a real tmpfs (root), libfaketime where installed,
the Prefect test server and `fleet generate`'s entry point. What each test protects is in its docstring.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import scaled, wait_until
from fleet.config import FleetConfig
from fleet.errors import JobConflict
from test_gen_dispatch import sims  # noqa: F401  (the fixture is re-used)
from test_gen_job_faults import exit_record, fill, rows_jsonl, tmpfs  # noqa: F401  (tmpfs: a fixture)
from test_gen_runner import job_file, progress, result_ids, start_runner, write_input

ROOT = Path(__file__).resolve().parents[1]
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


# ---------------------------------------------------------------------------- settings files in extra_args


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
@pytest.mark.parametrize("args", [["--config", "/etc/x.yaml"], ["--config=/etc/x.yaml"], ["--conf", "x.yaml"]])
def test_extra_args_that_read_a_file_of_settings_are_refused(kind: str, args: list[str]) -> None:
    """Protects the bind and the key: `engine.extra_args = ["--config", FILE]` was accepted for SGLang and
    vLLM, and that file can set --host 0.0.0.0, --port or --api-key behind fleet's checks. Now the config
    is refused with the reason and what to do, for engine.extra_args and per-server extra args alike; a
    flag that only starts alike (vLLM's --config-format) is not."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"engine\.extra_args passes --config.*would read its settings from "
                                              r"a file fleet cannot check.*give each setting as its own flag"):
        FleetConfig(engine={"kind": kind, "extra_args": args})
    with pytest.raises(ValidationError, match=r"servers\.extra_args_by_index\[1\] passes --config"):
        FleetConfig(engine={"kind": kind}, servers={"extra_args_by_index": {1: args}})
    FleetConfig(engine={"kind": kind, "extra_args": ["--config-format", "hf"]})


# ---------------------------------------------------------------------------- durations


def test_chunk_durations_come_from_the_monotonic_clock() -> None:
    """Protects the multi-node manifest: its wall time and each node's busy time and rate were differences
    of wall-clock timestamps, so a clock step (NTP, `date -s`) between a chunk's start and end made them
    wrong by the step. Now they come from the controller's monotonic clock when this boot measured every
    attempt (the timestamps stay wall clock), and from the wall clock only for attempts it did not."""
    from fleet.generation.multinode.chunks import BOOT_ID, Attempt, attempt_spans

    if BOOT_ID is None:
        pytest.skip("no /proc/sys/kernel/random/boot_id: monotonic readings cannot be matched to a boot")
    day = 86400.0
    a = Attempt("a", "/o/0", started_at=1000.0, ended_at=1010.0 + day, outcome="done", mono=[50.0, 60.0], boot=BOOT_ID)
    b = Attempt("b", "/o/1", started_at=1005.0, ended_at=1030.0 + day, outcome="done", mono=[55.0, 80.0], boot=BOOT_ID)
    assert attempt_spans([a, b]) == [(50.0, 60.0), (55.0, 80.0)]
    older = Attempt("a", "/o/2", started_at=2000.0, ended_at=2007.0, outcome="done")   # an older controller's record
    assert attempt_spans([a, older]) == [(1000.0, 1010.0 + day), (2000.0, 2007.0)], "one clock for all, or none"
    other_boot = Attempt("a", "/o/3", started_at=0.0, ended_at=5.0, mono=[90.0, 10.0], boot="another boot")
    assert attempt_spans([other_boot]) == [(0.0, 5.0)]


@pytest.mark.skipif(not FAKETIME.exists(), reason="libfaketime is not installed (apt-get install faketime)")
def test_a_wall_clock_step_mid_job_leaves_the_manifests_durations_right(tmp_path: Path, sims) -> None:
    """Protects the manifest's durations: the runner's wall clock steps a day ahead mid-job (libfaketime,
    the monotonic clock left alone, as an NTP step or `date -s` leaves it). The data is exact and
    wall_s, dispatch_s and the throughput stay those of the job (a minute, not a day); the timestamps
    (started_at, finished_at) may show the step."""
    # 50 tokens/s a stream: the job's ~270 rows after the step take ~18 s on an idle machine. At 400 the
    # whole job took ~2 s, and on a loaded one it ended before this test saw 30 rows: no step (4 runs
    # beside CPU burners: 1 failed "the step did happen")
    a = sims("--tokens-per-s", "50", "--max-running-requests", "8")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 300)
    job = job_file(tmp_path, inp, out, [a])
    stamp = tmp_path / "faketime.rc"
    stamp.write_text("+0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LD_PRELOAD": str(FAKETIME), "FAKETIME_TIMESTAMP_FILE": str(stamp),
           "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    log = tmp_path / "runner.log"
    t0 = time.monotonic()
    runner = subprocess.Popen([sys.executable, "-m", "fleet.generation.job.runner", "--job", str(job)], cwd=ROOT, env=env,
                              stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: (p := progress(out)) and (p.get("rows_done") or 0) >= 30, timeout=120, what="30 rows done")
        stamp.write_text("+1d\n")
        assert runner.poll() is None, "the job ended before the step: slow its server further"
        rc = runner.wait(timeout=300)
    finally:
        if runner.poll() is None:
            runner.kill()
    real = time.monotonic() - t0
    assert rc == 0, log.read_text()[-3000:]
    assert len(set(result_ids(out))) == rows
    m = json.loads((out / "manifest.json").read_text())
    assert m["timings"]["finished_at"] - m["timings"]["started_at"] > 80000, "the step did happen"
    assert 0 < m["timings"]["dispatch_s"] <= m["timings"]["wall_s"] <= real, m["timings"]
    assert m["this_run"]["wall_s"] <= real and m["overall"]["dispatch_s"] <= real
    assert m["throughput"]["completion_tok_s"] >= m["throughput"]["completion_tokens"] / real


# ---------------------------------------------------------------------------- a full disk


def test_the_rows_a_full_disk_keeps_are_the_rows_it_says(tmp_path: Path, tmpfs: Path, sims) -> None:
    """Fault: the output disk fills mid-job. The message said "the 5,100 committed rows are kept" where 5,400
    were: the count was taken at the first failed write, and the store's close committed its buffer once the
    space set aside for the manifest was freed. Now the buffer of a job stopped by its filesystem is dropped
    (generated again on resume) and the count is the final one: the remedy, exit.json, progress.json and the
    manifest name the rows that are in the shards."""
    a = sims("--tokens-per-s", "400", "--max-running-requests", "8")
    inp, out = tmp_path / "in.jsonl", tmpfs / "out"
    write_input(inp, 3000)
    job = job_file(tmp_path, inp, out, [a])
    log = tmp_path / "runner.log"
    runner = start_runner(job, log)
    try:
        wait_until(lambda: (p := progress(out)) and (p.get("committed") or 0) >= 50, timeout=60,
                   what="a few committed rows")
        fill(tmpfs)
        rc = runner.wait(timeout=scaled(60))
    finally:
        if runner.poll() is None:
            runner.kill()
    assert rc == 1, log.read_text()[-3000:]
    on_disk = len(result_ids(out))
    ex = exit_record(tmp_path)
    m = re.search(r"the ([\d,]+) committed rows are kept", ex["failure"]["remedy"])
    assert m, ex["failure"]
    said = int(m.group(1).replace(",", ""))
    manifest = json.loads((out / "manifest.json").read_text())
    assert said == on_disk == manifest["counts"]["committed"] == ex["counts"]["committed"], \
        (said, on_disk, manifest["counts"], ex["counts"])
    assert progress(out)["error"]["remedy"] == ex["failure"]["remedy"] == manifest["error"]["remedy"]


# ---------------------------------------------------------------------------- two jobs into one directory


@pytest.mark.usefixtures("prefect_api")
def test_the_loser_of_two_generates_into_one_directory_exits_2_and_names_the_other_input(
        tmp_path: Path, sims, monkeypatch, capsys) -> None:
    """Fault: two `fleet generate` into one directory at once, with different inputs. Both passed the check
    before bring-up (neither runner was up yet); the loser then met the winner's runner and exited 1 with
    "a different input (sha256 None…)". README's table says 2 for a second job into a job's directory. Now
    it exits 2 naming the input the running job reads and its own. (The race is made certain: the check
    before bring-up is told nothing runs yet, as it was at that moment.)"""
    from fleet.demo import to_toml
    from fleet.generation.job import validate
    from fleet.jobs import job_dir
    from fleet.node import connect
    from fleet.servers import stop_servers
    from flows.cli import main
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(1), n=1, generation={"max_tokens": 16})
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    winner_input, loser_input, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out"
    winner_input.write_bytes(rows_jsonl(400))
    loser_input.write_bytes(rows_jsonl(10))
    slow = sims("--tokens-per-s", "20", "--max-running-requests", "2")
    jdir = Path(job_dir(cfg.nodes[0], cfg, str(out)))
    jdir.mkdir(parents=True)
    (jdir / "job.json").write_text(json.dumps({
        "config": cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), "input": str(winner_input),
        "output": str(out), "servers": [{"node": "local", "index": 0, "url": slow.url, "model": "sim-model"}]}))
    winner = subprocess.Popen([sys.executable, "-m", "fleet.generation.job.runner", "--job", str(jdir / "job.json")],
                              cwd=jdir, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                              stderr=open(jdir / "runner.log", "wb"))
    (jdir / "runner.pid").write_text(str(winner.pid))

    def nothing_runs_yet(cfg: FleetConfig, *, input: str, output: str, **kw: Any) -> validate.JobPlan:
        return validate.JobPlan(str(Path(input).resolve()), str(Path(output).resolve()), "new", "a new job")

    monkeypatch.setattr(validate, "plan_job", nothing_runs_yet)
    try:
        rc = main(["generate", "-c", str(path), "--input", str(loser_input), "--output", str(out)])
    finally:
        with connect(cfg.nodes[0]) as node:
            stop_servers(node, cfg, cfg.nodes[0])
    text = capsys.readouterr()
    alive = winner.poll() is None
    winner.kill()
    winner.wait()
    assert rc == 2, text
    assert f"still writing {out}" in text.err and f"for a different input ({winner_input}; this command's is " \
        f"{loser_input})" in text.err, text.err
    assert "None" not in text.err.split("fleet generate:")[-1]
    assert alive, "the winner's runner was left alone"


def test_many_starts_into_one_directory_at_once_leave_one_runner_and_its_files_intact(tmp_path: Path) -> None:
    """Fault (issue 23): `fleet generate` into one directory at the same moment — each start found
    no runner and wrote job.json and runner.pid before the runners' own lock told all but one that
    they lost, so the winner's files could name a loser's input and a loser's (exiting) runner. Now
    a start claims the job directory before it writes anything: of 8 starts at once, each with its
    own input, one starts its runner and every other is refused with JobConflict (the CLI's exit 2,
    test above) having written nothing — job.json names the winner's input, runner.pid its runner,
    which runs."""
    import threading

    from fleet.generation.job.remote import start_job
    from fleet.node import LocalNode
    from fleet.servers import launch, plan_servers, wait_ready
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(1), n=1, engine={"sim": {"startup_s": 0.1, "tokens_per_s": 20}},
                     generation={"max_tokens": 16})
    node, node_cfg = LocalNode(), cfg.nodes[0]
    spec = plan_servers(cfg, node_cfg, [], model_path=cfg.model.source, python=sys.executable)[0]
    server = launch(node, cfg, spec)
    out = str(tmp_path / "out")
    n = 8
    inputs = []
    for i in range(n):
        inputs.append(tmp_path / f"in{i}.jsonl")
        inputs[-1].write_bytes(rows_jsonl(300 + i))
    gate = threading.Barrier(n, timeout=120)
    results: dict[int, Any] = {}

    def start(i: int) -> None:
        try:
            gate.wait()
            results[i] = start_job(LocalNode(), cfg, node_cfg, input_path=str(inputs[i]), output=out, specs=[spec])
        except BaseException as exc:  # the test judges it
            results[i] = exc

    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(n)]
    runners: list[int] = []
    try:
        wait_ready(node, cfg, spec, server.pid)
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(results) == n, "a start did not return"
        runners = [h.pid for h in results.values() if not isinstance(h, BaseException)]
        won = [i for i, h in results.items() if not isinstance(h, BaseException)]
        assert len(won) == 1, results
        lost = [h for h in results.values() if isinstance(h, BaseException)]
        assert all(isinstance(e, JobConflict) for e in lost), lost
        assert all("starting a job in" in str(e) or "still writing" in str(e) for e in lost), lost
        handle = results[won[0]]
        jdir = Path(handle.job_dir)
        assert json.loads((jdir / "job.json").read_text())["input"] == str(inputs[won[0]])
        assert int((jdir / "runner.pid").read_text().split()[0]) == handle.pid
        assert node.is_alive(handle.pid), "the winner's runner runs"
        assert not (jdir / "start.claim").exists(), "the claim was given back"
    finally:
        for pid in runners:
            if node.is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        node.stop(server.pid, grace_s=2)


def test_a_claim_left_by_a_killed_controller_does_not_refuse_its_successor(tmp_path: Path) -> None:
    """Fault (seen on the CI run of the object-storage test): the multi-node controller was SIGKILLed
    while it started a chunk's runner, after the start claim was taken and before it was given back;
    the next controller's start of that chunk was refused as "another `fleet generate` is starting a
    job" for CLAIM_STALE_S. A controller holds its own lock (ControllerLock) over its chunk
    directories, so it starts them `exclusive`, without a claim; a plain start still honours one."""
    from fleet.generation.job.remote import start_job
    from fleet.jobs import job_dir
    from fleet.node import LocalNode
    from fleet.servers import plan_servers
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(1), n=1, generation={"max_tokens": 16})
    node, node_cfg = LocalNode(), cfg.nodes[0]
    spec = plan_servers(cfg, node_cfg, [], model_path=cfg.model.source, python=sys.executable)[0]
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "out")
    inp.write_bytes(rows_jsonl(5))
    jdir = Path(job_dir(node_cfg, cfg, out))
    jdir.mkdir(parents=True)
    (jdir / "start.claim").write_text("controller-host pid 4242 0123456789ab\n")   # its start was cut short
    with pytest.raises(JobConflict, match="starting a job"):
        start_job(node, cfg, node_cfg, input_path=str(inp), output=out, specs=[spec])
    assert not (jdir / "job.json").exists()
    h = start_job(node, cfg, node_cfg, input_path=str(inp), output=out, specs=[spec], exclusive=True)
    try:
        assert not h.attached and json.loads((jdir / "job.json").read_text())["input"] == str(inp)
    finally:
        node.stop(h.pid, grace_s=2)


def test_a_runner_start_on_a_known_node_is_five_round_trips(tmp_path: Path) -> None:
    """Cost: the multi-node controller starts chunk after chunk on a kept connection; each start's node
    commands are round trips (an SSH exec each on a remote node, ≈ 3 ms of the controller's CPU and a
    few of the node's). Ten before: the runner's pid file read twice (again after a claim that an
    exclusive start does not take), the input's existence, job.json written, the last exit file
    removed, the env file written, the pid file removed, the launch, the new pid file read (twice: not
    yet there at the first look). Now five: the look, the input, job.json with the exit file's
    removal, the launch with the env file, the old pid file's removal and a bounded wait for the new
    one, and the read of it."""
    from fleet.generation.job.remote import start_job
    from fleet.node import LocalNode
    from fleet.servers import plan_servers
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(1), n=1, generation={"max_tokens": 16})
    node, node_cfg = LocalNode(), cfg.nodes[0]
    spec = plan_servers(cfg, node_cfg, [], model_path=cfg.model.source, python=sys.executable)[0]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(rows_jsonl(5))
    calls: list[list[str]] = []
    real = node._exec

    def counted(argv: Any, **kw: Any) -> Any:
        calls.append(list(argv))
        return real(argv, **kw)

    handles = []
    try:
        handles.append(start_job(node, cfg, node_cfg, input_path=str(inp), output=str(tmp_path / "out0"),
                                 specs=[spec], exclusive=True))
        node._exec = counted   # type: ignore[method-assign]
        handles.append(start_job(node, cfg, node_cfg, input_path=str(inp), output=str(tmp_path / "out1"),
                                 specs=[spec], exclusive=True))
        assert not handles[1].attached and handles[1].pid != handles[0].pid
        assert len(calls) == 5, [c[3] if c[:2] == ["sh", "-c"] else c[:3] for c in calls]
    finally:
        for h in handles:
            node.stop(h.pid, grace_s=2)


def test_a_long_end_of_a_run_keeps_its_progress_moving_and_never_reverts_it(tmp_path: Path) -> None:
    """Fault (fresh-clone CI): a chunk's runner, its rows done, spent over 20 s in its end (the data
    checks, the upload of its shards to the store on a busy machine) with progress.json untouched —
    the ticker had stopped — and the multi-node controller took it for a stalled runner: node lost,
    the finished chunk run again elsewhere. During the end progress.json is rewritten with a fresh
    updated_at; the final progress, once written, is the one rewritten (never an older state); after
    the end nothing writes it any more."""
    from fleet.generation.job.jobspec import JobSpec
    from fleet.generation.job.progress import Progress

    out = tmp_path / "out"
    out.mkdir()
    job = JobSpec(config={"name": "t"}, input=str(tmp_path / "in.jsonl"), output=str(out), servers=[])
    prog = Progress(job, store=None, started_at=time.time())
    path = out / "progress.json"

    def stamp() -> float:
        return float(json.loads(path.read_text())["updated_at"])

    prog.put({"state": "running", "rows_done": 10, "updated_at": 1.0})
    with prog.beating(0.05):
        wait_until(lambda: stamp() > 1.0, timeout=60, what="a beat")   # no row moves, the file does
        prog.put({"state": "done", "rows_done": 12, "updated_at": 2.0})   # the final progress
        wait_until(lambda: stamp() > 2.0, timeout=60, what="a beat after the final write")
        assert json.loads(path.read_text())["state"] == "done"
    last = path.read_text()
    assert json.loads(last)["state"] == "done" and json.loads(last)["rows_done"] == 12
    import threading

    assert not any(t.name == "fleet-progress-beat" for t in threading.enumerate())   # joined: nothing writes it now
