"""A job whose output (and input) is on object storage: a local S3-compatible server (moto's server
mode on loopback), two local nodes with sim servers, the runners reading their chunks from the store
and putting their commits there, the merge from the store to the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from conftest import free_port
from test_generate_flow import prompts, stop_everything  # noqa: F401  (fixture)
from test_multinode import _cli, _runner_pids, _server_pids, _wait, plan_state, state_home, two_nodes  # noqa: F401

SECRET = "s3-secret-7c1d2e3f4a5b"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """moto's S3 server on a loopback port, the AWS_* environment pointing at it, one bucket: its URL."""
    import httpx

    port = free_port()
    log = (tmp_path / "moto.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "moto.log").read_text()
        try:
            if httpx.get(f"{endpoint}/moto-api/", timeout=2).status_code < 500:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "moto server did not answer"
        time.sleep(0.2)
    for k, v in {"AWS_ACCESS_KEY_ID": "fleet-test", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)
    from fleet.generation.data.objstore import Store

    Store("s3://jobs").fs.mkdir("jobs")
    try:
        yield "s3://jobs"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def store_ids(url: str) -> list[str]:
    from fleet.generation.data.objstore import Store
    from fleet.generation.job.publish import store_shards

    st = Store(url)
    ids: list[str] = []
    for name in store_shards(st):
        with st.open_read(f"shards/{name}") as f:
            ids += pq.read_table(f, columns=["id"]).column(0).to_pylist()
    return ids


def acknowledged_state(out: str, peek: Path) -> dict[str, Any] | None:
    """A job's state as its copy under `<out>/_control/` has it: what the next controller reads, on any
    machine (a line the controller appended locally is not acknowledged, nor acted on, until its PUT)."""
    from fleet.generation.data.objstore import Store
    from fleet.generation.multinode.chunks import read_state
    from fleet.generation.multinode.journal import pull

    return read_state(peek) if pull(Store(f"{out}/_control"), peek) else None


def test_an_unfinished_upload_never_becomes_an_object(s3: str, tmp_path: Path) -> None:
    """A shard is visible in the store only when complete: a write cut short by an error leaves no object
    (on S3 and in a local directory alike), so a reader never takes half a shard for a commit."""
    from fleet.generation.data.objstore import Store

    for root in (f"{s3}/unit", str(tmp_path / "local")):
        st = Store(root)
        with pytest.raises(RuntimeError):
            with st.open_write("shards/part-000001.parquet") as f:
                f.write(b"x" * (6 << 20))   # past s3fs's first block: a multipart upload under way
                raise RuntimeError("killed mid-write")
        assert st.names("shards") == [] or "part-000001.parquet" not in st.names("shards")
        st.write_bytes("shards/part-000002.parquet", b"whole")
        assert st.read_bytes("shards/part-000002.parquet") == b"whole"


@pytest.mark.timeout(900)   # two bring-ups and a 900-row job through both faults, on a shared 2-core machine
def test_node_lost_and_controller_killed_every_id_once_in_the_store(tmp_path: Path, state_home: Path, s3: str,
                                                                    stop_everything) -> None:
    """Output on object storage, through both faults: a node frozen mid-chunk (lost: its chunk goes to the
    other node, whose fresh runner starts from the shards the lost one had put in the store), then the
    controller SIGKILLed mid-job while the lost node comes back (its old runner goes on and publishes an
    abandoned attempt), then the same command again. Every id ends exactly once in the store's merged
    output, the controller gathered nothing locally, and the store's credentials are in no file."""
    # node_lost_s: a runner that reads its chunk from the store starts slower (s3fs's imports, the download)
    cfg = two_nodes(tmp_path, generation={"max_tokens": 16, "chunk_rows": 300, "shard_rows": 20, "node_lost_s": 20},
                    sim={"tokens_per_s": 40, "max_running_requests": 4})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 900)
    from fleet.generation.data.objstore import Store

    Store(s3).put_file(str(inp), "in/prompts.jsonl")   # the input read from the store too
    out = f"{s3}/job"
    log1 = tmp_path / "first.log"
    first = _cli(cfg, tmp_path, f"{s3}/in/prompts.jsonl", out, log1)   # type: ignore[arg-type]
    frozen: list[int] = []
    try:
        def slow_chunk_with_published_shards() -> int | None:
            got = plan_state(state_home)
            if not got:
                return None
            for idx, c in got[1]["chunks"].items():
                if c["state"] == "running" and c["node"] == "slow":
                    if len(Store(f"{out}/_parts/slow/chunk-{int(idx):05d}").names("shards")) >= 2:
                        return int(idx)
            return None

        idx = _wait(first, log1, slow_chunk_with_published_shards, "the slow node to put shards in the store")
        frozen = _runner_pids(tmp_path / "work-slow") + _server_pids(tmp_path / "work-slow")
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)

        def taken_over() -> bool:
            st = acknowledged_state(out, tmp_path / "peek")   # the store's copy: what a next controller reads
            c = (st or {}).get("chunks", {}).get(str(idx), {})
            return c.get("state") == "running" and c.get("node") == "fast"

        _wait(first, log1, taken_over, "the lost node's chunk to start on the other node")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    log2 = tmp_path / "second.log"
    second = _cli(cfg, tmp_path, f"{s3}/in/prompts.jsonl", out, log2)   # type: ignore[arg-type]
    try:
        rc = second.wait(timeout=400)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert rc == 0, log2.read_text(errors="replace")[-5000:]
    pdir, st = plan_state(state_home)  # type: ignore[misc]
    assert any(e["event"] == "node-lost" and e["node"] == "slow" for e in st["events"])
    assert all(c["state"] == "done" for c in st["chunks"].values())
    ids = store_ids(out)
    assert len(ids) == len(set(ids)) == 900
    manifest = json.loads(Store(out).read_bytes("manifest.json") or b"{}")
    assert manifest["complete"] and manifest["counts"]["completed"] == 900
    assert not (pdir / "gathered").exists() and not (pdir / "output").exists()   # nothing through the controller
    # the takeover's runner started from the lost node's shards in the store (seeded, not generated again)
    jobs = [json.loads(p.read_text()) for p in (tmp_path / "work-fast").glob("jobs/*/job.json")]
    assert any(j["output"].endswith(f"chunk-{idx:05d}") and j["seed"] for j in jobs)
    # `fleet fetch` is optional: it merges from the store into a local directory; `fleet export` reads the URL
    from flows.cli import main

    assert main(["fetch", "-c", str(tmp_path / "fleet.toml"), "--output", str(tmp_path / "fetched")]) == 0
    fetched = [i for p in sorted((tmp_path / "fetched" / "shards").glob("*.parquet"))
               for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]
    assert sorted(fetched) == sorted(ids)
    assert main(["export", out, "--format", "jsonl"]) == 0
    assert len((Store(out).read_bytes("export.jsonl") or b"").splitlines()) == 900
    from test_security import _scan_tree

    for root in (tmp_path, state_home):
        assert _scan_tree(root, [SECRET]) == []


