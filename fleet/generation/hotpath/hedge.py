"""Backup requests: MapReduce's backup tasks, applied to rows.

With rows of minutes, the rows still in flight when the queue runs dry set the job's end:
every other server idles while a slower server (or a wedged one, until the watchdog takes
it out) holds them. So a server with free slots re-sends such a row; the first answer
wins, the other request is cancelled, and the row is written once.

When (`Hedge.plan`, every `hedge_poll_s` of the dispatcher):

- **on suspicion**: the rows of a server under stall suspicion (`suspected`: no progress for
  stall_s, its generation probe has not decided yet) are backed up even while the queue still holds rows: a
  `Backup` goes to the front of the queue, oldest row first, and the next free worker of
  another server sends it (the suspect's own workers take no row until the probe decides).
  Should the probe take the server out, the backups carry those rows (they are not queued
  a second time); should it keep the server, the first answer wins as below.
- **at the tail** (input exhausted, queue empty): a server with free slots takes rows in
  flight on other servers that it could finish sooner even if they run to their max_tokens
  (a slower server's young rows; a row overdue on its own server: older than 1.5 x the
  time a max_tokens row takes there). Two servers of one speed never back each other up:
  a backup started later cannot win there, it would only spend tokens.

Bound: the tokens spent on cancelled losers (`extra_tokens`: the loser's elapsed time x its
server's per-request token rate, at most the winner's tokens) stay within
`generation.hedge_max_extra_fraction` of the run's completion tokens: each backup reserves
its max_tokens while it runs, and is sent only if what is spent plus what is reserved still
fits. One backup per request at a time.

Ownership, the exactly-once rule (the store and `Ledger.finish_ok` guard it too): a row's
live sends are `Job.flights`. An ok answer wins: the other flights are marked `lost` and
their tasks cancelled (a worker's cancellation is taken back once its send is over:
`Flight.forget`). A failed send while another flight of the row is still out is dropped
(the other carries the row); the last flight out handles the row as if it had been alone
(retry, requeue, errors). A flight marked lost never touches the row again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fleet.generation.hotpath.client import Outcome
from fleet.generation.hotpath.rowqueue import Job, WorkQueue
from fleet.generation.hotpath.serverstate import ServerState

__all__ = ["Backup", "Flight", "Hedge"]

OVERDUE = 1.5    # a row older than this x the time a max_tokens row takes on its server is overdue
MARGIN = 0.8     # a backup must finish within this share of the primary's worst-case time left
DECAY = 0.98     # per answer: the per-request token rate follows a server's recent answers


class Backup:
    """A queue item: send a backup of `job`'s current request (any server but the ones it is on)."""

    __slots__ = ("job",)

    def __init__(self, job: Job) -> None:
        self.job = job


class Flight:
    """One send of a row's current request, on one server."""

    __slots__ = ("srv", "job", "task", "t0", "backup", "lost", "sent", "settled", "chunks")

    def __init__(self, srv: ServerState, job: Job, backup: bool) -> None:
        self.srv = srv
        self.job = job
        # what a win cancels: the worker sending it, or the backup's own task (set by its sender)
        self.task: asyncio.Task[Any] | None = asyncio.current_task()
        self.t0 = time.monotonic()
        self.backup = backup
        self.lost = False    # the other flight answered first: this one is cancelled and drops out
        self.sent = False    # its request left (or may have left) for the server
        self.settled = False  # its answer was taken (kept, retried, or dropped for the other's)
        self.chunks = 0      # events of its streamed answer so far (fleet.generation.hotpath.tokens)

    def chunk(self) -> None:
        """An event of its streamed answer arrived: the row's progress, and its server's."""
        self.chunks += 1
        self.srv.chunk()

    def forget(self) -> bool:
        """After a lost flight's send: take back the cancellation that ended it; False when
        another cancellation (the server went down, a shutdown) is still pending."""
        task = self.task
        if task is not None and task.cancelling():
            task.uncancel()
            return not task.cancelling()
        return True


