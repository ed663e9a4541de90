"""One job over several nodes, the pure parts: the chunk plan, the assignment state, the merge.

Real files, real Parquet shards written by the real ResultStore; no network."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

from fleet.generation.multinode.chunks import (
    Assignments, ControllerLock, Source, load_plan, merge, plan_sizes, split_input,
)
from fleet.generation.data.results import read_errors, read_rejects, shard_paths
from fleet.generation.data.store import ResultStore


def lines_file(path: Path, n: int, *, blank_every: int = 0) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n")
            if blank_every and i % blank_every == 0:
                f.write("\n")
    return path


@pytest.mark.parametrize("total,nodes,chunk_rows", [(1, 2, None), (5000, 2, None), (902_087, 2, None),
                                                    (10_000, 3, 700), (37, 5, 4)])
def test_plan_sizes_cover_every_row_and_shrink_to_the_tail(total: int, nodes: int, chunk_rows: int | None) -> None:
    """The split: every row in exactly one chunk, none above the ceiling, sizes never grow (the tail is small)."""
    sizes = plan_sizes(total, nodes, chunk_rows)
    assert sum(sizes) == total and all(s >= 1 for s in sizes)
    ceiling = chunk_rows or min(20_000, max(100, -(-total // (8 * nodes))))
    assert max(sizes) <= ceiling
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    if total >= 16 * ceiling:
        # the last round is a fraction of the first: a node waits on a shorter chunk at the end (and the
        # claim cuts shorter ones by the nodes' measured rates)
        assert sizes[-1] <= max(1, ceiling // 4) and sizes[-1] < sizes[0]
    assert plan_sizes(total, nodes, chunk_rows) == sizes   # deterministic


def test_split_jsonl_keeps_every_line_and_a_rerun_reads_the_same_plan(tmp_path: Path) -> None:
    """Chunk files concatenated are the input byte for byte (blank lines included, so lines map back);
    a second split of the same input returns the recorded plan; another input into the same job is refused."""
    inp = lines_file(tmp_path / "in.jsonl", 1000, blank_every=97)
    pdir = tmp_path / "plan"
    plan = split_input(inp, pdir, ["a", "b"], chunk_rows=90)
    joined = b"".join((pdir / c.file).read_bytes() for c in plan.chunks)
    assert joined == inp.read_bytes()
    assert [c.first_line for c in plan.chunks] == [1 + sum(c.lines for c in plan.chunks[:i])
                                                    for i in range(len(plan.chunks))]
    again = split_input(inp, pdir, ["a", "b", "c"], chunk_rows=5)
    assert again.chunks == plan.chunks and load_plan(pdir).chunks == plan.chunks
    other = lines_file(tmp_path / "other.jsonl", 10)
    from fleet.errors import ConfigError

    with pytest.raises(ConfigError, match="another --output"):
        split_input(other, pdir, ["a", "b"])


def test_split_gz_with_limit_and_parquet(tmp_path: Path) -> None:
    """A gzip input is cut into plain JSONL chunks; --limit counts rows, not lines; Parquet keeps its schema."""
    raw = lines_file(tmp_path / "in.jsonl", 300, blank_every=50).read_bytes()
    gz = tmp_path / "in.jsonl.gz"
    gz.write_bytes(gzip.compress(raw))
    plan = split_input(gz, tmp_path / "p1", ["a", "b"], chunk_rows=40, limit=120)
    text = b"".join((tmp_path / "p1" / c.file).read_bytes() for c in plan.chunks)
    assert sum(1 for ln in text.splitlines() if ln.strip()) == 120
    assert raw.startswith(text)

    table = pa.table({"id": [f"p{i}" for i in range(500)], "prompt": [f"x{i}" for i in range(500)]})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=64)
    plan = split_input(tmp_path / "in.parquet", tmp_path / "p2", ["a", "b"], chunk_rows=70)
    parts = [pq.read_table(tmp_path / "p2" / c.file) for c in plan.chunks]
    assert pa.concat_tables(parts).equals(table) and plan.fmt == "parquet"


@pytest.mark.parametrize("kind", ["jsonl.gz", "parquet"])
def test_a_larger_or_absent_limit_cuts_the_rest_of_the_input_into_new_chunks(tmp_path: Path, kind: str) -> None:
    """Fault: a multi-node job cut to `--limit 100` kept its plan for a later `--limit 200` or a call
    without one: every chunk done, "nothing to do", 100 of 300 rows. Now the lines after the last chunk
    are cut into new chunks (each line in exactly one chunk), a smaller limit changes nothing, and the
    plan records what it holds so a plan of the whole input is not counted again."""
    if kind == "parquet":
        table = pa.table({"id": [f"p{i}" for i in range(300)], "prompt": [f"x{i}" for i in range(300)]})
        inp = tmp_path / "in.parquet"
        pq.write_table(table, inp, row_group_size=64)

        def rows(plan_chunks: list) -> list[str]:
            return [i for c in plan_chunks for i in pq.read_table(pdir / c.file).column("id").to_pylist()]
        want = table.column("id").to_pylist()
    else:
        raw = lines_file(tmp_path / "in.jsonl", 300, blank_every=50).read_bytes()
        inp = tmp_path / "in.jsonl.gz"
        inp.write_bytes(gzip.compress(raw))

        def rows(plan_chunks: list) -> list[str]:
            return [json.loads(ln)["id"] for c in plan_chunks for ln in (pdir / c.file).read_bytes().splitlines()
                    if ln.strip()]
        want = [f"r{i}" for i in range(300)]
    pdir = tmp_path / "plan"
    first = split_input(inp, pdir, ["a", "b"], chunk_rows=40, limit=100)
    assert rows(first.chunks) == want[:100] and not first.whole_input
    n_first = len(first.chunks)
    assert split_input(inp, pdir, ["a", "b"], limit=50).chunks == first.chunks      # covered: nothing new
    grown = split_input(inp, pdir, ["a", "b"], limit=200)
    assert grown.chunks[:n_first] == first.chunks                                   # cut chunks never change
    assert rows(grown.chunks) == want[:200] and grown.limit == 200 and grown.rows == 200
    whole = split_input(inp, pdir, ["a", "b"])
    assert rows(whole.chunks) == want and whole.whole_input
    assert load_plan(pdir).chunks == whole.chunks and load_plan(pdir).total_lines == whole.total_lines
    if kind != "parquet":
        assert b"".join((pdir / c.file).read_bytes() for c in whole.chunks) == raw  # byte for byte, blanks too
    assert split_input(inp, pdir, ["a", "b"], limit=1000).chunks == whole.chunks    # the input ended: done


def test_an_input_that_ended_at_its_limit_gets_no_chunk_of_blank_lines(tmp_path: Path) -> None:
    """Fault guarded: an input of exactly N rows and trailing blank lines, cut to `--limit N`, then run
    without a limit, would get a last chunk of blank lines only (a runner that fails "no valid row").
    Now the plan records that it holds every row and cuts nothing more."""
    inp = lines_file(tmp_path / "in.jsonl", 100)
    with inp.open("a") as f:
        f.write("\n\n")
    pdir = tmp_path / "plan"
    first = split_input(inp, pdir, ["a", "b"], chunk_rows=40, limit=100)
    whole = split_input(inp, pdir, ["a", "b"])
    assert whole.chunks == first.chunks and whole.whole_input and whole.rows == 100


def test_assignments_pull_lose_rejoin_and_survive_a_new_controller(tmp_path: Path) -> None:
    """Pull order, a lost node's running chunk going back to the queue (its attempt kept), rejoin, and the
    state read back by a new controller (the old one killed): it re-attaches to the same running attempt."""
    inp = lines_file(tmp_path / "in.jsonl", 100)
    plan = split_input(inp, tmp_path / "p", ["a", "b"], chunk_rows=30)
    st = Assignments(tmp_path / "p", plan)
    assert st.claim("a") == 0
    st.start(0, "a", "/o/a/c0")
    assert st.claim("b") == 1 and st.claim("a") == 0     # a node's own running chunk first
    st.start(1, "b", "/o/b/c1")
    st.finish(0, "a", "done", fetched=True)
    assert st.claim("a") == 2
    st.start(2, "a", "/o/a/c2")
    assert st.node_lost("b", "no answer") == [1]
    assert st.claim("b") is None                          # a lost node claims nothing
    assert st.claim("a") == 2
    # a killed controller: the next one reads the same state
    st2 = Assignments(tmp_path / "p", plan)
    assert st2.chunks[1].state == "pending" and st2.chunks[1].attempts[0].outcome == "lost"
    assert st2.claim("a") == 2
    att, new = st2.start(2, "a", "/o/a/c2")
    assert not new and att.output == "/o/a/c2"            # re-attach, not a second attempt
    st2.node_ok("b")
    assert st2.claim("b") == 1                            # rejoined: takes the released chunk
    assert any(e["event"] == "node-rejoined" for e in st2.events)


def test_one_controller_per_job(tmp_path: Path) -> None:
    """A second controller on the same job is refused while the first holds it (two would double-assign)."""
    from fleet.errors import FatalError

    with ControllerLock(tmp_path):
        with pytest.raises(FatalError, match="another controller"):
            with ControllerLock(tmp_path):
                pass
    with ControllerLock(tmp_path):   # released on exit
        pass


def _store(d: Path, ids: list[str], *, errors: list[str] = (), reject_line: int | None = None) -> None:
    from fleet.generation.data.rows import Reject

    s = ResultStore(d, shard_rows=3)
    for i in ids:
        s.add_result({"id": i, "completion": f"answer {i}", "completion_tokens": 2, "prompt_tokens": 1})
    for e in errors:
        s.add_error(e, error="boom", attempts=6, line=1)
    if reject_line is not None:
        s.add_reject(Reject(line=reject_line, id=None, reason="not JSON", raw="{x"))
    s.close()


def test_merge_first_wins_and_every_id_once(tmp_path: Path) -> None:
    """The merge rule: a chunk re-run after a node loss (and the lost node's runner that finished anyway)
    gives duplicate ids; the merge keeps the first, drops the rest, drops an error for an id completed
    elsewhere, maps rejects' lines back to the input, and `fleet export` reads the result unchanged."""
    inp = lines_file(tmp_path / "in.jsonl", 20)
    plan = split_input(inp, tmp_path / "p", ["a", "b"], chunk_rows=10)
    c0, c1 = plan.chunks[0], plan.chunks[1]
    _store(tmp_path / "a0", [f"r{i}" for i in range(c0.lines)], reject_line=2)
    # chunk 1 finished on b; a had done part of it (then was lost) and errored r19 there
    done_b = [f"r{i}" for i in range(c0.lines, 20)]
    _store(tmp_path / "b1", done_b)
    _store(tmp_path / "a1", done_b[:4], errors=["r19"])
    srcs = [Source(c0, "a", tmp_path / "a0"), Source(c1, "b", tmp_path / "b1"), Source(c1, "a", tmp_path / "a1")]
    m = merge(srcs, tmp_path / "out")
    ids = [i for p in shard_paths(tmp_path / "out") for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(20)) and len(ids) == len(set(ids))
    assert m["merge"]["duplicates_dropped"] == 4
    assert list(read_errors(tmp_path / "out")) == []      # r19 completed on b: the error is dropped
    rej = list(read_rejects(tmp_path / "out"))
    assert [r["line"] for r in rej] == [2]
    assert m["counts"] == {"completed": 20, "errors": 0, "rejects": 1, "quality_rejects": 0,
                           "shards": m["counts"]["shards"]}
    from fleet.generation.data.export import export

    assert export(tmp_path / "out", "jsonl", tmp_path / "x.jsonl").rows == 20


def test_chunk_rows_follow_the_measured_rate_and_shrink_to_the_tail() -> None:
    """The pure sizing rule (issue 14: a chunk is a few minutes of work at the node's measured rate):
    unknown rate -> the plan's cut stands; early -> target_s of work; at the end -> the node's share of
    half of what is left, so both nodes' last chunks take about the same time; never below min_s of work."""
    from fleet.generation.multinode.chunks import CHUNK_TARGET_S, chunk_rows_for

    rates = {"fast": 20.0, "slow": 10.0}
    assert chunk_rows_for(None, rates, 10_000) is None and chunk_rows_for(0.0, rates, 10_000) is None
    assert chunk_rows_for(20.0, rates, 1_000_000) == int(20 * CHUNK_TARGET_S)     # minutes of work, not rows
    assert chunk_rows_for(10.0, rates, 1_000_000) == int(10 * CHUNK_TARGET_S)
    fast, slow = chunk_rows_for(20.0, rates, 3000), chunk_rows_for(10.0, rates, 3000)
    assert (fast, slow) == (1000, 500) and fast / 20.0 == slow / 10.0             # the tail: equal time
    assert chunk_rows_for(20.0, rates, 200) == 200                                # min_s of work, capped by what is left
    assert chunk_rows_for(20.0, {"fast": 20.0}, 4000) == 2000                     # alone: half of what is left


def test_a_slow_node_leaves_the_last_chunk_to_a_faster_one_that_would_end_it_sooner() -> None:
    from fleet.generation.multinode.chunks import finishes_first

    assert finishes_first(100, None, [(0.0, 20.0)])                       # no rate yet: take it
    assert finishes_first(100, 10.0, [(60.0, 20.0)])                      # fast busy for a minute: 10 s < 65 s
    assert not finishes_first(100, 10.0, [(2.0, 20.0)])                   # fast free in 2 s: 7 s < 10 s
    assert finishes_first(100, 20.0, [(0.0, 10.0)])                       # only faster nodes count
    # asked early, while its own chunk drains: its rest counts too (3 + 10 s > 2 + 5 + 5 s)
    assert finishes_first(100, 10.0, [(7.0, 20.0)]) and not finishes_first(100, 10.0, [(7.0, 20.0)], 3.0)


def test_a_node_rate_counts_overlapping_chunks_busy_time_once() -> None:
    """A chunk started early overlaps the one draining: summing their spans counted the overlap twice
    (a fast node of short chunks measured at half its rate). The busy time is the spans' union."""
    from fleet.generation.multinode.chunks import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 10.0), (8.0, 20.0), (18.0, 25.0)]) == 25.0     # each started 2 s early
    assert busy_seconds([(30.0, 35.0), (0.0, 10.0), (2.0, 5.0)]) == 15.0      # a gap, one span inside another