def test_a_jsonl_input_on_the_store_is_cut_into_byte_ranges_never_copied(s3: str, tmp_path: Path) -> None:
    """The controller must not copy a JSONL input on object storage (its disk and link would be the
    limit again): the plan's chunks are byte ranges of the input, written nowhere but plan.json; the
    ranges, a cut made at claim time included, hold every line once and in order (the last line has no
    newline), and a plan for another version of the input is refused."""
    from fleet.errors import ConfigError
    from fleet.generation.multinode.chunks import split_chunk, split_input
    from fleet.generation.data.objstore import Store
    from fleet.generation.data.ranges import read_span

    lines = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "é" * (i % 7)}]}) for i in range(250)]
    Store(s3).write_bytes("in/p.jsonl", ("\n".join(lines)).encode())
    url = f"{s3}/in/p.jsonl"
    pdir = tmp_path / "plan"
    plan = split_input(url, pdir, ["a", "b"], chunk_rows=40)
    assert all(c.span is not None and c.file == "" for c in plan.chunks)
    assert sorted(p.name for p in pdir.iterdir()) == ["plan.json"]
    split_chunk(pdir, plan, 0, 15)
    got = b"".join(read_span(url, c.span) for c in sorted(plan.chunks, key=lambda c: c.first_line))  # type: ignore[arg-type]
    assert got.decode().splitlines() == lines
    assert [c.lines for c in sorted(plan.chunks, key=lambda c: c.first_line)][:2] == [15, 25]
    again = split_input(url, pdir, ["a", "b"], chunk_rows=40)
    assert [c.span for c in again.chunks] == [c.span for c in plan.chunks]
    Store(s3).write_bytes("in/p.jsonl", ("\n".join(lines[:100])).encode())
    with pytest.raises(ConfigError):
        split_input(url, pdir, ["a", "b"], chunk_rows=40)


