"""Long rows, the seed job's shape: a wedged server and a half-speed one, new rules vs old.

    .venv/bin/python bench/bench_long_rows.py [--scale 3] [--slots 8] [--rows-per-slot 8] [--no-append]

Seven simulated SGLang servers per fleet: five at full speed, one at half speed, one wedged
mid-job (`--hang-after`: it serves that many requests, then /health still answers while
generations and /health_generate never do). Rows as a reasoning model writes them: max_tokens
4,096, lengths lognormal around 2,000 tokens (sigma 0.5, capped at 4,096: the sim's
`--lengths`), the same on every server (one --seed). At the seed job's speed (~17 tokens/s per
stream) a row takes 1–4 minutes; `--scale K` runs every server K x faster so the job fits in
minutes — rows of 20–80 s at K = 3, still longer than the 30 s stall window.

Two fleets, the same rows, run side by side in one process:

- **new**: backups (`generation.hedge_max_extra_fraction` 0.05) and the token-progress watchdog
  (`generation.stall_s` 30 s on the engine's token counters);
- **old**: no backups (`hedge_max_extra_fraction` 0) and the row clock (the watchdog is shown no
  token counters, as for an engine without /metrics: no row finished for 3 x the recent p99 row
  time, within [30 s, 300 s]) — the rules before issue 22.

Per run: makespan ÷ ideal (the kept tokens over the capacity that was there: the wedged server
counted until its wedge and again once the runner has it back, never while wedged), the same rows
on a runner with no overhead (the floor that indivisible rows of unknown length set, and a
clairvoyant one; bench/tail_floor.py), the healthy servers' idle time before and after the queue
ran dry and over the job, backups and their extra tokens, the time from the wedge (the wedged server's last answer: its progress stopped) to the
first of its rows sent elsewhere, and to its being taken out; every id exactly once. Every send
is kept in bench/results/long-rows-*.json.
`run_pair` is also the suite's small version (tests/test_gen_hedge.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fleet.config import GenerationConfig  # noqa: E402
from fleet.generation.hotpath.client import Outcome  # noqa: E402
from fleet.generation.hotpath.dispatch import Dispatcher, Endpoint  # noqa: E402
from fleet.generation.data.manifest import Summary  # noqa: E402
from fleet.generation.hotpath.hedge import Flight  # noqa: E402
from fleet.generation.data.rows import Request  # noqa: E402
from fleet.generation.hotpath.serverstate import ServerState  # noqa: E402

import tail_floor  # noqa: E402

SEED_TPS = 17.0          # tokens/s per stream at which a 4,096-token row takes 4 minutes
LENGTHS = "lognormal:2000:0.5"


class Store:
    """Every call of the store interface, to count ids."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def add_result(self, row: dict[str, Any]) -> None:
        self.results.append(row)

    def add_error(self, id: str, **kw: Any) -> None:
        self.errors.append(id)

    def add_reject(self, reject: Any) -> None:
        pass

    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], *, line: int | None) -> None:
        self.results.append(row)


class Logged(Dispatcher):
    """The fleet Dispatcher, every send logged: (server, row id, start s, end s, outcome kind)."""

    sends: list[tuple[str, str, float, float, str]]

    async def _send(self, srv: ServerState, f: Flight, timeout: float) -> Outcome | None:
        t0 = time.monotonic() - self._t0
        out: Outcome | None = None
        try:
            out = await super()._send(srv, f, timeout)
            return out
        finally:
            kind = "lost" if out is None or f.lost else out.kind
            self.sends.append((srv.name, f.job.req.id, t0, time.monotonic() - self._t0, kind))


