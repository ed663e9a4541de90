"""A job reads the input version it was planned on (fleet.generation.data.pin), on every store.

The fault: the input object rewritten mid-job, after the first part of the output is in the store.
Before the pin the job Completed (exit 0) with the first chunk's rows of the old input, half-lines cut
at the old offsets as rejects and foreign ids from the new one. Now it stops with one line ("the input
changed since the job was planned: …") and exit 2 — or, on a versioned S3 bucket, reads the planned
version to the end and completes with exactly the planned rows.

One local node with two sim servers, chunks of 40 rows, the sim slowed so a chunk takes seconds: the
rewrite waits on the first shard in the store (a condition), and chunks are still pending then.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.config import FleetConfig
from test_generate_flow import prompts, stop_everything  # noqa: F401  (fixture)
from test_multinode import _cli, _wait, plan_state, state_home  # noqa: F401
from test_objstore import s3, store_ids  # noqa: F401  (fixture)
from test_objstore_gcs import gcs  # noqa: F401  (fixture)
from test_objstore_hf import REPO, Hub, hub  # noqa: F401  (fixture)

CHANGED = "the input changed since the job was planned"


def one_node(tmp_path: Path, tokens_per_s: int = 20, **gen: Any) -> FleetConfig:
    """One local node, two sim servers slow enough that a 40-row chunk takes seconds."""
    from conftest import port_block
    from test_bringup import sim_config

    cfg = sim_config(tmp_path, port_block(2), n=2,
                     generation={"max_tokens": 16, "chunk_rows": 40, "shard_rows": 10, **gen},
                     engine={"sim": {"startup_s": 0.3, "tokens_per_s": tokens_per_s, "max_running_requests": 4}})
    data = cfg.model_dump(mode="json")
    data["venv"] = {"path": sys.prefix, "use_existing": True}   # the sim needs nothing but this interpreter
    (tmp_path / "shm").mkdir(exist_ok=True)
    data["nodes"][0]["ramdisk"] = str(tmp_path / "shm")
    return FleetConfig(**data)


def other_rows(n: int) -> bytes:
    return "".join(json.dumps({"id": f"x{i}", "messages": [{"role": "user", "content": f"other {i} " * 3}]}) + "\n"
                   for i in range(n)).encode()


def _rewrite_after_first_part(cfg: FleetConfig, tmp_path: Path, state_home: Path, url: str, out: str,
                              rewrite: Any) -> tuple[int, str]:
    """Run `fleet generate`, call `rewrite()` once the first shard is in the store and chunks are still
    pending, then wait for the end: (exit code, log)."""
    from fleet.generation.data.objstore import Store

    log = tmp_path / "gen.log"
    proc = _cli(cfg, tmp_path, url, out, log)   # type: ignore[arg-type]
    try:
        def first_part() -> bool:
            st = plan_state(state_home)
            if st is None:
                return False
            parts = Store(f"{out}/_parts/local").names()
            return any(Store(f"{out}/_parts/local/{p}").names("shards") for p in parts)

        _wait(proc, log, first_part, "the first shard in the store", timeout=300)
        pending = [c for c in plan_state(state_home)[1]["chunks"].values() if c["state"] == "pending"]  # type: ignore[index]
        assert pending, "every chunk had started before the rewrite: the test proves nothing"
        rewrite()
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, log.read_text(errors="replace")


def _assert_stopped_unmixed(rc: int, text: str, out: str, want: list[str]) -> None:
    assert rc == 2, text[-4000:]
    assert CHANGED in text and "start a new job into a new --output" in text, text[-3000:]
    assert "Traceback" not in text, text[-4000:]
    ids = store_ids(out)   # the parts' shards are merged into out: only rows of the planned version
    assert set(ids) <= set(want) and len(ids) == len(set(ids))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_s3_input_rewritten_mid_job_never_mixes_two_versions(tmp_path: Path, state_home: Path, s3: str,
                                                             stop_everything, versioned: bool) -> None:
    """On a plain bucket the ETag pinned at plan time no longer matches: the job stops, exit 2, one line,
    only rows of the planned version stored. On a versioned bucket the runners read the planned VersionId:
    the job completes with exactly the planned rows, none of the new object's."""
    from fleet.generation.data.objstore import Store

    cfg = one_node(tmp_path)
    stop_everything(cfg)
    bucket = s3
    if versioned:
        fs = Store(s3).fs
        fs.mkdir("vjobs")
        fs.call_s3("put_bucket_versioning", Bucket="vjobs", VersioningConfiguration={"Status": "Enabled"})
        bucket = "s3://vjobs"
    inp = prompts(tmp_path / "in.jsonl", 200)
    Store(bucket).put_file(str(inp), "in/prompts.jsonl")
    want = [f"r{i}" for i in range(200)]
    out = f"{bucket}/job"
    rc, text = _rewrite_after_first_part(cfg, tmp_path, state_home, f"{bucket}/in/prompts.jsonl", out,
                                         lambda: Store(bucket).write_bytes("in/prompts.jsonl", other_rows(200)))
    if versioned:
        assert rc == 0, text[-4000:]
        ids = store_ids(out)
        assert sorted(ids) == sorted(want), (len(ids), text[-2000:])
        manifest = json.loads(Store(out).read_bytes("manifest.json") or b"{}")
        assert manifest["complete"] and manifest["counts"]["rejects"] == 0
    else:
        _assert_stopped_unmixed(rc, text, out, want)


