"""The dispatcher: one queue, every healthy server pulling from it, exactly once.

    input iterator ──(thread, batches)──► feeder ──► WorkQueue ◄── K workers per server ──► chat()
                                                    ▲   (bounded: backpressure)                   │
                 retries (backoff + jitter) ────────┘                                             ▼
                 requeues (server died) ───────────┘                    store.add_result / add_error

Work stealing: every worker of every server takes the next row from the same queue as soon
as its previous one is done, so a slow server simply takes fewer rows; nothing is split in
advance. K per server = min(the server's max running requests, the configured cap).

Failures (see `fleet.generation.client` for how an answer is classified):
- permanent (a 400 for a prompt over the context, say): the row goes to errors at once;
- transient (5xx, 429, a garbled body): retried after an exponential, jittered delay; after
  `max_attempts` attempts the row goes to errors with the last error;
- connection errors, and timeouts while the server finished nothing else, are *suspects*: if
  the server turns out to be dead or stalled (a probe, the next requests, or the process
  check fail too), the row goes back to the queue and no attempt is charged; if the server is
  fine, the attempt is charged and the row retried. A row's attempts pay only for its own
  failures.

The stall watchdog (`_watchdog`): a server with rows in flight and none finished for
`stall_s` (derived from its recent p99 row time, see `stall_s()`) gets a generation probe
(/health_generate, else a one-token chat) on its own connection; a failed probe marks it down.

A server is marked DOWN after `down_after` consecutive connection failures (or a failed
stall probe, or one 401/403/404, or its process gone per `is_alive`, or `down_after_5xx`
5xx in a row): its workers are cancelled — and each checks its server's state before and
after every request, because a cancellation that races aiohttp's own timeout is lost — every
row it held goes back to the queue uncharged, and
`on_server_down(endpoint)` is awaited (the runner relaunches, waits and smokes it); True
re-admits the server, False tries again after a growing delay. Without a callback the
server is re-admitted once /health_generate answers (it runs a generation, so a server
whose /health answers while generation hangs stays out). With every server down the job
is *paused* — the queue simply has no consumer, so no retries are burned — until one
comes back.

The tail: once the input is exhausted, a server markedly slower than the others leaves the
last rows to them whenever they would finish those sooner (`_others_sooner`), so the
slowest GPU does not become the job's last finisher (bench/bench_balance.py).
Per server, `_Timeline` keeps [elapsed, in flight, completed, tokens] over the whole job in
bounded memory (progress.json and the manifest carry it).

Exactly once: a row is accepted into `_inflight` when fed and leaves it exactly once, by
`_finish_ok` or `_finish_error`; anything else (a stop, a kill) leaves the row unwritten,
and resume sends it again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from fleet.backoff import backoff_delay
from fleet.config import GenerationConfig
from fleet.generation.client import Outcome, chat, dumps, loads, new_session
from fleet.generation.work import RowPlan

log = logging.getLogger("fleet.generation")

__all__ = ["Dispatcher", "Endpoint", "Summary", "WorkQueue"]


class Store(Protocol):
    """What the dispatcher needs of fleet.generation.store.ResultStore."""

    # each may return False: "already recorded, nothing written" (None counts as written)
    def add_result(self, row: dict[str, Any]) -> bool | None: ...
    def add_error(self, id: str, *, error: str, attempts: int, line: int, server: str | None,
                  status: int | None) -> bool | None: ...
    def add_reject(self, reject: Any) -> bool | None: ...
    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], *, line: int | None) -> bool | None: ...


@dataclass
class Endpoint:
    """One server as the dispatcher sees it."""

    name: str                              # "node/index", shown in tables and stored per row
    url: str                               # base URL, e.g. http://127.0.0.1:30000
    model: str                             # the "model" field requests carry
    api_key: str | None = None
    max_running_requests: int | None = None  # fallback when /server_info does not say
    gpus: int = 1                          # GPUs the server uses (for GPU-hour cost)
    extra: dict[str, Any] = field(default_factory=dict)  # the caller's own data (launch spec, ...)


@dataclass(slots=True)
class _Job:
    req: Any                   # work.RowWork (an inputs.Request with its turns and gates)
    attempts: int = 0          # attempts charged so far
    requeues: int = 0          # times put back uncharged because its server went down
    last_error: str = ""
    last_status: int | None = None
    last_server: str | None = None


class WorkQueue:
    """Fresh rows (bounded, FIFO) and rows coming back (unbounded, served first).

    Rows coming back — retries whose delay is over, rows of a server that died — must never
    wait behind a full queue (that deadlocks when every worker is the one putting back), so
    they go to their own deque, and they go first so that a resumed row is not starved.
    """

    __slots__ = ("_fresh", "_again", "_getters", "_putters", "maxsize", "closed", "stopped")

    def __init__(self, maxsize: int) -> None:
        self._fresh: collections.deque[Any] = collections.deque()
        self._again: collections.deque[Any] = collections.deque()
        self._getters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._putters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.maxsize = maxsize
        self.closed = False    # no more rows will come: get() drains what is left, then None
        self.stopped = False   # stop: get() answers None at once, rows stay where they are

    def __len__(self) -> int:
        return len(self._fresh) + len(self._again)

    def _hand(self, item: Any) -> bool:
        while self._getters:
            fut = self._getters.popleft()
            if not fut.done():
                fut.set_result(item)
                return True
        return False

    def _wake_putter(self) -> None:
        while self._putters:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def put_again(self, item: Any) -> None:
        if not self._hand(item):
            self._again.append(item)

    async def put_fresh(self, item: Any) -> bool:
        """Wait for room, then queue `item`; False (item not queued) once the queue is closed."""
        while len(self._fresh) >= self.maxsize and not self.closed:
            fut = asyncio.get_running_loop().create_future()
            self._putters.append(fut)
            await fut
        if self.closed:
            return False
        if not self._hand(item):
            self._fresh.append(item)
        return True

    async def get(self) -> Any:
        """The next row, or None once closed and empty (or stopped)."""
        if self.stopped:
            return None
        if self._again:
            return self._again.popleft()
        if self._fresh:
            item = self._fresh.popleft()
            self._wake_putter()
            return item
        if self.closed:
            return None
        fut = asyncio.get_running_loop().create_future()
        self._getters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                item = fut.result()
                if item is not None:
                    self._again.appendleft(item)   # handed over just as we were cancelled: keep it
            else:
                try:
                    self._getters.remove(fut)
                except ValueError:
                    pass
            raise

    def close(self, stop: bool = False) -> None:
        """No more rows: waiting getters get None (with `stop`, every later get() too)."""
        self.closed = True
        self.stopped = self.stopped or stop
        while self._getters:
            fut = self._getters.popleft()
            if not fut.done():
                fut.set_result(None)
        while self._putters:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)

    def drain(self) -> list[Any]:
        items = list(self._again) + list(self._fresh)
        self._again.clear()
        self._fresh.clear()
        return items


class _Rate:
    """Tokens per second over a sliding window, sampled when asked."""

    __slots__ = ("window_s", "samples")

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, now: float, total: int) -> float:
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, v0 = self.samples[0]
        return (total - v0) / (now - t0) if now - t0 > 0.5 else 0.0


class _Timeline:
    """Per server, over the whole job, in bounded memory: (elapsed s, rows in flight, rows
    completed, completion tokens) every `every_s`; when `cap` samples are kept, every other one
    is dropped and the interval doubles, so a two-day job keeps ~cap evenly spaced points."""

    __slots__ = ("every_s", "cap", "points", "_next")

    def __init__(self, every_s: float = 2.0, cap: int = 240) -> None:
        self.every_s, self.cap = every_s, cap
        self.points: list[tuple[float, int, int, int]] = []
        self._next = 0.0

    def sample(self, t: float, in_flight: int, completed: int, tokens: int, force: bool = False) -> None:
        if t < self._next and not force:
            return
        self.points.append((round(t, 1), in_flight, completed, tokens))
        if len(self.points) >= self.cap:
            self.points = self.points[::2]
            self.every_s *= 2
        self._next = t + self.every_s

    def rows(self) -> list[list[float | int]]:
        return [list(p) for p in self.points]


class _Server:
    """Runtime state of one server."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.name = ep.name
        self.state = "starting"          # starting | up | down | recovering
        self.down_reason: str | None = None
        self.down_since: float | None = None
        self.session: aiohttp.ClientSession | None = None
        self.workers: list[asyncio.Task[None]] = []
        self.concurrency = 0
        self.in_flight = 0
        self.conn_streak = 0             # consecutive connection failures / timeouts
        self.err_streak = 0              # consecutive 5xx answers
        self.suspects: list[_Job] = []   # rows that failed to connect; charged only if the server is fine
        self.probe: asyncio.Task[None] | None = None
        self.recovery: asyncio.Task[None] | None = None
        self.restarts = 0
        self.downs = 0
        self.info: dict[str, Any] = {}
        self.accept_len: float | None = None
        # counters
        self.requests = 0                # completed rows
        self.failures = 0                # failed attempts of any kind
        self.permanent = 0               # rows sent to errors from this server
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.latency_sum = 0.0
        self.lat: float | None = None    # recent typical row time: median of `lats`
        self.lats: collections.deque[float] = collections.deque(maxlen=64)  # recent completed row times
        self.lat_at = 0.0                # monotonic time `lat` was last refreshed
        self.rate = _Rate()
        self.tok_s = 0.0
        # the watchdog: a server with rows in flight and no row done for stall_s is probed
        self.epoch = 0                   # bumped at every admission: a worker of an older epoch stops
        self.last_done = 0.0             # monotonic: last row completed (or the moment it became busy)
        self.probing = False             # a stall probe is running
        self.stalls = 0                  # stall probes sent
        self.sent = 0                    # requests sent (tests compare it with what reached the server)
        self.held_s = 0.0                # worker-seconds held back by the tail rule
        self.refreshes = 0               # rows given to a held server to refresh a stale estimate
        self.timeline = _Timeline()

    def alive_in(self, epoch: int) -> bool:
        """May a worker of `epoch` still send rows here? (Checked before and after every request:
        a cancellation can be lost when it races aiohttp's own timeout, this cannot.)"""
        return self.state == "up" and self.epoch == epoch

    def snapshot(self, now: float) -> dict[str, Any]:
        self.tok_s = self.rate.update(now, self.completion_tokens)
        return {
            "name": self.name, "url": self.ep.url, "state": self.state, "down_reason": self.down_reason,
            "concurrency": self.concurrency, "in_flight": self.in_flight, "requests": self.requests,
            "failures": self.failures, "errors": self.permanent,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "tok_s": round(self.tok_s, 1),
            "avg_latency_s": round(self.latency_sum / self.requests, 3) if self.requests else None,
            "accept_len": self.accept_len, "downs": self.downs, "restarts": self.restarts,
            "stalls": self.stalls, "sent": self.sent, "held_s": round(self.held_s, 1),
            "refreshes": self.refreshes, "lat_s": round(self.lat, 3) if self.lat is not None else None,
            "idle_s": round(now - self.last_done, 1) if self.in_flight and self.last_done else None,
            "timeline": self.timeline.rows(),
        }