@dataclass
class Fleet:
    names: list[str]
    urls: list[str]
    tps: list[float]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    relaunched: list[float] = field(default_factory=list)   # seconds each relaunch took

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()

    def relaunch(self, name: str, slots: int) -> None:
        """What the runner does with a server taken out: kill it, start it again (without the fault)."""
        from bench.sims import start_sims

        i = self.names.index(name)
        t0 = time.monotonic()
        self.procs[i].kill()
        self.procs[i].wait()
        port = int(self.urls[i].rsplit(":", 1)[1])
        procs, _ = start_sims([self.tps[i]], slots, seed=7, extra=[["--lengths", LENGTHS]], ports=[port])
        self.procs[i] = procs[0]
        self.relaunched.append(time.monotonic() - t0)


def start_fleet(full: int, tps: float, slots: int, hang_after: int, seed: int = 7) -> Fleet:
    """`full` servers at `tps`, one at half of it ("half"), one wedged after `hang_after` requests ("wedged")."""
    from bench.sims import start_sims

    speeds = [tps] * full + [tps / 2, tps]
    names = [f"s{i}" for i in range(full)] + ["half", "wedged"]
    procs, urls = start_sims(speeds, slots, seed=seed, extra=[["--lengths", LENGTHS]] * (full + 1)
                             + [["--lengths", LENGTHS, "--hang-after", str(hang_after)]])
    return Fleet(names, urls, speeds, procs)


def requests(n: int, tag: str) -> list[Request]:
    # the completion length comes from the prompt (and the fleets' shared seed): the same rows
    # have the same lengths in both fleets and on every server
    return [Request(f"{tag}-{i}", i + 1, [{"role": "user", "content": f"Think step by step about problem {i}."}],
                    {"max_tokens": 4096, "temperature": 0.6}) for i in range(n)]


async def row_clock(srv: ServerState, session: Any) -> None:
    """The old rules' watchdog: no token counters, judged by finished rows."""
    srv.progress = "rows"


async def run_job(fleet: Fleet, rows: list[Request], slots: int, *, old: bool, stall_s: float = 30.0,
                  fraction: float = 0.05, relaunch: bool = False, **dispatch: Any) -> dict[str, Any]:
    gen = GenerationConfig(max_concurrency_per_server=slots, max_tokens=4096, stall_s=stall_s,
                           hedge_max_extra_fraction=0.0 if old else fraction, request_timeout_s=3600)
    store = Store()

    async def relaunch_it(ep: Endpoint) -> bool:
        await asyncio.to_thread(fleet.relaunch, ep.name, slots)
        return True

    d = Logged([Endpoint(n, u, "sim-model") for n, u in zip(fleet.names, fleet.urls)], store, gen,
               stats_poll_s=3600, on_server_down=relaunch_it if relaunch else None, **dispatch)
    d.sends = []
    if old:
        d.health.read_progress = row_clock   # type: ignore[method-assign]
    summary = await d.run(rows)
    return measure(fleet, rows, slots, d, store, summary)


