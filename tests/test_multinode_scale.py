"""The controller over 20 fake nodes: bench/bench_controller_scale.py, small, counting only.

The controller's real code (a node_loop thread per node, run_chunk per attempt, the cuts, the
prestarts, state.json) drives fake nodes at the seam (connect/start_job) on a compressed clock,
some of them lost for a while mid-job. Nothing here asserts a speed or a ratio: only counts that
hold however slowly this machine runs (a thread starved past node_lost_s is a node loss more,
which the controller must survive the same way).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_controller_scale import run  # noqa: E402


def _args(**kw: object) -> argparse.Namespace:
    base = dict(nodes=20, rows=20_000, speed=25.0, losses=0.2, node_lost_s=60.0, probe_s=10.0, poll_s=1.0,
                seed=5, max_wall_s=240.0, uncached=False, whole_state=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_controller_twenty_fake_nodes_every_chunk_done_once_with_losses() -> None:
    """Twenty nodes of 7-8 servers, five of them lost for 60-300 s mid-job: the job ends (no stop
    on the wall-clock deadline, no chunk failed three times), every chunk is done by exactly one
    attempt, and the task runs are one per node plus one per chunk attempt (the Prefect count the
    README's scale section quotes)."""
    r = run(_args())
    assert r["errors"] == []
    assert r["losses"] == 5
    assert r["chunks_done"] == r["chunks"] == r["chunks_done_once"]
    assert r["task_runs"] >= r["nodes"] + r["chunks"]
    assert r["start_jobs"] >= r["chunks"]


def test_a_running_chunk_costs_its_node_one_round_trip_a_poll() -> None:
    """The controller looks at each running chunk's runner every poll_s (1 s): its progress and whether
    its process lives. That was two commands (a `cat` and a pid check), most of the controller's CPU
    on a real SSH seam at 100 nodes (each exec round trip ≈ 2-3 ms of the controller's CPU); now one
    (`Node.watch`: the state and the file in one command)."""
    r = run(_args(losses=0.0, seed=4))
    assert r["errors"] == []
    ops = r["op_counts"]
    assert ops.get("watch", 0) > r["chunks"]   # every chunk watched, most for many polls
    assert ops.get("is_alive", 0) + ops.get("read_text", 0) < ops["watch"], ops


def test_a_running_chunk_is_looked_at_often_near_its_start_and_end_and_rarely_in_between() -> None:
    """Cost: at 100 nodes over a real SSH seam, looking at every running chunk every second was two thirds
    of the controller's round trips. Now the wait between looks is poll_s until the first progress and
    near the end, a tenth of the time left (at most LOOK_MAX_S) in between, and never past the moment
    the drain (which starts the next chunk) begins."""
    from fleet.generation.multinode.nodework import LOOK_MAX_S, PRESTART_LEAD_S, _draining, look_every

    def prog(done: int, total: int = 3000, rate: float = 10.0, in_flight: int = 64) -> dict[str, object]:
        return {"state": "running", "rows_total": total, "rows_done": done, "rows_per_s": rate, "in_flight": in_flight}

    assert look_every(1.0, None) == 1.0                                   # no progress yet: its start
    assert look_every(1.0, {"state": "done"}) == 1.0
    assert look_every(1.0, prog(0)) == LOOK_MAX_S                         # 300 s left: the longest wait
    assert look_every(1.0, prog(2700)) == pytest.approx(3.0)             # 30 s left: a tenth of it
    assert look_every(1.0, prog(2990, in_flight=10)) == 1.0               # in its drain: every poll
    assert look_every(1.0, prog(0, rate=0.0)) == 1.0                      # no rate yet
    # all of it in flight from its start (more slots than rows): it drains at once, and once the next
    # chunk is started nothing waits on the drain — a tenth of the time left, at most LOOK_MAX_S
    assert look_every(1.0, prog(0, total=300, in_flight=300)) == 1.0
    assert look_every(1.0, prog(0, total=300, in_flight=300), next_started=True) == pytest.approx(3.0)
    assert look_every(1.0, prog(290, total=300, in_flight=10), next_started=True) == 1.0   # its end
    # never past the drain's start: the look after the wait still sees the chunk before it drains, or at it
    for done in range(0, 3000, 7):
        p = prog(done)
        wait = look_every(1.0, p)
        later = prog(min(3000, done + int(wait * 10)))
        before_drain = (3000 - done - 64) / 10.0 - PRESTART_LEAD_S
        assert wait <= max(1.0, before_drain) + 1e-9 and (wait == 1.0 or not _draining(p)), (done, wait, later)


def test_controller_scans_state_once_per_change_not_per_node_per_decision() -> None:
    """The first limit the scale bench found: every decision (next_size, min_rest) asked each
    node's rate, and each answer scanned every chunk's attempts — O(nodes × chunks) per decision,
    seconds per decision at 1,000 nodes. Then one scan of every chunk per change of the state (the
    sixth limit once most decisions followed a change: 2.1 ms per decision at 300 nodes). Now a node's
    rate comes from its own chunks, computed again only after a change that touched it: once per node
    at its first question, then at most once per node a write touched (one; two for a chunk run again
    after a node starved past node_lost_s on a loaded machine), however many questions were asked (a
    computation per question: as many as the questions, ≈ 5 times the writes here)."""
    r = run(_args(losses=0.0, seed=3))
    assert r["errors"] == []
    assert r["rate_scans"] < r["rate_questions"]
    assert r["rate_scans"] <= 2 * r["state_writes"] + r["nodes"]


def _rate_evaluations(nodes: int, tmp: Path, decisions: int = 30) -> int:
    """Node rates evaluated over `decisions` decisions at `nodes` nodes mid-job: each node has finished a
    chunk and runs one; before each decision one node's progress moves and one chunk ends."""
    from fleet.config import FleetConfig
    from fleet.generation.multinode.controller import Controller, NodeWork

    names = [f"n{i:04d}" for i in range(nodes)]
    tmp.mkdir()
    src = tmp / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": "q"}}\n' for i in range(nodes * 40)))
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, model={"served_name": "m"},
                      nodes=[{"name": n, "workdir": str(tmp / n)} for n in names], generation={"chunk_rows": 10})
    ctl = Controller(cfg, tmp / "plan", str(tmp / "out"), {n: NodeWork(n, []) for n in names})
    plan = ctl.prepare(str(src))
    assert ctl.assign is not None
    chunks = iter(plan.chunks)
    for k, name in enumerate(names):
        done, run = next(chunks), next(chunks)
        att, _ = ctl.assign.start(done.index, name, f"/o/{done.name}")
        ctl.assign.finish(done.index, name, "done", fetched=True)
        att.mono, att.ended_at = [0.0, 1.0 + k % 7], att.started_at + 1.0 + k % 7   # rates 1.4-10 rows/s
        ctl.assign.start(run.index, name, f"/o/{run.name}")
        ctl.nodes[name].chunk, ctl.nodes[name].progress = run.index, {"rows_total": run.lines, "rows_done": 1}
    ctl.next_size(names[0])   # the first question evaluates every node once
    evals = 0
    real = ctl.node_rate

    def counted(name: str) -> float | None:
        nonlocal evals
        evals += 1
        return real(name)

    ctl.node_rate = counted   # type: ignore[method-assign]
    for d in range(decisions):
        name = names[d % nodes]
        ctl.nodes[name].progress = {"rows_total": 10, "rows_done": 2 + d % 8}
        ended = ctl.assign.running_on(names[(d * 7 + 3) % nodes])[0]
        ctl.assign.finish(ended, names[(d * 7 + 3) % nodes], "done", fetched=True)
        ctl.next_size(name)
        ctl.min_rest()
    return evals


