"""How soon the dispatcher refills a server's slot, counted on the sim rather than timed (issue 27).

On a real engine a slot left empty after its row finished is throughput lost: the runner must
send a slot's next row as soon as its answer is in, before anything else (another answer, a
probe, a flush) has to happen. The sim's `--lockstep-rows N` answers one held row at a time and
only while every slot is held, so a dispatcher that is late refills nothing and its job stops;
it also counts a connection whose answer was followed by anything but the row's refill.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

from fleet.generation.hotpath.dispatch import Dispatcher
from fleet.generation.data.rows import Request
from test_gen_dispatch import MemStore, Sim, assert_exactly_once, fast, gen, rows, sims  # noqa: F401  (fixture)


def lockstep_counts(sim: Sim) -> dict[str, Any]:
    with urllib.request.urlopen(sim.url + "/sim/lockstep", timeout=10) as r:
        counts: dict[str, Any] = json.loads(r.read())
    return counts


def test_every_slot_is_refilled_before_another_row_is_answered_and_before_any_probe(sims) -> None:
    """Protects the completion-to-next-request gap of every slot, in events: after a row's
    answer the dispatcher sends that slot's next row before the server answers anything else
    (the sim answers nothing until it has; a late refill stops the job and fails the deadline),
    and the first request on the connection that carried the answer is that row, not a probe:
    the stats poller, polling all the time here, used to wait in the rows' pool for the next
    free connection, so the next row waited behind a probe (7-12 times per pass on an H200);
    no probe may use a row's connection at all."""
    n, k = 640, 16
    sim = sims("--lockstep-rows", str(n), "--max-running-requests", str(k))
    store = MemStore()
    items = rows(n, 8)
    d = Dispatcher([sim.endpoint("a")], store, gen(max_concurrency_per_server=k), **fast(stats_poll_s=0.001))

    async def job() -> Any:
        return await asyncio.wait_for(d.run(items), 120)   # a deadline: a slot never refilled stops the job

    summary = asyncio.run(job())
    assert summary.complete and summary.completed == n
    assert_exactly_once(store, [r.id for r in items])
    c = lockstep_counts(sim)
    assert c["answered"] == n and c["full"] == n - k, c   # every answer but the tail's had every slot held
    assert c["interlopers"] == 0 and c["shared"] == 0, c
    assert d.servers[0].accept_len is None or d.servers[0].accept_len > 0   # the poller still polled, elsewhere


def sim_streams(sim: Sim) -> dict[str, int]:
    with urllib.request.urlopen(sim.url + "/sim/streams", timeout=10) as r:
        counts: dict[str, int] = json.loads(r.read())
    return counts


def test_only_streamed_rows_per_server_are_streamed_and_their_chunks_keep_it_in(sims) -> None:
    """Protects the engine's throughput on `transformers serve`, where the runner streams for
    token progress: a streamed answer costs that engine's one busy thread an event per token, and
    streaming every row in flight cost it a share of its tok/s on an H200 (bench/RESULTS.md,
    issue 27). At most `Endpoint.streamed_rows` (2) of a server's rows are streamed at a time,
    counted by the sim, the others answered whole; a streamed row that ends hands its place to the
    next row sent, so the chunks still carry the server through rows twice `stall_s` long, to the
    last wave (judged by finished rows, or by a probe that fails in 0.2 s, it would be taken out)."""
    n, k = 32, 8
    sim = sims("--tokens-per-s", "2", "--max-running-requests", str(k))
    store = MemStore()
    items = [Request(f"r{i}", i + 1, [{"role": "user", "content": f"question {i}"}],
                     {"max_tokens": 6, "ignore_eos": True}) for i in range(n)]   # 3 s each
    ep = sim.endpoint("a", stream=True)
    assert ep.streamed_rows == 2
    d = Dispatcher([ep], store, gen(max_concurrency_per_server=k, stall_s=1.5, stall_min_s=1, stall_max_s=1),
                   **fast(stall_probe_timeout_s=0.2))
    summary = asyncio.run(asyncio.wait_for(d.run(items), 120))
    assert summary.complete and summary.completed == n and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    c = sim_streams(sim)
    assert c["max_at_once"] == 2 and c["now"] == 0, c
    assert n // k <= c["streamed"] < n // 2, c   # the place passes on: about 2 rows in every k
    s = summary.servers[0]
    assert (s["progress"], s["stalls"], s["downs"]) == ("stream", 0, 0), s


def test_nothing_is_streamed_once_rows_finish_well_within_stall_s(sims) -> None:
    """Protects the engine's throughput on `transformers serve` with short rows: even 2 streamed
    rows in flight cost it a wake-up of its HTTP thread at every decode step (10-15 % of its
    tok/s on an H200, bench/RESULTS.md, issue 27). Once a server's last rows (8 at least) each
    finished in under a quarter of stall_s, finished rows are its progress and nothing more is
    streamed (counted by the sim): only the rows sent before that are."""
    n, k = 320, 16
    sim = sims("--tokens-per-s", "400", "--max-running-requests", str(k))
    store = MemStore()
    items = rows(n, 8)   # 20 ms each, stall_s 30 s
    d = Dispatcher([sim.endpoint("a", stream=True)], store, gen(max_concurrency_per_server=k), **fast())
    summary = asyncio.run(asyncio.wait_for(d.run(items), 120))
    assert summary.complete and summary.completed == n and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    c = sim_streams(sim)
    assert 1 <= c["streamed"] <= 2 + 8, c   # the first rows, and refills before 8 had finished
    assert summary.servers[0]["stalls"] == 0