def test_store_credentials_from_a_prefect_secret_block(prefect_api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment's worker has no AWS_* in its shell: the credentials come from a Prefect Secret block
    named by FLEET_STORE_SECRET (a JSON object of AWS_* variables) into the process's environment, where
    s3fs and start_job's env file take them. A variable already set wins; a block holding anything else is
    refused without echoing its value."""
    from prefect.blocks.system import Secret

    from blocks.credentials import load_store_credentials
    from fleet.errors import ConfigError

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    Secret(value={"AWS_ACCESS_KEY_ID": "from-block", "AWS_SECRET_ACCESS_KEY": SECRET,
                  "AWS_REGION": "us-east-1"}).save("fleet-store-test", overwrite=True)
    monkeypatch.setenv("FLEET_STORE_SECRET", "fleet-store-test")
    assert sorted(load_store_credentials()) == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET and os.environ["AWS_REGION"] == "eu-west-1"
    Secret(value={"AWS_SECRET_ACCESS_KEY": SECRET, "PASSWORD": SECRET}).save("fleet-store-bad", overwrite=True)
    monkeypatch.setenv("FLEET_STORE_SECRET", "fleet-store-bad")
    with pytest.raises(ConfigError) as info:
        load_store_credentials()
    assert SECRET not in str(info.value)


def test_store_jobs_refuse_what_they_cannot_do_safely(tmp_path: Path) -> None:
    """Found in review: an object-storage job with [[endpoints]] would run per chunk under the
    controller, which starts only fleet's servers (an endpoints-only config failed with "no server
    came up"; a mixed one sent rows to the endpoint without its key); and a URL with a user or a
    password in it would be written to job.json, the manifest and the flow run's parameters. Both
    are refused before anything starts, with the remedy, and nothing is read from a store."""
    from fleet.config import FleetConfig
    from fleet.errors import InputError
    from fleet.generation.job.validate import plan_job

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hi"}\n')
    base = {"name": "t", "nodes": [{"name": "local", "workdir": str(tmp_path / "w")}], "engine": {"kind": "sim"}}
    with_endpoint = FleetConfig(**base, endpoints=[{"name": "r", "url": "http://127.0.0.1:9/v1", "model": "m"}])
    with pytest.raises(InputError, match="endpoints") as e:
        plan_job(with_endpoint, input=str(inp), output="s3://bucket/out")
    assert "local --input and --output" in (e.value.remedy or "")
    with pytest.raises(InputError, match="user or password") as e:
        plan_job(FleetConfig(**base), input=str(inp), output="s3://AKIA:secret@bucket/out")
    assert "secret" not in str(e.value)


@pytest.mark.timeout(900)   # two bring-ups and a 600-row job, on a shared 2-core machine
def test_controller_lost_with_its_machine_resumes_from_the_store(tmp_path: Path, state_home: Path, s3: str,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 stop_everything) -> None:
    """A controller whose machine is lost mid-job (SIGKILLed, its job directory deleted: plan, state,
    everything) must not lose the job: the plan and every acknowledged change are under the output's
    `_control/` in the store, and the same command on another machine (another state directory) reads
    them back, re-attaches to the running chunks, keeps the finished ones (not run again) and ends with
    every id exactly once in the store."""
    import shutil

    from fleet.generation.data.objstore import Store

    cfg = two_nodes(tmp_path, generation={"max_tokens": 16, "chunk_rows": 150, "shard_rows": 20, "node_lost_s": 30},
                    sim={"tokens_per_s": 40, "max_running_requests": 4})
    stop_everything(cfg)
    inp = prompts(tmp_path / "in.jsonl", 600)
    Store(s3).put_file(str(inp), "in/prompts.jsonl")
    out = f"{s3}/job"
    log1 = tmp_path / "first.log"
    first = _cli(cfg, tmp_path, f"{s3}/in/prompts.jsonl", out, log1)   # type: ignore[arg-type]
    try:
        def one_done_one_running() -> dict[str, Any] | None:
            got = acknowledged_state(out, tmp_path / "peek")
            states = [c["state"] for c in (got or {}).get("chunks", {}).values()]
            return got if "done" in states and "running" in states else None

        before = _wait(first, log1, one_done_one_running, "a chunk done and one running", timeout=400)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert Store(f"{out}/_control").exists("plan.json")
    shutil.rmtree(state_home)                                  # the first machine is gone
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "elsewhere"))
    log2 = tmp_path / "second.log"
    second = _cli(cfg, tmp_path, f"{s3}/in/prompts.jsonl", out, log2)   # type: ignore[arg-type]
    try:
        rc = second.wait(timeout=500)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert rc == 0, log2.read_text(errors="replace")[-5000:]
    assert "plan and state read from" in log2.read_text(errors="replace")
    _, st = plan_state(tmp_path / "elsewhere")  # type: ignore[misc]
    assert all(c["state"] == "done" for c in st["chunks"].values())
    for idx, c in before["chunks"].items():
        if c["state"] == "done":   # a chunk finished before the loss is not run again
            assert st["chunks"][idx]["attempts"] == c["attempts"]
    ids = store_ids(out)
    assert len(ids) == len(set(ids)) == 600
    manifest = json.loads(Store(out).read_bytes("manifest.json") or b"{}")
    assert manifest["complete"] and manifest["counts"]["completed"] == 600