def test_controller_decision_evaluates_changed_nodes_only_not_every_node(tmp_path: Path) -> None:
    """The fourth limit the scale bench found (at 1,000 nodes, 37 ms of CPU per decision, the
    controller CPU-bound at a tenth of the job): every decision (next_size, min_rest) evaluated every
    node's rate and rows left, O(nodes) per decision. Now only the nodes a change touched or whose
    progress moved since the last decision are evaluated again: the count per decision is the same
    at 100 nodes as at 1,000, and a few per decision, not hundreds."""
    small = _rate_evaluations(100, tmp_path / "small")
    large = _rate_evaluations(1000, tmp_path / "large")
    assert small == large
    assert large <= 3 * 30


class _Ticks:
    """A poll clock the test moves: a wait of `timeout` s ends after that many seconds of ticks, or at once
    when its event is set. `seen`/`waiting` let the test know the node has taken in each tick."""

    def __init__(self, stop: Any) -> None:
        self.cond = threading.Condition()
        self.now, self.seen, self.waiting, self.stop = 0.0, -1.0, 0, stop

    def wait(self, ev: threading.Event, timeout: float | None) -> bool:
        with self.cond:
            end = self.now + (timeout if timeout is not None else float("inf"))
            self.waiting += 1
            try:
                while not (ev.is_set() or self.stop.is_set()) and self.now < end - 1e-9:
                    self.seen = self.now
                    self.cond.wait(0.01)   # an event set elsewhere does not notify this condition
                return ev.is_set()
            finally:
                self.waiting -= 1

    def tick(self, s: float) -> None:
        with self.cond:
            self.now += s
            self.cond.notify_all()

    def settled(self) -> bool:
        with self.cond:
            return self.waiting == 1 and self.seen == self.now


