"""Per-server health: admission, the down/relaunch/readmit cycle, the stall watchdog, the tail rule.

    starting ──admit──► up ──mark_down──► down ──recover──► recovering ──admit──► up
                                            ▲                   │ (not yet: a growing delay)
                                            └───────────────────┘

A server is marked DOWN after `down_after` consecutive connection failures (or a failed
stall probe, or one 401/403/404, or its process gone per `is_alive`, or `down_after_5xx`
5xx in a row, or `down_after_invalid` invalid answers in a row, or an invalid answer and a
failed answer probe): its workers are cancelled — and each checks its server's state before and
after every request (`ServerState.alive_in`), because a cancellation that races aiohttp's
own timeout is lost — every row it held goes back to the queue uncharged, and
`on_server_down(endpoint)` is awaited (the runner relaunches, waits and smokes it); True
re-admits the server (a restart), READMITTED re-admits one found fine without a relaunch (an
`[[endpoints]]` server fleet did not start, or one that recovered by itself: counted apart, as
`readmissions`, since nothing was restarted), False tries again after a growing delay. Without a callback the
server is re-admitted once /health_generate answers (it runs a generation, so a server
whose /health answers while generation hangs stays out). With every server down the job
is *paused* — the queue simply has no consumer, so no retries are burned — until one
comes back.

Connection errors, and timeouts while the server finished nothing else, are *suspects*: if
the server turns out to be dead or stalled (a probe, the next requests, or the process
check fail too), the row goes back to the queue and no attempt is charged; if the server is
fine, the attempt is charged and the row retried (`resolve_suspects`).

The stall watchdog (`watchdog`): a server with rows in flight whose engine's token count
(/metrics, read every few seconds on a connection of its own; or, for an engine without
counters (`Endpoint.stream`), the chunks of the few rows streamed at a time, `streamed_rows`, while
its rows are long: `rows_show_progress`) has not moved, and that finished
no row, for `stall_s` (30 s by default, whatever the row length) is *under suspicion*
(`ServerState.under_suspicion`: its rows may be sent elsewhere meanwhile) and gets a generation
probe (/health_generate, else a one-token chat); a failed probe marks it down. An engine that
counts no tokens is judged by finished rows, on a clock derived from its recent p99 row time
(`row_stall_s`).

The tail: once the input is exhausted, a server markedly slower than the others leaves the
last rows to them whenever they would finish those sooner (`others_sooner`), so the
slowest GPU does not become the job's last finisher (bench/bench_balance.py).
Per server, `Timeline` keeps [elapsed, in flight, completed, tokens] over the whole job in
bounded memory (progress.json and the manifest carry it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

import aiohttp

from fleet.backoff import backoff_delay
from fleet.config import GenerationConfig
from fleet.generation.hotpath import probes, tokens
from fleet.generation.hotpath.client import new_session
from fleet.generation.hotpath.rowqueue import Ledger
from fleet.generation.hotpath.serverstate import Endpoint, ServerState, median, quantile

log = logging.getLogger("fleet.generation")

__all__ = ["IsAlive", "OnServerDown", "READMITTED", "ServerHealth"]


READMITTED: Literal["readmitted"] = "readmitted"   # on_server_down: fine again, and nothing was restarted
OnServerDown = Callable[[Endpoint], Awaitable[bool | Literal["readmitted"]]]
_SIGN = {"metrics": "no token progress", "stream": "no streamed token"}   # the stall, by progress source
IsAlive = Callable[[Endpoint], bool | None]
Spawn = Callable[[Awaitable[Any], str], "asyncio.Task[Any]"]
Worker = Callable[[ServerState, int], Coroutine[Any, Any, None]]


class ServerHealth:
    """Every server's state and the tasks that keep it honest; the dispatcher's workers send the rows.

    `spawn` runs a background task of the dispatcher (one that raises fails the job);
    `worker(srv, epoch)` is one worker of an admitted server; `on_change` is called when a
    server's state changed (the dispatcher's own state follows: running / paused).
    """

    def __init__(
        self,
        endpoints: list[Endpoint],
        gen: GenerationConfig,
        rows: Ledger,
        *,
        spawn: Spawn,
        worker: Worker,
        on_change: Callable[[], None],
        on_server_down: OnServerDown | None,
        is_alive: IsAlive | None,
        down_after: int,
        down_after_5xx: int,
        down_after_invalid: int,
        recovery_backoff_s: float,
        recovery_backoff_max_s: float,
        probe_interval_s: float,
        health_timeout_s: float,
        stats_poll_s: float,
        liveness_poll_s: float,
        stall_poll_s: float,
        stall_probe_timeout_s: float,
        rng: random.Random,
    ) -> None:
        self.gen = gen
        self.rows = rows
        self.servers = [ServerState(e) for e in endpoints]
        self.spawn, self.worker, self.on_change = spawn, worker, on_change
        self.on_server_down = on_server_down
        self.is_alive = is_alive
        self.down_after = down_after
        self.down_after_5xx = down_after_5xx
        self.down_after_invalid = down_after_invalid
        self.max_bytes = int(gen.max_response_mib * (1 << 20))
        self.recovery_backoff_s, self.recovery_backoff_max_s = recovery_backoff_s, recovery_backoff_max_s
        self.probe_interval_s = probe_interval_s
        self.health_timeout_s = health_timeout_s
        self.stats_poll_s = stats_poll_s
        self.liveness_poll_s = liveness_poll_s
        self.stall_poll_s = stall_poll_s
        self.stall_probe_timeout_s = stall_probe_timeout_s   # SGLang's own health check allows 20 s
        self.rng = rng
        self.t0 = time.monotonic()   # the job's start (the timelines' zero)
        self.lats: collections.deque[float] = collections.deque(maxlen=256)  # recent row times, every server

    # ------------------------------------------------------------------ admission, down, recovery
    def concurrency(self, srv: ServerState) -> int:
        if srv.ep.max_in_flight:   # set by hand for an endpoint (a router: the sum of its workers)
            return srv.ep.max_in_flight
        reported = probes.max_running(srv.info) or srv.ep.max_running_requests
        cap = self.gen.max_concurrency_per_server
        return max(1, min(reported, cap)) if reported else cap

    async def admit(self, srv: ServerState) -> bool:
        """Look the server up and start its workers; False (and why, in down_reason) when it is not usable."""
        session = new_session(self.gen.max_concurrency_per_server, api_key=srv.ep.api_key)
        try:
            reason = await probes.usable(srv.ep, session)
            if reason is None:
                srv.stats_missing = set()   # (re)admitted: perhaps another engine on that port now
                srv.info = await probes.server_info(srv.ep, session, srv.stats_missing)
        finally:
            await session.close()
        if reason is not None:
            srv.down_reason = reason
            return False
        srv.concurrency = self.concurrency(srv)
        # the pool is exactly as wide as the concurrency
        srv.session = new_session(srv.concurrency, api_key=srv.ep.api_key)
        srv.state = "up"
        srv.down_reason = None
        srv.conn_streak = srv.err_streak = srv.bad_streak = 0
        srv.garbled = srv.refusing = False
        # judged afresh: its refusals and rate limits were of the process or the quota before
        srv.pending, srv.overruled = set(), 0
        srv.paused_until, srv.limit, srv.grow, srv.limited_since, srv.limited_streak = 0.0, 0, 0, None, 0
        srv.epoch += 1
        srv.last_done = time.monotonic()
        # a relaunched engine starts its counters again, and may be another build: read afresh
        srv.progress = "stream" if srv.ep.stream else None
        srv.tokens, srv.read_at, srv.suspect_since = None, 0.0, None
        srv.gen_read = None   # its generated-token counter: the next reading is a baseline
        srv.generated_at = 0.0   # what an earlier process on this port generated proves nothing of this one
        srv.workers = [asyncio.ensure_future(self.worker(srv, srv.epoch)) for _ in range(srv.concurrency)]
        log.info("server %s up at %s: %d workers", srv.name, srv.ep.url, srv.concurrency)
        self.on_change()
        return True

    async def admit_or_recover(self, srv: ServerState) -> None:
        if not await self.admit(srv):
            self.mark_down(srv, srv.down_reason or "not usable")

    def mark_down(self, srv: ServerState, reason: str, *, garbled: bool = False, refusing: bool = False) -> None:
        """Take `srv` out: its workers stop, its rows go back, its recovery starts. `garbled`: for
        invalid answers, judged over several rows, so its suspects go back uncharged and unmarked
        (the poison count is for rows that kill servers), and it comes back only with a valid answer.
        `refusing`: for 4xx answers the other servers did not give; without a relaunch it comes
        back only once it answers a request it refused (`ServerState.refused_sample`)."""
        if srv.state in ("down", "recovering"):
            return
        if srv.state == "starting":
            srv.downs -= 1   # never up: not a failure of a running server
        log.warning("server %s down: %s", srv.name, reason)
        srv.state = "down"
        srv.down_reason = reason
        srv.down_since = time.monotonic()
        srv.suspect_since = None
        srv.downs += 1
        srv.garbled = garbled
        srv.refusing = refusing
        srv.pending = set()
        suspects, srv.suspects = srv.suspects, []
        for job in suspects:
            self.rows.requeue(job, poison=not garbled)
        me = asyncio.current_task()
        if srv.probe is not None and srv.probe is not me:
            srv.probe.cancel()
        for w in srv.workers:
            if w is not me:
                w.cancel()       # its row goes back to the queue in the worker's handler
        if me in srv.workers:
            me.cancel()          # the worker that noticed: cancelled at its next await
        self.on_change()
        if not self.rows.stopping:
            srv.recovery = self.spawn(self.recover(srv), f"recover-{srv.name}")

    async def recover(self, srv: ServerState) -> None:
        """Until the server is back: the callback (relaunch + smoke) or a health poll."""
        workers, srv.workers = srv.workers, []
        # Cancelled in mark_down; a worker whose cancellation was lost (it raced aiohttp's own
        # timeout) stops at its next state check. Never let one hold the relaunch back.
        if workers:
            await asyncio.wait(workers, timeout=5.0)
        if srv.session is not None:
            session, srv.session = srv.session, None
            await session.close()
        rounds = 0
        while not self.rows.stopping:
            srv.state = "recovering"
            try:
                readmitted = True
                if self.on_server_down is not None:
                    got = await self.on_server_down(srv.ep)
                    ok, readmitted = bool(got), got == READMITTED
                    if ok and not readmitted:
                        srv.restarts += 1
                else:
                    # /health may answer while generation hangs; /health_generate runs one (SGLang)
                    ok = await probes.ping(srv.ep, None, "/health_generate", timeout=self.health_timeout_s,
                                           missing_ok=True)
                    if ok and srv.garbled:   # out for invalid answers: back only with a valid one
                        ok, _ = await probes.answer_probe(srv.ep, self.stall_probe_timeout_s, self.max_bytes)
                # out for its refusals: back once it answers one (an endpoint's smoke, or a live server
                # the relaunch path finds fine, answers a short prompt that a shorter context takes)
                if ok and srv.refusing and srv.refused_sample is not None:
                    ok, why = await probes.answer_probe(srv.ep, self.gen.request_timeout_s, self.max_bytes,
                                                        srv.refused_sample)
                    if not ok:
                        log.info("server %s still refuses: %s", srv.name, why)
                if ok and await self.admit(srv):
                    srv.readmissions += readmitted
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the callback's failure is the server's, never the job's
                log.warning("recovering server %s failed: %s", srv.name, exc)
                srv.down_reason = f"recovery failed: {exc}"[:500]
            srv.state = "down"
            self.on_change()
            rounds += 1
            await asyncio.sleep(backoff_delay(rounds, self.recovery_backoff_s, max_s=self.recovery_backoff_max_s,
                                              jitter=0.25, rng=self.rng))

    async def poll_liveness(self) -> None:
        """The runner knows each server's process: a dead one is taken out at once, not after timeouts."""
        assert self.is_alive is not None
        while True:
            await asyncio.sleep(self.liveness_poll_s)
            for srv in self.servers:
                if srv.state != "up":
                    continue
                try:
                    alive = self.is_alive(srv.ep)
                except Exception:  # a check that cannot tell says nothing
                    alive = None
                if alive is False:
                    self.mark_down(srv, "server process exited")

    # ------------------------------------------------------------------ the stall watchdog
    def row_stall_s(self, srv: ServerState) -> float:
        """Without token counters: how long `srv` may hold rows without finishing one."""
        g = self.gen
        lats = srv.lats if len(srv.lats) >= 8 else self.lats
        if not lats:
            return g.stall_max_s
        return min(g.stall_max_s, max(g.stall_min_s, 3.0 * quantile(lats, 0.99)))

    def suspected(self, srv: ServerState) -> bool:
        """Under stall suspicion: the watchdog doubts `srv` and its probe has not decided yet.
        Backups (fleet.generation.hotpath.hedge) send its rows elsewhere meanwhile."""
        return srv.under_suspicion

    def stall_s(self, srv: ServerState) -> float:
        """How long `srv` may hold rows without progress before it is probed: `stall_s` when its
        engine counts tokens, else the row clock (`row_stall_s`)."""
        return self.gen.stall_s if srv.progress in ("metrics", "stream") else self.row_stall_s(srv)

    def read_every_s(self) -> float:
        """How often a busy server's token counters are read: four times per stall_s, at most every 5 s."""
        return max(self.stall_poll_s, min(5.0, self.gen.stall_s / 4))

    async def read_progress(self, srv: ServerState, session: aiohttp.ClientSession) -> None:
        """Read `srv`'s token counters; a total that moved is progress. A server without them
        (/metrics answers 404 or counts no tokens) is judged by finished rows from then on,
        until it is admitted again; one that does not answer at all shows no progress."""
        now = time.monotonic()
        srv.read_at = now
        kind, total, generated = await probes.token_count(srv.ep, session,
                                                          timeout=max(1.0, min(5.0, self.gen.stall_s / 2)))
        if kind != "failed":
            tokens.note_reading(srv, generated)
        if kind == "none":
            if srv.progress != "rows":
                log.info("server %s counts no tokens at /metrics: judged by finished rows", srv.name)
            srv.progress = "rows"
        elif kind == "failed":
            srv.progress = srv.progress or "metrics"   # silent: its stall clock runs
        elif total != srv.tokens:
            if srv.tokens is not None:   # moved since the last reading: it generated (a first reading is a baseline)
                srv.generated_at = now
            srv.progress, srv.tokens, srv.tokens_at, srv.suspect_since = "metrics", total, now, None

    async def watchdog(self) -> None:
        """A server with rows in flight and no progress for stall_s gets a generation probe.

        Progress is the engine's token count (read from /metrics every `read_every_s`), a
        finished row, or the moment it became busy. Tokens that advance, however slowly, keep
        a server in without a probe: a long prefill, 4,096-token rows, requests queued behind
        a full KV cache. Where the engine counts no tokens, "no row finished" for the row clock
        (3 x the recent p99 row time, `row_stall_s`) is the sign. The probe keeps a
        slow-but-working server in (SGLang answers /health_generate as soon as its scheduler
        outputs anything); a stopped or wedged one fails it and is taken out.
        """
        session = aiohttp.ClientSession()   # its own pool: the servers' pools are full of rows
        try:
            while True:
                await asyncio.sleep(self.stall_poll_s)
                now = time.monotonic()
                due = []
                for srv in self.servers:
                    srv.timeline.sample(now - self.t0, srv.in_flight, srv.requests, srv.completion_tokens)
                    if srv.state != "up" or not srv.in_flight or srv.probing:
                        continue
                    if srv.progress in (None, "metrics") and now - srv.read_at >= self.read_every_s():
                        due.append(srv)
                if due:
                    await asyncio.gather(*(self.read_progress(s, session) for s in due))
                    now = time.monotonic()
                for srv in self.servers:
                    if srv.state == "up" and srv.in_flight and not srv.probing:
                        self._judge(srv, now)
        finally:
            await session.close()

    def _judge(self, srv: ServerState, now: float) -> None:
        quiet = srv.quiet_s(now)
        limit = self.stall_s(srv)
        if quiet < limit:
            return
        what = _SIGN.get(srv.progress or "", "no row finished")
        why = f"{what} for {quiet:.0f} s with {srv.in_flight} in flight"
        srv.suspect_since = srv.suspect_since or now
        self.spawn(self.stall_probe(srv, why), f"stall-{srv.name}")

    async def stall_probe(self, srv: ServerState, why: str) -> None:
        srv.probing = True
        srv.stalls += 1
        epoch = srv.epoch
        try:
            ok, detail = await probes.generation_probe(srv.ep, self.stall_probe_timeout_s)
        finally:
            srv.probing = False
        if not srv.alive_in(epoch):
            return
        if ok:
            log.info("server %s: %s, but its generation probe answers: kept", srv.name, why)
            srv.last_done = time.monotonic()   # judged again after another stall_s
            srv.suspect_since = None
            if srv.suspects:
                self.resolve_suspects(srv)   # the server works: the timeouts were the rows' own
            return
        self.mark_down(srv, f"stalled: {why}; {detail}")

    async def answer_probe(self, srv: ServerState, why: str) -> None:
        """After an invalid answer: does the server answer a one-token chat with a valid completion?
        Yes: the row was to blame (its suspects are charged, retried). No: the server is out."""
        srv.answer_probing = True
        epoch = srv.epoch
        try:
            ok, detail = await probes.answer_probe(srv.ep, self.stall_probe_timeout_s, self.max_bytes)
        finally:
            srv.answer_probing = False
        if not srv.alive_in(epoch):
            return
        if ok:
            srv.bad_streak = 0
            if srv.suspects:
                self.resolve_suspects(srv)
            return
        self.mark_down(srv, f"an invalid answer ({why}), and its answer probe failed: {detail}"[:800], garbled=True)

    async def probe(self, srv: ServerState) -> None:
        """After a connection failure: is the server there at all? Decides the suspects' fate."""
        while srv.state == "up" and srv.suspects:
            if await probes.ping(srv.ep, srv.session, "/v1/models", timeout=5.0):
                if srv.state == "up":
                    srv.conn_streak = 0
                    self.resolve_suspects(srv)
                return
            srv.conn_streak += 1
            if srv.conn_streak >= self.down_after:
                self.mark_down(srv, f"{srv.conn_streak} connection failures in a row (probe of /v1/models)")
                return
            await asyncio.sleep(self.probe_interval_s)

    def resolve_suspects(self, srv: ServerState) -> None:
        """The server is alive: the connection failures were the rows' own, charge them."""
        suspects, srv.suspects = srv.suspects, []
        for job in suspects:
            self.rows.charge_and_retry(job)

    async def poll_stats(self) -> None:
        """Speculative accept length (and liveness of the numbers) every stats_poll_s.

        On a connection of its own per server, never one of the rows': their pool is exactly
        as wide as the server's concurrency, so a probe waiting there takes the next connection
        a row frees and that row's next request waits behind the probe (issue 27: 7-12 such
        waits per pass on `transformers serve`). A path answered 404 is not asked again, and a
        server with none of them left (transformers serve) is not asked at all.
        """
        sessions: dict[str, aiohttp.ClientSession] = {}
        try:
            while True:
                for srv in self.servers:
                    if srv.state != "up" or srv.stats_missing >= probes.STATS_PATHS:
                        continue
                    session = sessions.get(srv.name)
                    if session is None:
                        session = sessions[srv.name] = new_session(1, api_key=srv.ep.api_key)
                    try:
                        srv.accept_len = await probes.accept_len(srv.ep, session, srv.accept_len, srv.stats_missing)
                    except Exception:  # stats are best effort
                        pass
                await asyncio.sleep(self.stats_poll_s)
        finally:
            for session in sessions.values():
                await session.close()

    def rows_show_progress(self, srv: ServerState) -> bool:
        """Its rows finish often enough to be its progress: each of its last 8-64 took under a
        quarter of stall_s. Then nothing is streamed to it (`Endpoint.stream`): on `transformers
        serve` a streamed row in flight costs the engine a wake-up of its HTTP thread at every
        decode step, two such rows about 10-15 % of its tok/s on an H200 (bench/RESULTS.md, issue
        27), and a wedged engine still finishes no row for stall_s."""
        return len(srv.lats) >= 8 and max(srv.lats) < self.gen.stall_s / 4

    def note_done(self, srv: ServerState, latency_s: float) -> None:
        """A request finished on `srv`: the watchdog's clock and the row-time estimate."""
        now = time.monotonic()
        srv.last_done = srv.generated_at = now
        srv.lats.append(latency_s)
        self.lats.append(latency_s)
        if srv.lat is None or len(srv.lats) <= 8 or now - srv.lat_at >= 0.5:
            # the median of recent rows: one warm-up row (first request: seconds) must not
            # decide how fast the server is for the next hundred
            srv.lat, srv.lat_at = median(srv.lats), now

    # ------------------------------------------------------------------ the tail
    def others_sooner(self, srv: ServerState) -> bool:
        """At the tail: would the other servers finish the next row before this one could?

        While input keeps coming the queue is long and every server pulls. Once the input is
        exhausted, a markedly slower server that takes one of the last rows becomes the
        job's last finisher: it then leaves them to the others if they would drain the
        queue *and* finish that row before it would (its recent latency per row).

        Never on a stale estimate: a server's row time is the median of its recent rows (a
        warm-up row does not count for a hundred) and needs three of them; the others count
        only while they finish rows; and a held server idle for two of its row times takes a
        row to refresh its estimate (`hold_at_tail`).
        """
        lat = srv.lat
        now = time.monotonic()
        # only servers that are finishing rows: one that has finished nothing for three of its
        # row times (stopped, wedged: not yet caught by the watchdog) will not drain the queue
        others = [(s, s_lat) for s in self.servers if s is not srv and s.state == "up" and (s_lat := s.lat)
                  and (s.in_flight == 0 or now - s.last_done < 3 * s_lat)]
        if lat is None or len(srv.lats) < 3 or not others:
            return False   # no estimate yet (one warm-up row says nothing): never hold on it
        best = min(s_lat for _, s_lat in others)
        if lat <= 1.5 * best:
            return False
        rate = sum(s.concurrency / s_lat for s, s_lat in others)
        return lat > (len(self.rows.queue) + 1) / rate + best

    async def hold_at_tail(self, srv: ServerState) -> None:
        # a slow server may have hundreds of workers here: poll at a tenth of its row time
        pause = max(0.02, min(0.25, (srv.lat or 0.0) / 10))
        t0 = time.monotonic()
        try:
            while len(self.rows.queue) and not self.rows.stopping and self.others_sooner(srv):
                lat = srv.lat or 0.0
                if srv.in_flight == 0 and time.monotonic() - srv.last_done > 2 * lat:
                    # Held, idle, and its estimate is older than two of its rows: it may be
                    # stale (a held server learns nothing). One row refreshes it; the others
                    # stay held (in_flight is 1 before they look again).
                    srv.refreshes += 1
                    return
                await asyncio.sleep(pause)
        finally:
            srv.held_s += time.monotonic() - t0