def measure(fleet: Fleet, rows: list[Request], slots: int, d: Logged, store: Store,
            summary: Summary) -> dict[str, Any]:
    makespan = summary.wall_s
    ended = Counter([r["id"] for r in store.results] + store.errors)
    once = len(ended) == len(rows) and max(ended.values()) == 1
    lengths = {r["id"]: r["completion_tokens"] or 0 for r in store.results}
    tokens = sum(lengths.values())
    sends = d.sends
    wedged = [s for s in sends if s[0] == "wedged"]
    # the wedge, its slots out one by one, its return (tail_floor.wedge_windows); none unless taken out
    srv = next(s for s in d.servers if s.name == "wedged")
    out, t_stop, t_up = tail_floor.wedge_windows(sends, slots) if srv.downs else ({}, 0.0, float("inf"))
    stuck = {s[1] for s in wedged if s[4] != "ok"}   # rows it held and never answered
    elsewhere = [s[2] for s in sends if s[0] != "wedged" and s[1] in stuck
                 and s[2] >= min((w[2] for w in wedged if w[1] == s[1]), default=0.0)]
    t_flow = min(elsewhere) if elsewhere else None
    t_down = srv.down_since - d._t0 if srv.down_since is not None else None
    speeds = dict(zip(fleet.names, fleet.tps))
    ideal = tail_floor.fluid_ideal(tokens, speeds, slots, out)
    order = [lengths[r.id] for r in rows if r.id in lengths]
    greedy = tail_floor.list_schedule(order, speeds, slots, out)
    lpt = tail_floor.list_schedule(order, speeds, slots, out, clairvoyant=True)
    first = {}
    for _, rid, a, _, _ in sends:
        first[rid] = min(a, first.get(rid, a))
    t_dry = max(first.values(), default=0.0)   # the last row's first send: the queue ran dry
    healthy = [n for n in fleet.names if n != "wedged"]
    prof = tail_floor.idle_profile(sends, healthy, slots, makespan, t_dry)
    idle = prof["before_dry"] + prof["after_dry"]
    return {"makespan": makespan, "ideal": ideal, "ratio": makespan / ideal, "idle_slot_s": idle,
            "idle_server_s": idle / slots, "hedge": summary.hedge, "tokens": tokens,
            "greedy": greedy, "lpt": lpt, "t_dry": t_dry, "idle": prof, "rows_per_slot": len(rows) / (7 * slots),
            "extra_pct": 100.0 * summary.hedge["extra_tokens"] / tokens if tokens else 0.0,
            "t_stop": t_stop, "t_up": t_up, "out": out, "flow_s": None if t_flow is None else t_flow - t_stop,
            "down_s": None if t_down is None else t_down - t_stop, "once": once, "errors": len(store.errors),
            "complete": summary.complete, "wedged_down": srv.downs > 0, "relaunch_s": list(fleet.relaunched),
            "wedged_rows_after": srv.requests, "wedged_reason": srv.down_reason,
            "raw": {"speeds": speeds, "slots": slots, "sends": sends, "lengths": order}}


