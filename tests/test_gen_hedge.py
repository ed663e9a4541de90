"""Backup requests (fleet.generation.hotpath.hedge) against real simulated SGLang servers.

Every test counts (ids written, backups sent and won, requests the sims saw), none times:
each speed gap is wide enough that the order of events cannot flip on a busy machine.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from conftest import wait_until
from fleet.generation.hotpath.dispatch import Dispatcher, Endpoint
from fleet.generation.data.manifest import read_manifest
from fleet.generation.data.rows import Request
from test_gen_dispatch import MemStore, Sim, assert_exactly_once, fast, gen, sims  # noqa: F401  (fixture re-used)
from test_gen_runner import job_file, progress, result_ids, start_runner, write_input

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_sim_lognormal_lengths_are_a_long_tail_within_max_tokens() -> None:
    """The sim's --lengths lognormal:MEDIAN:SIGMA (the long-rows bench's reasoning-model lengths):
    deterministic per hash, median near MEDIAN, every length within 1..max_tokens, some at the cap."""
    from fleet.sim.determinism import hash_ints
    from fleet.sim.generation import lognormal_length

    xs = sorted(lognormal_length("lognormal:2000:0.5", hash_ints(7, 11, i), 4096) for i in range(4000))
    assert xs == sorted(lognormal_length("lognormal:2000:0.5", hash_ints(7, 11, i), 4096) for i in range(4000))
    assert 1 <= xs[0] and xs[-1] == 4096 and 1800 < xs[2000] < 2200
    assert 0.02 < sum(x == 4096 for x in xs) / len(xs) < 0.15


def fixed_rows(n: int, tokens: int) -> list[Request]:
    """Rows that all run to `tokens` (ignore_eos): a row's time on a server is tokens / its speed."""
    return [Request(f"r{i}", i + 1, [{"role": "user", "content": f"q {i}"}], {"max_tokens": tokens, "ignore_eos": True})
            for i in range(n)]


def running(sim: Sim) -> int:
    """Generations the sim holds now (its /metrics gauge): a cancelled request frees its slot."""
    with urllib.request.urlopen(sim.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("sglang:num_running_reqs{"))
    return int(float(line.rsplit(" ", 1)[1]))


