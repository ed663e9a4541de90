"""A JSONL input on object storage planned from its size, not its content (issue 35, item 3): the
controller cuts byte offsets without reading the rows, and each runner aligns its range to whole lines
by the standard split rule (a range owns the lines that start in it). Exactly once at every cut."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from test_generate_flow import stop_everything  # noqa: F401  (fixture)
from test_multinode import state_home, two_nodes  # noqa: F401
from test_objstore import s3, store_ids  # noqa: F401


def _awkward() -> bytes:
    """Lines of every length around the cut points: blank lines, a line longer than many ranges,
    id-less rows (their id is their content's hash), and a last line without a newline."""
    out = []
    for i in range(15):
        if i % 5 == 3:
            out.append("")
        elif i == 7:
            out.append(json.dumps({"id": "long", "messages": [{"role": "user", "content": "x" * 90}]}))
        elif i % 4 == 1:
            out.append(json.dumps({"messages": [{"role": "user", "content": f"no id {i}"}]}))
        else:
            out.append(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "q" * (i % 3)}]}))
    return "\n".join(out).encode()


def _mem(data: bytes) -> tuple[Any, str]:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/ranges/in.jsonl", data)
    return fs, "/ranges/in.jsonl"


@pytest.mark.parametrize("ahead", [8192, 3])   # a last line finished in the range's read, or by reads past it
def test_byte_ranges_cut_anywhere_hold_every_line_once(ahead: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split rule at every cut point (pure, over an in-memory file read as a store URL): two ranges
    cut at any byte — inside a line, exactly at a newline, inside a run of blank lines, inside the long
    line — and three ranges cut at any two bytes hold between them every line once, in order, each
    range whole lines; the last line, which has no newline, ends with one. (A range read as its bytes,
    as before, split lines in two wherever a cut fell inside one.)"""
    from fleet.generation.data import ranges
    from fleet.generation.data.ranges import read_span

    monkeypatch.setattr(ranges, "AHEAD", ahead)
    data = _awkward()
    _mem(data)
    url = "memory://ranges/in.jsonl"
    whole = data + b"\n"
    size = len(data)
    lines = set(whole.splitlines(keepends=True))
    for c in range(1, size):
        parts = [read_span(url, [0, c]), read_span(url, [c, size])]
        assert b"".join(parts) == whole, c
        assert all(ln in lines for p in parts for ln in p.splitlines(keepends=True)), c   # whole lines only
    for a in range(1, size, 7):
        for b in range(a + 1, size, 11):
            got = b"".join(read_span(url, span) for span in ([0, a], [a, b], [b, size]))
            assert got == whole, (a, b)
    # a range inside one line owns nothing; a cut exactly after a newline gives the next line to the right
    start = data.index(b'"long"')
    assert read_span(url, [start, start + 20]) == b""
    nl = data.index(b"\n") + 1
    assert read_span(url, [nl, nl + 1]).startswith(data[nl:nl + 5])
    assert read_span(url, [0, nl]) == data[:nl]


def test_a_size_cut_plan_reads_only_the_head_and_cuts_at_claim_time_without_a_read(
        s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller streamed the whole JSONL input on the store to plan it (7 MB of the 7.06 MB it
    downloaded in issue 35's run). Now the plan is cut from the object's size: the controller reads the
    head's bytes (an estimate of the bytes per line) and nothing else, a cut at claim time reads nothing,
    and the runners' aligned ranges hold every line once. The input's pin is still checked."""
    from fleet.errors import InputChanged
    from fleet.generation.data.objstore import Store
    from fleet.generation.data.ranges import SAMPLE, read_span
    from fleet.generation.multinode.chunks import split_chunk, split_input
    from test_objstore import _Fetched

    lines = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "q" * (i % 97)}]}) if i % 41 else ""
             for i in range(4000)]
    data = "\n".join(lines).encode()
    assert len(data) > 4 * SAMPLE
    Store(s3).write_bytes("in/sized.jsonl", data)
    url = f"{s3}/in/sized.jsonl"
    fetched = _Fetched(monkeypatch)
    plan = split_input(url, tmp_path / "plan", ["a", "b"], chunk_rows=300)
    assert fetched.bytes <= SAMPLE + 4   # the head, and 4 bytes to tell JSONL from Parquet
    assert all(c.approx and c.span is not None for c in plan.chunks) and len(plan.chunks) > 4
    spans = [c.span for c in sorted(plan.chunks, key=lambda c: c.first_line)]
    assert spans[0][0] == 0 and spans[-1][1] == len(data)   # type: ignore[index]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))   # type: ignore[index]
    before = fetched.bytes
    split_chunk(tmp_path / "plan", plan, 1, 100)   # at claim time: a byte, no read
    assert fetched.bytes == before
    got = b"".join(read_span(url, c.span, plan.input_id) for c in sorted(plan.chunks, key=lambda c: c.first_line))  # type: ignore[arg-type]
    assert got == data + b"\n"
    assert split_input(url, tmp_path / "plan", ["a", "b"], chunk_rows=300).chunks == plan.chunks   # kept
    Store(s3).write_bytes("in/sized.jsonl", data[: len(data) // 2])
    with pytest.raises(InputChanged, match="the input changed since the job was planned"):
        read_span(url, plan.chunks[2].span, plan.input_id)   # type: ignore[arg-type]


@pytest.mark.timeout(900)   # one bring-up and a small job, on a shared 2-core machine
def test_fleet_generate_over_a_size_cut_store_input_every_id_once(tmp_path: Path, state_home: Path, s3: str,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  stop_everything) -> None:
    """Through `fleet generate` over two nodes: a JSONL input on the store with blank lines, id-less rows,
    rows of very different lengths and a last line without a newline, planned from its size (chunks cut
    at bytes, again at claim time) and aligned by each runner: every id of the input is in the output
    exactly once — the id-less rows' content ids the same as a single read of the file gives — and the
    controller (this process; the runners are their own) read nothing of the input but its head."""
    from flows.fleet import fleet
    from fleet.generation.data.inputs import iter_input
    from fleet.generation.data.objstore import Store
    from fleet.generation.data.ranges import SAMPLE
    from fleet.generation.data.rows import Request
    from test_multinode import plan_state

    rows = []
    for i in range(160):
        if i % 23 == 5:
            rows.append("")
        elif i % 9 == 2:
            rows.append(json.dumps({"messages": [{"role": "user", "content": f"no id {i} " + "z" * (i % 13)}]}))
        else:
            rows.append(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "w" * (i * 37 % 1500)}]}))
    data = "\n".join(rows).encode()
    assert len(data) > SAMPLE
    (tmp_path / "whole.jsonl").write_bytes(data)
    want = [r.id for r in iter_input(tmp_path / "whole.jsonl", None) if isinstance(r, Request)]
    Store(s3).write_bytes("in/awkward.jsonl", data)
    url = f"{s3}/in/awkward.jsonl"
    out = f"{s3}/sized-out"

    input_bytes = [0]   # what this process (the controller) fetched of the input: ranged reads and cat_file
    import s3fs.core

    fetch, cat = s3fs.core._fetch_range, s3fs.core.S3FileSystem._cat_file

    def counted_fetch(fs: object, bucket: str, key: str, *a: object, **kw: object) -> bytes:
        got: bytes = fetch(fs, bucket, key, *a, **kw)   # type: ignore[arg-type]
        input_bytes[0] += len(got) if "awkward.jsonl" in key else 0
        return got

    async def counted_cat(fs: object, path: str, *a: object, **kw: object) -> bytes:
        got: bytes = await cat(fs, path, *a, **kw)   # type: ignore[arg-type]
        input_bytes[0] += len(got) if "awkward.jsonl" in path else 0
        return got

    monkeypatch.setattr(s3fs.core, "_fetch_range", counted_fetch)
    monkeypatch.setattr(s3fs.core.S3FileSystem, "_cat_file", counted_cat)
    cfg = two_nodes(tmp_path, generation={"max_tokens": 4, "chunk_rows": 40, "shard_rows": 10})
    stop_everything(cfg)
    state = fleet(config=cfg, action="generate", input=url, output=out, return_state=True)
    res = state.result(raise_on_failure=False)
    assert state.is_completed(), (state.message, res)
    _, st = plan_state(state_home)  # type: ignore[misc]
    assert all(c["state"] == "done" for c in st["chunks"].values())
    got = store_ids(out)
    assert sorted(got) == sorted(want) and len(got) == len(set(got)) == len(want)
    assert len(data) > SAMPLE and input_bytes[0] <= SAMPLE + 4
    # the data checks are the runners' own, summed: the same numbers as reading the output's check columns
    from fleet.generation.data.checks import data_checks

    manifest = json.loads(Store(out).read_bytes("manifest.json") or b"{}")
    assert manifest["checks_basis"].startswith("summed"), manifest.get("checks_basis")
    assert manifest["checks"] == data_checks(out) and manifest["checks"]["rows"] == len(want)


