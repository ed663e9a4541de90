"""Where a long-row job's makespan goes: the ideals a run is measured against, and its idle time.

Pure functions over what a run logged (bench_long_rows.py writes it to bench/results/):

- `fluid_ideal`: the kept tokens over the capacity that was there, as if rows could be split
  across slots at will. A server counts `slots x tokens/s` per second while it can generate:
  the wedged server from the start to its wedge and again from its return (never, if it was
  not relaunched), so a wedged server is never counted as working.
- `list_schedule`: the same rows on the same slots by a runner with no overhead at all:
  each free slot takes the next row (`clairvoyant=False`: the order given, what any runner
  that cannot see a row's length does), or the longest row left on the slot that would finish
  it first (`clairvoyant=True`, LPT: needs the lengths in advance, which nobody has at T=0.6).
  The wedged server's slots stop at the wedge and come back at its return; a row cut by the
  wedge starts again elsewhere at once (an instant, perfect watchdog). Its makespan over the
  fluid ideal is what indivisible rows of unknown length cost by themselves: the floor.
- `idle_profile`: the healthy servers' idle slot-seconds, split at the moment the queue ran dry
  (the last row's first send) and in ten equal time slices.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import Any

Send = tuple[str, str, float, float, str]   # server, row id, start s, end s, outcome kind


Out = dict[str, list[tuple[float, float]]]   # server -> per slot (0, 1, ...): (out from, back at; inf: never)


def _window(out: Out, n: str, i: int) -> tuple[float, float] | None:
    w = out.get(n, [])
    return w[i] if i < len(w) else None


def wedge_windows(sends: Sequence[Send], slots: int, name: str = "wedged") -> tuple[Out, float, float]:
    """From a run's sends: the wedged server's slots out (each from the first request on it that
    never answered, until its first answer after a relaunch: never, if none), the wedge (its last
    answer to a request sent before the first that hung: its progress stopped) and its return."""
    mine = [s for s in sends if s[0] == name]
    hung = min((s[2] for s in mine if s[4] != "ok"), default=float("inf"))
    if hung == float("inf"):
        return {}, 0.0, float("inf")
    t_stop = max((s[3] for s in mine if s[4] == "ok" and s[2] < hung), default=0.0)
    t_up = min((s[2] for s in mine if s[2] >= t_stop and s[4] == "ok"), default=float("inf"))
    hung_at = sorted(s[2] for s in mine if s[4] != "ok" and hung <= s[2] < t_up)[:slots]
    return {name: [(a, t_up) for a in hung_at]}, t_stop, t_up


def fluid_ideal(tokens: float, speeds: dict[str, float], slots: int, out: Out) -> float:
    """Seconds to generate `tokens` on `slots` per server at `speeds` (tokens/s per stream), slot i
    of server n out over `out[n][i]` (a wedge takes a server's slots one by one: each at the
    first request it never answers)."""
    total = slots * sum(speeds.values())
    t, left = 0.0, tokens
    # the capacity changes only at the outages' edges: walk them in order
    edges = sorted({e for ws in out.values() for a, b in ws for e in (a, b) if e != float("inf")})
    for edge in edges + [float("inf")]:
        cap = total - sum(speeds[n] for n, ws in out.items() for a, b in ws if a <= t < b)
        if cap > 0 and (edge == float("inf") or left <= cap * (edge - t)):
            return t + left / cap
        left -= cap * (edge - t)
        t = edge
    return float("inf")


def list_schedule(lengths: Sequence[int], speeds: dict[str, float], slots: int,
                  out: Out, clairvoyant: bool = False) -> float:
    """Makespan of `lengths` (tokens, in feed order) on `slots` per server at `speeds` (tokens/s per
    stream), with no overhead; see the module docstring. Not clairvoyant, a slower server keeps
    the runner's tail rule (`_held`): it leaves the last rows to faster ones that would finish
    them sooner, judging by the mean row, not the row's own length."""
    rows = sorted(lengths, reverse=True) if clairvoyant else list(lengths)
    fifo = deque(rows)   # the order given (popleft: a seed-sized job has 10^5 rows)
    mean = sum(lengths) / len(lengths) if lengths else 0.0
    free = [(0.0, -speeds[n], n, i) for n in speeds for i in range(slots)]
    heapq.heapify(free)
    cut: list[tuple[float, int]] = []   # (available at, length): rows a wedge cut
    end = 0.0
    while rows or cut:
        t, neg_v, n, i = heapq.heappop(free)
        w = _window(out, n, i)
        if w is not None and w[0] <= t < w[1]:
            if w[1] != float("inf"):
                heapq.heappush(free, (w[1], neg_v, n, i))
            continue
        faster = [ft for ft, fv, _, _ in free if fv < neg_v]
        if not clairvoyant and faster and _held(len(rows) + len(cut), mean, -neg_v, n, speeds, slots):
            heapq.heappush(free, (max(t, min(faster)) + 1e-6, neg_v, n, i))   # again once a faster slot frees
            continue
        ready = [c for c in cut if c[0] <= t]
        if ready:
            L = ready[0][1]
            cut.remove(ready[0])
        elif rows:
            L = _longest_here(rows, t, -neg_v, free) if clairvoyant else fifo.popleft()
            if not clairvoyant:
                rows.pop()   # only its count is read from here on
        else:   # nothing to take until a cut row comes back
            heapq.heappush(free, (min(c[0] for c in cut), neg_v, n, i))
            continue
        done = t + L / -neg_v
        if w is not None and t < w[0] < done:   # cut by the wedge: again elsewhere at once
            cut.append((w[0], L))
            if w[1] != float("inf"):
                heapq.heappush(free, (w[1], neg_v, n, i))
            continue
        end = max(end, done)
        heapq.heappush(free, (done, neg_v, n, i))
    return end