def test_claim_cuts_a_chunk_to_the_wanted_size_and_keeps_every_line(tmp_path: Path) -> None:
    """A first-time chunk longer than a node's wanted size is cut: the head is claimed, the rest stays
    pending at the end of the plan (in input order for the merge); files and plan.json agree; a new
    controller reads the cut plan; a chunk with attempts is never cut."""
    inp = lines_file(tmp_path / "in.jsonl", 1000, blank_every=97)
    pdir = tmp_path / "p"
    plan = split_input(inp, pdir, ["a", "b"], chunk_rows=400)
    n0, first = len(plan.chunks), plan.chunks[0].lines
    st = Assignments(pdir, plan)
    assert st.claim("a", lambda i: f"/o/{i}", rows=150) == 0
    assert plan.chunks[0].lines == 150 and plan.chunks[-1].index == n0
    assert plan.chunks[-1].first_line == 151 and st.chunks[n0].state == "pending"
    assert st.pending()[0] == n0                                           # input order: the rest comes next
    assert st.claim("b", lambda i: f"/o/{i}", rows=10_000) == n0           # longer than the rest: taken whole
    by_line = sorted(load_plan(pdir).chunks, key=lambda c: c.first_line)
    assert b"".join((pdir / c.file).read_bytes() for c in by_line) == inp.read_bytes()
    assert [c.first_line for c in by_line] == [1 + sum(c.lines for c in by_line[:i]) for i in range(len(by_line))]
    st.finish(n0, "b", "lost", "gone")                                     # now it has an attempt ...
    assert st.claim("a", another=True, rows=5) == n0 and load_plan(pdir).chunks[n0].lines == first - 150
    assert [c.index for c, _ in Assignments(pdir, load_plan(pdir)).sources()][:2] == [0, n0]
    assert any(e["event"] == "cut" for e in st.events)
    nxt = st.pending()[0]
    lines = load_plan(pdir).chunks[nxt].lines
    rows = lines * 2 // 3   # the rest (a third) is more than a quarter of rows: cut, unless below min_rest
    assert st.claim("b", another=True, rows=rows, min_rest=lines - rows) == nxt
    assert load_plan(pdir).chunks[nxt].lines == lines                          # taken whole: not cut


