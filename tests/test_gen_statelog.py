"""The multi-node job's state on disk and in the store (fleet/generation/multinode/journal.py): a line
per change, a snapshot now and then, a copy on object storage that another machine resumes from.

Pure and fast: plans built in memory (no chunk files), the store is fsspec's memory filesystem.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import StoreError
from fleet.generation.data.durable import write_json_atomic
from fleet.generation.data.objstore import Store
from fleet.generation.multinode import journal
from fleet.generation.multinode.chunks import PLAN_FILE, Assignments, Chunk, Plan, read_state


def _plan(pdir: Path, chunks: int, nodes: int = 10) -> Plan:
    plan = Plan(input="memory://in.jsonl", input_id={"size": chunks * 100}, total_lines=chunks * 100,
                chunk_rows=100, nodes=[f"n{i}" for i in range(nodes)],
                chunks=[Chunk(index=i, first_line=1 + 100 * i, lines=100, file="", span=[0, 1]) for i in range(chunks)],
                fmt="jsonl", limit=None, rows=chunks * 100)
    pdir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(pdir / PLAN_FILE, plan.to_dict())
    return plan


def _work(st: Assignments, changes: int, nodes: int = 10) -> None:
    """About `changes` changes as a job makes them: starts, finishes, a loss and a rejoin now and then."""
    made = 0
    k = 0
    while made < changes:
        node = f"n{k % nodes}"
        i = st.claim(node, lambda i: f"/w/{node}/chunk-{i:05d}")
        if i is None:
            break
        made += 1
        if k % 17 == 5:
            st.node_lost(node, "no answer")
            st.node_ok(node)
            made += 3
        else:
            st.finish(i, node, "done", fetched=True)
            made += 1
        k += 1


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for d in (a, b):
        d.pop("updated_at", None)
    assert a == b


def test_state_bytes_written_per_change_stay_constant_as_the_job_grows(tmp_path: Path) -> None:
    """The second limit the scale bench found: state.json was rewritten whole on every change, O(chunks)
    bytes each (≈ 5 MB per change at 1,000 nodes). Now a change is one log line and the snapshot is
    rewritten only when the log has grown to its size: the bytes written per change (log and snapshots
    together) do not grow with the job, at 100 chunks as at 5,000."""
    per_change = {}
    for chunks in (100, 5_000):
        pdir = tmp_path / str(chunks)
        st = Assignments(pdir, _plan(pdir, chunks))
        _work(st, 1_500)
        c = st.log.counters
        per_change[chunks] = (c["log_bytes"] + c["snapshot_bytes"]) / c["appends"]
        if chunks == 5_000:   # the old way wrote the whole state per change: > 100 KB here
            assert per_change[chunks] < 2_000 and len(json.dumps(st.snapshot())) > 100_000
    assert per_change[5_000] < 3 * per_change[100], per_change


def test_controller_killed_between_a_log_append_and_a_compaction_reloads_the_same_state(tmp_path: Path) -> None:
    """A controller killed at any point between two compactions (its last lines in the log, the snapshot
    older), or between writing a snapshot and starting the empty log after it (the old log's lines then
    all at or before the snapshot), reloads exactly the state it had acknowledged."""
    pdir = tmp_path / "p"
    plan = _plan(pdir, 300)
    st = Assignments(pdir, plan)
    _work(st, 900)   # past a compaction or more: a snapshot and a log after it
    assert st.log.counters["snapshots"] >= 1 and st.log.log_bytes > 0
    _same(Assignments(pdir, plan).snapshot(), st.snapshot())   # killed here: no close, no compaction

    real_replace = os.replace

    def killed(src: Any, dst: Any) -> None:
        if str(dst).endswith(journal.LOG_FILE):
            raise KeyboardInterrupt("killed after the snapshot, before the new log")
        real_replace(src, dst)

    os.replace = killed   # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            st.compact()
    finally:
        os.replace = real_replace   # type: ignore[assignment]
    again = Assignments(pdir, plan)
    _same(again.snapshot(), st.snapshot())
    _work(again, 50)    # and it goes on from there
    _same(Assignments(pdir, plan).snapshot(), again.snapshot())


def test_a_torn_last_line_is_ignored_and_never_glued_to_the_next(tmp_path: Path) -> None:
    """A kill in the middle of an append leaves half a line at the log's end: it is not a change (the
    method never returned), the state reads as before it, and the next change is appended after the
    last whole line (glued to the torn bytes, it would be lost too, with everything after it)."""
    pdir = tmp_path / "p"
    plan = _plan(pdir, 50)
    st = Assignments(pdir, plan)
    _work(st, 20)
    before = st.snapshot()
    st.close()
    with open(pdir / journal.LOG_FILE, "ab") as f:
        f.write(b'{"seq": 999, "chunks": {"3": {"state": "do')
    st2 = Assignments(pdir, plan)
    _same(st2.snapshot(), dict(before))
    i = st2.claim("n1", lambda i: f"/w/n1/chunk-{i:05d}")
    assert i is not None
    st2.finish(i, "n1", "done")
    st3 = Assignments(pdir, plan)
    assert st3.chunks[i].state == "done"
    _same(st3.snapshot(), st2.snapshot())


def test_a_damaged_line_before_the_last_refuses_to_load(tmp_path: Path) -> None:
    """Only the last line can be torn by a kill; a damaged line before it means the file was damaged
    otherwise, and replaying around it could forget a chunk's start: the load refuses, with a remedy."""
    from fleet.errors import FatalError

    pdir = tmp_path / "p"
    plan = _plan(pdir, 20)
    st = Assignments(pdir, plan)
    _work(st, 10)
    st.close()
    lines = (pdir / journal.LOG_FILE).read_bytes().splitlines(keepends=True)
    lines[1] = b"garbage\n"
    (pdir / journal.LOG_FILE).write_bytes(b"".join(lines))
    with pytest.raises(FatalError, match="damaged"):
        Assignments(pdir, plan)


