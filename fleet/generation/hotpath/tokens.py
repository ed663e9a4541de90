"""Tokens generated so far, the rows still in flight included: what the job's rate, its console
line and its ETA count, so that rows of minutes show progress long before the first one ends
(issue 37: 1,024-token rows on an H200 showed `0.0 tok/s now … ETA None s` for two minutes, and
again for two minutes after a relaunch, while the engine generated ~1,000 tok/s).

Per server, the best source it has:

| source | counts | read |
| --- | --- | --- |
| the engine's counter (`promtext.generated_tokens`: vLLM, SGLang's realtime decode counter, the sim) | every token decoded since the runner's first reading of it, summed over readings (a relaunched engine starts again from zero: its first reading is a baseline) | with the stall watchdog's readings of /metrics, every few seconds while it holds rows |
| an estimate | each row in flight: its age × the per-row token rate last seen (`Hedge.rate`: this server's recent answers, else the other servers'), at least the events of a streamed row (`Endpoint.stream`), at most its max_tokens | without such a counter |

What its answers said (`completion_tokens`) is a floor under either, and a server's count never
goes back (a row that ends shorter than estimated keeps its estimate until the answers catch up).
"""

from __future__ import annotations

from fleet.generation.hotpath.hedge import Flight, Hedge
from fleet.generation.hotpath.serverstate import ServerState

__all__ = ["count", "in_flight", "note_reading"]


def note_reading(srv: ServerState, generated: float | None) -> None:
    """A reading of `srv`'s engine counter of generated tokens (None: it has none)."""
    if generated is None:
        srv.gen_live, srv.gen_read = False, None
        return
    srv.gen_live = True
    if srv.gen_read is not None:
        delta = generated - srv.gen_read
        # below the last reading: the engine restarted under us, its counter from zero
        srv.gen_counted += delta if delta >= 0 else generated
    srv.gen_read = generated


def _row_rate(hedge: Hedge, srv: ServerState, servers: list[ServerState]) -> float:
    """Tokens per second of one row on `srv`: its recent answers', else the mean of the others'."""
    r = hedge.rate(srv)
    if r > 0:
        return r
    others = [x for x in (hedge.rate(s) for s in servers) if x > 0]
    return sum(others) / len(others) if others else 0.0


def _estimate(srv: ServerState, flights: list[Flight], now: float, rate: float, hedge: Hedge) -> float:
    """Tokens of `srv`'s rows in flight, from their age (see the module docstring)."""
    if rate <= 0:   # no answer anywhere yet: the streamed rows' own pace, if any streams
        streamed = [(f.chunks, now - f.t0) for f in flights if f.chunks]
        seconds = sum(s for _, s in streamed)
        rate = sum(c for c, _ in streamed) / seconds if seconds > 0 else 0.0
    return sum(min(hedge.max_tokens(f.job), max(f.chunks, (now - f.t0) * rate)) for f in flights)


def count(servers: list[ServerState], hedge: Hedge, now: float) -> float:
    """Every server's tokens generated in this run (each kept in `ServerState.generated`); their sum."""
    total = 0.0
    for srv in servers:
        if srv.gen_live:
            n = srv.gen_counted
        else:
            flights = list(hedge.on[srv.name].values())
            n = srv.completion_tokens + (_estimate(srv, flights, now, _row_rate(hedge, srv, servers), hedge)
                                         if flights else 0.0)
        srv.generated = max(srv.generated, n, float(srv.completion_tokens))
        total += srv.generated
    return total


def in_flight(hedge: Hedge, now: float) -> tuple[int, float | None]:
    """Rows in flight now (a row and its backup count once), and the age of the oldest send."""
    flights = [f for table in hedge.on.values() for f in table.values()]
    rows = {f.job.req.id for f in flights}
    return len(rows), (now - min(f.t0 for f in flights)) if flights else None
