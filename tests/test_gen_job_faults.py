"""Runner failures are loud and resumable; one output directory is one job; checks before anything starts.

Real parts: the runner as a process, sim servers, a real tmpfs for the full disk (root only), the
real store, `fleet generate` through its CLI entry point. What each test protects is in its docstring.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import wait_until
from fleet.config import FleetConfig
from fleet.errors import InputError, JobConflict
from fleet.generation.job.validate import ExistingJob
from fleet.generation.data.checks import account
from fleet.generation.job.runner import run_local
from test_gen_dispatch import sims  # noqa: F401  (the fixture is re-used)
from test_gen_runner import job_file, progress, result_ids, start_runner, write_input

ROOT = Path(__file__).resolve().parents[1]


def exit_record(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "exit.json").read_text())


def rows_jsonl(n: int) -> bytes:
    return "".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i} " + "x" * 40}]})
                   + "\n" for i in range(n)).encode()


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A real small tmpfs (needs root): the disk that fills up."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> Path:
    """Write zeros until the filesystem is full; return the filler file."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


# ---------------------------------------------------------------------------- runner failures


def test_disk_full_on_a_real_tmpfs_fails_loud_then_resumes_exactly_once(tmp_path: Path, tmpfs: Path, sims) -> None:
    """Fault: the output disk fills up mid-job. Before: progress froze at `committed 0` while the runner
    generated to the end and exited without a manifest. Now: the job stops within a tick, progress.json,
    the manifest and exit.json say `disk full … writing <file>` with the remedy, exit 1; after freeing
    space the same job resumes and every id ends exactly once."""
    a = sims("--tokens-per-s", "400", "--max-running-requests", "8")
    inp, out = tmp_path / "in.jsonl", tmpfs / "out"
    rows = write_input(inp, 3000)
    job = job_file(tmp_path, inp, out, [a])
    log = tmp_path / "runner.log"
    runner = start_runner(job, log)
    try:
        wait_until(lambda: (p := progress(out)) and (p.get("committed") or 0) >= 50, timeout=60,
                   what="a few committed rows")
        filler = fill(tmpfs)
        rc = runner.wait(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
    text = log.read_text()
    assert rc == 1, text[-3000:]
    ex = exit_record(tmp_path)
    assert ex["failure"]["kind"] == "disk_full", ex
    assert "no space left on device writing " + str(out) + "/" in ex["failure"]["cause"], "names the file"
    assert ex["failure"]["file"].startswith(str(out) + "/")
    assert "free space" in ex["failure"]["remedy"] and "run the same command again" in ex["failure"]["remedy"]
    p = progress(out)
    assert p["state"] == "failed" and p["error"]["kind"] == "disk_full", p
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "failed" and manifest["error"]["kind"] == "disk_full"
    assert manifest["counts"]["committed"] < rows, "it stopped, not generated to the end"
    assert "FAILED: disk full" in text
    assert not (out / ".reserve.tmp").exists()

    filler.unlink()
    second = start_runner(job, log)
    assert second.wait(timeout=120) == 0, log.read_text()[-3000:]
    ids = result_ids(out)
    assert len(ids) == len(set(ids)) == rows
    assert account(inp, out)["ok"]
    assert progress(out)["state"] == "done" and exit_record(tmp_path)["failure"] is None


@pytest.mark.parametrize("left", [0, 128 * 1024])
def test_a_disk_already_full_at_start_fails_at_once_with_the_cause(tmp_path: Path, tmpfs: Path, sims,
                                                                   left: int) -> None:
    """Fault: the runner starts on a disk with no (0 B) or too little (128 KiB: the store opens, the space
    set aside for the manifest does not fit) space left. It exits 1 at once — no generation, no traceback,
    no hang — and exit.json says disk full with the remedy."""
    a = sims()
    inp, out = tmp_path / "in.jsonl", tmpfs / "out"
    write_input(inp, 50)
    filler = fill(tmpfs)
    os.truncate(filler, max(0, filler.stat().st_size - left))
    job = job_file(tmp_path, inp, out, [a])
    log = tmp_path / "runner.log"
    rc = start_runner(job, log).wait(timeout=60)
    text = log.read_text()
    assert rc == 1, text[-3000:]
    assert "Traceback" not in text
    failure = exit_record(tmp_path)["failure"]
    assert failure["kind"] == "disk_full" and "free space" in failure["remedy"], failure
    assert not result_ids(out)


def test_output_dir_removed_mid_run_stops_the_job_and_says_so(tmp_path: Path, sims) -> None:
    """Fault: the output directory is deleted while the job runs. Before: the runner generated to the
    end into nothing and exited without a manifest. Now: it stops at the next tick, exit 1, and exit.json
    (in the job directory) says the output was removed and how to start again."""
    a = sims("--tokens-per-s", "300", "--max-running-requests", "8")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 3000)
    job = job_file(tmp_path, inp, out, [a])
    log = tmp_path / "runner.log"
    runner = start_runner(job, log)
    try:
        wait_until(lambda: (p := progress(out)) and (p.get("committed") or 0) >= 30, timeout=60,
                   what="a few committed rows")
        shutil.rmtree(out)
        rc = runner.wait(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert rc == 1, log.read_text()[-3000:]
    ex = exit_record(tmp_path)
    assert ex["failure"]["kind"] == "output_removed", ex
    assert f"output directory {out} was removed while the job ran" == ex["failure"]["cause"]
    assert "run the same command again" in ex["failure"]["remedy"]
    assert ex["counts"]["completed"] < rows, "it stopped instead of generating into nothing"
    assert not out.exists(), "the runner does not recreate a directory someone removed"


def test_a_shard_commit_that_fails_in_the_flush_thread_names_the_shard(tmp_path: Path, sims) -> None:
    """Fault: the periodic shard commit (run in a worker thread) fails — here `shards/` is replaced by a
    file mid-run. The job stops as failed naming the shard it could not write, exit 1, manifest written."""
    a = sims("--tokens-per-s", "300", "--max-running-requests", "8")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 3000)
    job = job_file(tmp_path, inp, out, [a])
    log = tmp_path / "runner.log"
    runner = start_runner(job, log)
    try:
        wait_until(lambda: (p := progress(out)) and (p.get("committed") or 0) >= 30, timeout=60,
                   what="a few committed rows")
        shutil.rmtree(out / "shards")
        (out / "shards").write_text("not a directory")
        rc = runner.wait(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert rc == 1, log.read_text()[-3000:]
    failure = exit_record(tmp_path)["failure"]
    assert failure["file"].startswith(str(out / "shards" / "part-")) and failure["file"].endswith(".parquet"), failure
    assert "Not a directory" in failure["cause"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "failed" and manifest["this_run"]["completed"] < rows
    assert "RuntimeError" not in log.read_text()


def test_truncated_gzip_input_keeps_the_rows_before_and_names_line_and_byte(tmp_path: Path, sims) -> None:
    """Fault: a truncated .jsonl.gz. Before: an uncaught EOFError in count_rows, no manifest, progress stuck
    at `starting`. Now: every row before the cut is generated and kept, the job ends failed with
    `corrupt or truncated after line N (byte …)`, the manifest and exit.json carry it, exit 1."""
    a = sims()
    data = gzip.compress(rows_jsonl(800))
    inp, out = tmp_path / "in.jsonl.gz", tmp_path / "out"
    inp.write_bytes(data[: len(data) // 2])
    job = job_file(tmp_path, inp, out, [a])
    log = tmp_path / "runner.log"
    rc = start_runner(job, log).wait(timeout=120)
    assert rc == 1, log.read_text()[-3000:]
    failure = exit_record(tmp_path)["failure"]
    assert failure["kind"] == "input" and str(inp) in failure["cause"], failure
    assert "corrupt or truncated after line" in failure["cause"] and "byte" in failure["cause"]
    good = int(failure["cause"].split("after line ")[1].split()[0].replace(",", ""))
    assert 0 < good < 800
    ids = result_ids(out)
    assert sorted(ids) == sorted(f"r{i}" for i in range(good)), "the rows before the cut are generated and kept"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "failed" and manifest["error"]["kind"] == "input"
    assert progress(out)["state"] == "failed"
    assert "run the same command" in failure["remedy"]

    # The remedy works: a complete copy in its place, the same command, and the job finishes — the
    # rows done are skipped by id, not generated twice (the directory accepts the repaired input).
    inp.write_bytes(data)
    rc = start_runner(job, log).wait(timeout=120)
    assert rc == 0, log.read_text()[-3000:]
    ids = result_ids(out)
    assert len(ids) == len(set(ids)) == 800
    assert progress(out)["this_run"]["fed"] == 800 - good


def test_truncated_and_corrupt_parquet_and_directory_inputs_are_clear_errors(tmp_path: Path) -> None:
    """Fault: a truncated Parquet file (ArrowInvalid escaped count_rows), a corrupt page mid-file, a directory
    (`ended None:`). Each is an InputError naming the file (and the row for a bad page)."""
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.sources import count_rows

    path = tmp_path / "in.parquet"
    n = 20000
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)],
                             "messages": [json.dumps([{"role": "user", "content": "q" * 100}])] * n}),
                   path, row_group_size=2000)
    blob = path.read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(blob[: len(blob) // 2])
    for fn in (count_rows, lambda p: list(iter_input(p, None))):
        with pytest.raises(InputError, match=f"input {truncated} is not a readable Parquet file"):
            fn(truncated)
    corrupt = tmp_path / "corrupt.parquet"
    bad = bytearray(blob)
    bad[len(bad) // 2: len(bad) // 2 + 4000] = b"\0" * 4000
    corrupt.write_bytes(bytes(bad))
    seen = []
    with pytest.raises(InputError, match=r"is corrupt after row [\d,]+ \(of 20,000"):
        for item in iter_input(corrupt, None):
            seen.append(item.id)
    assert seen and seen == [f"r{i}" for i in range(len(seen))], "rows before the bad page come through"
    with pytest.raises(InputError, match="is a directory"):
        count_rows(tmp_path)


def test_directory_as_input_to_the_runner_exits_2_with_the_reason(tmp_path: Path, sims) -> None:
    """Fault: a directory as the runner's input. Before: `ended None:` (no progress, no word). Now: exit 2 and
    exit.json says `input … is a directory`, which the CLI prints."""
    a = sims()
    (tmp_path / "indir").mkdir()
    job = job_file(tmp_path, tmp_path / "indir", tmp_path / "out", [a])
    log = tmp_path / "runner.log"
    assert start_runner(job, log).wait(timeout=60) == 2
    failure = exit_record(tmp_path)["failure"]
    assert failure["kind"] == "input" and failure["cause"] == f"input {tmp_path / 'indir'} is a directory"


def test_a_progress_ticker_that_cannot_write_fails_the_job_at_once(tmp_path: Path, sims) -> None:
    """Fault: an exception in the progress ticker (progress.json cannot be replaced). Before: the ticker task
    died silently and the job ran on blind. Now: the job stops as failed naming progress.json, exit 1."""
    a = sims("--tokens-per-s", "200", "--max-running-requests", "4")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 2000)
    (out / "progress.json").mkdir(parents=True)   # os.replace onto a directory: EISDIR
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={"max_tokens": 48})
    rc = run_local(cfg, inp, out, [{"node": "local", "index": 0, "url": a.url, "model": "sim-model"}],
                   progress_interval_s=0.1)
    assert rc == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "failed" and "progress.json" in manifest["error"]["cause"], manifest["error"]
    assert manifest["this_run"]["completed"] < rows


def test_a_dispatcher_task_that_raises_fails_the_job_loudly(tmp_path: Path, sims, monkeypatch) -> None:
    """Fault: an exception in one of the dispatcher's background tasks (stats, liveness, watchdog) was
    dropped with the task, and the job ran on without that part. Now the job stops as failed with the
    exception as its cause, exit 1 (the fault is injected by making the stats poller raise)."""
    from fleet.generation.hotpath import health

    async def broken(self: Any) -> None:
        raise RuntimeError("stats poller exploded")

    monkeypatch.setattr(health.ServerHealth, "poll_stats", broken)
    a = sims("--tokens-per-s", "200", "--max-running-requests", "4")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 2000)
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, generation={"max_tokens": 48})
    rc = run_local(cfg, inp, out, [{"node": "local", "index": 0, "url": a.url, "model": "sim-model"}])
    assert rc == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "failed", manifest["reason"]
    assert manifest["error"]["cause"] == "runner error: RuntimeError: stats poller exploded"
    assert manifest["this_run"]["completed"] < rows