def test_state_mirrored_to_the_store_resumes_on_another_machine(tmp_path: Path) -> None:
    """A job on object storage must survive the loss of the controller's machine: every change is put
    under `<output>/_control/` (a log segment rewritten whole, at most SEGMENT_BYTES a PUT; the plan
    before any line that needs it, a cut's new chunk included), and a controller with an empty
    directory elsewhere reads back the same plan and state. A line appended locally whose PUT failed
    was never acknowledged: the store's copy, without it, is what the next controller reads."""
    from fleet.generation.multinode.chunks import load_plan, split_input

    root = f"memory://statelog-{uuid.uuid4().hex}"
    Store(root).write_bytes("in.jsonl", b"".join(b'{"id": %d, "prompt": "q"}\n' % i for i in range(20_000)))
    mirror = Store(f"{root}/out/_control")
    pdir = tmp_path / "first"
    plan = split_input(f"{root}/in.jsonl", pdir, [f"n{i}" for i in range(10)], chunk_rows=100)
    n = len(plan.chunks)
    st = Assignments(pdir, plan, mirror)
    _work(st, 250)   # past a compaction, half the chunks left
    assert st.log.counters["snapshots"] >= 1
    st.claim("n2", rows=40)   # a cut: plan.json changes, and must reach the store before its line
    i = st.claim("n2", lambda i: f"/w/n2/chunk-{i:05d}")
    assert i is not None
    c = st.log.counters
    assert c["puts"] >= c["appends"] and c["put_bytes"] - c["plan_put_bytes"] - c["snapshot_bytes"] <= \
        c["appends"] * (journal.SEGMENT_BYTES + 1_000)
    assert c["snapshots"] >= 1 and len(mirror.names("log")) <= 1 + c["log_bytes"] // journal.SEGMENT_BYTES

    other = tmp_path / "second"   # another machine: nothing of `first`
    assert journal.pull(mirror, other)
    plan2 = load_plan(other)
    assert plan2 is not None and plan2.chunks == st.plan.chunks and len(plan2.chunks) == n + 1
    st2 = Assignments(other, plan2, mirror)
    _same(st2.snapshot(), st.snapshot())

    def no_store(*a: Any, **kw: Any) -> None:
        raise OSError("the store is unreachable")

    st2.log.mirror = Store(mirror.root)
    st2.log.mirror.write_bytes = no_store   # type: ignore[method-assign]
    journal.PUT_TRIES, tries = 1, journal.PUT_TRIES
    try:
        with pytest.raises(StoreError):   # the store's OSError, in one line with its remedy (storeerrors.py)
            st2.finish(i, "n2", "done")
    finally:
        journal.PUT_TRIES = tries
    third = tmp_path / "third"
    assert journal.pull(mirror, third)
    assert read_state(third)["chunks"][str(i)]["state"] == "running"   # type: ignore[index]
    assert read_state(other)["chunks"][str(i)]["state"] == "done"     # type: ignore[index]


