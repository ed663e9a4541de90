"""The row books (`fleet.generation.hotpath.rowqueue.Ledger`) on their own: no server, no network.

The dispatcher suite (test_gen_dispatch.py) proves the same rules end to end against simulated
servers; these pin each rule where it now lives, in a few milliseconds each.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from fleet.config import GenerationConfig
from fleet.generation.hotpath.client import Outcome
from fleet.generation.data.rows import Reject, Request
from fleet.generation.hotpath.rowqueue import Job, Ledger, WorkQueue
from fleet.generation.hotpath.work import RowPlan


class Store:
    """Records what the books write; `known` ids answer False (an earlier run wrote them)."""

    def __init__(self, known: set[str] | None = None) -> None:
        self.results: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.rejects: list[Any] = []
        self.known = known or set()

    def add_result(self, row: dict[str, Any]) -> bool:
        if row["id"] in self.known:
            return False
        self.results.append(row)
        return True

    def add_error(self, id: str, **kw: Any) -> bool:
        self.errors.append({"id": id, **kw})
        return True

    def add_reject(self, reject: Any) -> bool:
        self.rejects.append(reject)
        return True

    def add_quality_reject(self, row: dict[str, Any], reasons: list[str], *, line: int | None) -> bool:
        raise AssertionError("no quality gate is on in these tests")


def books(store: Store, max_attempts: int = 3) -> tuple[Ledger, list[str]]:
    failed: list[str] = []
    ledger = Ledger(store, WorkQueue(16), max_attempts=max_attempts, backoff_s=0.0, backoff_max_s=0.0, jitter=0.0,
                    rng=random.Random(0), fail=failed.append)
    return ledger, failed


def request(i: int) -> Request:
    return Request(f"r{i}", i + 1, [{"role": "user", "content": f"question {i}"}], {"max_tokens": 8})


def job(i: int) -> Job:
    return Job(RowPlan(GenerationConfig()).work(request(i)))


def ok() -> Outcome:
    return Outcome("ok", status=200, completion="an answer", finish_reason="stop", prompt_tokens=3,
                   completion_tokens=2, latency_s=0.1)


def test_a_row_is_written_once_and_the_books_close_when_the_last_one_ends() -> None:
    """Exactly once: a second ending of the same row (a late answer after a requeue) writes
    nothing and counts nothing; `done` is set only once the input is exhausted and none is out."""
    store = Store()
    ledger, _ = books(store)
    ledger.done = asyncio.Event()
    assert ledger.accept(request(0)) and ledger.accept(request(1))
    j0, j1 = job(0), job(1)
    assert ledger.finish_ok(j0, ok(), "s")
    assert not ledger.finish_ok(j0, ok(), "s"), "a row ended twice"
    ledger.finish_error(j0)
    assert [r["id"] for r in store.results] == ["r0"] and not store.errors
    ledger.feed_done = True
    ledger.check_done()
    assert not ledger.done.is_set(), "r1 is still out"
    assert ledger.finish_ok(j1, ok(), "s")
    assert ledger.done.is_set() and ledger.queue.closed
    assert (ledger.fed, ledger.completed, ledger.errors) == (2, 2, 0)


def test_a_row_an_earlier_run_wrote_is_not_counted_again() -> None:
    """The store guards too: a result it already holds (False) leaves the row ended but uncounted."""
    ledger, _ = books(Store(known={"r0"}))
    assert ledger.accept(request(0))
    assert not ledger.finish_ok(job(0), ok(), "s")
    assert ledger.completed == 0 and not ledger.inflight


def test_rejects_and_duplicate_ids_are_recorded_not_queued() -> None:
    """An input reject is written as a reject; a second row with an id already in flight is a
    reject too (two results under one id would break exactly-once)."""
    store = Store()
    ledger, _ = books(store)
    assert not ledger.accept(Reject(line=1, id=None, raw="{", reason="not JSON"))
    assert ledger.accept(request(0))
    assert not ledger.accept(request(0))
    assert ledger.rejects == 2 and ledger.fed == 1
    assert "duplicate id" in store.rejects[1].reason


def test_a_row_is_charged_until_max_attempts_then_goes_to_errors() -> None:
    """Transient failures are retried with a delay and charged; the last allowed one ends the row
    in errors with its last error. A stop leaves a charged row unwritten (resume sends it again)."""
    store = Store()
    ledger, _ = books(store, max_attempts=3)

    async def main() -> None:
        assert ledger.accept(request(0))
        j = job(0)
        j.last_error = "HTTP 503"
        ledger.charge_and_retry(j)
        assert await asyncio.wait_for(ledger.queue.get(), 5) is j, "the retry comes back through the queue"
        ledger.charge_and_retry(j)
        await asyncio.wait_for(ledger.queue.get(), 5)
        ledger.charge_and_retry(j)
        assert ledger.retries == 2 and j.attempts == 3
        assert store.errors == [{"id": "r0", "error": "HTTP 503", "attempts": 3, "line": 1, "server": None,
                                 "status": None}]
        assert ledger.accept(request(1))
        ledger.stopping = True
        ledger.charge_and_retry(job(1))
        assert not ledger.retry_handles and len(ledger.queue) == 0 and "r1" in ledger.inflight

    asyncio.run(main())


def test_a_row_that_keeps_killing_servers_ends_in_errors() -> None:
    """A requeue is free (its server died), but a row that went down with more than
    max_requeues servers may be what kills them: it ends in errors, saying so."""
    store = Store()
    ledger, _ = books(store, max_attempts=3)
    assert ledger.accept(request(0))
    j = job(0)
    j.last_error = "connection reset"
    for _ in range(ledger.max_requeues):
        ledger.requeue(j, poison=True)
    assert not store.errors and len(ledger.queue) == ledger.max_requeues
    ledger.requeue(j, poison=True)
    assert store.errors[0]["error"].startswith(f"{ledger.max_requeues} servers went down while serving this row")
    ledger.requeue(job(0), poison=False)   # never reached a server: not counted
    assert ledger.requeues == ledger.max_requeues


def test_the_same_error_for_the_first_hundred_rows_fails_the_job() -> None:
    """No success and one refusal for every row is a config problem: stop at 100 rather than
    fill the errors file; differing errors (prompts over the context) never trip it."""
    ledger, failed = books(Store())
    for i in range(100):
        assert ledger.accept(request(i))
        j = job(i)
        j.last_error = "HTTP 400: unknown sampling parameter 'tempreature'" if i != 50 else "other"
        ledger.finish_error(j)
    assert not failed, "a differing error resets the rule"
    ledger2, failed2 = books(Store())
    for i in range(100):
        assert ledger2.accept(request(i))
        j = job(i)
        j.last_error = "HTTP 400: unknown sampling parameter 'tempreature'"
        ledger2.finish_error(j)
    assert len(failed2) == 1 and failed2[0].startswith("the first 100 rows all failed with the same error")