def test_the_next_chunk_starts_a_runner_start_before_the_current_one_ends() -> None:
    """`_draining`: the next chunk's runner is started once what is left of the running chunk is in flight
    or would be sent within PRESTART_LEAD_S at its rate, so the servers stay busy across runner starts."""
    from fleet.generation.multinode.controller import PRESTART_LEAD_S, _draining

    rate = 10.0
    lead = int(rate * PRESTART_LEAD_S)
    assert not _draining({"state": "running", "rows_total": 1000, "rows_done": 1000 - lead - 9, "in_flight": 8,
                          "rows_per_s": rate})
    assert _draining({"state": "running", "rows_total": 1000, "rows_done": 1000 - lead - 8, "in_flight": 8,
                      "rows_per_s": rate})
    assert _draining({"state": "running", "rows_total": 1000, "rows_done": 992, "in_flight": 8})  # no rate yet
    assert not _draining({"state": "done", "rows_total": 1000, "rows_done": 1000})   # ended: run_chunk's turn
    assert not _draining({"state": "running", "rows_done": 5})                       # total not known yet


def test_a_slow_node_asks_again_for_its_early_next_chunk_while_it_drains(tmp_path: Path) -> None:
    """The early start of a slow node's next chunk is refused while a faster node would end that chunk
    sooner; `_prestart` then says so (False: asked again at the next poll) and claims nothing. Asked
    only once, the slow node's next chunk waited for its runner's exit and a whole runner start.
    A faster node's chunk started early counts to its busy time: seen free the moment it started
    its next chunk, it took every chunk from the slow node, which idled."""
    from fleet.config import FleetConfig
    from fleet.generation.multinode.controller import Controller, NodeWork
    from fleet.node import LocalNode

    cfg = FleetConfig(name="t", engine={"kind": "sim"}, model={"served_name": "m"},
                      nodes=[{"name": n, "workdir": str(tmp_path / n), "servers": 1} for n in ("fast", "slow")],
                      generation={"chunk_rows": 100})

    def measured(keep: int, tag: str) -> tuple[Controller, list[int]]:
        """1,000 rows in chunks of 100 (tapering at the end), fast measured at 20 rows/s and slow at 10,
        every chunk done but the first `keep` pending ones: the job's tail."""
        ctl = Controller(cfg, tmp_path / f"plan-{tag}", str(tmp_path / f"out-{tag}"),
                         {n: NodeWork(n, []) for n in ("fast", "slow")})
        ctl.prepare(str(lines_file(tmp_path / f"in-{tag}.jsonl", 1000)))
        assert ctl.assign is not None
        done = [(0, "fast"), (1, "slow")]
        done += [(i, "fast") for i in ctl.assign.pending()[2 + keep:]]
        clock = {"fast": 0.0, "slow": 0.0}   # each node's chunks one after another, not overlapping
        for idx, node in done:
            att, _ = ctl.assign.start(idx, node, f"/o/{node}/{idx}")
            ctl.assign.finish(idx, node, "done", fetched=True)
            secs = ctl.chunk(idx).lines / (20.0 if node == "fast" else 10.0)
            att.started_at -= 1000 - clock[node]
            att.ended_at = att.started_at + secs
            if att.mono:   # durations: the monotonic clock
                att.mono = [att.mono[0] - 1000 + clock[node], att.mono[0] - 1000 + clock[node] + secs]
            clock[node] += secs
        return ctl, ctl.assign.pending()

    # one chunk pending: fast is free now and ends it in 5 s, slow in 10 s -> slow leaves it
    ctl, pending = measured(1, "tail")
    assert ctl.assign is not None and len(pending) == 1 and ctl.chunk(pending[0]).lines == 100
    assert ctl.next_size("slow")[1] is False
    assert ctl._prestart(LocalNode("slow"), "slow") is False
    assert ctl.assign.pending() == pending and not ctl.assign.running_on("slow")
    # three pending: fast drains its chunk (10 rows left: 0.5 s) and has started the next one early
    # (100 rows: 5 s): it would end the third in 10.5 s, slow in 10 s -> slow takes it
    ctl, pending = measured(3, "busy")
    assert ctl.assign is not None and len(pending) == 3 and ctl.chunk(pending[2]).lines == 100
    cur, early = pending[0], pending[1]
    ctl.assign.start(cur, "fast", f"/o/fast/{cur}")
    ctl.assign.start(early, "fast", f"/o/fast/{early}")
    ctl.nodes["fast"].chunk, ctl.nodes["fast"].progress = cur, {"rows_total": 100, "rows_done": 90}
    assert ctl._free_in("fast", 20.0) == 5.5
    assert ctl.next_size("slow")[1] is True
    # nothing left to claim: decided, the caller stops asking
    for i in ctl.assign.pending():
        ctl.assign.start(i, "fast", f"/o/fast/{i}")
    assert ctl._prestart(LocalNode("slow"), "slow") is True