def test_input_with_no_valid_row_fails_in_the_runner_too(tmp_path: Path, sims) -> None:
    """Fault: an input of rejects only reached the runner (started by hand). Before: "done, 0 rows", exit 0.
    Now: failed, "holds no valid row", exit 1."""
    a = sims()
    inp, out = tmp_path / "in.csv", tmp_path / "out"
    inp.write_text("id,prompt\n1,hello\n2,world\n")
    cfg = FleetConfig(name="t", engine={"kind": "sim"})
    rc = run_local(cfg, inp, out, [{"node": "local", "index": 0, "url": a.url, "model": "sim-model"}])
    assert rc == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert "holds no valid row" in manifest["error"]["cause"]


# ---------------------------------------------------------------------------- checks before anything starts


def cli_config(tmp_path: Path, **generation: Any) -> Path:
    from fleet.demo import to_toml

    data = {"name": "t", "nodes": [{"name": "local", "workdir": str(tmp_path / "work")}],
            "engine": {"kind": "sim"}, "model": {"source": str(tmp_path / "model")},
            "generation": {"max_tokens": 48, **generation}}
    path = tmp_path / f"fleet-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(to_toml(data))
    return path


def fleet_generate(capsys, *args: str) -> tuple[int, str]:
    from flows.cli import main

    rc = main(["generate", *args])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "csv", "blank", "output-is-a-file",
                                  "output-not-empty", "relative-missing", "output-cannot-be-created"])
