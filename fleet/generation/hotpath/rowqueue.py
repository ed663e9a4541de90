"""The row queue and its books: every row fed is written exactly once, or left for resume.

    feeder ──put_fresh──► WorkQueue ◄──put_again── retries (backoff + jitter, `Ledger.charge_and_retry`)
                            │    ▲                 requeues (server died, `Ledger.requeue`)
                           get   └──────────────── the next turn of a row (`Ledger.next_request`)
                            ▼
                         workers ──► Ledger.finish_ok / finish_error ──► store

Charging: a row's attempts pay only for its own failures. A permanent failure (a 400 for a
prompt over the context, say) sends the row to errors at once; a transient one is retried
after an exponential, jittered delay, and after `max_attempts` attempts the row goes to
errors with the last error. A row whose server died under it goes back uncharged
(`requeue`), unless it keeps killing servers (`max_requeues`).

Exactly once: a row is accepted into `inflight` when fed (`accept`) and leaves it exactly
once, by `finish_ok` or `finish_error`; anything else (a stop, a kill) leaves the row
unwritten, and resume sends it again.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.backoff import backoff_delay
from fleet.generation.hotpath.client import Outcome

__all__ = ["Job", "Ledger", "Store", "WorkQueue"]


class Store(Protocol):
    """What the dispatcher needs of fleet.generation.data.store.ResultStore."""

    # each may return False: "already recorded, nothing written" (None counts as written)
    def add_result(self, row: dict[str, Any]) -> bool | None: ...
    def add_error(self, id: str, *, error: str, attempts: int, line: int, server: str | None,
                  status: int | None) -> bool | None: ...
    def add_reject(self, reject: Any) -> bool | None: ...
    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], *, line: int | None) -> bool | None: ...


@dataclass(slots=True)
class Job:
    req: Any                   # work.RowWork (an rows.Request with its turns and gates)
    attempts: int = 0          # attempts charged so far
    requeues: int = 0          # times put back uncharged because its server went down
    last_error: str = ""
    last_status: int | None = None
    last_server: str | None = None
    # hedge.Flight: the sends of its current request now out (two while a backup races the first)
    flights: list[Any] = field(default_factory=list)
    hedges: int = 0            # backups sent for it (fleet.generation.hotpath.hedge)
    # servers that refused its current request with a 4xx, and the error: it is tried on another
    # before the error is the row's (dispatch._refused); a server here does not take it while another can
    refused: dict[str, str] | None = None
    avoid: str | None = None   # the server whose 5xx it is retrying after: another takes it if one can


class WorkQueue:
    """Fresh rows (bounded, FIFO) and rows coming back (unbounded, served first).

    Rows coming back — retries whose delay is over, rows of a server that died — must never
    wait behind a full queue (that deadlocks when every worker is the one putting back), so
    they go to their own deque, and they go first so that a resumed row is not starved.

    Rows coming back may be for other servers than some (`skip(item, server)`: a row a server refused
    with a 4xx goes to another one while another can take it): such a row waits in `_again` for a
    getter it suits, and `rehand()` looks again when the servers changed.
    """

    __slots__ = ("_fresh", "_again", "_getters", "_putters", "maxsize", "closed", "stopped", "skip")

    def __init__(self, maxsize: int) -> None:
        self._fresh: collections.deque[Any] = collections.deque()
        self._again: collections.deque[Any] = collections.deque()
        self._getters: collections.deque[tuple[asyncio.Future[Any], str | None]] = collections.deque()
        self._putters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.maxsize = maxsize
        self.closed = False    # no more rows will come: get() drains what is left, then None
        self.stopped = False   # stop: get() answers None at once, rows stay where they are
        self.skip: Callable[[Any, str], bool] | None = None   # set by the dispatcher

    def __len__(self) -> int:
        return len(self._fresh) + len(self._again)

    def _hand(self, item: Any) -> bool:
        skip = self.skip
        if skip is not None and (getattr(item, "refused", None) or getattr(item, "avoid", None)):
            for entry in self._getters:   # the first getter it suits (rare: a refused or 5xx row)
                fut, name = entry
                if not fut.done() and not (name is not None and skip is not None and skip(item, name)):
                    self._getters.remove(entry)
                    fut.set_result(item)
                    return True
            return False
        while self._getters:
            fut, _ = self._getters.popleft()
            if not fut.done():
                fut.set_result(item)
                return True
        return False

    def rehand(self) -> None:
        """The servers changed (one up, one down): rows waiting for another server than the
        getters' may suit them now."""
        if not self._getters or not self._again:
            return
        for item in list(self._again):
            if not self._getters:
                return
            if self._hand(item):
                self._again.remove(item)

    def _take_again(self, name: str | None) -> tuple[bool, Any]:
        """The first row coming back that suits server `name`."""
        skip = self.skip
        if skip is None or name is None:
            return True, self._again.popleft()
        for i, item in enumerate(self._again):
            if not skip(item, name):
                del self._again[i]
                return True, item
        return False, None

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

    def take_refused(self, name: str) -> Any:
        """A row coming back that other servers refused and `name` has not (its verdict), or None."""
        for i, item in enumerate(self._again):
            refused = getattr(item, "refused", None)
            if refused and name not in refused:
                del self._again[i]
                return item
        return None

    async def get(self, name: str | None = None) -> Any:
        """The next row for server `name`, or None once closed and empty (or stopped)."""
        if self.stopped:
            return None
        if self._again:
            found, item = self._take_again(name)
            if found:
                return item
        if self._fresh:
            item = self._fresh.popleft()
            self._wake_putter()
            return item
        if self.closed and not self._again:
            return None
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, name)
        self._getters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # bounded: the future is done (waited for above)
                item = fut.result()
                if item is not None:
                    self._again.appendleft(item)   # handed over just as we were cancelled: keep it
            else:
                try:
                    self._getters.remove(entry)
                except ValueError:
                    pass
            raise

    def close(self, stop: bool = False) -> None:
        """No more rows: waiting getters get None (with `stop`, every later get() too)."""
        self.closed = True
        self.stopped = self.stopped or stop
        while self._getters:
            fut, _ = self._getters.popleft()
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