def _results(d: Path, ids: list[int], shard_rows: int = 4) -> None:
    from fleet.generation.data.store import ResultStore

    s = ResultStore(d, shard_rows=shard_rows)
    for i in ids:
        s.add_result({"id": f"r{i}", "completion": "" if i % 7 == 0 else f"<think>x</think> answer {i}",
                      "finish_reason": "length" if i % 5 == 0 else "stop", "completion_tokens": (i * 31) % 17,
                      "prompt_tokens": 1})
    s.close()


def test_the_job_checks_are_the_chunks_checks_summed_exactly(s3: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller read the whole output's check columns again after the merge (issue 35: part of
    its 7.06 MB, and of the 94 s after the last row). Each chunk's runner already checks its own output
    for its manifest; the job's checks are now their sum — exact, the token quantiles too (from summed
    histograms), equal to reading the merged rows — and nothing is read for them. When the merge dropped
    a row (an id twice) or kept one from an abandoned attempt, the sum would be wrong: then they are read."""
    from fleet.config import FleetConfig
    from fleet.generation.data import checks as checks_mod
    from fleet.generation.data.checks import data_checks, sum_checks
    from fleet.generation.data.objstore import Store
    from fleet.generation.multinode.chunks import Assignments, split_input
    from fleet.generation.multinode.controller import merge_job, part_url

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "q"}) + "\n" for i in range(45)))
    plan = split_input(inp, tmp_path / "plan", ["a"], chunk_rows=15)
    out = f"{s3}/summed"

    def attempt(assign: Assignments, c: Any, node: str, ids: list[int]) -> None:
        d = tmp_path / node / c.name   # named as a node's first attempt: its part is part_url's (fence.attempt_part)
        if d.exists():
            shutil.rmtree(d)
        _results(d, ids)
        part = Store(part_url(out, node, c))
        for p in sorted((d / "shards").glob("part-*.parquet")):
            part.put_file(str(p), f"shards/{p.name}")
        part.write_bytes("manifest.json", json.dumps({"complete": True, "state": "done", "accounted": len(ids),
                                                      "checks": data_checks(d)}).encode())
        assign.start(c.index, node, str(d))
        assign.finish(c.index, node, "done")

    assign = Assignments(tmp_path / "plan", plan)
    for c in plan.chunks:
        attempt(assign, c, "a", list(range(c.first_line - 1, c.first_line - 1 + c.lines)))
    parts = [data_checks(tmp_path / "a" / c.name) for c in plan.chunks]
    cfg = FleetConfig(name="t", nodes=[{"name": "a", "workdir": str(tmp_path / "w")}], engine={"kind": "sim"})

    def no_read(*a: object, **kw: object) -> None:
        raise AssertionError("the output was read for the checks")

    with monkeypatch.context() as m:
        m.setattr(checks_mod, "data_checks", no_read)
        manifest = merge_job(cfg, tmp_path / "plan", plan, assign, out, store=out)
    whole = data_checks(out)
    assert "error" not in manifest["checks"], manifest["checks"]   # before: the output read again here
    assert manifest["checks_basis"].startswith("summed")
    assert manifest["checks"] == whole == sum_checks(parts)
    assert whole["rows"] == 45 and whole["completion_tokens"]["p95"] is not None
    # the same id on two lines in two chunks: the merge drops the second copy, the sum would count it
    (tmp_path / "in.jsonl").write_text(inp.read_text())
    plan2 = split_input(inp, tmp_path / "plan2", ["a"], chunk_rows=15)
    assign2 = Assignments(tmp_path / "plan2", plan2)
    out = f"{s3}/dup"
    for c in plan2.chunks:
        first = c.first_line - 1
        attempt(assign2, c, "a", list(range(first, first + c.lines)) + ([0] if c.index == 1 else []))
    manifest = merge_job(cfg, tmp_path / "plan2", plan2, assign2, out, store=out)
    assert manifest["checks_basis"] == "read from the merged output"
    assert manifest["checks"] == data_checks(out) and manifest["checks"]["rows"] == 45


def test_sum_checks_of_parts_is_data_checks_of_the_whole(tmp_path: Path) -> None:
    """Pure: the checks of any split of the rows sum to the checks of all of them, quantiles exactly
    (pyarrow's linear interpolation, from the histograms); a part without a histogram (an older
    runner's) or with an error cannot be summed."""
    from fleet.generation.data.checks import data_checks, sum_checks

    _results(tmp_path / "all", list(range(50)))
    cuts = [0, 1, 2, 17, 33, 50]
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        _results(tmp_path / f"p{a}", list(range(a, b)))
        parts.append(data_checks(tmp_path / f"p{a}"))
    whole = data_checks(tmp_path / "all")
    assert sum_checks(parts) == whole
    assert whole["completion_tokens"]["p50"] == 8.0 and whole["completion_tokens"]["rows"] == 50
    old = {k: v for k, v in parts[0].items() if k != "completion_tokens_hist"}
    assert sum_checks([old, *parts[1:]]) is None and sum_checks([{"error": "x"}]) is None