def test_generate_validates_input_and_output_before_any_server_starts(tmp_path: Path, capsys, monkeypatch,
                                                                      case: str) -> None:
    """Fault: a wrong --input was found only after the bring-up (exit 1), an empty file or a CSV "generated
    0 row(s)" (exit 0). Now each is exit 2 with the reason, and no server was started."""
    cfg = cli_config(tmp_path)
    good = tmp_path / "in.jsonl"
    good.write_bytes(rows_jsonl(3))
    inp, out = str(good), str(tmp_path / "out")
    expect = ""
    if case == "missing":
        inp, expect = str(tmp_path / "nope.jsonl"), "does not exist"
    elif case == "relative-missing":
        monkeypatch.chdir(tmp_path)
        inp, expect = "nope.jsonl", f"(resolved to {tmp_path / 'nope.jsonl'})"
    elif case == "directory":
        inp, expect = str(tmp_path), "is a directory"
    elif case == "empty":
        (tmp_path / "empty.jsonl").write_text("")
        inp, expect = str(tmp_path / "empty.jsonl"), "is empty"
    elif case == "csv":
        (tmp_path / "in.csv").write_text("id,prompt\n1,hello\n")
        inp, expect = str(tmp_path / "in.csv"), "holds no valid row"
    elif case == "blank":
        (tmp_path / "blank.jsonl").write_text("\n\n  \n")
        inp, expect = str(tmp_path / "blank.jsonl"), "holds no rows"
    elif case == "output-is-a-file":
        out, expect = str(good), "exists and is not a directory"
    elif case == "output-not-empty":
        (tmp_path / "home").mkdir()
        (tmp_path / "home" / "notes.txt").write_text("mine")
        out, expect = str(tmp_path / "home"), "non-empty directory that holds no fleet job"
    elif case == "output-cannot-be-created":   # issue 34: it said "no space left (0 KiB free)"
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc here")
        out, expect = "/proc/nope/out", "/proc/nope/out on node local cannot be created"
    rc, text = fleet_generate(capsys, "-c", str(cfg), "--input", inp, "--output", out)
    assert rc == 2, text
    assert expect in text and " — " in text, text   # the reason, then the remedy, on one line
    assert not (tmp_path / "work" / "servers").exists(), "nothing was started"