@dataclass
class Summary:
    state: str                 # done | stopped | failed
    complete: bool             # input exhausted and every row fed ended in results or errors
    completed: int
    errors: int
    rejects: int
    fed: int                   # rows accepted from the input this run
    unfinished: int            # rows fed but left unwritten (a stop): resume sends them again
    retries: int
    requeues: int
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    reason: str | None = None
    servers: list[dict[str, Any]] = field(default_factory=list)
    quality_rejects: int = 0   # rows a quality gate turned away (quality_rejects.jsonl)
    gates: dict[str, Any] = field(default_factory=dict)   # work.GateStats of this run


def _max_running(info: dict[str, Any]) -> int | None:
    """max_running_requests from SGLang's /server_info (top level, or its scheduler's internal state)."""
    v = info.get("max_running_requests")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    for st in info.get("internal_states") or []:
        v = st.get("max_running_requests") if isinstance(st, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _quantile(values: Iterable[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _median(values: Iterable[float]) -> float:
    return _quantile(values, 0.5)


OnServerDown = Callable[[Endpoint], Awaitable[bool]]
IsAlive = Callable[[Endpoint], bool | None]

_ACCEPT_METRIC = re.compile(r"^sglang:spec_accept_length(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


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
        self.servers = [_Server(e) for e in endpoints]
        self.on_server_down = on_server_down
        self.is_alive = is_alive
        self.queue_size = queue_size
        self.down_after = down_after
        self.down_after_5xx = down_after_5xx
        self.backoff_s, self.backoff_max_s, self.jitter = backoff_s, backoff_max_s, jitter
        self.recovery_backoff_s, self.recovery_backoff_max_s = recovery_backoff_s, recovery_backoff_max_s
        self.probe_interval_s = probe_interval_s
        self.health_timeout_s = health_timeout_s
        self.stats_poll_s = stats_poll_s
        self.liveness_poll_s = liveness_poll_s
        self.stall_poll_s = stall_poll_s
        self.stall_probe_timeout_s = stall_probe_timeout_s   # SGLang's own health check allows 20 s
        self.feed_batch = feed_batch
        self.rng = random.Random(seed)
        self.max_requeues = max(10, 2 * gen.max_attempts)  # a row that kills every server it meets
        self.state = "starting"
        self.reason: str | None = None
        self.queue = WorkQueue(queue_size or 1024)
        self._inflight: set[str] = set()
        self._retry_handles: set[asyncio.TimerHandle] = set()
        self._feed_done = False
        self._stopping = False
        self._done: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._t0 = time.monotonic()
        self._started_at = time.time()
        # counters of this run
        self.fed = 0
        self.completed = 0
        self.errors = 0
        self.rejects = 0
        self.retries = 0
        self.requeues = 0
        self.quality_rejects = 0
        self._rate = _Rate()
        self._first_error: str | None = None
        self.task_error: BaseException | None = None   # the first background task that raised (see _task_ended)
        self._lats: collections.deque[float] = collections.deque(maxlen=256)  # recent row times, every server

    # ------------------------------------------------------------------ public
    async def run(self, items: Iterable[Any]) -> Summary:
        """Feed `items` (inputs.Request / inputs.Reject) through the servers until every row
        ended, or a stop; return what happened."""
        self._done = asyncio.Event()
        self._t0 = time.monotonic()
        self._started_at = time.time()
        total_k = sum(min(e.max_running_requests or self.gen.max_concurrency_per_server,
                          self.gen.max_concurrency_per_server) for e in (s.ep for s in self.servers))
        self.queue.maxsize = self.queue_size or max(1024, 2 * total_k)
        await asyncio.gather(*(self._admit_or_recover(s) for s in self.servers))
        self._update_state()
        self._spawn(self._feed(items), "feeder")
        self._spawn(self._poll_stats(), "stats")
        self._spawn(self._watchdog(), "watchdog")
        if self.is_alive is not None:
            self._spawn(self._poll_liveness(), "liveness")
        try:
            await self._done.wait()
        finally:
            await self._shutdown()
        return self.summary()

    def request_stop(self, grace_s: float = 60.0, reason: str = "stop requested") -> None:
        """Stop taking rows; let the in-flight ones finish for up to `grace_s`, then end.

        Called again (a second signal), the shorter grace wins."""
        if self._stopping:
            self._spawn(self._grace(grace_s), "grace")
            return
        self._stopping = True
        self.reason = self.reason or reason
        self.state = "stopping"
        for h in self._retry_handles:
            h.cancel()
        self._retry_handles.clear()
        self.queue.close(stop=True)
        self._spawn(self._grace(grace_s), "grace")

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def snapshot(self) -> dict[str, Any]:
        """Counters for the progress file (cheap; call every few seconds)."""
        now = time.monotonic()
        servers = [s.snapshot(now) for s in self.servers]
        tokens = sum(s.completion_tokens for s in self.servers)
        return {
            "state": self.state, "reason": self.reason,
            "fed": self.fed, "completed": self.completed, "errors": self.errors, "rejects": self.rejects,
            "in_flight": self.in_flight, "queued": len(self.queue), "retries": self.retries,
            "requeues": self.requeues, "outstanding": len(self._inflight),
            "prompt_tokens": sum(s.prompt_tokens for s in self.servers), "completion_tokens": tokens,
            "tok_s": round(self._rate.update(now, tokens), 1),
            "tok_s_avg": round(tokens / (now - self._t0), 1) if now > self._t0 else 0.0,
            "elapsed_s": round(now - self._t0, 1), "servers_up": sum(s.state == "up" for s in self.servers),
            "servers": servers,
        }

    def summary(self) -> Summary:
        now = time.monotonic()
        for s in self.servers:   # the last point: the timeline ends where the job did
            s.timeline.sample(now - self._t0, s.in_flight, s.requests, s.completion_tokens, force=True)
        complete = self._feed_done and not self._inflight
        state = "failed" if self.state.startswith("failed") else ("done" if complete else "stopped")
        return Summary(
            state=state, complete=complete, completed=self.completed, errors=self.errors, rejects=self.rejects,
            fed=self.fed, unfinished=len(self._inflight), retries=self.retries, requeues=self.requeues,
            prompt_tokens=sum(s.prompt_tokens for s in self.servers),
            completion_tokens=sum(s.completion_tokens for s in self.servers),
            wall_s=now - self._t0, reason=self.reason, servers=[s.snapshot(now) for s in self.servers],
            quality_rejects=self.quality_rejects, gates=self.plan.stats.as_dict(),
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
            while not self._stopping:
                batch = await loop.run_in_executor(pool, take)
                if not batch:
                    break
                for item in batch:
                    if self._stopping:
                        break
                    if not hasattr(item, "messages"):   # an inputs.Reject
                        if self.store.add_reject(item) is not False:   # False: recorded by an earlier run
                            self.rejects += 1
                        continue
                    rid = item.id
                    if rid in self._inflight:
                        from fleet.generation.inputs import Reject

                        self.store.add_reject(Reject(line=item.line, id=rid, raw="",
                                                     reason="duplicate id: the same id is already in flight"))
                        self.rejects += 1
                        continue
                    self._inflight.add(rid)
                    self.fed += 1
                    if not await self.queue.put_fresh(_Job(self.plan.work(item))):
                        break
        except Exception as exc:  # an unreadable input is fatal: stop cleanly, keep what is done
            log.exception("reading the input failed")
            self._fail(f"reading the input failed: {type(exc).__name__}: {exc}")
            return
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if not self._stopping:
            self._feed_done = True
            self._check_done()

    # ------------------------------------------------------------------ servers
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

    async def _server_info(self, srv: _Server, session: aiohttp.ClientSession) -> dict[str, Any]:
        for path in ("/server_info", "/get_server_info"):
            try:
                async with session.get(srv.ep.url + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status == 200:
                        doc = loads(await r.read())
                        return doc if isinstance(doc, dict) else {}
                    if r.status != 404:
                        return {}
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                return {}
        return {}

    def _concurrency(self, srv: _Server) -> int:
        reported = _max_running(srv.info) or srv.ep.max_running_requests
        cap = self.gen.max_concurrency_per_server
        return max(1, min(reported, cap)) if reported else cap

    async def _admit(self, srv: _Server) -> bool:
        """Look the server up and start its workers; False (and why, in down_reason) when it is not usable."""
        session = new_session(self.gen.max_concurrency_per_server, api_key=srv.ep.api_key)
        try:
            reason = await self._usable(srv, session)
            if reason is None:
                srv.info = await self._server_info(srv, session)
        finally:
            await session.close()
        if reason is not None:
            srv.down_reason = reason
            return False
        srv.concurrency = self._concurrency(srv)
        # the pool is exactly as wide as the concurrency
        srv.session = new_session(srv.concurrency, api_key=srv.ep.api_key)
        srv.state = "up"
        srv.down_reason = None
        srv.conn_streak = srv.err_streak = 0
        srv.epoch += 1
        srv.last_done = time.monotonic()
        srv.workers = [asyncio.ensure_future(self._worker(srv, srv.epoch)) for _ in range(srv.concurrency)]
        log.info("server %s up at %s: %d workers", srv.name, srv.ep.url, srv.concurrency)
        self._update_state()
        return True

    async def _usable(self, srv: _Server, session: aiohttp.ClientSession) -> str | None:
        """None when the server is healthy and takes our key; else why not."""
        if not await self._ping(srv, session, "/health"):
            return f"not answering {srv.ep.url}/health"
        try:
            # /health needs no key on SGLang; /v1/models does: a wrong key shows here, not on every row
            async with session.get(srv.ep.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
                if r.status in (401, 403):
                    return f"HTTP {r.status} from /v1/models: the server refuses our API key"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return f"not answering {srv.ep.url}/v1/models"
        return None

    async def _admit_or_recover(self, srv: _Server) -> None:
        if not await self._admit(srv):
            self._mark_down(srv, srv.down_reason or "not usable")

    async def _ping(self, srv: _Server, session: aiohttp.ClientSession | None = None, path: str = "/health",
                    timeout: float = 10.0, missing_ok: bool = False) -> bool:
        """True when the server answers `path` with 200 (`/v1/models`: any answer at all; with
        `missing_ok`, a 404 falls back to /health: vLLM and transformers have no /health_generate)."""
        own = session is None
        session = session or aiohttp.ClientSession(headers={"Authorization": f"Bearer {srv.ep.api_key}"}
                                                   if srv.ep.api_key else None)
        try:
            async with session.get(srv.ep.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                await r.read()
                if r.status == 404 and missing_ok:
                    return await self._ping(srv, session, "/health", timeout)
                return r.status == 200 or path == "/v1/models"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, RuntimeError):  # RuntimeError: session closed
            return False
        finally:
            if own:
                await session.close()

    def _mark_down(self, srv: _Server, reason: str) -> None:
        if srv.state in ("down", "recovering"):
            return
        if srv.state == "starting":
            srv.downs -= 1   # never up: not a failure of a running server
        log.warning("server %s down: %s", srv.name, reason)
        srv.state = "down"
        srv.down_reason = reason
        srv.down_since = time.monotonic()
        srv.downs += 1
        suspects, srv.suspects = srv.suspects, []
        for job in suspects:
            self._requeue(job, poison=True)
        me = asyncio.current_task()
        if srv.probe is not None and srv.probe is not me:
            srv.probe.cancel()
        for w in srv.workers:
            if w is not me:
                w.cancel()       # its row goes back to the queue in the worker's handler
        if me in srv.workers:
            me.cancel()          # the worker that noticed: cancelled at its next await
        self._update_state()
        if not self._stopping:
            srv.recovery = self._spawn(self._recover(srv), f"recover-{srv.name}")

    async def _recover(self, srv: _Server) -> None:
        """Until the server is back: the callback (relaunch + smoke) or a health poll."""
        workers, srv.workers = srv.workers, []
        # Cancelled in _mark_down; a worker whose cancellation was lost (it raced aiohttp's own
        # timeout) stops at its next state check. Never let one hold the relaunch back.
        if workers:
            await asyncio.wait(workers, timeout=5.0)
        if srv.session is not None:
            session, srv.session = srv.session, None
            await session.close()
        rounds = 0
        while not self._stopping:
            srv.state = "recovering"
            try:
                if self.on_server_down is not None:
                    ok = bool(await self.on_server_down(srv.ep))
                    if ok:
                        srv.restarts += 1
                else:
                    # /health may answer while generation hangs; /health_generate runs one (SGLang)
                    ok = await self._ping(srv, None, "/health_generate", timeout=self.health_timeout_s,
                                          missing_ok=True)
                if ok and await self._admit(srv):
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the callback's failure is the server's, never the job's
                log.warning("recovering server %s failed: %s", srv.name, exc)
                srv.down_reason = f"recovery failed: {exc}"[:500]
            srv.state = "down"
            self._update_state()
            rounds += 1
            await asyncio.sleep(backoff_delay(rounds, self.recovery_backoff_s, max_s=self.recovery_backoff_max_s,
                                              jitter=0.25, rng=self.rng))

    def _update_state(self) -> None:
        if self._stopping or self.state.startswith("failed"):
            return
        up = sum(s.state == "up" for s in self.servers)
        if up == 0 and all(s.state != "starting" for s in self.servers):
            if not self.state.startswith("paused"):
                log.warning("every server is down: the job is paused until one comes back")
            self.state = "paused: all servers down"
        elif up:
            self.state = "running"

    async def _poll_liveness(self) -> None:
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
                    self._mark_down(srv, "server process exited")

    # ------------------------------------------------------------------ the stall watchdog
    def stall_s(self, srv: _Server) -> float:
        """How long `srv` may hold rows without finishing one before it is probed."""
        g = self.gen
        if g.stall_s is not None:
            return g.stall_s
        lats = srv.lats if len(srv.lats) >= 8 else self._lats
        if not lats:
            return g.stall_max_s
        return min(g.stall_max_s, max(g.stall_min_s, 3.0 * _quantile(lats, 0.99)))

    async def _watchdog(self) -> None:
        """A server with rows in flight and none finished for stall_s gets a generation probe.

        "No row finished" is a strong signal: workers only take a new row when one ends, so
        every row it holds has then run for longer than 3 x the recent p99 row time. The probe
        keeps a slow-but-working server in (SGLang answers /health_generate from its recent
        scheduler activity when busy); a stopped or wedged one fails it and is taken out.
        """
        while True:
            await asyncio.sleep(self.stall_poll_s)
            now = time.monotonic()
            for srv in self.servers:
                srv.timeline.sample(now - self._t0, srv.in_flight, srv.requests, srv.completion_tokens)
                if srv.state != "up" or not srv.in_flight or srv.probing:
                    continue
                idle = now - srv.last_done
                if idle >= self.stall_s(srv):
                    self._spawn(self._stall_probe(srv, f"no row finished for {idle:.0f} s with {srv.in_flight} "
                                                       f"in flight"), f"stall-{srv.name}")

    async def _stall_probe(self, srv: _Server, why: str) -> None:
        srv.probing = True
        srv.stalls += 1
        epoch = srv.epoch
        try:
            ok, detail = await self._generation_probe(srv)
        finally:
            srv.probing = False
        if not srv.alive_in(epoch):
            return
        if ok:
            log.info("server %s: %s, but its generation probe answers: kept", srv.name, why)
            srv.last_done = time.monotonic()   # judged again after another stall_s
            if srv.suspects:
                self._resolve_suspects(srv)    # the server works: the timeouts were the rows' own
            return
        self._mark_down(srv, f"stalled: {why}; {detail}")

    async def _generation_probe(self, srv: _Server) -> tuple[bool, str]:
        """(answers, why not): /health_generate (SGLang runs a generation for it), or a one-token
        chat where there is none (vLLM, transformers). Its own connection: the worker pool is full."""
        t = self.stall_probe_timeout_s
        path = "/health_generate"
        session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {srv.ep.api_key}"}
                                        if srv.ep.api_key else None)
        try:
            async with session.get(srv.ep.url + path, timeout=aiohttp.ClientTimeout(total=t)) as r:
                await r.read()
                if r.status != 404:
                    return r.status == 200, f"{path} answered HTTP {r.status}"
            path = "a one-token chat"
            body = {"model": srv.ep.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
            async with session.post(srv.ep.url + "/v1/chat/completions", data=dumps(body),
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=t)) as r:
                await r.read()
                return r.status == 200, f"{path} answered HTTP {r.status}"
        except asyncio.TimeoutError:
            return False, f"{path} did not answer within {t:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return False, f"{path} failed: {type(exc).__name__}: {exc}"[:300]
        finally:
            await session.close()

    async def _poll_stats(self) -> None:
        """Speculative accept length (and liveness of the numbers) every stats_poll_s."""
        while True:
            for srv in self.servers:
                if srv.state == "up" and srv.session is not None:
                    try:
                        srv.accept_len = await self._accept_len(srv)
                    except Exception:  # stats are best effort
                        pass
            await asyncio.sleep(self.stats_poll_s)

    async def _accept_len(self, srv: _Server) -> float | None:
        assert srv.session is not None
        info = await self._server_info(srv, srv.session)
        for st in info.get("internal_states") or []:
            if isinstance(st, dict) and isinstance(st.get("avg_spec_accept_length"), int | float):
                return round(float(st["avg_spec_accept_length"]), 3)
        try:
            async with srv.session.get(srv.ep.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status == 200:
                    m = _ACCEPT_METRIC.search((await r.read()).decode("utf-8", "replace"))
                    if m:
                        return round(float(m.group(1)), 3)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            pass
        return srv.accept_len

    # ------------------------------------------------------------------ the hot path
    async def _worker(self, srv: _Server, epoch: int) -> None:
        q = self.queue
        timeout = self.gen.request_timeout_s
        job: _Job | None = None
        sent = False   # job reached (or may have reached) the server
        try:
            while srv.alive_in(epoch):
                if self._feed_done and srv.lat is not None and len(q):
                    await self._hold_at_tail(srv)
                    if not srv.alive_in(epoch):
                        return
                job, sent = await q.get(), False
                if job is None:
                    return
                if not srv.alive_in(epoch):   # went down while we waited: the row never left
                    j, job = job, None
                    q.put_again(j)
                    return
                if srv.in_flight == 0:
                    srv.last_done = time.monotonic()   # idle until now: the stall clock starts here
                srv.in_flight += 1
                srv.sent += 1
                sent = True
                try:
                    out = await chat(srv.session, srv.ep.url, srv.ep.model, job.req, None, timeout)  # type: ignore[arg-type]
                except (RuntimeError, ValueError, aiohttp.ClientError) as exc:  # a session closed under us
                    out = Outcome("connection", error=f"{type(exc).__name__}: {exc}"[:500])
                finally:
                    srv.in_flight -= 1
                j, job = job, None
                if not srv.alive_in(epoch) and not out.ok:
                    # Taken out while this row was on it (a cancellation lost to aiohttp's timeout
                    # ends here): not the row's fault. A real answer is kept whatever happened.
                    self._requeue(j, poison=True)
                    return
                self._handle(srv, j, out)
        except asyncio.CancelledError:
            if job is not None:
                self._requeue(job, poison=sent)
            raise
        except Exception as exc:  # a store that cannot write is fatal: stop, keep what is written
            log.exception("worker of %s failed", srv.name)
            self._fail(f"{type(exc).__name__}: {exc}")

    def _others_sooner(self, srv: _Server) -> bool:
        """At the tail: would the other servers finish the next row before this one could?

        While input keeps coming the queue is long and every server pulls. Once the input is
        exhausted, a markedly slower server that takes one of the last rows becomes the
        job's last finisher: it then leaves them to the others if they would drain the
        queue *and* finish that row before it would (its recent latency per row).

        Never on a stale estimate: a server's row time is the median of its recent rows (a
        warm-up row does not count for a hundred) and needs three of them; the others count
        only while they finish rows; and a held server idle for two of its row times takes a
        row to refresh its estimate (`_hold_at_tail`).
        """
        lat = srv.lat
        now = time.monotonic()
        # only servers that are finishing rows: one that has finished nothing for three of its
        # row times (stopped, wedged: not yet caught by the watchdog) will not drain the queue
        others = [s for s in self.servers if s is not srv and s.state == "up" and s.lat
                  and (s.in_flight == 0 or now - s.last_done < 3 * s.lat)]
        if lat is None or len(srv.lats) < 3 or not others:
            return False   # no estimate yet (one warm-up row says nothing): never hold on it
        best = min(s.lat for s in others)  # type: ignore[type-var]
        if lat <= 1.5 * best:
            return False
        rate = sum(s.concurrency / s.lat for s in others)  # type: ignore[operator]
        return lat > (len(self.queue) + 1) / rate + best

    async def _hold_at_tail(self, srv: _Server) -> None:
        # a slow server may have hundreds of workers here: poll at a tenth of its row time
        pause = max(0.02, min(0.25, (srv.lat or 0.0) / 10))
        t0 = time.monotonic()
        try:
            while len(self.queue) and not self._stopping and self._others_sooner(srv):
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

    def _handle(self, srv: _Server, job: _Job, out: Outcome) -> None:
        kind = out.kind
        if kind == "ok":
            srv.conn_streak = srv.err_streak = 0
            if srv.suspects:
                self._resolve_suspects(srv)
            if job.req.advance(out, job.attempts + 1):
                self._next_request(srv, job, out)
            else:
                self._finish_ok(srv, job, out)
            return
        srv.failures += 1
        job.last_error, job.last_status, job.last_server = out.error or kind, out.status, srv.name
        if kind == "permanent":
            srv.conn_streak = srv.err_streak = 0
            job.attempts += 1
            srv.permanent += 1
            self._finish_error(job)
        elif kind == "transient":
            srv.conn_streak = 0
            if out.status is not None and out.status >= 500:
                srv.err_streak += 1
            self._charge_and_retry(job)
            if srv.err_streak >= self.down_after_5xx and srv.state == "up":
                self._mark_down(srv, f"{srv.err_streak} HTTP 5xx answers in a row; last: {out.error}")
        elif kind == "unusable":
            self._requeue(job, poison=False)
            self._mark_down(srv, f"{out.error} (check the API key, the model name and the URL)")
        elif srv.state != "up":
            self._requeue(job, poison=True)   # its server is already out: not the row's fault
        elif kind == "timeout":
            if srv.last_done >= time.monotonic() - out.latency_s:
                self._charge_and_retry(job)   # the server finished other rows meanwhile: this row is slow
            else:
                # nothing finished on this server for as long as the row waited: the server's
                # fault unless a generation probe says it is fine (then the row is charged)
                srv.suspects.append(job)
                if not srv.probing:
                    self._spawn(self._stall_probe(srv, f"a request timed out ({out.error})"), f"stall-{srv.name}")
        else:  # connection: a suspect until the server is known dead or alive
            srv.conn_streak += 1
            srv.suspects.append(job)
            if srv.conn_streak >= self.down_after:
                self._mark_down(srv, f"{srv.conn_streak} connection failures in a row; last: {out.error}")
            elif srv.probe is None or srv.probe.done():
                srv.probe = self._spawn(self._probe(srv), f"probe-{srv.name}")

    async def _probe(self, srv: _Server) -> None:
        """After a connection failure: is the server there at all? Decides the suspects' fate."""
        while srv.state == "up" and srv.suspects:
            if await self._ping(srv, srv.session, "/v1/models", timeout=5.0):
                if srv.state == "up":
                    srv.conn_streak = 0
                    self._resolve_suspects(srv)
                return
            srv.conn_streak += 1
            if srv.conn_streak >= self.down_after:
                self._mark_down(srv, f"{srv.conn_streak} connection failures in a row (probe of /v1/models)")
                return
            await asyncio.sleep(self.probe_interval_s)

    def _resolve_suspects(self, srv: _Server) -> None:
        """The server is alive: the connection failures were the rows' own, charge them."""
        suspects, srv.suspects = srv.suspects, []
        for job in suspects:
            self._charge_and_retry(job)

    def _charge_and_retry(self, job: _Job) -> None:
        job.attempts += 1
        if job.attempts >= self.gen.max_attempts:
            self._finish_error(job)
            return
        if self._stopping:
            return  # left unwritten: resume sends it again
        self.retries += 1
        delay = backoff_delay(job.attempts, self.backoff_s, max_s=self.backoff_max_s, jitter=self.jitter, rng=self.rng)
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def due() -> None:
            self._retry_handles.discard(handle)  # type: ignore[arg-type]
            self.queue.put_again(job)

        handle = loop.call_later(delay, due)
        self._retry_handles.add(handle)

    def _requeue(self, job: _Job, poison: bool = True) -> None:
        """Back to the queue, uncharged: its server died under it (`poison`: while serving it,
        so the row might be what kills servers), or it never reached the server."""
        if not poison:
            if not self._stopping:
                self.queue.put_again(job)
            return
        job.requeues += 1
        if job.requeues > self.max_requeues:
            job.last_error = (f"{job.requeues - 1} servers went down while serving this row "
                              f"(it may crash them); last: {job.last_error}")
            self._finish_error(job)
            return
        self.requeues += 1
        if not self._stopping:
            self.queue.put_again(job)

    def _next_request(self, srv: _Server, job: _Job, out: Outcome) -> None:
        """The row's next turn (or a quality gate's retry): back to the shared queue, any
        server may take it; failures are charged per request, so the count starts again."""
        srv.prompt_tokens += out.prompt_tokens or 0
        srv.completion_tokens += out.completion_tokens or 0
        self._note_done(srv, out.latency_s)
        job.attempts = 0
        if self._stopping:
            return  # left unwritten: resume regenerates the whole row
        self.queue.put_again(job)

    def _note_done(self, srv: _Server, latency_s: float) -> None:
        """A request finished on `srv`: the watchdog's clock and the row-time estimate."""
        now = time.monotonic()
        srv.last_done = now
        srv.lats.append(latency_s)
        self._lats.append(latency_s)
        if srv.lat is None or len(srv.lats) <= 8 or now - srv.lat_at >= 0.5:
            # the median of recent rows: one warm-up row (first request: seconds) must not
            # decide how fast the server is for the next hundred
            srv.lat, srv.lat_at = _median(srv.lats), now

    def _finish_ok(self, srv: _Server, job: _Job, out: Outcome) -> None:
        req = job.req
        if req.id not in self._inflight:
            return  # already ended: never write a row twice
        pt, ct = out.prompt_tokens or 0, out.completion_tokens or 0
        row, reasons = req.result(out, srv.name)
        if reasons:
            stored = self.store.add_quality_reject(row, reasons, line=req.line)
        else:
            stored = self.store.add_result(row)
        self._inflight.discard(req.id)
        if stored is False:   # the store already holds this id (it guards too): not counted twice
            self._check_done()
            return
        srv.requests += 1
        srv.prompt_tokens += pt
        srv.completion_tokens += ct
        srv.latency_sum += out.latency_s
        self._note_done(srv, out.latency_s)
        if reasons:
            self.quality_rejects += 1
        else:
            self.completed += 1
        self._check_done()

    def _finish_error(self, job: _Job) -> None:
        req = job.req
        if req.id not in self._inflight:
            return
        stored = self.store.add_error(req.id, error=req.label_error(job.last_error), attempts=job.attempts, line=req.line,
                                      server=job.last_server, status=job.last_status)
        self._inflight.discard(req.id)
        if stored is False:
            self._check_done()
            return
        self.errors += 1
        if self.completed == 0:
            # The same refusal for every row and no success at all: a config problem (a bad
            # sampling parameter, say), not the rows. Stop rather than fill the errors file.
            # (Prompts over the context fail with differing messages and never trip this.)
            if self.errors == 1:
                self._first_error = job.last_error
            elif job.last_error != self._first_error:
                self._first_error = None
            if self.errors >= 100 and self._first_error is not None and not self._stopping:
                self._fail(f"the first {self.errors} rows all failed with the same error and none "
                           f"succeeded: {job.last_error}")
        self._check_done()

    def _check_done(self) -> None:
        if self._feed_done and not self._inflight and self._done is not None:
            self.queue.close()
            self._done.set()

    def _fail(self, reason: str) -> None:
        if self.state.startswith("failed"):
            return
        self.request_stop(grace_s=0, reason=reason)
        self.state = f"failed: {reason}"[:500]

    async def _grace(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._done is not None:
            self._done.set()

    async def _shutdown(self) -> None:
        for h in self._retry_handles:
            h.cancel()
        self._retry_handles.clear()
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
            self.state = "done" if self._feed_done and not self._inflight else "stopped"