class Ledger:
    """Which rows are out, what they have cost, and the one place each one ends.

    `stopping` (a stop was asked: nothing goes back to the queue) and `feed_done` (the input
    is exhausted) are set by the dispatcher; `done` is set once every row fed has ended.
    """

    def __init__(self, store: Store, queue: WorkQueue, *, max_attempts: int, backoff_s: float,
                 backoff_max_s: float, jitter: float, rng: random.Random, fail: Callable[[str], None]) -> None:
        self.store = store
        self.queue = queue
        self.max_attempts = max_attempts
        self.max_requeues = max(10, 2 * max_attempts)  # a row that kills every server it meets
        self.backoff_s, self.backoff_max_s, self.jitter = backoff_s, backoff_max_s, jitter
        self.rng = rng
        self.fail = fail   # stop the job as failed, with the reason
        self.inflight: set[str] = set()
        self.retry_handles: set[asyncio.TimerHandle] = set()
        self.feed_done = False
        self.stopping = False
        self.done: asyncio.Event | None = None
        # counters of this run
        self.fed = 0
        self.completed = 0
        self.errors = 0
        self.rejects = 0
        self.retries = 0
        self.requeues = 0
        self.quality_rejects = 0
        self._first_error: str | None = None

    def accept(self, item: Any) -> bool:
        """A row read from the input (rows.Request / rows.Reject): True when it is a new row,
        now in flight and to be queued; False when it was recorded as a reject instead."""
        if not hasattr(item, "messages"):   # an rows.Reject
            if self.store.add_reject(item) is not False:   # False: recorded by an earlier run
                self.rejects += 1
            return False
        rid = item.id
        if rid in self.inflight:
            from fleet.generation.data.rows import Reject

            self.store.add_reject(Reject(line=item.line, id=rid, raw="",
                                         reason="duplicate id: the same id is already in flight"))
            self.rejects += 1
            return False
        self.inflight.add(rid)
        self.fed += 1
        return True

    def cancel_retries(self) -> None:
        for h in self.retry_handles:
            h.cancel()
        self.retry_handles.clear()

    def charge_and_retry(self, job: Job) -> None:
        job.attempts += 1
        if job.attempts >= self.max_attempts:
            self.finish_error(job)
            return
        if self.stopping:
            return  # left unwritten: resume sends it again
        self.retries += 1
        delay = backoff_delay(job.attempts, self.backoff_s, max_s=self.backoff_max_s, jitter=self.jitter, rng=self.rng)
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def due() -> None:
            assert handle is not None
            self.retry_handles.discard(handle)
            self.queue.put_again(job)

        handle = loop.call_later(delay, due)
        self.retry_handles.add(handle)

    def requeue(self, job: Job, poison: bool = True) -> None:
        """Back to the queue, uncharged: its server died under it (`poison`: while serving it,
        so the row might be what kills servers), or it never reached the server."""
        if job.req.id not in self.inflight:
            return   # already ended (a backup's answer won): never send a finished row again
        if not poison:
            if not self.stopping:
                self.queue.put_again(job)
            return
        job.requeues += 1
        if job.requeues > self.max_requeues:
            job.last_error = (f"{job.requeues - 1} servers went down while serving this row "
                              f"(it may crash them); last: {job.last_error}")
            self.finish_error(job)
            return
        self.requeues += 1
        if not self.stopping:
            self.queue.put_again(job)

    def next_request(self, job: Job) -> None:
        """The row's next turn (or a quality gate's retry): back to the shared queue, any
        server may take it; failures are charged per request, so the count starts again."""
        job.attempts = 0
        if self.stopping:
            return  # left unwritten: resume regenerates the whole row
        self.queue.put_again(job)

    def finish_ok(self, job: Job, out: Outcome, server: str) -> bool:
        """Write the row's result (or its quality reject); True when written and counted here
        (the caller then counts it for its server)."""
        req = job.req
        if req.id not in self.inflight:
            return False  # already ended: never write a row twice
        row, reasons = req.result(out, server)
        if reasons:
            stored = self.store.add_quality_reject(row, reasons, line=req.line)
        else:
            stored = self.store.add_result(row)
        self.inflight.discard(req.id)
        if stored is False:   # the store already holds this id (it guards too): not counted twice
            self.check_done()
            return False
        if reasons:
            self.quality_rejects += 1
        else:
            self.completed += 1
        self.check_done()
        return True

    def finish_error(self, job: Job) -> None:
        req = job.req
        if req.id not in self.inflight:
            return
        stored = self.store.add_error(req.id, error=req.label_error(job.last_error), attempts=job.attempts, line=req.line,
                                      server=job.last_server, status=job.last_status)
        self.inflight.discard(req.id)
        if stored is False:
            self.check_done()
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
            if self.errors >= 100 and self._first_error is not None and not self.stopping:
                self.fail(f"the first {self.errors} rows all failed with the same error and none "
                          f"succeeded: {job.last_error}")
        self.check_done()

    def check_done(self) -> None:
        if self.feed_done and not self.inflight and self.done is not None:
            self.queue.close()
            self.done.set()