def slow_beside_quick(sims: Any) -> tuple[Any, MemStore, Any]:
    """150 rows on a server at 0.5 tok/s beside one at 5,000 (backups up to half the tokens): the
    job ends complete, every id exactly once, nothing in errors; (its summary, the store, the slow sim)."""
    slow = sims("--tokens-per-s", "0.5", "--max-running-requests", "4")
    quick = sims("--tokens-per-s", "5000", "--max-running-requests", "8")
    store = MemStore()
    items = fixed_rows(150, 24)
    d = Dispatcher([slow.endpoint("slow"), quick.endpoint("quick")], store,
                   gen(hedge_max_extra_fraction=0.5, request_timeout_s=600), hedge_poll_s=0.05, **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 150 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    return summary, store, slow


def test_slow_server_rows_hedged_at_the_tail_every_id_once_within_the_bound(sims) -> None:
    """The tail: once the queue is empty, a fast server with free slots backs up the rows a
    much slower server still holds (each would take it 48 s; the fast one answers in
    milliseconds). The backups win, the slow server's requests are cancelled, every id is
    written exactly once, and the tokens the losers cost stay within the configured share."""
    summary, store, slow = slow_beside_quick(sims)
    h = summary.hedge
    assert h["backups"] >= 1 and h["rows"] >= 1 and h["wins"] >= 1, h
    assert h["extra_tokens"] <= 0.5 * summary.completion_tokens, h
    assert h["extra_tokens"] <= h["bound_tokens"] and h["out"] == 0, h
    assert Counter(r["server"] for r in store.results)["slow"] == 0, "a 48 s row outran a 5 ms backup"
    wait_until(lambda: running(slow) == 0, timeout=30, what="the slow server's lost requests cancelled")


def test_hedged_row_whose_original_answers_first_cancels_the_backup(sims) -> None:
    """The other way round: rows on a server under suspicion (the hook, forced here) are
    backed up on a server 20 x slower, which comes up only once every row is in flight (so it
    holds no row of its own). The originals answer first, so every backup is cancelled — the
    backup server ends holding nothing — no backup wins, every row is written once, by its
    original server."""
    orig = sims("--tokens-per-s", "10", "--max-running-requests", "4")
    backup = Sim("--tokens-per-s", "0.5", "--max-running-requests", "64")
    store = MemStore()
    items = fixed_rows(4, 100)   # 10 s each on orig, 200 s on the backup server

    up: list[bool] = []

    async def bring_up(ep: Endpoint) -> bool:
        while not (d.rows.feed_done and not len(d.queue)):
            await asyncio.sleep(0.01)
        await asyncio.to_thread(backup.start)
        up.append(True)
        return True

    d = Dispatcher([orig.endpoint("orig"), backup.endpoint("backup")], store,
                   gen(hedge_max_extra_fraction=1.0, request_timeout_s=600, stall_s=600), on_server_down=bring_up,
                   hedge_poll_s=0.02, **fast())
    d.hedge.suspected = lambda s: s.name == "orig" and bool(up)   # from when it holds every row
    d.hedge.tokens = 10**6   # a budget from the start (nothing answered yet)
    try:
        summary = asyncio.run(d.run(items))
        assert summary.complete and summary.completed == 4 and not store.errors
        assert_exactly_once(store, [r.id for r in items])
        assert {r["server"] for r in store.results} == {"orig"}
        h = summary.hedge
        assert h["backups"] >= 1 and h["wins"] == 0 and h["cancelled"] == h["backups"] and h["out"] == 0, h
        wait_until(lambda: running(backup) == 0, timeout=30, what="every backup cancelled at the server")
    finally:
        backup.kill()


def test_backup_of_a_wedged_servers_row_carries_it_when_the_server_is_taken_out(sims) -> None:
    """A wedged server (generations and /health_generate hang) under suspicion: its rows are
    backed up on the other server while its probe runs; when the probe takes it out, the rows
    with a backup out are not queued a second time (the backup carries them), the others go
    back uncharged. Every id exactly once, no attempt charged."""
    good = sims("--tokens-per-s", "100", "--max-running-requests", "8")
    wedged = sims("--tokens-per-s", "100", "--max-running-requests", "8", "--hang-after", "12")
    store = MemStore()
    items = fixed_rows(400, 16)   # 0.16 s each: ~8 s of work for the good server, the probe decides in 2 s
    never = asyncio.Event()

    async def stay_down(ep: Endpoint) -> bool:
        await never.wait()
        return False

    d = Dispatcher([good.endpoint("good"), wedged.endpoint("wedged")], store,
                   gen(hedge_max_extra_fraction=1.0, request_timeout_s=600, stall_s=0.5), on_server_down=stay_down,
                   hedge_poll_s=0.02, **fast(stall_probe_timeout_s=2.0))
    d.hedge.tokens = 10**6
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 400 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    w = {s["name"]: s for s in summary.servers}["wedged"]
    assert w["downs"] == 1 and (w["down_reason"] or "").startswith("stalled"), w
    assert summary.hedge["backups"] >= 1 and summary.hedge["wins"] >= 1, summary.hedge
    assert all(r["attempts"] == 1 for r in store.results), "a wedged server's rows must not be charged"


def test_kill_9_during_a_hedge_then_resume_every_id_exactly_once(tmp_path: Path, sims) -> None:
    """A runner killed (SIGKILL) while backups are out — rows then have two requests out on
    two servers — and resumed: no id lost, none written twice. The first run's progress.json
    records the backups; the resumed run's manifest records its own hedge counters."""
    good = sims("--tokens-per-s", "40", "--max-running-requests", "8")
    wedged = sims("--tokens-per-s", "40", "--max-running-requests", "8", "--hang-after", "8")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    n = write_input(inp, 300)
    job = job_file(tmp_path, inp, out, [good, wedged],
                   config={"generation": {"max_tokens": 48, "max_attempts": 3, "stall_s": 0.5,
                                          "hedge_max_extra_fraction": 1.0}},
                   dispatch={"hedge_poll_s": 0.05, "stall_poll_s": 0.05, "stall_probe_timeout_s": 600})
    log = tmp_path / "runner.log"
    first = start_runner(job, log)
    try:
        p = wait_until(lambda: (p := progress(out)) and p.get("hedge", {}).get("out", 0) >= 1 and p,
                       timeout=120, what="backups out")
        assert p["state"] == "running" and p["rows_done"] < n, p
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    wedged.kill()
    wedged.start("--tokens-per-s", "40", "--max-running-requests", "8")
    second = start_runner(job, log)
    assert second.wait(timeout=300) == 0, log.read_text()[-3000:]
    ids = result_ids(out)
    dup = [i for i, c in Counter(ids).items() if c > 1]
    assert not dup, f"written twice: {dup[:10]}"
    assert set(ids) == {f"r{i}" for i in range(n)}
    m = read_manifest(out)
    assert m is not None and m["state"] == "done" and "hedge" in m["this_run"], m and m.get("this_run")
    final = json.loads((out / "progress.json").read_text())
    assert "hedge" in final and final["hedge"]["out"] == 0


def test_long_rows_bench_small_wedged_server_out_rows_hedged_every_id_once() -> None:
    """bench/bench_long_rows.py, small (3 servers: one full speed, one at half, one wedged after
    6 requests; 60 rows of lognormal lengths up to 4,096 tokens; a 1 s stall window): the
    wedged server is taken out on its token count, its rows are backed up before that, and
    every id ends exactly once. Counting only: the bench's timings are not asserted."""
    import bench_long_rows as bench

    fleet = bench.start_fleet(1, 2000.0, 4, 6)
    try:
        res = asyncio.run(bench.run_pair(fleet, None, 60, 4, stall_s=1.0, fraction=0.5, hedge_poll_s=0.05,
                                         stall_probe_timeout_s=3.0))["new"]
    finally:
        fleet.stop()
    assert res["complete"] and res["once"] and res["errors"] == 0, res
    assert res["wedged_down"] and res["wedged_reason"].startswith("stalled: no token progress"), res
    assert res["hedge"]["rows"] >= 1 and res["hedge"]["out"] == 0, res["hedge"]
    assert res["hedge"]["extra_tokens"] <= res["hedge"]["bound_tokens"], res["hedge"]
    assert res["flow_s"] is not None, "the wedged server's rows never went elsewhere"


def test_long_rows_ideal_never_counts_a_wedged_server_as_working() -> None:
    """The bench's yardstick: the fluid ideal counts a wedged server out from its wedge until it is
    back (for good when it never is); an ideal that counted it working would blame the runner for
    capacity that was not there. Pure arithmetic, no timing."""
    import tail_floor

    inf = float("inf")
    assert tail_floor.fluid_ideal(100, {"a": 1, "b": 1}, 1, {}) == 50
    assert tail_floor.fluid_ideal(100, {"a": 1, "b": 1}, 1, {"b": [(10, inf)]}) == 90
    assert tail_floor.fluid_ideal(100, {"a": 1, "b": 1}, 1, {"b": [(10, 20)]}) == 55
    # a wedge takes a server's slots one by one: here one of b's two at 10, the other at 30
    assert tail_floor.fluid_ideal(100, {"a": 1, "b": 1}, 2, {"b": [(10, inf), (30, inf)]}) == 30
    # the windows come from the sends: the wedged server's slots out from the requests it never answered
    sends = [("wedged", "r1", 0.0, 10.0, "ok"), ("wedged", "r2", 0.0, 12.0, "ok"),
             ("wedged", "r3", 10.0, 99.0, "lost"), ("wedged", "r4", 12.0, 99.0, "connection"),
             ("wedged", "r5", 60.0, 70.0, "ok")]
    assert tail_floor.wedge_windows(sends, 2) == ({"wedged": [(10.0, 60.0), (12.0, 60.0)]}, 12.0, 60.0)


def test_long_rows_floor_restarts_rows_cut_by_the_wedge_and_holds_a_slow_server_at_the_tail() -> None:
    """The no-overhead floor the bench compares a run with: a row cut by the wedge starts again
    elsewhere at once; a server four times slower leaves the last row to a faster one; a
    clairvoyant order puts the long row first. Pure arithmetic, no timing."""
    import tail_floor

    inf = float("inf")
    assert tail_floor.list_schedule([10, 10, 10, 10], {"a": 1, "b": 1}, 1, {}) == 20
    # b takes the second row and is wedged at 5: a runs all four (the cut one right after its first)
    assert tail_floor.list_schedule([10, 10, 10, 10], {"a": 1, "b": 1}, 1, {"b": [(5, inf)]}) == 40
    # the slow server would take 40 s for the last row; the fast one finishes it at 20
    assert tail_floor.list_schedule([10, 10], {"a": 1, "slow": 0.25}, 1, {}) == 20
    assert tail_floor.list_schedule([1, 1, 1, 1, 8], {"a": 1, "b": 1}, 1, {}) == 10
    assert tail_floor.list_schedule([1, 1, 1, 1, 8], {"a": 1, "b": 1}, 1, {}, clairvoyant=True) == 8


def test_lost_send_whose_cancellation_is_swallowed_never_touches_the_row(sims, monkeypatch) -> None:
    """Fault: a loser's cancellation can race aiohttp's own timer and come back as a timeout
    answer instead of a CancelledError (see test_gen_dispatch's lost-cancellation test). Here
    every cancellation inside `chat` is swallowed that way: the slow server's primaries, lost
    to their backups, "answer" with a timeout — which must neither retry, charge nor write the
    row again. Every id exactly once, every attempt 1, nothing in errors."""
    import fleet.generation.hotpath.dispatch as dispatch_mod
    from fleet.generation.hotpath.client import Outcome

    real_chat = dispatch_mod.chat

    async def swallowing_chat(*a: Any, **kw: Any) -> Outcome:
        try:
            return await real_chat(*a, **kw)
        except asyncio.CancelledError:
            return Outcome("timeout", error="no answer within 600 s (a cancellation lost to aiohttp's timer)")

    monkeypatch.setattr(dispatch_mod, "chat", swallowing_chat)
    summary, store, _ = slow_beside_quick(sims)
    assert summary.hedge["wins"] >= 1 and summary.retries == 0, (summary.hedge, summary.retries)
    assert all(r["attempts"] == 1 for r in store.results)
