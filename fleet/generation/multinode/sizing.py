"""The sizing rules of a multi-node job's chunks once the nodes' rates are measured (Prefect-free).

`chunk_rows_for`: a node's next chunk is a few minutes of its work, but at most its share of half of
what is left (so the last chunks end together); `finishes_first`: a slow node leaves a chunk to a
faster one that would end it sooner; `busy_seconds`: the time a node had a chunk running. The plan's
sizes before any rate is known are `plan_sizes` (planning.py); see chunks.py's docstring.
"""

from __future__ import annotations

import math

CHUNK_TARGET_S = 180.0   # a chunk is a few minutes of work at the node's measured rate
MIN_CHUNK_S = 15.0       # and never less than this: below it a runner's start (~8 s here) is most of the chunk


def chunk_rows_for(rate: float | None, rates: dict[str, float], rows_left: int, *,
                   target_s: float = CHUNK_TARGET_S, min_s: float = MIN_CHUNK_S,
                   total: float | None = None) -> int | None:
    """Rows of a node's next chunk from its measured rate (rows/s), or None before it is known.

    `rates`: the measured rate of every live node (this one included); `rows_left`: rows not yet
    handed out. The chunk is `target_s` of the node's work, but never more than its share (its
    rate over all rates) of half of what is left: factoring by capacity, so chunks shrink towards
    the end and the nodes' last chunks end together. At least `min_s` of work (a runner start must
    pay), at most what is left. Before any rate is known, the plan's cut stands (`plan_sizes`).
    `total`: the rates' sum when the caller keeps it (the controller's `RateView`), else summed here
    exactly (`math.fsum`: the same value however it was summed)."""
    if rate is None or rate <= 0 or rows_left <= 0:
        return None
    if total is None:
        total = math.fsum(r for r in rates.values() if r > 0)
    total = total or rate
    guided = rows_left * (rate / max(total, rate)) / 2
    want = min(rate * target_s, guided)
    return max(1, min(rows_left, math.ceil(max(want, rate * min_s))))


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans: the time a node had at least one chunk running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def chunks_before(mine: float, busy: float, rate: float, rows: int) -> int:
    """How many chunks of `rows` a node of `rate` rows/s, free in `busy` s, ends strictly before `mine` s."""
    x = (mine - busy) * rate / rows
    return max(0, math.ceil(x) - 1) if x > 0 else 0


def finishes_first(rows: int, rate: float | None, others: list[tuple[float, float]], free_s: float = 0.0,
                   pending_rows: int | None = None) -> bool:
    """Should a node of `rate` rows/s, free in `free_s` (the rest of the chunk it drains, when it asks
    early), take a chunk of `rows`? Not when the faster nodes (`others`: (free_s, rate) of the other live
    nodes) would end all the pending work (`pending_rows`, this chunk included; default: this chunk
    alone) sooner than it would end this chunk: a slow node that takes the last chunk is what makes a
    job's tail long. While there is more pending than the faster nodes can end first, it takes it: at
    1,000 nodes a faster node ending this one chunk sooner is nearly always true, and leaving every
    chunk to one kept half the nodes idle while chunks waited (the scale bench's fifth limit). Unknown
    rates: take it. (The controller asks `RateView.sooner`: the same rule, naming the node.)"""
    if not rate or rate <= 0:
        return True
    mine = free_s + rows / rate
    need = math.ceil((pending_rows or rows) / rows)
    return sum(chunks_before(mine, busy, r, rows) for busy, r in others if r > rate) < need