def _progress(pid: int, t: float, rows: int, servers_up: int = 1) -> dict[str, object]:
    return {"pid": pid, "updated_at": t, "rows_done": rows, "servers": [{}], "servers_up": servers_up}


def test_a_runner_slow_to_start_is_not_a_lost_node_but_one_that_never_starts_is() -> None:
    """Fault (a fresh-clone CI run): at the suite's busiest minute a chunk's runner took over 20 s
    to write its first progress (Python's imports, its first reads), and the controller called its
    node lost (node_lost_s 20) though the runner was alive and about to start. Before its own first
    progress a runner gets runner_start_s; a file an earlier runner left (another pid) does not
    count as a start; once started, node_lost_s without a change is a stall."""
    from fleet.generation.multinode.controller import RunnerLiveness

    live = RunnerLiveness(pid=7, lost_s=20.0, start_s=300.0, since=0.0)
    live.saw(1.0, None)                              # nothing written yet
    live.saw(5.0, _progress(6, 1234.0, 40))          # an earlier attempt's runner's file
    assert live.lost(45.0) is None                   # 45 s without a word: still starting
    assert "within 301 s of its start" in (live.lost(301.0) or "")
    live.saw(60.0, _progress(7, 1300.0, 0))         # its first progress
    assert live.lost(79.0) is None
    live.saw(79.0, _progress(7, 1319.0, 0))          # rewritten (a tick, no row yet): moving
    assert live.lost(98.0) is None
    assert "did not change for 21 s" in (live.lost(100.0) or "")