def _until(cond: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_an_idle_node_asks_again_only_when_something_it_waits_on_changes(tmp_path: Path) -> None:
    """The 1,000-node bench's next limit: an idle node (nothing pending, or a faster node would end the
    next chunk sooner) asked for work at every poll whether or not anything had changed: 572,860
    decisions in 500 s, the controller CPU-bound. Now it asks again at the first change that concerns it
    (here a chunk handed back to the queue: claimed at once, with no poll in between) or when its
    back-off ends (doubled from poll_s up to idle_max_s: never an unbounded wait). Counted in polls of a
    clock the test moves, not in time: over 40 polls with 40 changes that do not concern it (another
    node's chunks ending), it asks a handful of times, not at every poll."""
    from fleet.config import FleetConfig
    from fleet.generation.multinode.controller import Controller, NodeWork

    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": "q"}}\n' for i in range(600)))
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, model={"served_name": "m"},
                      nodes=[{"name": n, "workdir": str(tmp_path / n)} for n in ("a", "b")],
                      generation={"chunk_rows": 10})
    ctl = Controller(cfg, tmp_path / "plan", str(tmp_path / "out"), {n: NodeWork(n, []) for n in ("a", "b")},
                     poll_s=1.0)
    ctl.idle_max_s = 8.0
    plan = ctl.prepare(str(src))
    assert ctl.assign is not None and len(plan.chunks) > 45
    for c in plan.chunks:   # node a holds every chunk: b has nothing to do
        ctl.assign.start(c.index, "a", f"/o/a/{c.name}")
    stop = threading.Event()
    ticks = _Ticks(stop)

    class Stop(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            return ticks.wait(self, timeout)

    ctl._stop = stop = Stop()   # type: ignore[assignment]
    ticks.stop = stop
    ctl._wait = ticks.wait   # type: ignore[method-assign]   (the waits of the code before: ctl._stop's)
    asked = [0]
    ran: list[int] = []
    for obj, name in ((ctl, "next_size"), (ctl.assign, "claim")):
        real = getattr(obj, name)

        def counted(node: str, *a: Any, _real: Any = real, **kw: Any) -> Any:
            asked[0] += node == "b"
            return _real(node, *a, **kw)

        setattr(obj, name, counted)

    def run_chunk(name: str, index: int) -> dict[str, Any]:
        ran.append(index)
        assert ctl.assign is not None
        ctl.assign.finish(index, name, "done", fetched=True)
        return {"chunk": index, "state": "done"}

    t = threading.Thread(target=ctl.node_loop, args=("b", run_chunk), daemon=True)
    t.start()
    try:
        _until(ticks.settled, "node b waiting")
        before = asked[0]
        for i in range(40):   # a's chunks end one by one: nothing b waits on
            ctl.assign.finish(plan.chunks[i].index, "a", "done", fetched=True)
            ticks.tick(ctl.poll_s)
            _until(ticks.settled, f"node b taking in poll {i + 1}")
        polls = asked[0] - before
        assert 2 <= polls <= 2 * 8, polls   # the code before: 2 per poll (next_size and claim), 80 here
        back = plan.chunks[45].index
        ctl.assign.finish(back, "a", "failed", "its runner died")   # handed back: b takes it, no poll needed
        _until(lambda: ran == [back], "node b claiming the chunk handed back")
        assert ticks.now == 40 * ctl.poll_s
    finally:
        ctl.stop()
        t.join(timeout=30)
    assert not t.is_alive()


def test_a_node_waiting_on_a_faster_one_is_woken_by_that_node_not_by_others(tmp_path: Path) -> None:
    """What wakes a node told to wait (`Assignments.watch`): a change of the faster node it left the chunk
    to (here: it claims the chunk), a chunk handed back to the queue, the job's end — not the changes of
    every other node (at 1,000 nodes, hundreds a minute: each would be a decision of every idle node)."""
    from fleet.generation.multinode.chunks import Assignments, split_input

    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": "q"}}\n' for i in range(60)))
    pdir = tmp_path / "p"
    st = Assignments(pdir, split_input(src, pdir, ["slow", "fast", "other"], chunk_rows=10))
    slow, free = threading.Event(), threading.Event()
    st.watch("slow", slow, frozenset({"fast"}))
    st.watch("idle", free, frozenset())
    i = st.claim("other", lambda i: f"/o/other/{i}")
    assert i is not None
    st.finish(i, "other", "done", fetched=True)
    st.node_ok("other")
    assert not slow.is_set() and not free.is_set()
    j = st.claim("fast", lambda i: f"/o/fast/{i}")
    assert j is not None and slow.is_set() and not free.is_set()
    st.finish(j, "fast", "lost", "no answer")   # handed back: every waiting node may take it
    assert free.is_set()
    st.unwatch("idle")
    assert "idle" not in st._watchers


def test_a_slow_node_takes_a_chunk_while_more_is_pending_than_the_faster_nodes_end_first() -> None:
    """The tail rule left a chunk to a faster node whenever that node would end this one chunk sooner —
    at 1,000 nodes nearly always true, so most nodes were told to wait while thousands of chunks were
    pending (the device bench at 1,000 nodes, speed 1: 53 % of the capacity unused while chunks
    waited; 196,000 of 213,000 decisions said "wait"). Now a node waits only when the faster nodes would
    end all the pending work before it ends its chunk: mid-job it takes, in the tail it still leaves the
    last chunks to the faster nodes."""
    from fleet.generation.multinode.chunks import finishes_first
    from fleet.generation.multinode.controller import RateView

    fast = [(0.0, 10.0)] * 10   # ten nodes of 10 rows/s, free now; the one asking does 5 rows/s
    assert not finishes_first(100, 5.0, fast)                           # one chunk alone: a fast node ends it first
    assert finishes_first(100, 5.0, fast, pending_rows=100_000)         # mid-job: far more than they end in 20 s
    assert not finishes_first(100, 5.0, fast, pending_rows=1_000)       # the tail: 10 chunks, they end 10 first
    assert finishes_first(100, 5.0, fast, pending_rows=1_100)           # 11 chunks: the eleventh would wait for them
    v = RateView([f"f{i}" for i in range(10)] + ["slow"])
    for i in range(10):
        v.update(f"f{i}", 10.0, 0, False)
    v.update("slow", 5.0, 0, False)
    assert v.sooner("slow", 5.0, 100, 0.0, 100_000) is None
    assert v.sooner("slow", 5.0, 100, 0.0, 1_000) in {f"f{i}" for i in range(10)}


def test_the_faster_node_check_walks_only_faster_nodes_and_answers_as_finishes_first() -> None:
    """`RateView.sooner` (what a decision asks, 2.4 ms per decision at 1,000 nodes when every node was
    walked through a generator) must give `finishes_first`'s answer on every case: live nodes only, faster
    ones only, the node itself never; and it looks at no node slower than the one asking."""
    import random

    from fleet.generation.multinode.chunks import finishes_first
    from fleet.generation.multinode.controller import RateView

    rng = random.Random(7)
    for case in range(300):
        names = [f"n{i}" for i in range(rng.randint(1, 40))]
        v = RateView(names)
        for n in names:
            v.update(n, rng.choice([None, round(rng.uniform(1, 12), 1)]), rng.randint(0, 400), rng.random() < 0.1)
        me = rng.choice(names)
        rate = v.rate.get(me) or rng.uniform(1, 12)
        rows, free_s = rng.randint(1, 300), rng.uniform(0, 30)
        pending = rng.choice([None, rows, rows * rng.randint(1, 30) + rng.randint(0, rows)])
        others = [(v.left[n] / r, r) for n, r in v.rate.items() if n != me and n not in v.lost]
        got = v.sooner(me, rate, rows, free_s, pending)
        assert (got is None) == finishes_first(rows, rate, others, free_s, pending), case
        assert got is None or (v.rate[got] > rate and got != me and got not in v.lost)
    looked: list[str] = []

    class Left(dict):   # type: ignore[type-arg]
        def __getitem__(self, key: str) -> int:
            looked.append(key)
            return int(super().__getitem__(key))

    v = RateView([])
    for i in range(100):
        v.update(f"n{i:03d}", 1.0 + i, 1000, False)
    v.left = Left(v.left)
    assert v.sooner("n050", 51.0, 10, 0.0) is None
    assert sorted(looked) == [f"n{i:03d}" for i in range(51, 100)]


@pytest.mark.parametrize("fault", ["node-unreachable", "controller-disk"])
def test_a_node_unreachable_while_its_chunk_starts_is_lost_not_the_jobs_end(tmp_path: Path, fault: str) -> None:
    """The 1,000-node device bench of main at 745b189: a node's outage began between its connect and its
    runner's start, and the job ended after 7 s — the bench's fake node raised a bare OSError, which
    the real SSH seam never does (it raises ConnectionLost). The fake now raises what the seam does;
    this holds the contract: a node unreachable while its chunk starts is that node lost, and the
    chunk stays in the queue for another node. A bare OSError there is the controller's own (its
    disk full, the store refusing access): not a node lost (it would be lost again at each rejoin,
    for ever) but the error itself, which ends the job with its cause."""
    from fleet.config import FleetConfig
    from fleet.errors import ConnectionLost
    from fleet.generation.multinode.controller import Controller, NodeLost, NodeWork

    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": "q"}}\n' for i in range(40)))
    cfg = FleetConfig(name="t", engine={"kind": "sim"}, model={"served_name": "m"},
                      nodes=[{"name": n, "workdir": str(tmp_path / n)} for n in ("a", "b")], generation={"chunk_rows": 10})
    ctl = Controller(cfg, tmp_path / "plan", str(tmp_path / "out"), {n: NodeWork(n, []) for n in ("a", "b")})
    ctl.prepare(str(src))
    assert ctl.assign is not None
    exc: Exception = (ConnectionLost("a: no route to host", host="a") if fault == "node-unreachable"
                      else OSError(28, "No space left on device"))

    def failing(*a: Any, **kw: Any) -> Any:
        raise exc

    ctl._put_input = failing   # type: ignore[method-assign]
    first = ctl.assign.first_pending()
    assert first is not None
    with pytest.raises(NodeLost if fault == "node-unreachable" else OSError) as info:
        ctl.run_chunk("a", first)
    assert isinstance(info.value, NodeLost) == (fault == "node-unreachable")
    assert ctl.assign.first_pending() == first and not ctl.assign.running_on("a")