@pytest.mark.timeout(600)
def test_gcs_input_rewritten_mid_job_stops_the_job(tmp_path: Path, state_home: Path, gcs: str, stop_everything) -> None:
    """gs://: the generation pinned at plan time changes with the rewrite: the job stops, exit 2, unmixed."""
    from fleet.generation.data.objstore import Store

    cfg = one_node(tmp_path)
    stop_everything(cfg)
    Store(gcs).put_file(str(prompts(tmp_path / "in.jsonl", 200)), "in/prompts.jsonl")
    out = f"{gcs}/job"
    rc, text = _rewrite_after_first_part(cfg, tmp_path, state_home, f"{gcs}/in/prompts.jsonl", out,
                                         lambda: Store(gcs).write_bytes("in/prompts.jsonl", other_rows(200)))
    _assert_stopped_unmixed(rc, text, out, [f"r{i}" for i in range(200)])


@pytest.mark.timeout(600)
def test_hf_input_pushed_to_mid_job_stops_the_job(tmp_path: Path, state_home: Path, hub: Hub, s3: str,
                                                 stop_everything) -> None:
    """hf://: the file pushed to mid-job (another blob at the path): ranges are read at the commit pinned
    at plan time and the blob id checked; the stand-in serves one revision, so the job stops (the real
    Hub would serve the pinned commit's blob and the job would complete), exit 2, unmixed."""
    cfg = one_node(tmp_path)
    stop_everything(cfg)
    hub.files["train/prompts.jsonl"] = prompts(tmp_path / "in.jsonl", 200).read_bytes()
    out = f"{s3}/hfjob"

    def push() -> None:
        hub.files["train/prompts.jsonl"] = other_rows(200)

    rc, text = _rewrite_after_first_part(cfg, tmp_path, state_home, f"hf://datasets/{REPO}/train/prompts.jsonl",
                                         out, push)
    _assert_stopped_unmixed(rc, text, out, [f"r{i}" for i in range(200)])


@pytest.mark.timeout(600)
def test_local_input_rewritten_in_place_mid_job_stops_the_job(tmp_path: Path, stop_everything) -> None:
    """A local input rewritten in place (same inode) while its runner reads it: the rows after the
    rewrite were the new file's, at the old offsets. The runner pins the file's size, mtime and inode as
    it starts (before its SHA-256) and checks them for every row it reads: it stops, exit 2, and the
    output holds only rows of the version it began with. 2,000 rows: the runner reads ahead at most its
    queue (1,024 rows), so at the first commit most of the file is still unread."""
    from test_generate_flow import shard_ids

    cfg = one_node(tmp_path, tokens_per_s=100)
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 2000)
    out = tmp_path / "out"
    log = tmp_path / "gen.log"
    proc = _cli(cfg, tmp_path, inp, out, log)
    try:
        _wait(proc, log, lambda: list((out / "shards").glob("part-*.parquet")), "the first committed shard",
              timeout=300)
        with inp.open("r+b") as f:   # in place: the runner's open file sees the new bytes
            f.truncate(0)
            f.write(other_rows(2000))
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 2, text[-4000:]
    assert CHANGED in text and "Traceback" not in text, text[-4000:]
    ids = shard_ids(out)
    assert ids and set(ids) <= {f"r{i}" for i in range(2000)} and len(ids) == len(set(ids))