def test_a_job_with_no_copy_in_the_store_is_not_pulled(tmp_path: Path) -> None:
    """A new job (or one begun before the store copy existed): nothing is read, nothing is removed."""
    mirror = Store(f"memory://statelog-{uuid.uuid4().hex}/out/_control")
    pdir = tmp_path / "p"
    _plan(pdir, 5)
    assert not journal.pull(mirror, pdir)
    assert (pdir / PLAN_FILE).exists()


def test_a_cut_whose_put_failed_leaves_every_line_in_one_chunk(tmp_path: Path) -> None:
    """A cut is a line of the state log (plan.json is no longer rewritten per cut); with a store, the
    line is acknowledged once its segment is put there. If that PUT fails, the cut was never made: the
    head's chunk file is not replaced (it still holds the rest's lines), and the next controller on this
    machine (the store's copy pulled) reads a plan whose chunk files hold every input line exactly once."""
    from fleet.generation.multinode.chunks import load_plan, split_input

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": "q"}) + "\n" for i in range(400)))
    mirror = Store(f"memory://statelog-{uuid.uuid4().hex}/out/_control")
    pdir = tmp_path / "p"
    plan = split_input(inp, pdir, ["a", "b"], chunk_rows=100)
    n = len(plan.chunks)
    st = Assignments(pdir, plan, mirror)
    st.start(0, "a", "/w/a/chunk-00000")
    first = st.pending()[0]
    head_file = (pdir / plan.chunks[first].file).read_bytes()

    def no_store(*a: Any, **kw: Any) -> None:
        raise OSError("the store is unreachable")

    st.log.mirror = Store(mirror.root)
    st.log.mirror.write_bytes = no_store   # type: ignore[method-assign]
    journal.PUT_TRIES, tries = 1, journal.PUT_TRIES
    try:
        with pytest.raises(StoreError):   # the store's OSError, in one line with its remedy (storeerrors.py)
            st.claim("b", rows=30)
    finally:
        journal.PUT_TRIES = tries
    assert (pdir / plan.chunks[first].file).read_bytes() == head_file
    assert journal.pull(mirror, pdir)
    again = load_plan(pdir)
    assert again is not None and len(again.chunks) == n
    lines = [line for c in again.chunks for line in (pdir / c.file).read_text().splitlines()]
    assert sorted(lines) == sorted(inp.read_text().splitlines()) and sum(c.lines for c in again.chunks) == 400
    st2 = Assignments(pdir, again)
    assert st2.chunks[first].state == "pending" and st2.chunks[0].state == "running"