async def run_pair(new_fleet: Fleet, old_fleet: Fleet | None, rows: int, slots: int,
                   **kw: Any) -> dict[str, dict[str, Any]]:
    """The new rules on one fleet and (given one) the old rules on the other, at once, the same rows."""
    jobs = {"new": run_job(new_fleet, requests(rows, "row"), slots, old=False, **kw)}
    if old_fleet is not None:
        jobs["old"] = run_job(old_fleet, requests(rows, "row"), slots, old=True, **kw)
    done = await asyncio.gather(*jobs.values())
    return dict(zip(jobs, done))


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def table(res: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| rules | makespan s | fluid ideal s | **makespan ÷ ideal** | no-overhead runner s (÷ ideal) "
             "| clairvoyant LPT s (÷ ideal) | makespan ÷ no-overhead runner | queue dry at s "
             "| healthy idle server-s before / after dry | rows hedged / wins | extra tokens (% of kept) "
             "| wedge → its rows elsewhere s | wedge → taken out s | ids exactly once |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in res.items():
        h, i, n = r["hedge"], r["idle"], len(r["idle"]["first_send"])
        lines.append(f"| {name} | {r['makespan']:.0f} | {r['ideal']:.0f} | **{r['ratio']:.3f}** | "
                     f"{r['greedy']:.0f} ({r['greedy'] / r['ideal']:.3f}) | {r['lpt']:.0f} ({r['lpt'] / r['ideal']:.3f}) | "
                     f"{r['makespan'] / r['greedy']:.3f} | {r['t_dry']:.0f} | "
                     f"{i['before_dry'] / r['raw']['slots'] / n:,.0f} / {i['after_dry'] / r['raw']['slots'] / n:,.0f} | "
                     f"{h['rows']} / {h['wins']} | {h['extra_tokens']:,} ({r['extra_pct']:.2f} %) | "
                     f"{_fmt(r['flow_s'])} | {_fmt(r['down_s'])} | {'yes' if r['once'] else 'NO'} |")
    return lines


def dump(res: dict[str, dict[str, Any]], argv: list[str], load: tuple[float, ...]) -> Path:
    """Everything a run logged (every send, every row's length), to recompute any figure later."""
    import json

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H%M")
    path = ROOT / "bench" / "results" / f"long-rows-{stamp}-{os.getpid()}.json"
    path.write_text(json.dumps({"argv": argv, "load": load, "runs": res}, default=str))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=3.0, help="every server this many times the seed job's speed")
    ap.add_argument("--slots", type=int, default=8, help="running requests per server")
    ap.add_argument("--rows-per-slot", type=float, default=8.0)
    ap.add_argument("--hang-after", type=int, default=None, help="requests the wedged server serves (default 2 x slots)")
    ap.add_argument("--relaunch", action="store_true",
                    help="relaunch a server taken out (as the runner does)")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    tps = SEED_TPS * args.scale
    n = int(args.rows_per_slot * args.slots * 7)
    hang = args.hang_after or 2 * args.slots
    fleets = [start_fleet(5, tps, args.slots, hang), start_fleet(5, tps, args.slots, hang, seed=7)]
    t0 = time.monotonic()
    try:
        res = asyncio.run(run_pair(fleets[0], fleets[1], n, args.slots, relaunch=args.relaunch))
    finally:
        for f in fleets:
            f.stop()
    wall = time.monotonic() - t0
    load = os.getloadavg()
    raw = dump(res, sys.argv[1:], load)   # first: a figure below that fails leaves the raw run
    lines = [
        f"### Long rows: a wedged server and a half-speed one (issue 22), {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"    {shlex.join(['.venv/bin/python', 'bench/bench_long_rows.py', *sys.argv[1:]])}",
        "",
        f"This machine: 2 cores shared with other developers' work, load average {load[0]:.1f} at the end; "
        f"the bench took {wall / 60:.1f} min. Two fleets of 7 sim servers side by side ({args.slots} slots each: "
        f"5 at {tps:g} tokens/s per stream, one at half that, one wedged after {hang} requests), the same "
        f"{n} rows on each: max_tokens 4,096, lengths lognormal around 2,000 tokens (sigma 0.5, capped), so "
        f"rows of {891 / tps:.0f}–{4096 / tps:.0f} s ({args.scale:g} x the seed job's ~17 tokens/s per stream, "
        f"where they take 1–4 min). new: backups (hedge_max_extra_fraction 0.05) + token-progress watchdog "
        f"(stall_s 30 s); old: no backups + the row clock (3 x p99 row time within [30, 300] s). "
        + ("The server taken out is relaunched without the fault (kill, start, /health: "
           + ", ".join(f"{r:.1f}" for f in fleets for r in f.relaunched) + " s), as the runner does." if args.relaunch else "A server taken out stays out.")
        + " Fluid ideal: the kept tokens over the capacity that was there (the wedged server counted until its "
        "wedge and again from its first row after it; never as working while wedged), rows split at will. "
        "No-overhead runner: the same rows, in the same order, each free slot taking the next (a slower server "
        "keeping the runner's tail rule), no start-up, no latency, a perfect watchdog (bench/tail_floor.py); clairvoyant LPT: the longest row first, on the slot "
        "that finishes it first (needs lengths nobody knows in advance).",
        "",
        *table(res),
    ]
    lines += ["", "Idle slot-seconds per healthy server, in ten equal slices of the job:", ""]
    lines += [f"- {name}: " + ", ".join(f"{x:.0f}" for x in r["idle"]["slices"])
              + f" (slices of {r['idle']['slice_s']:.0f} s; rows per slot {r['rows_per_slot']:.1f})"
              for name, r in res.items()]
    lines += ["", f"Raw: `{raw.relative_to(ROOT)}`"]
    text = "\n".join(lines)
    print("\n" + text)
    for name, r in res.items():
        print(name, {k: r[k] for k in ("complete", "errors", "wedged_down", "wedged_reason", "t_stop", "hedge")})
    if not args.no_append:
        path = ROOT / "bench" / "RESULTS.md"
        path.write_text(path.read_text().rstrip("\n") + "\n\n" + text + "\n")
        print(f"\nappended to {path}")


if __name__ == "__main__":
    main()