def test_relative_input_is_taken_from_the_callers_directory(tmp_path: Path, monkeypatch) -> None:
    """Fault: a relative --input that exists failed after ~50 s (the detached runner has another working
    directory). Now it is resolved against the caller's directory before anything starts."""
    from fleet.generation.job.validate import plan_job

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.jsonl").write_bytes(rows_jsonl(2))
    monkeypatch.chdir(tmp_path)
    cfg = FleetConfig(name="t", nodes=[{"name": "local", "workdir": str(tmp_path / "work")}])
    plan = plan_job(cfg, input="data/in.jsonl", output="out")
    assert plan.input == str(tmp_path / "data" / "in.jsonl") and plan.output == str(tmp_path / "out")
    assert plan.verdict == "new"


# ---------------------------------------------------------------------------- one directory, one job


def finished_job(tmp_path: Path, sims, **generation: Any) -> tuple[Path, Path, Path]:
    a = sims()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    inp.write_bytes(rows_jsonl(40))
    cfg_path = cli_config(tmp_path, **generation)
    from fleet.config import load_config

    rc = run_local(load_config(str(cfg_path)), inp, out, [{"node": "local", "index": 0, "url": a.url,
                                                          "model": "sim-model"}])
    assert rc == 0
    return cfg_path, inp, out


