"""The dispatcher: one queue, every healthy server pulling from it, exactly once.

    input iterator ──(thread, batches)──► feeder ──► WorkQueue ◄── K workers per server ──► chat()
                                                    ▲   (bounded: backpressure)                   │
                 retries (backoff + jitter) ────────┘                                             ▼
                 requeues (server died) ───────────┘                    store.add_result / add_error

Work stealing: every worker of every server takes the next row from the same queue as soon
as its previous one is done, so a slow server simply takes fewer rows; nothing is split in
advance. K per server = min(the server's max running requests, the configured cap).

This module is the loop: the feeder, the workers, and where each answer goes (`_handle`).
The rest lives beside it:

- `fleet.generation.hotpath.client`: one request, and how its answer is classified;
- `fleet.generation.hotpath.rowqueue`: the queue, and the books that write each row exactly once
  and charge a row only for its own failures;
- `fleet.generation.hotpath.health`: each server's health — admission, down, relaunch, re-admission,
  the stall watchdog, the tail rule;
- `fleet.generation.hotpath.serverstate`: what is known of one server (state, counters, row times);
- `fleet.generation.hotpath.probes`: the HTTP checks health makes;
- `fleet.generation.hotpath.hedge`: backup requests at the tail and on suspicion, and which send of
  a row owns it while two race (`Job.flights`).

How an answer is handled:
- ok: the row's next request (a turn, a gate's retry) or its result;
- permanent (a 400 for a prompt over the context, say): the row's fault only when a second server
  says so too (or none other can ask): else it goes back uncharged to another server, and the
  server that refused it is judged by what the others answer (`_refused`): one whose refusals
  others answer `down_after_4xx` times in a row is taken out, like a crash, and back only once it
  answers one (a server with a shorter context, a missing LoRA, a stricter validator);
- rate-limited (429, a 503 with Retry-After): uncharged, back to the queue; the server gets nothing
  new until its Retry-After (capped by `retry_after_max_s`), its in-flight limit halves and grows
  back with answers (AIMD, `_rate_limited`); one that answers nothing else for `rate_limit_down_s` is down;
- transient (5xx, an abort): retried after an exponential, jittered delay, on another server when
  one can take it; after `max_attempts` attempts the row goes to errors with the last error;
- invalid (a body that is not a chat completion, an answer over the size cap, a status no chat
  endpoint gives): a *suspect*, like a connection error — `down_after_invalid` in a row take the
  server out (its rows go back uncharged), else an answer probe decides: a valid one-token
  completion says the row was to blame (charged, retried), another invalid answer takes the
  server out. So a server that answers garbage is taken out (and relaunched) like a crashing
  one, and its rows end on the others, neither in errors nor in quality rejects;
- unusable (401/403/404): the server is marked down, the row goes back uncharged;
- connection errors, and timeouts while the server finished nothing else, are *suspects*
  until the server is known dead (back to the queue, uncharged) or alive (charged, retried);
- any failure while another send of the row (a backup, or the send it backs up) is still
  out: dropped, the other carries the row; an ok answer cancels the other send.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import aiohttp

from fleet.config import GenerationConfig
from fleet.generation.hotpath.client import Outcome, chat
from fleet.generation.hotpath.health import IsAlive, OnServerDown, ServerHealth
from fleet.generation.hotpath.hedge import Backup, Flight, Hedge
from fleet.generation.data.manifest import Summary
from fleet.generation.hotpath.rowqueue import Job, Ledger, Store, WorkQueue
from fleet.generation.hotpath.serverstate import Endpoint, Rate, ServerState
from fleet.generation.hotpath import tokens as gen_tokens
from fleet.generation.hotpath.work import RowPlan

log = logging.getLogger("fleet.generation")

__all__ = ["Dispatcher", "Endpoint"]



class Dispatcher:
    """Push rows through a set of servers; see the module docstring for the rules."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        store: Store,
        gen: GenerationConfig,
        *,
        on_server_down: OnServerDown | None = None,
        is_alive: IsAlive | None = None,
        queue_size: int | None = None,
        down_after: int = 3,
        down_after_5xx: int = 50,
        down_after_invalid: int = 3,
        down_after_4xx: int = 3,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        jitter: float = 0.5,
        recovery_backoff_s: float = 2.0,
        recovery_backoff_max_s: float = 30.0,
        probe_interval_s: float = 0.5,
        health_timeout_s: float = 60.0,
        stats_poll_s: float = 10.0,
        liveness_poll_s: float = 2.0,
        stall_poll_s: float = 1.0,
        stall_probe_timeout_s: float = 20.0,
        hedge_poll_s: float = 1.0,
        bounds_poll_s: float = 1.0,
        feed_batch: int = 256,
        seed: int | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no servers to dispatch to")
        names = [e.name for e in endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique: {names}")
        self.gen = gen
        self.store = store
        self.plan = RowPlan(gen)   # turns, quality gates, reasoning effort: per row, in work.RowWork
        self.queue_size = queue_size
        self.feed_batch = feed_batch
        rng = random.Random(seed)
        self.state = "starting"
        self.reason: str | None = None
        self.queue = WorkQueue(queue_size or 1024)
        self.rows = Ledger(store, self.queue, max_attempts=gen.max_attempts, backoff_s=backoff_s,
                           backoff_max_s=backoff_max_s, jitter=jitter, rng=rng, fail=self._fail)
        self.health = ServerHealth(
            endpoints, gen, self.rows, spawn=self._spawn, worker=self._worker, on_change=self._update_state,
            on_server_down=on_server_down, is_alive=is_alive, down_after=down_after, down_after_5xx=down_after_5xx,
            down_after_invalid=down_after_invalid,
            recovery_backoff_s=recovery_backoff_s, recovery_backoff_max_s=recovery_backoff_max_s,
            probe_interval_s=probe_interval_s, health_timeout_s=health_timeout_s, stats_poll_s=stats_poll_s,
            liveness_poll_s=liveness_poll_s, stall_poll_s=stall_poll_s, stall_probe_timeout_s=stall_probe_timeout_s,
            rng=rng)
        self.servers = self.health.servers
        self.by_name = {s.name: s for s in self.servers}
        self.down_after_4xx = down_after_4xx
        self.queue.skip = self._skip
        self.bounds_poll_s = bounds_poll_s
        self.remedy: str | None = None   # a failure's remedy when the dispatcher knows it (no server usable)
        self.hedge = Hedge(gen.hedge_max_extra_fraction, self.servers, self.queue, self.health.suspected,
                           lambda: self.rows.feed_done, gen.max_tokens)
        self.hedge_poll_s = hedge_poll_s
        self._tasks: set[asyncio.Task[Any]] = set()
        self._t0 = time.monotonic()
        self._started_at = time.time()
        self._rate = Rate()
        self.task_error: BaseException | None = None   # the first task or worker that raised (see _task_ended)

    # ------------------------------------------------------------------ public
    async def run(self, items: Iterable[Any]) -> Summary:
        """Feed `items` (rows.Request / rows.Reject) through the servers until every row
        ended, or a stop; return what happened."""
        self.rows.done = asyncio.Event()
        self._t0 = self.health.t0 = time.monotonic()
        self._started_at = time.time()
        total_k = sum(min(e.max_running_requests or self.gen.max_concurrency_per_server,
                          self.gen.max_concurrency_per_server) for e in (s.ep for s in self.servers))
        self.queue.maxsize = self.queue_size or max(1024, 2 * total_k)
        await asyncio.gather(*(self.health.admit_or_recover(s) for s in self.servers))
        self._update_state()
        self._spawn(self._feed(items), "feeder")
        self._spawn(self.health.poll_stats(), "stats")
        self._spawn(self.health.watchdog(), "watchdog")
        if self.health.is_alive is not None:
            self._spawn(self.health.poll_liveness(), "liveness")
        if self.hedge.fraction > 0:
            self._spawn(self._hedger(), "hedger")
        self._spawn(self._bounds(), "bounds")
        try:
            await self.rows.done.wait()  # bounded: the job itself: set once every row has ended, or by a stop
        finally:
            await self._shutdown()
        return self.summary()

    def request_stop(self, grace_s: float = 60.0, reason: str = "stop requested") -> None:
        """Stop taking rows; let the in-flight ones finish for up to `grace_s`, then end.

        Called again (a second signal), the shorter grace wins."""
        if self.rows.stopping:
            self._spawn(self._grace(grace_s), "grace")
            return
        self.rows.stopping = True
        self.reason = self.reason or reason
        self.state = "stopping"
        self.rows.cancel_retries()
        self.queue.close(stop=True)
        self._spawn(self._grace(grace_s), "grace")

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def snapshot(self) -> dict[str, Any]:
        """Counters for the progress file (cheap; call every few seconds)."""
        now = time.monotonic()
        # generated: the rows in flight counted too (fleet.generation.hotpath.tokens), so that
        # the rate and the ETA move while rows of minutes decode, not only when one ends
        generated = gen_tokens.count(self.servers, self.hedge, now)
        rows_in_flight, oldest = gen_tokens.in_flight(self.hedge, now)
        servers = [s.snapshot(now) for s in self.servers]
        tokens = sum(s.completion_tokens for s in self.servers)
        return {
            "state": self.state, "reason": self.reason,
            "fed": self.rows.fed, "completed": self.rows.completed, "errors": self.rows.errors, "rejects": self.rows.rejects,
            "in_flight": self.in_flight, "rows_in_flight": rows_in_flight,
            "oldest_in_flight_s": round(oldest, 1) if oldest is not None else None,
            "queued": len(self.queue), "retries": self.rows.retries,
            "requeues": self.rows.requeues, "outstanding": len(self.rows.inflight),
            "prompt_tokens": sum(s.prompt_tokens for s in self.servers), "completion_tokens": tokens,
            "generated_tokens": round(generated),
            "tok_s": round(self._rate.update(now, round(generated)), 1),
            "tok_s_avg": round(generated / (now - self._t0), 1) if now > self._t0 else 0.0,
            "elapsed_s": round(now - self._t0, 1), "servers_up": sum(s.state == "up" for s in self.servers),
            "hedge": self.hedge.stats(), "servers": servers,
        }

    def summary(self) -> Summary:
        now = time.monotonic()
        gen_tokens.count(self.servers, self.hedge, now)   # each server's tok_s, as in progress.json
        for s in self.servers:   # the last point: the timeline ends where the job did
            s.timeline.sample(now - self._t0, s.in_flight, s.requests, s.completion_tokens, force=True)
        complete = self.rows.feed_done and not self.rows.inflight
        state = "failed" if self.state.startswith("failed") else ("done" if complete else "stopped")
        return Summary(
            state=state, complete=complete, completed=self.rows.completed, errors=self.rows.errors, rejects=self.rows.rejects,
            fed=self.rows.fed, unfinished=len(self.rows.inflight), retries=self.rows.retries, requeues=self.rows.requeues,
            prompt_tokens=sum(s.prompt_tokens for s in self.servers),
            completion_tokens=sum(s.completion_tokens for s in self.servers),
            wall_s=now - self._t0, reason=self.reason, servers=[s.snapshot(now) for s in self.servers],
            quality_rejects=self.rows.quality_rejects, gates=self.plan.stats.as_dict(), hedge=self.hedge.stats(),
        )

    # ------------------------------------------------------------------ feeding
    async def _feed(self, items: Iterable[Any]) -> None:
        """Move rows from the (blocking) input iterator to the queue, a batch per thread hop."""
        it: Iterator[Any] = iter(items)
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1, thread_name_prefix="fleet-input")
        n = self.feed_batch

        def take() -> list[Any]:
            out = []
            for item in it:
                out.append(item)
                if len(out) >= n:
                    break
            return out

        try:
            while not self.rows.stopping:
                batch = await loop.run_in_executor(pool, take)
                if not batch:
                    break
                for item in batch:
                    if self.rows.stopping:
                        break
                    if not self.rows.accept(item):   # a reject, recorded
                        continue
                    if not await self.queue.put_fresh(Job(self.plan.work(item))):
                        break
        except Exception as exc:  # an unreadable input is fatal: stop cleanly, keep what is done
            log.exception("reading the input failed")
            self._fail(f"reading the input failed: {type(exc).__name__}: {exc}")
            return
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if not self.rows.stopping:
            self.rows.feed_done = True
            self.rows.check_done()

    # ------------------------------------------------------------------ background tasks, state
    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._task_ended)
        return task

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        """A background task (feeder, stats, liveness, watchdog, ...) that raised fails the job, loudly:
        a dead part must never leave the job running blind. `task_error` is the exception itself."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("dispatcher task %s failed", task.get_name(), exc_info=exc)
        if self.task_error is None:
            self.task_error = exc
        self._fail(f"the {task.get_name()} task failed: {type(exc).__name__}: {exc}")

    def _update_state(self) -> None:
        self.queue.rehand()   # a row waiting for another server than the waiting ones may suit them now
        if self.rows.stopping or self.state.startswith("failed"):
            return
        up = sum(s.state == "up" for s in self.servers)
        if up == 0 and all(s.state != "starting" for s in self.servers):
            if not self.state.startswith("paused"):
                log.warning("every server is down: the job is paused until one comes back")
            self.state = "paused: all servers down"
        elif up:
            self.state = "running"

    # ------------------------------------------------------------------ the hot path
    async def _worker(self, srv: ServerState, epoch: int) -> None:
        q = self.queue
        timeout = self.gen.request_timeout_s
        job: Job | None = None
        flight: Flight | None = None   # job's send: it reached (or may have reached) the server
        try:
            while srv.alive_in(epoch):
                if self.rows.feed_done and srv.lat is not None and len(q):
                    await self.health.hold_at_tail(srv)
                    if not srv.alive_in(epoch):
                        return
                if self.hedge.suspected(srv):
                    await self._while_suspected(srv)   # no new row for a server that may be wedged
                    if not srv.alive_in(epoch):
                        return
                item = None
                if srv.limit or srv.paused_until or len(srv.pending) >= self.down_after_4xx:
                    # rate-limited, or its refusals await the others' verdict (meanwhile it judges theirs)
                    item = await self._gate(srv, epoch)
                    if not srv.alive_in(epoch):
                        if item is not None:
                            q.put_again(item)
                        return
                flight = None
                if item is None:
                    # bounded: the feeder ends each queue with None; a down server's workers are cancelled
                    srv.reserved += 1   # past the gate: counted against its limit while it waits for a row
                    try:
                        item = await q.get(srv.name)
                    finally:
                        srv.reserved -= 1
                if item is None:
                    return
                if not srv.alive_in(epoch):   # went down while we waited: the row never left
                    q.put_again(item)
                    return
                if srv.paused_until > time.monotonic() or (srv.limit and srv.in_flight >= srv.limit):
                    q.put_again(item)   # rate-limited while it waited: the row is another worker's
                    continue
                if isinstance(item, Backup):   # a suspect server's row, sent here too
                    job = self.hedge.take(item, srv)
                    if job is None:
                        continue
                    flight = self.hedge.start(srv, job, backup=True)
                else:
                    job = item
                    flight = self.hedge.start(srv, job)
                out = await self._send(srv, flight, timeout)
                job = None
                landed = self._landed(srv, epoch, flight, out)
                # stored or buffered now: its texts (tens of MB for a runaway answer) are not held
                # while this worker waits for its next row and that row's answer
                out = None
                if not landed:
                    return
        except asyncio.CancelledError:
            # back to the queue unless another send of the row still carries it, or won it
            if job is not None and (flight is None or not (flight.lost or job.flights)):
                self.rows.requeue(job, poison=flight is not None)
            raise
        except Exception as exc:  # a store that cannot write is fatal: stop, keep what is written
            log.exception("worker of %s failed", srv.name)
            if self.task_error is None:   # the runner turns it into the job's cause and remedy
                self.task_error = exc
            self._fail(f"{type(exc).__name__}: {exc}")

    async def _send(self, srv: ServerState, f: Flight, timeout: float) -> Outcome | None:
        """One request of `f`'s row to `srv`; None when another send of the row answered first
        (this one was cancelled for it); a session closed under us is a connection failure."""
        if srv.in_flight == 0:
            srv.last_done = time.monotonic()   # idle until now: the stall clock starts here
        srv.in_flight += 1
        srv.sent += 1
        f.sent = True
        # streamed (its chunks are the server's token progress) while fewer than streamed_rows are
        # and its rows are too long to show progress by finishing
        watch = (srv.ep.stream and srv.streaming < srv.ep.streamed_rows
                 and not self.health.rows_show_progress(srv))
        srv.streaming += watch
        try:
            # ignore: the session is None only once the server is out (recover, shutdown), and
            # the worker checked alive_in just before
            return await chat(srv.session, srv.ep.url, srv.ep.model, f.job.req, None, timeout,  # type: ignore[arg-type]
                              self.health.max_bytes, f.chunk if watch else None)
        except (RuntimeError, ValueError, aiohttp.ClientError) as exc:  # a session closed under us
            return Outcome("connection", error=f"{type(exc).__name__}: {exc}"[:500])
        except asyncio.CancelledError:
            if f.lost and f.forget():
                return None   # lost the race: the worker goes on with its next row
            raise
        finally:
            srv.in_flight -= 1
            srv.streaming -= watch
            self.hedge.end(f)
            if srv.limit:
                srv.gate.set()   # a slot under its lowered limit is free

    def _landed(self, srv: ServerState, epoch: int, f: Flight, out: Outcome | None) -> bool:
        """Where a send's answer goes; False when its server is out (its worker stops)."""
        job = f.job
        f.settled = True
        if out is None or f.lost:
            f.forget()   # lost, its cancellation swallowed (aiohttp's timer): the other send owns the row
            return srv.alive_in(epoch)
        if out.ok:
            self.hedge.answered(f, out)   # first: the other send, if any, is cancelled
            self.hedge.note(srv, out)
        elif job.flights:
            srv.failures += 1   # the other send of this row is still out: it carries the row
            return srv.alive_in(epoch)
        elif not srv.alive_in(epoch):
            # Taken out while this row was on it (a cancellation lost to aiohttp's timeout
            # ends here): not the row's fault. A real answer is kept whatever happened.
            self.rows.requeue(job, poison=True)
            return False
        self._handle(srv, job, out)
        return True

    # ------------------------------------------------------------------ other people's servers
    def _skip(self, item: Any, name: str) -> bool:
        """Should server `name` leave `item` to another? A row it refused (4xx) or whose 5xx is being
        retried goes to a server that has not refused it, while one such is up (WorkQueue.skip)."""
        if not isinstance(item, Job):
            return False
        refused = item.refused
        if not (refused and name in refused) and item.avoid != name:
            return False
        return any(s.state == "up" and s.name != name and not (refused and s.name in refused)
                   for s in self.servers)

    def _peer_up(self, srv: ServerState, refused: dict[str, str] | None = None) -> bool:
        return any(s is not srv and s.state == "up" and not (refused and s.name in refused) for s in self.servers)

    async def _gate(self, srv: ServerState, epoch: int) -> Job | None:
        """Until `srv` may take a new row: not while its Retry-After runs, nor past its lowered
        in-flight limit, nor while `down_after_4xx` of its refusals wait for the other servers'
        verdict (a server that refuses every row in a millisecond would otherwise bounce the whole
        input to the others before the first verdict). While it waits for a verdict it still gives
        its own on rows other servers refused (returned: the worker sends it), else two servers that
        both refuse would wait on each other. Woken by `srv.gate`, and at least every second."""
        while srv.alive_in(epoch) and not self.rows.stopping:
            now = time.monotonic()
            if srv.paused_until and srv.paused_until <= now:
                srv.paused_until = 0.0   # over: the worker loop's check is one comparison again
            if srv.paused_until > now:
                wait = srv.paused_until - now
            elif srv.limit and srv.in_flight + srv.reserved >= srv.limit:
                wait = 1.0
            elif len(srv.pending) >= self.down_after_4xx and self._peer_up(srv):
                srv.pending &= self.rows.inflight   # rows ended meanwhile (an error, a stop) judge nothing
                if len(srv.pending) < self.down_after_4xx:
                    return None
                theirs = self.queue.take_refused(srv.name)
                if theirs is not None:
                    return theirs   # type: ignore[no-any-return]
                wait = 1.0
            else:
                return None
            srv.gate.clear()
            try:
                await asyncio.wait_for(srv.gate.wait(), min(wait, 1.0))   # bounded: wait_for, ≤ 1 s
            except asyncio.TimeoutError:
                pass
        return None

    def _refused(self, srv: ServerState, job: Job, out: Outcome) -> bool:
        """A 4xx from `srv`: True when the row goes to another server first (uncharged); False when
        the error is the row's: another server refused it too, or none other can be asked."""
        refused = job.refused or {}
        if refused and any(n != srv.name for n in refused):
            for name in refused:   # a second opinion agrees: the rows' fault, not theirs
                other = self.by_name.get(name)
                if other is not None:
                    other.pending.discard(job.req.id)
                    other.overruled = 0
                    other.gate.set()
            return False
        if srv.name in refused or not self._peer_up(srv, refused):
            return False
        job.refused = {**refused, srv.name: out.error or f"HTTP {out.status}"}
        srv.refusals += 1
        srv.pending.add(job.req.id)
        srv.refused_sample = job.req
        self.rows.requeue(job, poison=False)
        for other in self.servers:   # one waiting for a verdict of its own may give this one
            if other is not srv:
                other.gate.set()
        return True

    def _overruled(self, srv: ServerState, job: Job) -> None:
        """`srv` answered a row other servers had refused: their refusals were theirs."""
        refused, job.refused = job.refused or {}, None
        for name, error in refused.items():
            other = self.by_name.get(name)
            if other is None or other is srv:
                continue
            other.pending.discard(job.req.id)
            other.overruled += 1
            other.gate.set()
            if other.overruled >= self.down_after_4xx and other.state == "up":
                self.health.mark_down(other, f"{other.overruled} rows it refused were answered by other servers "
                                             f"(its errors, not the rows'); last: {error}", refusing=True)

    def _rate_limited(self, srv: ServerState, job: Job, out: Outcome) -> None:
        """A 429 (or 503 with Retry-After): the server is busy, the row is not to blame."""
        now = time.monotonic()
        srv.rate_limits += 1
        if srv.limited_since is None:
            srv.limited_since = now
        if now >= srv.paused_until:
            # a new refusal, not one more answer to the requests already out when the pause began:
            # one multiplicative decrease per pause
            srv.limited_streak += 1
            srv.limit = max(1, (srv.limit or srv.concurrency) // 2)
            srv.grow = 0
            # a Retry-After of 0 (seen from gateways) would be a busy loop of refusals: 0.1 s at least
            wait = (max(0.1, out.retry_after_s) if out.retry_after_s is not None
                    else 2.0 ** min(srv.limited_streak - 1, 16))
            wait = min(wait, self.gen.retry_after_max_s)
            srv.paused_until = now + wait
            log.info("server %s rate-limits (%s): nothing new for %.1f s, at most %d in flight",
                     srv.name, out.error, wait, srv.limit)
        self.rows.requeue(job, poison=False)
        limited = now - srv.limited_since
        if limited >= self.gen.rate_limit_down_s and srv.state == "up":
            self.health.mark_down(srv, f"rate-limited for {limited:.0f} s with no answer (generation.rate_limit_down_s); "
                                       f"last: {out.error}")

    async def _bounds(self) -> None:
        """No silent pause: with every server down, the job fails once no server was admitted for
        `admit_max_s` since its start, or those that were up stayed down for `paused_max_s`."""
        down_since: float | None = None
        while True:
            await asyncio.sleep(self.bounds_poll_s)
            if self.rows.stopping or any(s.state in ("up", "starting") for s in self.servers):
                down_since = None
                continue
            now = time.monotonic()
            down_since = down_since or now
            ever = any(s.epoch > 0 for s in self.servers)
            bound, setting = ((self.gen.paused_max_s, "paused_max_s") if ever else (self.gen.admit_max_s, "admit_max_s"))
            waited = now - (down_since if ever else self._t0)
            if waited < bound:
                continue
            why = "; ".join(f"{s.name}: {s.down_reason or s.state}" for s in self.servers)
            what = (f"every server has been down for {waited:.0f} s" if ever else
                    f"no server could be admitted in {waited:.0f} s since the job started")
            self.remedy = (f"make a server usable (each one's reason is above), or raise generation.{setting}; "
                           "then run the same command again to resume: committed rows are kept")
            self._fail(f"{what} (generation.{setting}): {why}"[:1500])
            return

    # ------------------------------------------------------------------ backups
    async def _while_suspected(self, srv: ServerState) -> None:
        """Until the watchdog's probe decides: its rows are being backed up elsewhere, and a
        new row sent to a wedged server would only wait there for the same verdict."""
        while self.hedge.suspected(srv) and srv.state == "up" and not self.rows.stopping:
            await asyncio.sleep(0.05)

    async def _hedger(self) -> None:
        """Every hedge_poll_s: the backups `Hedge.plan` asks for: a suspect's rows to the queue's
        front (the next free worker of another server sends them), the tail's each its own task
        on the server with free slots (in `workers`, so that a server taken out cancels it)."""
        while True:
            await asyncio.sleep(self.hedge_poll_s)
            if self.rows.stopping:
                continue
            queued, direct = self.hedge.plan()
            for job in queued:
                self.queue.put_again(Backup(job))
            for srv, job in direct:
                f = self.hedge.start(srv, job, backup=True)
                task = asyncio.ensure_future(self._backup(srv, srv.epoch, f))
                f.task = task
                srv.workers.append(task)
                task.add_done_callback(partial(self._backup_done, srv, f))

    async def _backup(self, srv: ServerState, epoch: int, f: Flight) -> None:
        try:
            if not srv.alive_in(epoch) or f.lost:
                return
            log.debug("backup of %s on %s", f.job.req.id, srv.name)
            out = await self._send(srv, f, self.gen.request_timeout_s)
            self._landed(srv, epoch, f, out)
        except Exception as exc:  # a store that cannot write is fatal: stop, keep what is written
            log.exception("backup on %s failed", srv.name)
            self._fail(f"{type(exc).__name__}: {exc}")

    def _backup_done(self, srv: ServerState, f: Flight, task: asyncio.Task[None]) -> None:
        """A backup ended. Ended without an answer (its server went down, a stop) while the
        row's first send failed meanwhile (dropped for this one): the row goes back."""
        if task in srv.workers:
            srv.workers.remove(task)
        job = f.job
        if f in job.flights:   # never sent: cancelled before its first step, or its server went out
            self.hedge.end(f)
        if not f.settled and not f.lost and not job.flights:
            self.rows.requeue(job, poison=f.sent)

    def _handle(self, srv: ServerState, job: Job, out: Outcome) -> None:
        """Where an answer goes: see the module docstring."""
        if out.kind != "ok":
            self._handle_failure(srv, job, out)
            return
        srv.conn_streak = srv.err_streak = srv.bad_streak = srv.overruled = 0
        if srv.suspects:
            self.health.resolve_suspects(srv)
        if srv.limited_since is not None:
            srv.limited_since, srv.limited_streak = None, 0
        if srv.limit:   # additive increase: one more slot per limit's worth of answers
            srv.grow += 1
            if srv.grow >= srv.limit:
                srv.limit, srv.grow = srv.limit + 1, 0
                if srv.limit >= srv.concurrency:
                    srv.limit = 0
        job.avoid = None
        if job.refused:
            self._overruled(srv, job)
        if job.req.advance(out, job.attempts + 1):
            self._next_request(srv, job, out)
        else:
            self._finish_ok(srv, job, out)

    def _handle_failure(self, srv: ServerState, job: Job, out: Outcome) -> None:
        kind = out.kind
        srv.failures += 1
        job.last_error, job.last_status, job.last_server = out.error or kind, out.status, srv.name
        if kind == "permanent":
            srv.conn_streak = srv.err_streak = 0
            if self._refused(srv, job, out):
                return
            job.refused = None
            job.attempts += 1
            srv.permanent += 1
            self.rows.finish_error(job)
        elif kind == "transient":
            srv.conn_streak = 0
            if out.rate_limited:
                self._rate_limited(srv, job, out)
                return
            if out.status is not None and out.status >= 500:
                srv.err_streak += 1
            job.avoid = srv.name   # retried elsewhere when another server can take it
            self.rows.charge_and_retry(job)
            if srv.err_streak >= self.health.down_after_5xx and srv.state == "up":
                self.health.mark_down(srv, f"{srv.err_streak} HTTP 5xx answers in a row; last: {out.error}")
        elif kind == "unusable":
            self.rows.requeue(job, poison=False)
            self.health.mark_down(srv, f"{out.error} (check the API key, the model name and the URL)")
        elif kind == "invalid":
            self._invalid(srv, job, out)
        elif srv.state != "up":
            self.rows.requeue(job, poison=True)   # its server is already out: not the row's fault
        elif kind == "timeout":
            if srv.last_done >= time.monotonic() - out.latency_s:
                self.rows.charge_and_retry(job)   # the server finished other rows meanwhile: this row is slow
            else:
                # nothing finished on this server for as long as the row waited: the server's
                # fault unless a generation probe says it is fine (then the row is charged)
                srv.suspects.append(job)
                if not srv.probing:
                    self._spawn(self.health.stall_probe(srv, f"a request timed out ({out.error})"), f"stall-{srv.name}")
        else:  # connection: a suspect until the server is known dead or alive
            srv.conn_streak += 1
            srv.suspects.append(job)
            if srv.conn_streak >= self.health.down_after:
                self.health.mark_down(srv, f"{srv.conn_streak} connection failures in a row; last: {out.error}")
            elif srv.probe is None or srv.probe.done():
                srv.probe = self._spawn(self.health.probe(srv), f"probe-{srv.name}")

    def _invalid(self, srv: ServerState, job: Job, out: Outcome) -> None:
        """An answer that is not a completion: a suspect until the server is judged (module docstring)."""
        srv.conn_streak = 0
        srv.bad_streak += 1
        srv.invalid += 1
        if srv.state != "up":
            self.rows.requeue(job, poison=False)   # already out for it: not the row's fault
            return
        srv.suspects.append(job)
        if srv.bad_streak >= self.health.down_after_invalid:
            self.health.mark_down(srv, f"{srv.bad_streak} invalid answers in a row; last: {out.error}", garbled=True)
        elif not srv.answer_probing:
            self._spawn(self.health.answer_probe(srv, out.error or "an invalid answer"), f"answer-{srv.name}")

    def _next_request(self, srv: ServerState, job: Job, out: Outcome) -> None:
        """The row's next turn (or a quality gate's retry): back to the shared queue, any
        server may take it; failures are charged per request, so the count starts again."""
        srv.prompt_tokens += out.prompt_tokens or 0
        srv.completion_tokens += out.completion_tokens or 0
        self.health.note_done(srv, out.latency_s)
        self.rows.next_request(job)

    def _finish_ok(self, srv: ServerState, job: Job, out: Outcome) -> None:
        """The row's last answer: written (once) by the books, then counted for its server."""
        if not self.rows.finish_ok(job, out, srv.name):
            return
        srv.requests += 1
        srv.prompt_tokens += out.prompt_tokens or 0
        srv.completion_tokens += out.completion_tokens or 0
        srv.latency_sum += out.latency_s
        self.health.note_done(srv, out.latency_s)

    def _fail(self, reason: str) -> None:
        if self.state.startswith("failed"):
            return
        self.request_stop(grace_s=0, reason=reason)
        self.state = f"failed: {reason}"[:500]

    async def _grace(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.rows.done is not None:
            self.rows.done.set()

    async def _shutdown(self) -> None:
        self.rows.cancel_retries()
        self.queue.close()
        workers = [w for s in self.servers for w in s.workers]
        # finished workers have returned; the rest hold rows a stop leaves unwritten
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.servers:
            if s.session is not None:
                await s.session.close()
                s.session = None
        self.queue.drain()   # rows left here stay unwritten: resume sends them again
        if not self.state.startswith("failed"):
            self.state = "done" if self.rows.feed_done and not self.rows.inflight else "stopped"