def test_a_started_runner_with_no_server_up_is_lost_after_node_lost_s() -> None:
    """A runner that keeps writing progress while none of its servers is up is lost after
    node_lost_s (its chunk is better off on another node), however lively its file."""
    from fleet.generation.multinode.controller import RunnerLiveness

    live = RunnerLiveness(pid=7, lost_s=20.0, start_s=300.0, since=0.0)
    for t in range(0, 21, 2):
        live.saw(float(t), _progress(7, 1000.0 + t, 10, servers_up=0))
    assert live.lost(20.0) is None
    live.saw(22.0, _progress(7, 1022.0, 10, servers_up=0))
    assert "none of its servers was up for 22 s" in (live.lost(22.0) or "")
    live.saw(23.0, _progress(7, 1023.0, 11, servers_up=1))
    assert live.lost(23.0) is None

def _plain_indexes(st: Assignments) -> tuple[list[int], int, dict[str, list[int]], dict[str, tuple[int, float]]]:
    """What the kept indexes must equal, computed the plain way from every chunk (as each question did
    before they were kept change by change): the pending chunks in input order and their lines, each
    node's running chunks, each node's finished lines and busy seconds."""
    from fleet.generation.multinode.chunks import attempt_spans, busy_seconds

    pending = sorted((i for i, c in st.chunks.items() if c.state == "pending"), key=lambda i: st.plan.chunks[i].first_line)
    running: dict[str, list[int]] = {}
    done: dict[str, tuple[int, list[Any]]] = {}
    for i, c in st.chunks.items():
        if c.state == "running" and c.node is not None:
            running.setdefault(c.node, []).append(i)
        for a in c.attempts:
            if a.outcome == "done" and a.ended_at:
                rows, atts = done.get(a.node, (0, []))
                done[a.node] = (rows + st.plan.chunks[i].lines, atts + [a])
    finished = {n: (rows, busy_seconds(attempt_spans(atts))) for n, (rows, atts) in done.items()}
    return pending, sum(st.plan.chunks[i].lines for i in pending), running, finished


