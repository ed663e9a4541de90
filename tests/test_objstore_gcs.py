"""`gs://` through the same Store seam, against a local GCS emulator (the `gcp-storage-emulator`
package, in memory, on loopback) with gcsfs: the exactly-once rules that hold on S3 hold there —
an unfinished upload is no object, the merge keeps every id once, an input is read in place.

A whole gs:// job with its runner on an SSH node, authenticated with the controller's
GOOGLE_APPLICATION_CREDENTIALS: tests/test_objstore_nodes.py.
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

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import free_port


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """The emulator on a loopback port, gcsfs pointed at it (STORAGE_EMULATOR_HOST), one bucket: its URL."""
    import httpx

    port = free_port()
    log = (tmp_path / "gcs.log").open("wb")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "gcp-storage-emulator"), "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "gcs.log").read_text()
        try:
            if httpx.get(f"{endpoint}/storage/v1/b", timeout=2).status_code < 500:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the GCS emulator did not answer"
        time.sleep(0.2)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    # gcsfs's experimental bucket-type probe speaks gRPC, which the emulator does not: a minute per bucket
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec

    fsspec.filesystem("gs").clear_instance_cache()
    from fleet.generation.data.objstore import Store

    Store("gs://jobs").fs.mkdir("jobs")
    try:
        yield "gs://jobs"
    finally:
        fsspec.filesystem("gs").clear_instance_cache()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def test_gs_an_unfinished_upload_never_becomes_an_object_and_the_first_error_is_kept(gcs: str) -> None:
    """On gs:// too a shard cut short by an error leaves no object. The emulator cannot abort a resumable
    upload (it answers 501): that failure used to replace the error that cut the write (the caller saw
    an HTTP 501, not why its write stopped); the upload, never finalized, is no object either way."""
    from fleet.generation.data.objstore import Store

    st = Store(f"{gcs}/unit")
    with pytest.raises(RuntimeError, match="killed mid-write"):
        with st.open_write("shards/part-000001.parquet") as f:
            f.write(b"x" * (20 << 20))   # past gcsfs's first block: a resumable upload under way
            raise RuntimeError("killed mid-write")
    assert st.names("shards") == []
    st.write_bytes("shards/part-000002.parquet", b"whole")
    assert st.names("shards") == ["part-000002.parquet"] and st.read_bytes("shards/part-000002.parquet") == b"whole"


def test_gs_merge_keeps_every_id_once_and_inputs_are_read_in_place(gcs: str, tmp_path: Path) -> None:
    """The first-wins merge from parts on gs:// to a gs:// output: a chunk re-run elsewhere gives duplicate
    ids, the merge keeps each once (server-side copies for whole shards) and runs the data checks there; a
    JSONL input on gs:// is planned in byte ranges that hold every line once, a Parquet one read by rows."""
    from fleet.generation.data.objstore import Store
    from fleet.generation.data.ranges import read_rows, read_span
    from fleet.generation.data.store import ResultStore
    from fleet.generation.multinode.chunks import Source, merge, split_input
    from fleet.generation.multinode.controller import part_url

    lines = [json.dumps({"id": f"r{i}", "prompt": "q"}) for i in range(40)]
    Store(gcs).write_bytes("in/p.jsonl", ("\n".join(lines) + "\n").encode())
    plan = split_input(f"{gcs}/in/p.jsonl", tmp_path / "plan", ["a", "b"], chunk_rows=10)
    assert all(c.span is not None for c in plan.chunks)
    assert b"".join(read_span(plan.input, c.span) for c in plan.chunks).decode().splitlines() == lines  # type: ignore[arg-type]
    out = f"{gcs}/job"
    sources = []
    for c, node, ids in [(plan.chunks[0], "a", range(0, 10)), (plan.chunks[1], "b", range(10, 20)),
                         (plan.chunks[1], "a", range(10, 14))] + [(c, "b", range(c.first_line - 1, c.first_line - 1 + c.lines))
                                                                  for c in plan.chunks[2:]]:
        d = tmp_path / f"{node}-{c.name}-{len(sources)}"
        s = ResultStore(d, shard_rows=3)
        for i in ids:
            s.add_result({"id": f"r{i}", "completion": f"answer {i}", "completion_tokens": 2, "prompt_tokens": 1})
        s.close()
        url = part_url(out, node, c) + f"-{len(sources)}"
        for p in sorted((d / "shards").glob("part-*.parquet")):
            Store(url).put_file(str(p), f"shards/{p.name}")
        sources.append(Source(c, node, url))
    m = merge(sources, out)
    ids = [i for name in Store(out).names("shards")
           for i in pq.read_table(Store(out).fs.open(f"jobs/job/shards/{name}", "rb"), columns=["id"]).column(0).to_pylist()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(40)) and len(ids) == len(set(ids))
    assert m["merge"]["duplicates_dropped"] == 4 and json.loads(Store(out).read_bytes("manifest.json") or b"{}")["complete"]
    from fleet.generation.data.checks import data_checks

    assert data_checks(out)["rows"] == 40
    table = pa.table({"id": [f"p{i}" for i in range(300)]})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=50)
    Store(gcs).put_file(str(tmp_path / "in.parquet"), "in/p.parquet")
    assert read_rows(f"{gcs}/in/p.parquet", 120, 70).column(0).to_pylist() == [f"p{i}" for i in range(120, 190)]