def test_finished_job_rerun_says_nothing_to_do_and_starts_nothing(tmp_path: Path, sims, capsys) -> None:
    """Fault: re-running a finished job printed "generated N row(s)" as if it had generated them. Now:
    "nothing to do: N rows already done", exit 0, no server started."""
    cfg, inp, out = finished_job(tmp_path, sims)
    rc, text = fleet_generate(capsys, "-c", str(cfg), "--input", str(inp), "--output", str(out))
    assert rc == 0, text
    assert f"nothing to do: 40 rows already done in {out}" in text and "generated" not in text
    assert not (tmp_path / "work" / "servers").exists()


def _finished(rows: int, limit: int | None, rows_in_input: int | None = 300, *, old: bool = False) -> ExistingJob:
    inp: dict[str, Any] = {"fingerprint": "a" * 64, "rows": rows}
    if not old:
        inp.update(rows_in_input=rows_in_input, limit=limit)
    manifest = {"complete": True, "state": "done", "input": inp, "counts": {"completed": rows},
                "config": {"generation": {"limit": limit}}}
    return ExistingJob("local", "/o", store_job={"input_fingerprint": "a" * 64}, manifest=manifest)


@pytest.mark.parametrize("done_limit,rows,asked,verdict", [
    (100, 100, None, "resume"), (100, 100, 200, "resume"), (100, 100, 100, "done"), (100, 100, 50, "done"),
    (None, 300, None, "done"), (None, 300, 50, "done"), (500, 300, None, "done"), (300, 300, None, "done")])
def test_a_finished_job_is_done_only_for_the_rows_this_call_asks_for(done_limit: int | None, rows: int,
                                                                     asked: int | None, verdict: str) -> None:
    """Fault: the directory's done count was never compared to this call's --limit: a job finished under
    `--limit 100` was "nothing to do" for `--limit 200` and for no limit. Now it goes on (resume) unless
    its rows cover what this call asks for (its limit, or every row of the input: 300 here)."""
    from fleet.generation.job.validate import decide

    cfg = FleetConfig(name="t")
    cfg.generation.limit = asked
    plan = decide(_finished(rows, done_limit), cfg, input_fp=lambda: "a" * 64, input_path="/in.jsonl",
                  retry_errors=False)
    assert plan.verdict == verdict, plan.message
    assert ("nothing to do" in plan.message) == (verdict == "done"), plan.message


def test_a_manifest_from_before_the_input_count_still_goes_on_under_a_larger_limit() -> None:
    """Fault guarded for directories finished before the manifest recorded the input's row count and
    limit: the limit is read from the recorded config; an input that ended before its limit is whole."""
    from fleet.generation.job.validate import covers

    assert not covers(_finished(100, 100, old=True).manifest or {}, None)
    assert not covers(_finished(100, 100, old=True).manifest or {}, 200)
    assert covers(_finished(100, 100, old=True).manifest or {}, 80)
    assert covers(_finished(70, 100, old=True).manifest or {}, None)      # 70 rows < limit 100: the whole input
    assert covers(_finished(300, None, old=True).manifest or {}, None)


def test_different_input_or_parameters_into_a_finished_job_are_refused(tmp_path: Path, sims, capsys) -> None:
    """Fault: another input, or other generation parameters, into a finished job's directory would resume
    into it and mix two datasets. Now: exit 2, naming what differs, with the remedy (another --output)."""
    cfg, inp, out = finished_job(tmp_path, sims)
    other = tmp_path / "other.jsonl"
    other.write_bytes(rows_jsonl(41))
    rc, text = fleet_generate(capsys, "-c", str(cfg), "--input", str(other), "--output", str(out))
    assert rc == 2 and "holds results of a different input" in text and "--output" in text, text
    hotter = cli_config(tmp_path, temperature=0.9)
    rc, text = fleet_generate(capsys, "-c", str(hotter), "--input", str(inp), "--output", str(out))
    assert rc == 2 and "generation.temperature: 0.6 → 0.9" in text, text
    # an operational knob is not a different job: a resume may change it
    faster = cli_config(tmp_path, request_timeout_s=30)
    rc, text = fleet_generate(capsys, "-c", str(faster), "--input", str(inp), "--output", str(out))
    assert rc == 0 and "nothing to do" in text, text
    # and the runner refuses too, whoever starts it
    from fleet.config import load_config

    with pytest.raises(JobConflict, match="other parameters"):
        run_local(load_config(str(hotter)), inp, out, [{"node": "local", "index": 0, "url": "http://127.0.0.1:9",
                                                        "model": "m"}])