def _same_as_a_scan(st: Assignments) -> None:
    pending, rows, running, finished = _plain_indexes(st)
    assert st.pending() == pending and st.rows_pending() == rows
    assert st.first_pending() == (pending[0] if pending else None)
    for name in _NODES:
        assert st.running_on(name) == running.get(name, [])
        assert st.finished_on(name) == finished.get(name, (0, 0.0))


_NODES = ("a", "b", "c")
_OPS = st_.lists(st_.tuples(st_.sampled_from(["claim", "cut", "done", "failed", "lost", "node-lost", "node-ok",
                                               "fetched"]),
                            st_.sampled_from(_NODES), st_.integers(1, 60)), max_size=40)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_the_kept_indexes_answer_as_a_scan_of_every_chunk(ops: list[tuple[str, str, int]]) -> None:
    """The pending chunks in input order, their lines, each node's running chunks and its finished lines
    and busy time are kept change by change (`Assignments._index`): rebuilt from every chunk at the first
    question after each change, they made a decision O(chunks) (2.1 ms at 300 nodes, the scale bench's
    sixth limit). After any sequence of claims, cuts, ends (done, failed, lost), node losses and
    rejoins, and in a new controller reading the state back, they must equal the plain scan."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fleet-idx-") as tmp:
        pdir = Path(tmp) / "p"
        plan = split_input(lines_file(Path(tmp) / "in.jsonl", 300, blank_every=41), pdir, list(_NODES),
                           chunk_rows=40)
        st = Assignments(pdir, plan)
        for op, node, n in ops:
            mine = st.running_on(node)
            if op in ("claim", "cut"):
                st.claim(node, lambda i: f"/o/{node}/{i}", another=True, rows=n if op == "cut" else None)
            elif op in ("done", "failed", "lost") and mine:
                st.finish(mine[n % len(mine)], node, op, fetched=True)
            elif op == "node-lost":
                st.node_lost(node, "test")
            elif op == "node-ok":
                st.node_ok(node)
            elif op == "fetched" and mine:
                st.mark_fetched(mine[0], f"/o/{node}/{mine[0]}")
            _same_as_a_scan(st)
        st.close()
        again = Assignments(pdir, load_plan(pdir))   # a new controller: the indexes built from what it reads
        _same_as_a_scan(again)
        assert again.pending() == st.pending()
        again.close()
