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
from test_multinode import _cli, _run_to_end, _runner_pids, _server_pids, _wait, plan_state, state_home, two_nodes  # noqa: F401

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
    output, the controller gathered nothing locally, the node that finished every attempt it ran keeps no
    working copy of them, and the store's credentials are in no file."""
    # node_lost_s: a runner that reads its chunk from the store starts slower (s3fs's imports, the download)
    # (30 s: at load 6-7 on CI's 2 cores a healthy runner's progress once stood still for 21 s)
    cfg = two_nodes(tmp_path, generation={"max_tokens": 16, "chunk_rows": 300, "shard_rows": 20, "node_lost_s": 30},
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
        def slow_runner_of(idx: int) -> int | None:
            """The live runner on the slow node writing chunk `idx` (its working copy's job.json)."""
            from fleet.node import LocalNode

            for jf in (tmp_path / "work-slow").glob("jobs/*/job.json"):
                if json.loads(jf.read_text())["output"].endswith(f"chunk-{idx:05d}"):
                    pidf = jf.parent / "runner.pid"
                    pid = int((pidf.read_text().split() or ["0"])[0]) if pidf.exists() else 0
                    return pid if pid and LocalNode().is_alive(pid) else None
            return None

        tried: set[int] = set()

        def slow_chunk_with_published_shards() -> int | None:
            got = plan_state(state_home)
            if not got:
                return None
            for idx, c in got[1]["chunks"].items():
                if c["state"] == "running" and c["node"] == "slow" and int(idx) not in tried:
                    if len(Store(f"{out}/_parts/slow/chunk-{int(idx):05d}").names("shards")) >= 2 \
                            and slow_runner_of(int(idx)):
                        return int(idx)
            return None

        def frozen_mid_chunk() -> tuple[int] | None:
            """Freeze the slow node while its runner is mid-chunk. The controller's state lags the
            runner (a chunk it still calls running may be finished): after the SIGSTOP the scene is
            checked — that chunk's runner alive (stopped) and its manifest not in the store — and
            otherwise let go, and the next chunk on the slow node is tried. The chunk comes back in a
            tuple: `_wait` takes a falsy answer for "not yet", and chunk 0 is falsy (when the slow
            node drew chunk 0, this wait froze it again and again until the job ended without it)."""
            idx = slow_chunk_with_published_shards()
            if idx is None:
                return None
            pids = _runner_pids(tmp_path / "work-slow") + _server_pids(tmp_path / "work-slow")
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            frozen[:] = pids
            if slow_runner_of(idx) in pids and \
                    Store(f"{out}/_parts/slow/chunk-{idx:05d}").read_bytes("manifest.json") is None:
                return (idx,)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            frozen.clear()
            tried.add(idx)
            return None

        (idx,) = _wait(first, log1, frozen_mid_chunk, "the slow node to put shards in the store, caught mid-chunk")

        def seeded_takeover() -> bool:
            """The chunk handed to the other node, whose runner starts from the lost node's shards in the
            store. Read from this machine's copy of the state and the node's job files: cheap, so the
            controller is killed mid-job — the store's copy, read after the kill, must say the same. Polling
            the store's copy here (a dozen reads a look, on a loaded machine) let the takeover end, and the
            job with it, before a look saw it running (seen here at load 10-14)."""
            c = ((plan_state(state_home) or ({}, {}))[1]).get("chunks", {}).get(str(idx), {})
            if c.get("node") != "fast" or c.get("state") not in ("running", "done"):
                return False
            jobs = [json.loads(p.read_text()) for p in (tmp_path / "work-fast").glob("jobs/*/job.json")]
            return any(j["output"].endswith(f"chunk-{idx:05d}") and j["seed"] for j in jobs)

        _wait(first, log1, seeded_takeover, "the lost node's chunk to start on the other node, seeded from the store")
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:   # it ended on its own: the assertion above says why
            pass
        first.wait()
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    # the store's copy (what a next controller reads) had the takeover before its runner started
    c = (acknowledged_state(out, tmp_path / "peek") or {}).get("chunks", {}).get(str(idx), {})
    assert c.get("node") == "fast" and c.get("state") in ("running", "done"), c
    log2 = tmp_path / "second.log"
    _run_to_end(_cli(cfg, tmp_path, f"{s3}/in/prompts.jsonl", out, log2), log2)   # type: ignore[arg-type]
    pdir, st = plan_state(state_home)  # type: ignore[misc]
    assert any(e["event"] == "node-lost" and e["node"] == "slow" for e in st["events"])
    assert all(c["state"] == "done" for c in st["chunks"].values())
    ids = store_ids(out)
    assert len(ids) == len(set(ids)) == 900
    manifest = json.loads(Store(out).read_bytes("manifest.json") or b"{}")
    assert manifest["complete"] and manifest["counts"]["completed"] == 900
    assert not (pdir / "gathered").exists() and not (pdir / "output").exists()   # nothing through the controller
    # every row merged in the store: the fast node's working copies, chunk inputs and job dirs are gone
    fast = tmp_path / "work-fast"
    assert not list(fast.glob("objstore/*/fast/*")) and not list(fast.glob("jobs/*/job.json"))
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
    from fleet.errors import ConfigError, InputChanged
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
    with pytest.raises(InputChanged, match="the input changed since the job was planned"):
        split_input(url, pdir, ["a", "b"], chunk_rows=40)
    with pytest.raises(ConfigError, match="another --output"):   # another input into the same job
        split_input(f"{s3}/in/other.jsonl", pdir, ["a", "b"], chunk_rows=40)


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


AWS_BLOCK_SECRET = "aws-block-secret-5e6f7a8b9c0d"


def _aws_credentials(endpoint: str | None = None, **kw: Any) -> Any:
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    return AwsCredentials(aws_access_key_id="fleet-block", aws_secret_access_key=AWS_BLOCK_SECRET,
                          region_name="us-east-1", aws_client_parameters=AwsClientParameters(endpoint_url=endpoint), **kw)


def test_store_credentials_from_a_prefect_aws_block(prefect_api, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ecosystem keeps AWS credentials in prefect-aws's AwsCredentials (or an S3Bucket holding one), not
    in a Secret of fleet's own shape: FLEET_STORE_AWS_BLOCK names either (`NAME`, `aws-credentials/NAME`,
    `s3-bucket/NAME`) and its keys, region and endpoint become the AWS_* variables. A missing block, a block
    that names a profile or a role (a node's runner has neither), an unknown kind, or prefect-aws not
    installed is a ConfigError with its remedy, never echoing the block's secret."""
    from prefect_aws import S3Bucket

    from blocks.credentials import load_store_credentials
    from fleet.errors import ConfigError

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL",
              "FLEET_STORE_SECRET"):
        monkeypatch.delenv(k, raising=False)
    _aws_credentials("http://127.0.0.1:9").save("fleet-aws-test", overwrite=True)
    S3Bucket(bucket_name="jobs", credentials=_aws_credentials("http://127.0.0.1:8")).save("fleet-bucket-test",
                                                                                           overwrite=True)
    monkeypatch.setenv("FLEET_STORE_AWS_BLOCK", "s3-bucket/fleet-bucket-test")
    assert sorted(load_store_credentials()) == ["AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_REGION",
                                                "AWS_SECRET_ACCESS_KEY"]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == AWS_BLOCK_SECRET and os.environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:8"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    for ref in ("fleet-aws-test", "aws-credentials/fleet-aws-test"):   # a variable already set wins
        monkeypatch.setenv("FLEET_STORE_AWS_BLOCK", ref)
        assert load_store_credentials() == ["AWS_ENDPOINT_URL"] and os.environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
        monkeypatch.delenv("AWS_ENDPOINT_URL")
    _aws_credentials(profile_name="dev").save("fleet-aws-profile", overwrite=True)
    for ref, remedy in (("fleet-aws-missing", "create it"), ("fleet-aws-profile", "access keys"),
                        ("secret/fleet-aws-test", "aws-credentials/NAME")):
        monkeypatch.setenv("FLEET_STORE_AWS_BLOCK", ref)
        with pytest.raises(ConfigError) as info:
            load_store_credentials()
        assert remedy in (info.value.remedy or "") and AWS_BLOCK_SECRET not in str(info.value), ref
    monkeypatch.setenv("FLEET_STORE_AWS_BLOCK", "fleet-aws-test")
    monkeypatch.setitem(sys.modules, "prefect_aws", None)   # prefect-aws not installed: its import fails
    with pytest.raises(ConfigError) as info:
        load_store_credentials()
    assert "pip install 'fleet[aws]'" in (info.value.remedy or "")


def test_a_store_job_with_its_credentials_from_an_aws_credentials_block(tmp_path: Path, state_home: Path, s3: str,
                                                                      prefect_api, stop_everything,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With no AWS_* in the flow's environment, only FLEET_STORE_AWS_BLOCK naming an AwsCredentials block
    (the keys and the S3-compatible server's endpoint in it), a job reading and writing s3:// runs over two
    local nodes: every id once in the store, and the block's secret in no file under the nodes' workdirs,
    the plan and state, nor in the command line of any process started meanwhile."""
    from fleet.generation.data.objstore import Store
    from flows.fleet import fleet
    from test_security import CmdlineWatcher, _scan_tree

    cfg = two_nodes(tmp_path, generation={"max_tokens": 8, "chunk_rows": 100})
    stop_everything(cfg)
    Store(s3).put_file(str(prompts(tmp_path / "in.jsonl", 200)), "in/prompts.jsonl")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL", "FLEET_STORE_SECRET"):
        monkeypatch.delenv(k, raising=False)
    _aws_credentials(endpoint).save("fleet-aws-job", overwrite=True)
    monkeypatch.setenv("FLEET_STORE_AWS_BLOCK", "fleet-aws-job")
    out = f"{s3}/aws-job"
    with CmdlineWatcher() as watch:
        state = fleet(config=cfg, action="generate", input=f"{s3}/in/prompts.jsonl", output=out, return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), (state.message, res)
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == AWS_BLOCK_SECRET   # the block's, loaded by the flow
    ids = store_ids(out)
    assert len(ids) == len(set(ids)) == 200
    assert [argv for argv in watch.seen.values() if AWS_BLOCK_SECRET in argv] == []
    for root in (tmp_path, state_home):
        assert _scan_tree(root, [AWS_BLOCK_SECRET]) == []


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


class _Fetched:
    """Bytes fetched from the S3 server, counted where s3fs fetches them (a file's ranged GETs, cat_file)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import s3fs.core

        self.bytes = 0
        fetch, cat = s3fs.core._fetch_range, s3fs.core.S3FileSystem._cat_file

        def counted_fetch(*a: object, **kw: object) -> bytes:
            data: bytes = fetch(*a, **kw)   # type: ignore[arg-type]
            self.bytes += len(data)
            return data

        async def counted_cat(fs: object, *a: object, **kw: object) -> bytes:
            data: bytes = await cat(fs, *a, **kw)   # type: ignore[arg-type]
            self.bytes += len(data)
            return data

        monkeypatch.setattr(s3fs.core, "_fetch_range", counted_fetch)
        monkeypatch.setattr(s3fs.core.S3FileSystem, "_cat_file", counted_cat)


def test_a_jsonl_input_on_the_store_is_read_once_to_plan(s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller streamed a JSONL input on the store twice to plan it (once to count its lines, once
    to find each chunk's byte offset): at a hundred nodes the input is the biggest thing it reads. One
    pass now, whatever the limit; a larger limit later reads only the lines after the plan's; and the
    ranges hold every line once, blank lines and a last line without a newline included."""
    from fleet.generation.data.objstore import Store
    from fleet.generation.data.ranges import read_span
    from fleet.generation.multinode.chunks import split_input

    lines = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "q" * (i % 50)}]}) if i % 41 else ""
             for i in range(3000)]
    data = "\n".join(lines).encode()
    Store(s3).write_bytes("in/once.jsonl", data)
    url = f"{s3}/in/once.jsonl"
    fetched = _Fetched(monkeypatch)
    plan = split_input(url, tmp_path / "plan", ["a", "b"], chunk_rows=200, limit=1000)
    first = fetched.bytes
    assert first <= len(data) + 4   # once (and 4 bytes to tell JSONL from Parquet); it was twice
    end = plan.chunks[-1].span[1]   # type: ignore[index]
    grown = split_input(url, tmp_path / "plan", ["a", "b"], chunk_rows=200)
    assert fetched.bytes - first <= len(data) - end   # only the lines after the plan's
    got = b"".join(read_span(url, c.span) for c in sorted(grown.chunks, key=lambda c: c.first_line))  # type: ignore[arg-type]
    assert got == data + b"\n"
    assert grown.total_lines == 3000 and grown.rows == sum(1 for ln in lines if ln)
    assert [c.first_line for c in grown.chunks] == [1 + sum(c.lines for c in grown.chunks[:i])
                                                     for i in range(len(grown.chunks))]


def test_a_parquet_input_on_the_store_is_read_in_place_by_row_groups(s3: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A Parquet input on the store was read whole by the controller and cut into chunk objects under
    `<output>/_inputs/` (the controller's disk and link in the data path again). Now the plan reads only
    its footer and writes nothing but plan.json; each chunk (a row range, cut at claim time too) is read
    by its runner as only the row groups that hold its rows; the runner's start arguments name them;
    and the chunks' rows, concatenated, are the input's, in order."""
    import pyarrow as pa

    from fleet.config import FleetConfig
    from fleet.generation.data.objstore import Store
    from fleet.generation.job.publish import stage_input
    from fleet.generation.multinode.controller import Controller, NodeWork

    n = 2000
    table = pa.table({"id": [f"r{i}" for i in range(n)],
                      "messages": [[{"role": "user", "content": f"{i:05d}" + "x" * 2000}] for i in range(n)]})
    src = tmp_path / "in.parquet"
    pq.write_table(table, src, row_group_size=100, compression="none")
    Store(s3).put_file(str(src), "in/p.parquet")
    url = f"{s3}/in/p.parquet"
    cfg = FleetConfig(name="t", nodes=[{"name": "a", "workdir": str(tmp_path / "w")}], engine={"kind": "sim"},
                      generation={"chunk_rows": 250})
    ctl = Controller(cfg, tmp_path / "plan", f"{s3}/job", {"a": NodeWork("a", [])})
    fetched = _Fetched(monkeypatch)
    plan = ctl.prepare(url)
    md = pq.ParquetFile(src).metadata
    group = max(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
    footer = 64 * 1024 + md.serialized_size + 8   # pyarrow reads the last 64 KiB, then the rest of the footer
    assert fetched.bytes <= footer < src.stat().st_size / 10   # the footer, not the rows
    assert plan.fmt == "parquet" and all(not c.file and c.span is None for c in plan.chunks)
    # no chunk copy: only the plan and the controller's state (journal.py: snapshot + log of changes)
    assert {p.name for p in (tmp_path / "plan").iterdir()} <= {"plan.json", "store.json", "state.json", "state.jsonl"}
    assert ctl.assign is not None and ctl.assign.claim("a", rows=130) == 0   # cut inside a row group at claim time
    chunks = sorted(plan.chunks, key=lambda c: c.first_line)
    args = ctl.store_args("a", chunks[1].index, "/out")
    assert args["input_rows"] == [130, 130 + chunks[1].lines] and args["input_span"] is None
    got = []
    for c in chunks:
        before = fetched.bytes
        local = stage_input(url, tmp_path / "w" / c.name, None, [c.first_line - 1, c.first_line - 1 + c.lines])
        groups = -(-(c.first_line - 1 + c.lines) // 100) - (c.first_line - 1) // 100   # the row groups it spans
        assert fetched.bytes - before <= groups * group + footer   # those row groups and the footer
        got += pq.read_table(local, columns=["id"]).column(0).to_pylist()
    assert got == [f"r{i}" for i in range(n)]
    assert not Store(f"{s3}/job").exists("_inputs")


def test_a_finished_store_job_leaves_no_working_copy_on_its_nodes_but_never_drops_a_row(s3: str, tmp_path: Path) -> None:
    """Nodes kept every chunk's working copy (shards, the chunk's input, the runner's job directory) after
    the job was merged in the store: a hundred nodes, every chunk they ran, on their disks for good. Now
    they are removed once the merged output is complete, but a copy stays, with its reason, while its
    runner lives, while a committed shard of it is not in the store (in its part, or seeded from one),
    or while its errors are not (the part has no manifest yet); before the merge is complete, nothing goes."""
    from fleet.config import FleetConfig
    from fleet.generation.data.objstore import Store
    from fleet.generation.multinode.cleanup import Copy, clean_nodes, input_dir
    from fleet.jobs import job_dir

    work = tmp_path / "w"
    cfg = FleetConfig(name="t", nodes=[{"name": "a", "workdir": str(work)}], engine={"kind": "sim"})
    out = f"{s3}/job"

    def copy(i: int, shards: list[int], stored: list[int], *, seeded: list[int] = (), errors: bool = False,  # type: ignore[assignment]
             manifest: bool = False, pid: int | None = None) -> Copy:
        o = work / "objstore" / "k" / "a" / f"chunk-{i:05d}"
        (o / "shards").mkdir(parents=True)
        for s in shards:
            (o / "shards" / f"part-{s:06d}.parquet").write_bytes(b"rows")
        if seeded:
            (o / ".seeded.json").write_text(json.dumps([f"part-{s:06d}.parquet" for s in seeded]))
        if errors:
            (o / "errors.jsonl").write_text('{"id": "x"}\n')
        Path(input_dir(str(o)), "0-10-in.jsonl").parent.mkdir()
        Path(input_dir(str(o)), "0-10-in.jsonl").write_text("{}\n")
        jd = Path(job_dir(cfg.node("a"), cfg, str(o)))
        jd.mkdir(parents=True)
        (jd / "job.json").write_text("{}")
        if pid is not None:
            (jd / "runner.pid").write_text(f"{pid}\n")
        part = Store(f"{out}/_parts/a/chunk-{i:05d}")
        for s in stored:
            part.write_bytes(f"shards/part-{s:06d}.parquet", b"rows")
        if manifest:
            part.write_bytes("manifest.json", b"{}")
        return Copy("a", str(o), str(jd), part.root)

    copies = [copy(0, [1, 2], [1, 2]),                                            # all in its part
              copy(1, [1, 2], [2], seeded=[1], errors=True, manifest=True),       # one seeded, records published
              copy(2, [1, 3], [1]),                                               # a shard only on the node
              copy(3, [1], [1], pid=os.getpid()),                                 # its runner alive
              copy(4, [1], [1], errors=True)]                                     # errors not published
    Store(out).write_bytes("manifest.json", json.dumps({"complete": False}).encode())
    early = clean_nodes(cfg, out, copies)
    assert early.removed == [] and early.skipped and all(Path(c.output).is_dir() for c in copies)
    Store(out).write_bytes("manifest.json", json.dumps({"complete": True}).encode())
    done = clean_nodes(cfg, out, copies)
    gone = {c.output for c in copies[:2]}
    assert sorted(done.removed) == sorted(f"a:{o}" for o in gone)
    for c in copies:
        there = c.output not in gone
        assert Path(c.output).exists() == Path(input_dir(c.output)).exists() == Path(c.job_dir).exists() == there
    assert "not in the store" in done.kept[f"a:{copies[2].output}"] and "part-000003" in done.kept[f"a:{copies[2].output}"]
    assert "running" in done.kept[f"a:{copies[3].output}"]
    assert "errors.jsonl" in done.kept[f"a:{copies[4].output}"]
    # the rows are all still in the store
    assert Store(f"{out}/_parts/a/chunk-00000").names("shards") == ["part-000001.parquet", "part-000002.parquet"]


def test_data_checks_run_for_an_output_on_object_storage(s3: str, tmp_path: Path) -> None:
    """The merged manifest of a job whose output is on object storage said `checks: skipped` (run `fleet
    check` on a fetched copy): the drafter-data numbers (answers cut at max_tokens, empty ones, think tags,
    token percentiles) were missing exactly for the jobs run at scale. The merge now runs them on the
    store's shards, reading only their check columns, and they equal the checks of the same rows on disk."""
    from fleet.config import FleetConfig
    from fleet.generation.data.checks import data_checks
    from fleet.generation.data.objstore import Store
    from fleet.generation.data.store import ResultStore
    from fleet.generation.multinode.chunks import Assignments, split_input
    from fleet.generation.multinode.controller import merge_job, part_url

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "q"}) + "\n" for i in range(30)))
    plan = split_input(inp, tmp_path / "plan", ["a"], chunk_rows=15)
    assign = Assignments(tmp_path / "plan", plan)
    out = f"{s3}/checked"
    local = tmp_path / "local"
    for c in plan.chunks:
        d = tmp_path / c.name
        s = ResultStore(d, shard_rows=4)
        for i in range(c.first_line - 1, c.first_line - 1 + c.lines):
            s.add_result({"id": f"r{i}", "completion": "" if i % 7 == 0 else f"<think>x</think> answer {i}",
                          "finish_reason": "length" if i % 5 == 0 else "stop", "completion_tokens": i,
                          "prompt_tokens": 1})
        s.close()
        part = Store(part_url(out, "a", c))
        for p in sorted((d / "shards").glob("part-*.parquet")):
            part.put_file(str(p), f"shards/{p.name}")
        part.write_bytes("manifest.json", json.dumps({"complete": True, "state": "done", "accounted": c.lines}).encode())
        assign.start(c.index, "a", str(d))
        assign.finish(c.index, "a", "done")
    cfg = FleetConfig(name="t", nodes=[{"name": "a", "workdir": str(tmp_path / "w")}], engine={"kind": "sim"})
    manifest = merge_job(cfg, tmp_path / "plan", plan, assign, out, store=out)
    merge_job(cfg, tmp_path / "plan", plan, assign, local, store=out)   # the same merge, onto this disk
    checks = manifest["checks"]
    assert "skipped" not in checks and "error" not in checks
    assert checks == data_checks(local)
    assert checks["rows"] == 30 and checks["cut_at_max_tokens"] == 6 and checks["empty_completions"] == 5
    assert checks["think_tags"] == 25 and checks["completion_tokens"]["max"] == 29
    assert json.loads(Store(out).read_bytes("manifest.json") or b"{}")["checks"] == checks

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
    text = _run_to_end(_cli(cfg, tmp_path, f"{s3}/in/prompts.jsonl", out, log2), log2, timeout=500)   # type: ignore[arg-type]
    assert "plan and state read from" in text
    _, st = plan_state(tmp_path / "elsewhere")  # type: ignore[misc]
    assert all(c["state"] == "done" for c in st["chunks"].values())
    for idx, c in before["chunks"].items():
        if c["state"] == "done":   # a chunk finished before the loss is not run again
            assert st["chunks"][idx]["attempts"] == c["attempts"]
    ids = store_ids(out)
    assert len(ids) == len(set(ids)) == 600
    manifest = json.loads(Store(out).read_bytes("manifest.json") or b"{}")
    assert manifest["complete"] and manifest["counts"]["completed"] == 600