class Hedge:
    """Which rows get a backup, where, within the token budget; and what that cost."""

    def __init__(self, fraction: float, servers: list[ServerState], queue: WorkQueue,
                 suspected: Callable[[ServerState], bool], feed_done: Callable[[], bool],
                 default_max_tokens: int) -> None:
        self.fraction = fraction
        self.servers = servers
        self.queue = queue
        self.suspected = suspected
        self.feed_done = feed_done
        self.default_max_tokens = default_max_tokens
        self.on: dict[str, dict[str, Flight]] = {s.name: {} for s in servers}   # server -> row id -> its flight
        self.queued: set[str] = set()   # rows with a Backup in the queue
        self._rate: dict[str, list[float]] = {s.name: [0.0, 0.0] for s in servers}   # decayed tokens, seconds
        self.tokens = 0          # completion tokens answered in this run: the budget's base
        self.reserved = 0        # max_tokens of the backups out or queued now
        # what the job reads (progress.json, the manifest)
        self.backups = 0         # backups decided (sent, or queued to be sent)
        self.out = 0             # backups out or queued now
        self.rows = 0            # rows that got at least one
        self.wins = 0            # backups that answered first
        self.extra_tokens = 0    # tokens of cancelled losers (estimated; see the module docstring)
        self.cancelled = 0       # losing requests cancelled

    # ------------------------------------------------------------------ the budget
    def reserve(self, job: Job) -> None:
        """A backup of `job` is decided: counted, and its max_tokens held until it ends."""
        if not job.hedges:
            self.rows += 1
        job.hedges += 1
        self.backups += 1
        self.out += 1
        self.reserved += self.max_tokens(job)

    def release(self, job: Job) -> None:
        self.out -= 1
        self.reserved -= self.max_tokens(job)

    def budget_left(self) -> float:
        return self.fraction * self.tokens - self.extra_tokens - self.reserved

    # ------------------------------------------------------------------ flights
    def start(self, srv: ServerState, job: Job, backup: bool = False) -> Flight:
        """A send of `job` to `srv` (a backup: `reserve`d already)."""
        f = Flight(srv, job, backup)
        job.flights.append(f)
        self.on[srv.name][job.req.id] = f
        return f

    def end(self, f: Flight) -> None:
        job = f.job
        try:
            job.flights.remove(f)
        except ValueError:
            return   # ended already (a win ends the losers at once; their sends end them again)
        table = self.on[f.srv.name]
        if table.get(job.req.id) is f:
            del table[job.req.id]
        if f.backup:
            self.release(job)

    def take(self, item: Backup, srv: ServerState) -> Job | None:
        """A worker of `srv` took `item` from the queue: the row to back up, or None when the
        backup is moot (the row ended or moved on, no send of it is out, or one is on `srv`)."""
        job = item.job
        self.queued.discard(job.req.id)
        if not job.flights or any(f.srv is srv for f in job.flights) or len(job.flights) > 1:
            self.release(job)
            return None
        return job

    def answered(self, f: Flight, out: Outcome) -> None:
        """`f` answered ok, first: the row is its; every other flight of the row loses."""
        tokens = out.completion_tokens or 0
        if f.backup:
            self.wins += 1
        now = time.monotonic()
        for other in list(f.job.flights):
            other.lost = True
            self.extra_tokens += min(tokens, int((now - other.t0) * self.rate(other.srv)))
            self.cancelled += 1
            if other.task is not None:
                other.task.cancel()
            self.end(other)

    def note(self, srv: ServerState, out: Outcome) -> None:
        """An ok answer on `srv` (every one taken): the budget's base, the server's
        per-request token rate."""
        tokens = out.completion_tokens or 0
        self.tokens += tokens
        r = self._rate[srv.name]
        r[0] = r[0] * DECAY + tokens
        r[1] = r[1] * DECAY + out.latency_s

    def rate(self, srv: ServerState) -> float:
        """Tokens per second of one request on `srv` (0.0 before it answered one)."""
        tok, sec = self._rate[srv.name]
        return tok / sec if sec > 0 else 0.0

    def max_tokens(self, job: Job) -> int:
        m = job.req.params.get("max_tokens") if job.req.params else None
        return m if isinstance(m, int) and m > 0 else self.default_max_tokens

    # ------------------------------------------------------------------ which rows, where
    def plan(self) -> tuple[list[Job], list[tuple[ServerState, Job]]]:
        """The backups to send now, each `reserve`d: a suspect's rows (for the queue's front),
        and at the tail (server with free slots, row)."""
        if self.fraction <= 0:
            return [], []
        up = [s for s in self.servers if s.state == "up" and s.session is not None]
        suspects = [s for s in up if self.suspected(s)]
        # not a rate-limited server (paused, or at its lowered limit: dispatch._rate_limited) nor one
        # whose refusals await a verdict: a backup there would only be refused too
        now = time.monotonic()
        targets = [s for s in up if s not in suspects and not s.limit and s.paused_until <= now and not s.pending]
        if not targets:
            return [], []
        left = self.budget_left()
        queued: list[Job] = []
        for f in sorted((f for s in suspects for f in self.on[s.name].values() if self._alone(f)),
                        key=lambda f: f.t0):
            m = self.max_tokens(f.job)
            if m <= left:
                left -= m
                queued.append(f.job)
        direct: list[tuple[ServerState, Job]] = []
        if self.feed_done() and not len(self.queue):
            direct = self._tail(up, suspects, targets, left)
        for job in queued:
            self.reserve(job)
            self.queued.add(job.req.id)
        for _, job in direct:
            self.reserve(job)
        return queued, direct

    def _alone(self, f: Flight) -> bool:
        """A row's only send, with no backup queued for it."""
        return len(f.job.flights) == 1 and not f.lost and f.job.req.id not in self.queued

    def _tail(self, up: list[ServerState], suspects: list[ServerState], targets: list[ServerState],
              left: float) -> list[tuple[ServerState, Job]]:
        now = time.monotonic()
        room = {t.name: t.concurrency - t.in_flight for t in targets}
        fastest = max((self.rate(t) for t in targets), default=0.0)
        out: list[tuple[ServerState, Job]] = []
        for _, f in self._candidates([s for s in up if s not in suspects], now, fastest):
            m = self.max_tokens(f.job)
            if m > left:
                continue
            t = self._target(f, targets, room, now)
            if t is None:
                continue
            room[t.name] -= 1
            left -= m
            out.append((t, f.job))
        return out

    def _candidates(self, servers: list[ServerState], now: float,
                    fastest: float) -> list[tuple[tuple[int, float], Flight]]:
        """At the tail, the flights worth a backup, best first: overdue ones (oldest first), then
        by how much later than a backup they may end. A row on a server that has answered
        nothing yet is overdue once older than a max_tokens row takes on the fastest."""
        found: list[tuple[tuple[int, float], Flight]] = []
        for s in servers:
            r = self.rate(s)
            for f in self.on[s.name].values():
                if not self._alone(f):
                    continue
                age = now - f.t0
                worst = self.max_tokens(f.job) / r if r > 0 else 0.0
                if r <= 0:
                    if fastest > 0 and age > OVERDUE * self.max_tokens(f.job) / fastest:
                        found.append(((1, -age), f))
                elif age > OVERDUE * worst:
                    found.append(((1, -age), f))
                else:
                    found.append(((2, -(worst - age)), f))
        found.sort(key=lambda x: x[0])
        return found

    def _target(self, f: Flight, targets: list[ServerState], room: dict[str, int],
                now: float) -> ServerState | None:
        """The server with room that would finish a max_tokens row soonest, if that beats `f`."""
        m = self.max_tokens(f.job)
        best: tuple[float, ServerState] | None = None
        for t in targets:
            r = self.rate(t)
            if t is f.srv or room[t.name] <= 0 or r <= 0:
                continue
            cost = m / r
            if best is None or cost < best[0]:
                best = (cost, t)
        if best is None:
            return None
        r = self.rate(f.srv)
        age = now - f.t0
        if r <= 0:   # its server has answered nothing: overdue against the target's own time
            return best[1] if age > OVERDUE * best[0] else None
        overdue = age > OVERDUE * m / r
        return best[1] if overdue or best[0] < MARGIN * (m / r - age) else None

    def stats(self) -> dict[str, Any]:
        """The job's record (progress.json, the manifest)."""
        return {"backups": self.backups, "out": self.out, "rows": self.rows, "wins": self.wins,
                "cancelled": self.cancelled, "extra_tokens": self.extra_tokens, "max_extra_fraction": self.fraction,
                "bound_tokens": int(self.fraction * self.tokens)}