def test_plan_bytes_written_per_cut_stay_constant_as_the_plan_grows(tmp_path: Path) -> None:
    """The scale bench's next limit: plan.json was rewritten whole on every cut (1.3 MB at 1,000 nodes,
    a cut per first claim of a chunk: thousands a job). Now a cut is a line of the state log and
    plan.json is rewritten only at the log's compaction: the bytes written per cut (plan.json, log
    lines, snapshots) do not grow with the plan, at 100 chunks as at 5,000; a new controller reads the
    plan with every cut (plan.json plus the cuts logged since it was written)."""
    from fleet.generation.multinode import assignments as assignments_mod   # where compact() looks it up
    from fleet.generation.multinode.chunks import load_plan

    per_cut = {}
    real = assignments_mod.write_json_atomic
    for n in (100, 5_000):
        pdir = tmp_path / str(n)
        plan = _plan(pdir, n)
        for c in plan.chunks:   # chunks of 10,000 lines, each cut to 100 at its claim
            plan.chunks[c.index] = Chunk(index=c.index, first_line=1 + 10_000 * c.index, lines=10_000, file="")
        plan.total_lines = plan.rows = 10_000 * n
        write_json_atomic(pdir / PLAN_FILE, plan.to_dict())
        st = Assignments(pdir, plan)
        written = [0]

        def counted(path: Any, obj: Any, _w: list[int] = written) -> None:
            real(path, obj)
            _w[0] += Path(path).stat().st_size

        assignments_mod.write_json_atomic = counted   # type: ignore[assignment]
        try:
            for k in range(600):
                node = f"n{k % 10}"
                i = st.claim(node, lambda i: f"/w/{node}/chunk-{i:05d}", rows=100)
                assert i is not None
                st.finish(i, node, "done", fetched=True)
        finally:
            assignments_mod.write_json_atomic = real   # type: ignore[assignment]
        cuts = len(plan.chunks) - n
        assert cuts > 500
        c = st.log.counters
        per_cut[n] = (written[0] + c["log_bytes"] + c["snapshot_bytes"]) / cuts
        st.close()
        again = load_plan(pdir)
        assert again is not None and again.chunks == plan.chunks
    assert len(json.dumps(plan.to_dict())) > 400_000   # the old way: > 400 KB written per cut at 5,000 chunks
    assert per_cut[5_000] < 3 * per_cut[100] and per_cut[5_000] < 5_000, per_cut


def test_a_job_begun_before_the_store_copy_puts_its_whole_state_there_first(tmp_path: Path) -> None:
    """A job on object storage begun before the store kept a copy of its state (or a new one): the
    controller puts the plan and the whole state in the store before any line; its log lines alone
    would leave a controller elsewhere without what this machine's state held (a finished chunk run
    again, or worse, a running one started twice)."""
    from fleet.config import FleetConfig
    from fleet.generation.multinode.chunks import split_input
    from fleet.generation.multinode.controller import Controller, NodeWork

    root = f"memory://statelog-{uuid.uuid4().hex}"
    Store(root).write_bytes("in.jsonl", b"".join(b'{"id": %d, "prompt": "q"}\n' % i for i in range(2_000)))
    pdir = tmp_path / "plan"
    old = Assignments(pdir, split_input(f"{root}/in.jsonl", pdir, ["a", "b"], chunk_rows=100))
    old.start(0, "a", "/w/a/chunk-00000")
    old.finish(0, "a", "done")
    old.close()
    cfg = FleetConfig(name="t", nodes=[{"name": n, "workdir": str(tmp_path / n)} for n in ("a", "b")],
                      engine={"kind": "sim"}, model={"served_name": "m"})
    ctl = Controller(cfg, pdir, f"{root}/out", {n: NodeWork(n, []) for n in ("a", "b")})
    ctl.prepare(f"{root}/in.jsonl")
    assert ctl.assign is not None
    ctl.assign.start(1, "b", "/w/b/chunk-00001")
    elsewhere = tmp_path / "elsewhere"
    assert journal.pull(Store(f"{root}/out/_control"), elsewhere)
    st = read_state(elsewhere)
    assert st is not None
    assert st["chunks"]["0"]["state"] == "done" and st["chunks"]["1"]["state"] == "running"


def _old_job(tmp_path: Path, root: str) -> tuple[Any, Path]:
    """A job on the store begun before the store kept its state (chunk 0 done), and its controller."""
    from fleet.config import FleetConfig
    from fleet.generation.multinode.chunks import split_input
    from fleet.generation.multinode.controller import Controller, NodeWork

    Store(root).write_bytes("in.jsonl", b"".join(b'{"id": %d, "prompt": "q"}\n' % i for i in range(1_000)))
    pdir = tmp_path / "plan"
    old = Assignments(pdir, split_input(f"{root}/in.jsonl", pdir, ["a", "b"], chunk_rows=100))
    old.start(0, "a", "/w/a/chunk-00000")
    old.finish(0, "a", "done")
    old.close()
    nodes = [{"name": n, "workdir": str(tmp_path / n)} for n in ("a", "b")]
    cfg = FleetConfig.model_validate({"name": "t", "nodes": nodes, "engine": {"kind": "sim"},
                                      "model": {"served_name": "m"}})
    return Controller(cfg, pdir, f"{root}/out", {n: NodeWork(n, []) for n in ("a", "b")}), pdir


