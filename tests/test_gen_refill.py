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

from fleet.generation.dispatch import Dispatcher
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