@pytest.fixture
def live_runner(tmp_path: Path, sims):
    """A real runner, slow enough to be alive, started the way `fleet generate` starts it (job dir, pid file)."""
    from fleet.config import load_config
    from fleet.jobs import job_dir

    a = sims("--tokens-per-s", "20", "--max-running-requests", "2")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    inp.write_bytes(rows_jsonl(400))
    cfg_path = cli_config(tmp_path)
    cfg = load_config(str(cfg_path))
    jdir = Path(job_dir(cfg.nodes[0], cfg, str(out)))
    jdir.mkdir(parents=True)
    job = {"config": cfg.model_dump(mode="json", exclude={"servers": {"api_key"}}), "input": str(inp),
           "output": str(out), "servers": [{"node": "local", "index": 0, "url": a.url, "model": "sim-model"}],
           "progress_interval_s": 0.2}
    (jdir / "job.json").write_text(json.dumps(job))
    proc = subprocess.Popen([sys.executable, "-m", "fleet.generation.job.runner", "--job", str(jdir / "job.json")],
                            cwd=jdir, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=open(jdir / "runner.log", "wb"))
    (jdir / "runner.pid").write_text(str(proc.pid))
    try:
        wait_until(lambda: (p := progress(out)) and p.get("state") == "running", timeout=60, what="runner running")
        yield cfg_path, inp, out, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_live_job_is_not_reattached_with_another_input_params_or_retry_errors(tmp_path: Path, live_runner,
                                                                               capsys) -> None:
    """Fault: `fleet generate` with a different --input, --retry-errors or changed settings into a live job's
    directory printed "re-attached", then "generated 6000 row(s)" — rows never generated. Now each is
    refused (exit 2) naming the live runner and how to stop it; the same command re-attaches."""
    from fleet.generation.job.validate import plan_job
    from fleet.config import load_config

    cfg_path, inp, out, proc = live_runner
    other = tmp_path / "other.jsonl"
    other.write_bytes(rows_jsonl(10))
    rc, text = fleet_generate(capsys, "-c", str(cfg_path), "--input", str(other), "--output", str(out))
    assert rc == 2 and f"runner (pid {proc.pid}) is still writing" in text and "different input" in text, text
    assert f"kill -TERM {proc.pid}" in text
    rc, text = fleet_generate(capsys, "-c", str(cfg_path), "--input", str(inp), "--output", str(out),
                              "--retry-errors")
    assert rc == 2 and "--retry-errors needs it to end first" in text, text
    changed = cli_config(tmp_path, max_attempts=2)   # even an operational knob: the live runner keeps its own
    rc, text = fleet_generate(capsys, "-c", str(changed), "--input", str(inp), "--output", str(out))
    assert rc == 2 and "generation.max_attempts: 6 → 2" in text, text
    plan = plan_job(load_config(str(cfg_path)), input=str(inp), output=str(out))
    assert plan.verdict == "attach" and str(proc.pid) in plan.message
    assert proc.poll() is None, "the live runner was left alone"


