"""The commit interval is a setting (`generation.commit_every_s`, issue 22 item 3): it reaches
the detached runner, and a kill -9 right after a commit loses only the rows finished since.

Counted, never timed: shards on disk, ids in them, what the resume sends again.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from pydantic import ValidationError

from fleet.config import FleetConfig, GenerationConfig
from fleet.generation.job.jobspec import JobSpec
from fleet.generation.data.results import read_errors, read_rejects, shard_paths
from test_gen_runner import progress, result_ids, start_runner, wait_for, write_input
from test_gen_dispatch import sims  # noqa: F401  (the fixture is re-used)


def test_commit_every_s_is_a_bounded_setting_the_job_file_leaves_to_the_config(tmp_path: Path) -> None:
    """The default is 10 s (a kill -9 used to regenerate up to 30 s of rows); out-of-range
    values are refused; a job file without its own interval takes the config's."""
    assert GenerationConfig().commit_every_s == 10.0
    for bad in (0, 0.1, 601):
        with pytest.raises(ValidationError):
            GenerationConfig(commit_every_s=bad)
    doc = {"config": FleetConfig(generation={"commit_every_s": 3}).model_dump(mode="json"),
           "input": "in.jsonl", "output": "out", "servers": []}
    (tmp_path / "job.json").write_text(json.dumps(doc))
    job = JobSpec.load(tmp_path / "job.json")
    assert job.flush_interval_s is None


def test_kill_9_after_a_commit_loses_only_the_rows_since_it(tmp_path: Path, sims) -> None:
    """Fault: kill -9 of the runner. The config's commit_every_s (0.5 s, far below the shard
    size) reaches the detached runner — it commits shard after shard by the clock, which the
    old fixed 30 s never would within this job — and the kill lands just after a commit: every
    row of every shard survives, no id is in two shards, and the resume sends again exactly
    the rows not on disk, which are the uncommitted rows plus those never finished."""
    a = sims("--tokens-per-s", "60", "--max-running-requests", "8")
    b = sims("--tokens-per-s", "60", "--max-running-requests", "8")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = write_input(inp, 600)
    job = {
        "config": {"name": "t", "engine": {"kind": "sim"},
                   "generation": {"max_tokens": 24, "max_attempts": 3, "commit_every_s": 0.5, "shard_rows": 100000}},
        "input": str(inp), "output": str(out),
        "servers": [{"node": "local", "index": i, "url": s.url, "model": "sim-model"} for i, s in enumerate((a, b))],
        "progress_interval_s": 0.1, "console_interval_s": 1, "stop_grace_s": 10,
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    log = tmp_path / "runner.log"
    first = start_runner(path, log)
    try:
        wait_for(lambda: len(shard_paths(out)) >= 3, 120, "three timed commits")
        seen = len(shard_paths(out))
        wait_for(lambda: len(shard_paths(out)) > seen, 60, "the next commit")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    killed_at = progress(out)
    on_disk = result_ids(out)
    assert killed_at["state"] == "running" and len(on_disk) < rows, "killed mid-run"
    assert len(on_disk) == len(set(on_disk)), "an id is in two shards"
    assert len(on_disk) >= killed_at["committed"], "a committed row was lost"

    second = start_runner(path, log)
    assert second.wait(timeout=120) == 0, log.read_text()[-3000:]
    final = progress(out)
    ids = result_ids(out)
    assert len(ids) == len(set(ids)) == rows and not list(read_errors(out)) and not list(read_rejects(out))
    assert final["this_run"]["fed"] == rows - len(on_disk), "the resume sent again a committed row, or missed one"