def _held(left: int, mean: float, v: float, n: str, speeds: dict[str, float], slots: int) -> bool:
    """health.others_sooner with exact speeds: a markedly slower server leaves the row to the
    others when they would drain what is left and this row before it could finish it."""
    best = max(speeds.values())
    if v * 1.5 >= best:
        return False
    rate = sum(slots * s / mean for m, s in speeds.items() if m != n)
    return mean / v > (left + 1) / rate + mean / best


def _longest_here(rows: list[int], t: float, v: float, free: list[tuple[float, float, str, int]]) -> int:
    """LPT on slots of several speeds: the longest row left goes here unless another slot, free
    later but faster, would finish it sooner; then the next longest is tried here."""
    for k, L in enumerate(rows):
        mine = t + L / v
        if all(ft + L / -nv >= mine for ft, nv, _, _ in free):
            return rows.pop(k)
    return rows.pop()


def idle_profile(sends: Sequence[Send], healthy: Sequence[str], slots: int, makespan: float,
                 t_dry: float, pieces: int = 10) -> dict[str, Any]:
    """Healthy servers' idle slot-seconds: before and after `t_dry`, and per time slice."""
    busy: dict[str, list[tuple[float, float]]] = {n: [] for n in healthy}
    for n, _, a, b, _ in sends:
        if n in busy:
            busy[n].append((a, b))

    def idle(lo: float, hi: float) -> float:
        used = sum(max(0.0, min(b, hi) - max(a, lo)) for n in healthy for a, b in busy[n])
        return len(healthy) * slots * (hi - lo) - used

    step = makespan / pieces
    return {"before_dry": idle(0.0, t_dry), "after_dry": idle(t_dry, makespan),
            "slices": [round(idle(k * step, (k + 1) * step) / len(healthy), 1) for k in range(pieces)],
            "slice_s": step,
            "first_send": {n: min((a for a, _ in busy[n]), default=None) for n in healthy}}


def refigure(path: str) -> None:
    """One bench_long_rows run's floors, from its raw record, with the floor model as it is now."""
    import json

    d = json.load(open(path))
    print(f"{path}: {' '.join(d['argv'])} (load {d['load'][0]:.1f})")
    for name, r in d["runs"].items():
        raw = r["raw"]
        out = wedge_windows([tuple(x) for x in raw["sends"]], raw["slots"])[0] if r["wedged_down"] else {}
        ideal = fluid_ideal(sum(raw["lengths"]), raw["speeds"], raw["slots"], out)
        g = list_schedule(raw["lengths"], raw["speeds"], raw["slots"], out)
        lpt = list_schedule(raw["lengths"], raw["speeds"], raw["slots"], out, clairvoyant=True)
        print(f"  {name}: makespan {r['makespan']:.0f} s, ideal {ideal:.0f} s, ratio {r['makespan'] / ideal:.3f}; "
              f"no-overhead {g:.0f} s ({g / ideal:.3f}), LPT {lpt:.0f} s ({lpt / ideal:.3f}); "
              f"makespan / no-overhead {r['makespan'] / g:.3f}")


def main() -> None:
    """The floor against the job's length: rows per slot on bench_long_rows' fleet (5 servers at
    full speed, one at half, one more at full), lengths as the sim draws them, several draws."""
    import argparse
    import math
    import random

    ap = argparse.ArgumentParser(description="no-overhead makespan ÷ fluid ideal against rows per slot")
    ap.add_argument("--rows-per-slot", type=float, nargs="+", default=[4, 8, 16, 36, 64, 200, 2000])
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--raw", nargs="+", default=[], help="bench_long_rows runs (bench/results/long-rows-*.json): "
                    "their floors computed again with this module")
    args = ap.parse_args()
    for path in args.raw:
        refigure(path)
    if args.raw:
        return
    tps = 51.0
    speeds = {**{f"s{i}": tps for i in range(5)}, "half": tps / 2, "s5": tps}
    print("| rows per slot | rows | fluid ideal s | no-overhead ÷ ideal (each draw) | clairvoyant LPT ÷ ideal |")
    print("| --- | --- | --- | --- | --- |")
    for rps in args.rows_per_slot:
        n = int(rps * args.slots * len(speeds))
        greedy, lpt, ideal = [], [], 0.0
        for seed in range(args.draws):
            rng = random.Random(seed)
            rows = [min(4096, max(1, int(rng.lognormvariate(math.log(2000), 0.5)))) for _ in range(n)]
            ideal = fluid_ideal(sum(rows), speeds, args.slots, {})
            greedy.append(list_schedule(rows, speeds, args.slots, {}) / ideal)
            if n <= 5000:
                lpt.append(list_schedule(rows, speeds, args.slots, {}, clairvoyant=True) / ideal)
        print(f"| {rps:g} | {n:,} | {ideal:,.0f} | " + " ".join(f"{g:.3f}" for g in greedy) + " | "
              + (" ".join(f"{x:.3f}" for x in lpt) or "—") + " |")


if __name__ == "__main__":
    main()