def test_bringup_refuses_a_spec_change_under_a_live_job(tmp_path: Path, sims) -> None:
    """Fault: `fleet up` with a changed spec while a runner used the servers replaced them under it (the two
    then fought over the slot). Now the launch is refused naming the job and how to stop it; the server
    keeps running; once the job is stopped the new spec is applied."""
    from fleet.generation.job.remote import start_job
    from fleet.jobs import live_jobs
    from fleet.node import LocalNode
    from fleet.servers import launch, plan_servers, wait_ready
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(1), n=1, engine={"sim": {"startup_s": 0.1, "tokens_per_s": 20}},
                     generation={"max_tokens": 16})
    node, node_cfg = LocalNode(), cfg.nodes[0]
    spec = plan_servers(cfg, node_cfg, [], model_path=cfg.model.source, python=sys.executable)[0]
    first = launch(node, cfg, spec)
    runner = None
    try:
        wait_ready(node, cfg, spec, first.pid)
        inp = tmp_path / "in.jsonl"
        inp.write_bytes(rows_jsonl(300))
        out = str(tmp_path / "out")
        handle = start_job(node, cfg, node_cfg, input_path=str(inp), output=out, specs=[spec])
        runner = handle.pid
        assert [j.pid for j in live_jobs(node, node_cfg.workdir, cfg.name)] == [runner]
        changed = sim_config(tmp_path, spec.port, n=1, engine={"sim": {"startup_s": 0.1, "tokens_per_s": 50}},
                             generation={"max_tokens": 16})
        spec2 = plan_servers(changed, node_cfg, [], model_path=cfg.model.source, python=sys.executable)[0]
        with pytest.raises(JobConflict) as err:
            launch(node, changed, spec2)
        msg = err.value.one_line()
        assert f"in use by the generation job writing {out} (runner pid {runner}" in msg, msg
        assert f"kill -TERM {runner}" in msg
        assert node.is_alive(first.pid), "the server was not pulled from under the job"
        os.kill(runner, signal.SIGTERM)
        wait_until(lambda: not node.is_alive(runner), timeout=60, what="the runner stops")
        replaced = launch(node, changed, spec2)
        assert replaced.replaced_pid == first.pid and replaced.pid != first.pid
        node.stop(replaced.pid, grace_s=2)
    finally:
        if runner and node.is_alive(runner):
            os.kill(runner, signal.SIGKILL)
        node.stop(first.pid, grace_s=2)


# ---------------------------------------------------------------------------- what the operator is told


def test_a_killed_runner_is_reported_with_a_cause_and_a_remedy(tmp_path: Path, live_runner) -> None:
    """Fault: the runner's death was reported as `generation on local ended running: running`. Now the
    watcher says it died without a final state, how it probably died, and to run the same command again."""
    from fleet.generation.job.remote import JobHandle, outcome, watch_job
    from fleet.jobs import job_dir
    from fleet.node import LocalNode
    from fleet.config import load_config

    cfg_path, inp, out, proc = live_runner
    cfg = load_config(str(cfg_path))
    jdir = job_dir(cfg.nodes[0], cfg, str(out))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    handle = JobHandle("local", jdir, str(out), proc.pid, False, f"{jdir}/runner.log")
    final = watch_job(LocalNode(), handle, poll_s=0.1)
    ok, cause, remedy = outcome(final, handle)
    assert not ok
    assert f"the runner (pid {proc.pid}) on node local died without a final state" in cause
    assert "SIGKILL" in cause and "run the same command again to resume" in remedy
    assert "running" not in cause.split("died")[0]