def test_a_failed_first_snapshot_put_does_not_forget_the_done_chunks(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first upgraded run of a job begun before the store copy puts its whole state there; if the
    state.json PUT fails (a store hiccup, a kill between two PUTs), the store must not be left holding
    the plan alone: the next run took "plan there" for "state there", replaced the state here with none,
    and every finished chunk ran again (its parts orphaned)."""
    root = f"memory://statelog-{uuid.uuid4().hex}"
    ctl, pdir = _old_job(tmp_path, root)
    real = Store.write_bytes

    def no_snapshot(self: Store, name: str, data: bytes) -> None:
        if name == journal.SNAPSHOT_FILE:
            raise OSError("the store hiccuped")
        real(self, name, data)

    monkeypatch.setattr(journal, "PUT_TRIES", 1)
    monkeypatch.setattr(Store, "write_bytes", no_snapshot)
    with pytest.raises(StoreError):   # the store's OSError, in one line with its remedy (storeerrors.py)
        ctl.prepare(f"{root}/in.jsonl")
    assert ctl.assign is not None
    ctl.assign.close()
    monkeypatch.setattr(Store, "write_bytes", real)
    ctl.prepare(f"{root}/in.jsonl")
    assert ctl.assign is not None and ctl.assign.chunks[0].state == "done"
    elsewhere = tmp_path / "elsewhere"
    assert journal.pull(Store(f"{root}/out/_control"), elsewhere)
    assert read_state(elsewhere)["chunks"]["0"]["state"] == "done"   # type: ignore[index]


def test_a_store_holding_only_the_plan_leaves_the_state_here(tmp_path: Path) -> None:
    """A store with plan.json but no snapshot and no log (left so by an older controller that put the
    plan first, then failed the snapshot's PUT) holds no state: pull must not delete the state here
    (the only record of the finished chunks) nor write an empty log over it."""
    root = f"memory://statelog-{uuid.uuid4().hex}"
    _, pdir = _old_job(tmp_path, root)
    mirror = Store(f"{root}/out/_control")
    mirror.write_bytes(PLAN_FILE, (pdir / PLAN_FILE).read_bytes())
    files = (journal.SNAPSHOT_FILE, journal.LOG_FILE)
    before = {f: (pdir / f).read_bytes() if (pdir / f).exists() else None for f in files}
    assert not journal.pull(mirror, pdir)
    assert {f: (pdir / f).read_bytes() if (pdir / f).exists() else None for f in files} == before
    assert read_state(pdir)["chunks"]["0"]["state"] == "done"   # type: ignore[index]


def test_a_gap_in_the_stored_log_is_refused_not_resumed_from(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A store copy whose log skips changes (a segment lost) must not be resumed from as if whole: the
    changes in the gap (a chunk started, finished) would be forgotten. pull reads again, then raises a
    FatalError with a remedy; a local log with a gap refuses to load too."""
    from fleet.errors import FatalError

    monkeypatch.setattr(journal, "PULL_PAUSE_S", 0.0)
    mirror = Store(f"memory://statelog-{uuid.uuid4().hex}/out/_control")
    pdir = tmp_path / "p"
    plan = _plan(pdir, 5)
    st = Assignments(pdir, plan, mirror)
    for i in range(3):
        st.start(i, "n0", f"/w/n0/chunk-{i:05d}")
    st.close()
    segs = mirror.names("log")
    assert len(segs) == 1
    lines = mirror.read_bytes(f"log/{segs[0]}").splitlines(keepends=True)   # type: ignore[union-attr]
    mirror.write_bytes(f"log/{segs[0]}", lines[0] + b"".join(lines[2:]))
    with pytest.raises(FatalError, match="gap") as exc:
        journal.pull(mirror, tmp_path / "other")
    assert exc.value.remedy
    local = (pdir / journal.LOG_FILE).read_bytes().splitlines(keepends=True)
    (pdir / journal.LOG_FILE).write_bytes(local[0] + b"".join(local[2:]))
    with pytest.raises(FatalError, match="missing"):
        Assignments(pdir, plan)


def test_a_parquet_job_on_the_store_resumes_in_another_plan_dir(tmp_path: Path) -> None:
    """A Parquet input on the store is read in place (row ranges), like a JSONL one: a controller on
    another machine (another plan directory, nothing of the first's disk) pulls the job and resumes it
    with the same chunks and state (the README once said such a job refused to move)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from fleet.generation.multinode.chunks import load_plan, split_input

    root = f"memory://statelog-{uuid.uuid4().hex}"
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(1_000)), "prompt": ["q"] * 1_000}), buf, row_group_size=100)
    Store(root).write_bytes("in.parquet", buf.getvalue())
    mirror = Store(f"{root}/out/_control")
    first = tmp_path / "plan1"
    plan = split_input(f"{root}/in.parquet", first, ["a", "b"], chunk_rows=100)
    assert plan.fmt == "parquet" and all(not c.file for c in plan.chunks)
    st = Assignments(first, plan, mirror)
    st.compact()
    st.start(0, "a", "/w/a/chunk-00000")
    st.finish(0, "a", "done")
    st.start(1, "b", "/w/b/chunk-00001")
    st.close()
    second = tmp_path / "plan2"
    assert journal.pull(mirror, second)
    again = split_input(f"{root}/in.parquet", second, ["a", "b"], chunk_rows=100)   # kept, not refused
    assert again.chunks == plan.chunks and load_plan(second) == again
    st2 = Assignments(second, again, mirror)
    assert st2.chunks[0].state == "done" and st2.chunks[1].state == "running" and st2.chunks[2].state == "pending"


def test_a_gzip_job_staged_on_another_machine_is_refused_before_downloading(tmp_path: Path) -> None:
    """A gzip input on the store is staged and cut on the controller's machine: a controller elsewhere
    cannot resume it. It used to download the whole gzip first, then refuse with a remedy that did not
    apply ("run the same input again"); it must refuse before any download, saying where it can resume
    (the machine that began it) or how to run it anywhere (JSONL or Parquet, read in place)."""
    import gzip

    from fleet.config import FleetConfig
    from fleet.errors import ConfigError
    from fleet.generation.multinode.controller import Controller, NodeWork

    root = f"memory://statelog-{uuid.uuid4().hex}"
    Store(root).write_bytes("p.jsonl.gz", gzip.compress(b"".join(b'{"id": %d, "prompt": "q"}\n' % i
                                                                  for i in range(500))))
    nodes = [{"name": n, "workdir": str(tmp_path / n)} for n in ("a", "b")]
    cfg = FleetConfig.model_validate({"name": "t", "nodes": nodes, "engine": {"kind": "sim"},
                                      "model": {"served_name": "m"}})

    def controller(pdir: Path) -> Controller:
        return Controller(cfg, pdir, f"{root}/out", {n: NodeWork(n, []) for n in ("a", "b")})

    first = controller(tmp_path / "plan1")
    plan = first.prepare(f"{root}/p.jsonl.gz")
    assert first.assign is not None and Path(plan.input).is_file()
    first.assign.close()
    again = controller(tmp_path / "plan1")   # the same machine resumes it
    assert again.prepare(f"{root}/p.jsonl.gz").chunks == plan.chunks
    assert again.assign is not None
    again.assign.close()
    other = controller(tmp_path / "plan2")
    with pytest.raises(ConfigError, match="not on this machine") as exc:
        other.prepare(f"{root}/p.jsonl.gz")
    assert "machine that began it" in (exc.value.remedy or "") and "Parquet" in (exc.value.remedy or "")
    assert not list((tmp_path / "plan2").glob(".source.input/*"))   # nothing downloaded