def test_fleet_generate_prints_the_runners_cause_and_remedy(tmp_path: Path) -> None:
    """Fault: `fleet generate` said `FAILED: … ended running: running` when the runner failed. Now it prints
    the runner's own cause (a truncated .jsonl.gz at line N) and remedy, exit 1; the rows before are kept.
    (The CLI runs as a process: Prefect's log handler must not bind to a test's captured stream.)"""
    from fleet.demo import to_toml
    from fleet.node import connect
    from fleet.servers import stop_servers
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(1), n=1, generation={"max_tokens": 16})
    path = tmp_path / "fleet.toml"
    path.write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    data = gzip.compress(rows_jsonl(400))
    inp = tmp_path / "in.jsonl.gz"
    inp.write_bytes(data[: len(data) * 2 // 3])
    out = tmp_path / "out"
    try:
        r = subprocess.run([sys.executable, "-m", "flows.cli", "generate", "-c", str(path), "--input", str(inp),
                            "--output", str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           capture_output=True, text=True, timeout=400)
    finally:
        with connect(cfg.nodes[0]) as node:
            stop_servers(node, cfg, cfg.nodes[0])
    text = r.stdout + r.stderr
    assert r.returncode == 1, text[-3000:]
    line = next(ln for ln in text.splitlines() if ln.startswith("fleet generate: FAILED:"))
    assert f"input {inp} is corrupt or truncated after line" in line, line
    assert "the rows before that point are kept" in line and "ended running" not in line
    assert len(result_ids(out)) > 0


def test_a_repaired_copy_of_a_broken_input_may_continue_its_job_but_no_other_input(tmp_path: Path) -> None:
    """Fault guarded both ways: after a truncated input failed the job, its complete copy (another SHA-256)
    must continue the job rather than be refused; an input into a directory whose input was fine is refused."""
    from fleet.generation.job.validate import ExistingJob, decide

    cfg = FleetConfig(name="t")
    broken = ExistingJob("local", "/o", store_job={"input_fingerprint": "a" * 64, "input_broken": "input x is "
                                                   "corrupt or truncated after line 3"})
    plan = decide(broken, cfg, input_fp=lambda: "b" * 64, input_path="/in.jsonl.gz", retry_errors=False)
    assert plan.verdict == "resume" and "replacement for its broken input" in plan.message
    fine = ExistingJob("local", "/o", store_job={"input_fingerprint": "a" * 64})
    with pytest.raises(JobConflict, match="holds results of a different input"):
        decide(fine, cfg, input_fp=lambda: "b" * 64, input_path="/in.jsonl.gz", retry_errors=False)


@pytest.mark.usefixtures("prefect_api")
def test_the_flows_generate_action_validates_before_bringup_and_fleet_up_names_the_live_job(tmp_path: Path) -> None:
    """Faults, through the flow as a deployment runs it: (1) the generate action with a missing input started
    every server first; now it ends Failed with the reason and starts nothing. (2) `fleet up` with a changed
    spec under a live job replaced its server; now it fails naming the job and `kill -TERM <runner pid>`."""
    from flows.cli import run_bringup
    from fleet.generation.job.remote import start_job
    from fleet.node import LocalNode, connect
    from fleet.servers import plan_servers, stop_servers
    from flows.fleet import fleet
    from test_bringup import port_block, sim_config

    cfg = sim_config(tmp_path, port_block(1), n=1, engine={"sim": {"startup_s": 0.1, "tokens_per_s": 20}},
                     generation={"max_tokens": 16})
    state = fleet(config=cfg, action="generate", input=str(tmp_path / "nope.jsonl"), output=str(tmp_path / "o"),
                  return_state=True)
    assert state.is_failed() and "does not exist" in state.message, state.message
    assert not (tmp_path / "work" / "servers").exists(), "the generate action started nothing"

    runner = None
    try:
        ok, _, message = run_bringup(cfg)   # what `fleet up` runs and prints
        assert ok, message
        node, node_cfg = LocalNode(), cfg.nodes[0]
        spec = plan_servers(cfg, node_cfg, [], model_path=cfg.model.source, python=sys.executable)[0]
        inp = tmp_path / "in.jsonl"
        inp.write_bytes(rows_jsonl(300))
        handle = start_job(node, cfg, node_cfg, input_path=str(inp), output=str(tmp_path / "out"), specs=[spec])
        runner = handle.pid
        # frozen, so the job is still live when the second bring-up looks, however long that takes
        # (left running, its 300 rows were done before the checks below on a busy machine)
        os.kill(runner, signal.SIGSTOP)
        changed = cfg.model_copy(update={"engine": cfg.engine.model_copy(
            update={"sim": cfg.engine.sim.model_copy(update={"tokens_per_s": 50})})})
        ok, _, message = run_bringup(changed)
        assert not ok
        assert f"in use by the generation job writing {tmp_path / 'out'}" in message, message
        assert f"kill -TERM {runner}" in message
        assert node.is_alive(runner)
    finally:
        if runner:
            subprocess.run(["kill", "-9", str(runner)], check=False)
        with connect(cfg.nodes[0]) as node:
            stop_servers(node, cfg, cfg.nodes[0])


def test_an_input_path_on_the_node_is_checked_there(tmp_path: Path) -> None:
    """Fault: an --input that is only a path on an SSH node (not on this machine) was found missing, a
    directory or empty only by the runner, after the bring-up. Now it is checked on the node first (exercised
    through the same shell the SSH node runs, on the local node)."""
    from fleet.generation.job.validate import _check_input_on_node
    from fleet.node import LocalNode

    node = LocalNode()
    with pytest.raises(InputError, match="does not exist here nor on node local"):
        _check_input_on_node(node, str(tmp_path / "nope.jsonl"))
    with pytest.raises(InputError, match="is a directory"):
        _check_input_on_node(node, str(tmp_path))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputError, match="is empty"):
        _check_input_on_node(node, str(tmp_path / "empty.jsonl"))
    (tmp_path / "in.jsonl").write_bytes(rows_jsonl(2))
    got = _check_input_on_node(node, str(tmp_path / "in.jsonl"))
    assert got.size == (tmp_path / "in.jsonl").stat().st_size and not got.local
