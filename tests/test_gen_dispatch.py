"""The dispatcher and the HTTP client against real simulated SGLang servers (subprocesses).

The store here is an in-memory stand-in that records every call, so each test can assert
the exactly-once rule directly: every fed id ends in exactly one add_result / add_error.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from conftest import free_port
from fleet.config import GenerationConfig
from fleet.generation.hotpath.client import chat, classify_status, new_session
from fleet.generation.hotpath.dispatch import Dispatcher, Endpoint
from fleet.generation.data.rows import Reject, Request
from fleet.generation.hotpath.rowqueue import WorkQueue

SIM = ("-m", "fleet.sim")  # the simulated SGLang server




class Sim:
    """One simulated SGLang server process; `start()` returns once /health answers 200."""

    def __init__(self, *args: str, port: int | None = None, log: Path | None = None) -> None:
        self.port = port or free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *args: str) -> Sim:
        argv = [sys.executable, *SIM, "--port", str(self.port), "--startup-s", "0", "--log-interval-s", "60",
                *(args or self.args)]
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60   # a deadline, not a speed check (busy machines)
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"sim on {self.port} exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"sim on {self.port} not healthy within 60 s")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def endpoint(self, name: str, **kw: Any) -> Endpoint:
        return Endpoint(name=name, url=self.url, model="sim-model", **kw)


@pytest.fixture
def sims():
    started: list[Sim] = []

    def make(*args: str, **kw: Any) -> Sim:
        s = Sim(*args, **kw).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.kill()


class MemStore:
    """Records every call of the store interface the dispatcher uses."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.rejects: list[Any] = []

    def add_result(self, row: dict[str, Any]) -> None:
        self.results.append(row)

    def add_error(self, id: str, **kw: Any) -> None:
        self.errors.append({"id": id, **kw})

    def add_reject(self, reject: Any) -> None:
        self.rejects.append(reject)

    def ended(self) -> Counter[str]:
        return Counter([r["id"] for r in self.results] + [e["id"] for e in self.errors])


def rows(n: int, max_tokens: int = 32, start: int = 0) -> list[Request]:
    return [Request(f"r{i}", i + 1, [{"role": "user", "content": f"question number {i}"}], {"max_tokens": max_tokens})
            for i in range(start, start + n)]


def gen(**kw: Any) -> GenerationConfig:
    return GenerationConfig(**{"max_concurrency_per_server": 64, "max_attempts": 6, "request_timeout_s": 30, **kw})


def fast(d: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    """Dispatcher options that keep tests quick: short backoffs and polls."""
    return {"backoff_s": 0.02, "backoff_max_s": 0.2, "recovery_backoff_s": 0.1, "recovery_backoff_max_s": 0.3,
            "probe_interval_s": 0.05, "liveness_poll_s": 0.1, "health_timeout_s": 2.0, "stall_poll_s": 0.05,
            "stall_probe_timeout_s": 1.0, **(d or {}), **kw}


def assert_exactly_once(store: MemStore, ids: list[str]) -> None:
    ended = store.ended()
    dup = [i for i, n in ended.items() if n > 1]
    assert not dup, f"ids written twice: {dup[:10]}"
    missing = set(ids) - set(ended)
    assert not missing, f"ids never written: {sorted(missing)[:10]}"


# ----------------------------------------------------------------------------- pure


def test_classify_status() -> None:
    assert [classify_status(s) for s in (400, 408, 409, 413, 422, 425, 429, 500, 503, 401, 404)] == [
        "permanent", "transient", "transient", "permanent", "permanent", "transient", "transient",
        "transient", "transient", "unusable", "unusable"]


def test_parse_completion_fields() -> None:
    from fleet.generation.hotpath.client import Outcome, parse_completion

    out = Outcome("ok")
    parse_completion({"choices": [{"message": {"content": None, "reasoning_content": "hmm",
                                               "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
                                   "finish_reason": "tool_calls"}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 7}}, out)
    assert (out.completion, out.reasoning_content, out.finish_reason, out.prompt_tokens, out.completion_tokens) == (
        "", "hmm", "tool_calls", 5, 7)
    assert out.tool_calls[0]["function"]["name"] == "f"
    with pytest.raises(ValueError):
        parse_completion({"object": "error"}, Outcome("ok"))


def test_work_queue_again_first_backpressure_and_close() -> None:
    async def go() -> None:
        q = WorkQueue(2)
        await q.put_fresh("a")
        await q.put_fresh("b")
        blocked = asyncio.ensure_future(q.put_fresh("c"))
        await asyncio.sleep(0.01)
        assert not blocked.done(), "a full queue must hold the feeder back"
        q.put_again("retry")                      # never blocks, served first
        assert await q.get() == "retry"
        assert await q.get() == "a"
        await asyncio.sleep(0.01)
        assert blocked.done() and blocked.result() is True
        assert [await q.get(), await q.get()] == ["b", "c"]
        waiter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.01)
        q.close()
        assert await waiter is None and await q.get() is None
        assert await q.put_fresh("late") is False

    asyncio.run(go())


def test_work_queue_item_handed_to_cancelled_getter_is_kept() -> None:
    """Regression: a row handed to a worker just as it is cancelled must not vanish."""
    async def go() -> None:
        q = WorkQueue(10)
        getter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put_again("row")          # handed to the waiting getter's future...
        getter.cancel()             # ...which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await getter
        assert await q.get() == "row"

    asyncio.run(go())


# ----------------------------------------------------------------------------- the client


def test_client_outcomes_against_sim(sims) -> None:
    s = sims("--context-length", "64", "--error-rate", "0")
    bad = sims("--error-rate", "1.0")
    dead_port = free_port()

    async def go() -> dict[str, Any]:
        sess = new_session(4)
        try:
            ok = await chat(sess, s.url, "sim-model", rows(1, 8)[0])
            long = Request("long", 1, [{"role": "user", "content": "word " * 200}], {"max_tokens": 8})
            over = await chat(sess, s.url, "sim-model", long)
            wrong_model = await chat(sess, s.url, "nope", rows(1)[0])
            err = await chat(sess, bad.url, "sim-model", rows(1)[0])
            refused = await chat(sess, f"http://127.0.0.1:{dead_port}", "sim-model", rows(1)[0])
            think = await chat(sess, s.url, "sim-model", Request("t", 1, [{"role": "user", "content": "hi"}],
                                                                 {"max_tokens": 30, "chat_template_kwargs":
                                                                  {"enable_thinking": True}, "ignore_eos": True}))
        finally:
            await sess.close()
        return dict(ok=ok, over=over, wrong_model=wrong_model, err=err, refused=refused, think=think)

    r = asyncio.run(go())
    ok = r["ok"]
    assert ok.ok and ok.completion and ok.finish_reason in ("stop", "length")
    assert ok.prompt_tokens and ok.completion_tokens and ok.latency_s > 0 and ok.finished_at >= ok.started_at
    assert r["over"].kind == "permanent" and r["over"].status == 400
    assert "longer than the model's context length" in r["over"].error
    assert r["wrong_model"].kind == "unusable" and r["wrong_model"].status == 404
    assert r["err"].kind == "transient" and r["err"].status == 500 and "simulated" in r["err"].error
    assert r["refused"].kind == "connection" and r["refused"].status is None
    assert r["think"].reasoning_content and r["think"].completion and r["think"].completion_tokens == 30


# ----------------------------------------------------------------------------- dispatch


def test_heterogeneous_speeds_fast_server_takes_more(sims) -> None:
    """Work stealing: the faster server takes more rows. The speeds differ by a lot (a row takes
    ~0 s against 3 s), so per-request overhead on a busy machine cannot close the gap (at 4x
    speeds of 8 and 32 ms per row, 50 ms of overhead each made them nearly equal)."""
    fast_s = sims("--tokens-per-s", "100000", "--max-running-requests", "8", "--speculative-algorithm", "EAGLE")
    slow_s = sims("--tokens-per-s", "10", "--max-running-requests", "8")
    store = MemStore()
    items = rows(400, 32)
    d = Dispatcher([fast_s.endpoint("fast"), slow_s.endpoint("slow")], store, gen(), **fast())
    summary = asyncio.run(d.run(items))
    assert summary.state == "done" and summary.complete and summary.completed == 400
    assert_exactly_once(store, [r.id for r in items])
    by = {s["name"]: s for s in summary.servers}
    assert by["fast"]["concurrency"] == 8 == by["slow"]["concurrency"], "K comes from /server_info"
    # only the direction is asserted, never a ratio: on a loaded machine HTTP overhead (the same
    # for both) shrinks the share; the wide speed gap keeps the direction safe
    assert by["fast"]["requests"] > by["slow"]["requests"], by
    assert by["fast"]["accept_len"] and by["slow"]["accept_len"] is None
    row = store.results[0]
    assert set(row) == {"id", "messages", "completion", "reasoning_content", "tool_calls", "finish_reason",
                        "prompt_tokens", "completion_tokens", "server", "attempts", "latency_s", "started_at",
                        "finished_at", "params", "flags", "turns", "extra", "token_ids", "key_order"}
    assert row["attempts"] == 1 and row["messages"][0]["role"] == "user" and row["server"] in ("fast", "slow")


def test_5xx_retried_until_every_row_completes(sims) -> None:
    a = sims("--error-rate", "0.1", "--seed", "1", "--tokens-per-s", "20000")
    b = sims("--error-rate", "0.1", "--seed", "2", "--tokens-per-s", "20000")
    store = MemStore()
    items = rows(500, 16)
    d = Dispatcher([a.endpoint("a"), b.endpoint("b")], store, gen(), **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 500 and not store.errors, (summary, store.errors)
    assert_exactly_once(store, [r.id for r in items])
    attempts = Counter(r["attempts"] for r in store.results)
    assert attempts[1] < 500 and sum(attempts.values()) == 500, attempts
    assert summary.retries == sum((n - 1) * c for n, c in attempts.items())
    assert all(s["state"] != "down" for s in summary.servers), "10% 5xx must not take a server out"


def test_prompt_over_context_goes_to_errors_at_once(sims) -> None:
    s = sims("--context-length", "128")
    store = MemStore()
    items = rows(20, 16)
    items.insert(7, Request("too-long", 99, [{"role": "user", "content": "token " * 500}], {"max_tokens": 16}))
    summary = asyncio.run(Dispatcher([s.endpoint("s")], store, gen(), **fast()).run(items))
    assert summary.complete and summary.completed == 20 and summary.errors == 1 and summary.retries == 0
    (err,) = store.errors
    assert err["id"] == "too-long" and err["attempts"] == 1 and err["status"] == 400 and err["line"] == 99
    assert "longer than the model's context length (128 tokens)" in err["error"] and err["server"] == "s"


def test_rejects_pass_through_and_duplicate_in_flight_id_is_rejected(sims) -> None:
    s = sims("--tokens-per-s", "200")   # slow: the first copy is still in flight when the second comes
    store = MemStore()
    items: list[Any] = rows(5, 16)
    items.insert(2, Reject(3, None, "line 3: not valid JSON", "{oops"))
    items.append(Request("r0", 42, [{"role": "user", "content": "again"}], {"max_tokens": 16}))
    summary = asyncio.run(Dispatcher([s.endpoint("s")], store, gen(), **fast()).run(items))
    assert summary.complete and summary.completed == 5 and summary.rejects == 2
    assert store.rejects[0].reason == "line 3: not valid JSON"
    assert store.rejects[1].id == "r0" and store.rejects[1].line == 42 and "duplicate" in store.rejects[1].reason
    assert_exactly_once(store, [r.id for r in items if isinstance(r, Request)])


def test_server_crash_requeues_its_rows_uncharged(sims) -> None:
    """A server dying mid-run costs its in-flight rows nothing: they go back and finish elsewhere."""
    good = sims("--tokens-per-s", "3000", "--max-running-requests", "8")
    dying = sims("--tokens-per-s", "3000", "--max-running-requests", "8", "--crash-after", "40")
    store = MemStore()
    items = rows(300, 32)
    d = Dispatcher([good.endpoint("good"), dying.endpoint("dying")], store, gen(), **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 300 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    by = {s["name"]: s for s in summary.servers}
    assert by["dying"]["state"] in ("down", "recovering") and by["dying"]["downs"] == 1
    assert 30 <= by["dying"]["requests"] < 40
    assert summary.requeues >= 1
    assert all(r["attempts"] == 1 for r in store.results), "a dead server's rows must not be charged"


def test_server_relaunched_by_callback_is_readmitted(sims, tmp_path: Path) -> None:
    """on_server_down brings the server back (here: a new process on the same port) → re-admitted."""
    a = sims("--tokens-per-s", "2000", "--max-running-requests", "4", "--crash-after", "25")
    calls: list[str] = []

    async def relaunch(ep: Endpoint) -> bool:
        calls.append(ep.name)
        a.kill()
        await asyncio.to_thread(a.start, "--tokens-per-s", "2000", "--max-running-requests", "4")
        return True

    store = MemStore()
    items = rows(150, 32)
    d = Dispatcher([a.endpoint("a")], store, gen(), on_server_down=relaunch, **fast())
    summary = asyncio.run(d.run(items))
    assert calls == ["a"]
    assert summary.complete and summary.completed == 150 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    (srv,) = summary.servers
    assert srv["downs"] == 1 and srv["restarts"] == 1 and srv["requests"] == 150


def test_all_servers_down_pauses_without_burning_retries_then_resumes(sims) -> None:
    s = sims("--tokens-per-s", "1000", "--max-running-requests", "4")
    store = MemStore()
    items = rows(120, 32)
    seen: dict[str, Any] = {}

    async def go() -> Any:
        d = Dispatcher([s.endpoint("only")], store, gen(max_attempts=2), **fast())
        task = asyncio.ensure_future(d.run(items))
        while len(store.results) < 20:
            await asyncio.sleep(0.01)
        s.kill()
        t0 = time.monotonic()
        while not d.state.startswith("paused"):
            assert time.monotonic() - t0 < 60, d.state
            await asyncio.sleep(0.02)
        seen["paused"] = d.snapshot()
        await asyncio.sleep(1.0)  # several recovery polls while paused
        seen["still"] = d.snapshot()
        await asyncio.to_thread(s.start)
        return await task

    summary = asyncio.run(go())
    paused, still = seen["paused"], seen["still"]
    assert paused["state"] == "paused: all servers down" and paused["servers_up"] == 0
    assert still["state"].startswith("paused") and still["errors"] == 0
    assert still["retries"] == paused["retries"], "no retries are burned while paused"
    assert summary.complete and summary.completed == 120 and not store.errors
    assert_exactly_once(store, [r.id for r in items])


def test_hung_server_taken_out_after_timeouts(sims) -> None:
    ok = sims("--tokens-per-s", "5000")
    hung = sims("--hang-requests")
    store = MemStore()
    items = rows(60, 16)
    d = Dispatcher([ok.endpoint("ok"), hung.endpoint("hung", max_running_requests=4)], store,
                   gen(request_timeout_s=0.5, max_concurrency_per_server=4), **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 60 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    by = {s["name"]: s for s in summary.servers}
    assert by["hung"]["requests"] == 0 and by["hung"]["downs"] == 1
    assert by["hung"]["state"] in ("down", "recovering"), "/health answers, but /health_generate hangs: kept out"
    assert "timed out" in by["hung"]["down_reason"]


def test_wrong_api_key_takes_the_server_out_not_the_rows(sims) -> None:
    """401 is the server's configuration, not the row's: no row may land in errors for it."""
    good = sims("--tokens-per-s", "5000")
    locked = sims("--api-key", "right")
    store = MemStore()
    items = rows(50, 16)
    d = Dispatcher([good.endpoint("good"), locked.endpoint("locked", api_key="wrong")], store, gen(), **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 50 and not store.errors
    by = {s["name"]: s for s in summary.servers}
    assert by["locked"]["requests"] == 0 and "API key" in (by["locked"]["down_reason"] or "")


def test_stop_lets_in_flight_finish_and_leaves_the_rest_unwritten(sims) -> None:
    s = sims("--tokens-per-s", "400", "--max-running-requests", "8")
    store = MemStore()
    items = rows(200, 32)

    async def go() -> Any:
        d = Dispatcher([s.endpoint("s")], store, gen(), **fast())
        task = asyncio.ensure_future(d.run(items))
        while len(store.results) < 10:
            await asyncio.sleep(0.01)
        d.request_stop(grace_s=5)
        return await task

    summary = asyncio.run(go())
    assert summary.state == "stopped" and not summary.complete
    assert summary.completed == len(store.results) and summary.unfinished == summary.fed - summary.completed
    assert summary.completed < 200
    assert not [i for i, n in store.ended().items() if n > 1]
    assert summary.servers[0]["in_flight"] == 0, "in-flight rows were let finish"


def test_same_error_for_every_row_fails_the_job_fast(sims) -> None:
    """A bad sampling parameter makes every row fail alike: stop instead of filling the errors file."""
    s = sims()
    store = MemStore()
    items = [Request(f"r{i}", i, [{"role": "user", "content": "x"}], {"max_tokens": -1}) for i in range(1000)]
    summary = asyncio.run(Dispatcher([s.endpoint("s")], store, gen(), **fast()).run(items))
    assert summary.state == "failed" and "same error" in (summary.reason or "")
    assert 100 <= len(store.errors) < 1000


def test_session_pool_width_follows_concurrency() -> None:
    async def go() -> int:
        sess = new_session(7)
        try:
            assert isinstance(sess.connector, aiohttp.TCPConnector)
            return sess.connector.limit
        finally:
            await sess.close()

    assert asyncio.run(go()) == 7


# ----------------------------------------------------------------------------- the stall watchdog


def sim_arrivals(sim: Sim) -> int:
    """Generation requests that reached the sim (its own count, from /server_info)."""
    import json
    import urllib.request

    with urllib.request.urlopen(sim.url + "/server_info", timeout=10) as r:
        return json.loads(r.read())["sim"]["generation_requests"]


def test_stall_s_derived_from_recent_row_times_within_floor_and_ceiling() -> None:
    """Without token counters the stall limit follows what the job has seen: 3 x the recent
    p99 row time, within [stall_min_s, stall_max_s]; the ceiling before any row finished. A
    server whose engine counts tokens is held to stall_s whatever its rows take."""
    d = Dispatcher([Endpoint("a", "http://127.0.0.1:1", "m"), Endpoint("b", "http://127.0.0.1:2", "m")], MemStore(),
                   gen(stall_min_s=5, stall_max_s=100))
    a, b = d.servers
    a.progress = b.progress = "rows"
    assert d.health.stall_s(a) == 100, "nothing seen yet: the ceiling"
    d.health.lats.extend([1.0] * 99 + [4.0])
    assert d.health.stall_s(a) == 12.0, "too few rows of its own: the job's p99 (4 s) x 3"
    a.lats.extend([0.5] * 50)
    assert d.health.stall_s(a) == 5, "3 x 0.5 s is under the floor"
    b.lats.extend([60.0] * 50)
    assert d.health.stall_s(b) == 100, "3 x 60 s is over the ceiling"
    a.progress = b.progress = "metrics"
    d.health.gen = gen(stall_s=7)
    assert d.health.stall_s(a) == d.health.stall_s(b) == 7


def test_wedged_server_is_taken_out_relaunched_and_readmitted(sims) -> None:
    """Fault: a server wedges mid-job (/health answers, generations and /health_generate hang:
    SGLang with a stuck scheduler; the sim's --hang-after). Before the watchdog its rows were
    held until the request timeout (30 min by default). Now: no row finished for stall_s → the
    generation probe fails → down at once; its in-flight rows go back uncharged, the server is
    relaunched through the down callback (the crash path) and re-admitted, and serves again."""
    # one row at a time, ~0.8 s each: alone it would need ~100 s for the rest, so the relaunch
    # (a second or two) always ends first and the relaunched server takes rows again
    good = sims("--tokens-per-s", "20", "--max-running-requests", "1")
    wedged = sims("--tokens-per-s", "3000", "--max-running-requests", "8", "--hang-after", "15")
    store = MemStore()
    items = rows(150, 32)
    calls: list[str] = []

    async def relaunch(ep: Endpoint) -> bool:
        calls.append(ep.name)
        wedged.kill()
        await asyncio.to_thread(wedged.start, "--tokens-per-s", "3000", "--max-running-requests", "8")
        return True

    d = Dispatcher([good.endpoint("good"), wedged.endpoint("wedged")], store,
                   gen(stall_s=0.5, request_timeout_s=600), on_server_down=relaunch, **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 150 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    w = {s["name"]: s for s in summary.servers}["wedged"]
    assert calls == ["wedged"] and w["downs"] == 1 and w["restarts"] == 1, "relaunched once, re-admitted"
    assert w["stalls"] >= 1 and w["state"] == "up"
    assert w["requests"] > 15, "the relaunched server served again"
    assert all(r["attempts"] == 1 for r in store.results), "no row was charged for the server's stall"


def test_cancellation_lost_to_aiohttps_timeout_no_request_reaches_the_down_server(sims, monkeypatch) -> None:
    """Fault (the observed bug): a worker's cancellation races aiohttp's own timeout and is
    swallowed (aiohttp turns it into a TimeoutError): the worker used to loop on, POSTing to its
    down server every few seconds until a healthy row ended in errors with "12 servers went
    down while serving this row", and the relaunch waited for those workers forever. Here every
    cancellation inside `chat` is swallowed that way. The server wedges (--hang-after), the
    watchdog takes it out, and the sim's own count proves that no request reached it after it
    was marked down (the recovery callback never brings it back); every row ends exactly once,
    uncharged, on the other server."""
    import fleet.generation.hotpath.dispatch as dispatch_mod
    from fleet.generation.hotpath.client import Outcome

    real_chat = dispatch_mod.chat

    async def swallowing_chat(*a: Any, **kw: Any) -> Outcome:
        try:
            return await real_chat(*a, **kw)
        except asyncio.CancelledError:
            return Outcome("timeout", error="no answer within 30 s (a cancellation lost to aiohttp's timer)")

    monkeypatch.setattr(dispatch_mod, "chat", swallowing_chat)
    good = sims("--tokens-per-s", "3000", "--max-running-requests", "8")
    wedged = sims("--tokens-per-s", "3000", "--max-running-requests", "8", "--hang-after", "20")
    store = MemStore()
    items = rows(400, 32)
    at_down: dict[str, int] = {}
    never = asyncio.Event()

    async def recover(ep: Endpoint) -> bool:
        srv = next(s for s in d.servers if s.name == ep.name)
        at_down["sent"] = srv.sent
        await never.wait()   # stays down until the job ends
        return False

    # no backups: they could carry the wedged server's rows to the end before its probe decides
    d = Dispatcher([good.endpoint("good"), wedged.endpoint("wedged")], store,
                   gen(stall_s=0.5, request_timeout_s=600, hedge_max_extra_fraction=0), on_server_down=recover,
                   **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 400 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    w = {s["name"]: s for s in summary.servers}["wedged"]
    assert w["downs"] == 1 and w["stalls"] >= 1 and w["requests"] <= 20
    assert (w["down_reason"] or "").startswith("stalled: no token progress"), w["down_reason"]
    assert "/health_generate did not answer" in w["down_reason"]
    arrived = sim_arrivals(wedged)
    assert 20 < arrived <= at_down["sent"], "the server saw a request after it was marked down"
    assert w["sent"] == at_down["sent"], "a request was sent to the server after it was marked down"
    assert all(r["attempts"] == 1 for r in store.results), "a stalled server's rows must not be charged"


def test_slow_row_on_a_working_server_is_charged_a_stalled_server_is_not(sims) -> None:
    """A row's attempt budget pays only for the row's own failures: a row that times out on a
    server whose generation probe answers (it is the row that is slow) is charged and ends in
    errors after max_attempts; the server stays up and its other rows are charged nothing."""
    s = sims("--tokens-per-s", "200", "--max-running-requests", "8")
    store = MemStore()
    items = rows(20, 4) + [Request("long", 99, [{"role": "user", "content": "a long one"}],
                                   {"max_tokens": 4000, "ignore_eos": True})]
    d = Dispatcher([s.endpoint("s")], store, gen(request_timeout_s=1.0, max_attempts=2, stall_s=600), **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 20
    assert [e["id"] for e in store.errors] == ["long"] and store.errors[0]["attempts"] == 2
    assert summary.servers[0]["downs"] == 0 and summary.servers[0]["state"] == "up"
    assert all(r["attempts"] == 1 for r in store.results)


# ----------------------------------------------------------------------------- the tail rule


def test_two_equal_servers_input_exhausted_at_once_both_work_to_the_end(sims) -> None:
    """Fault (the GPU half-speed suspect): with the input exhausted from the first row, the tail
    rule judged a server on its first, warm-up row (the first request of a real engine takes
    seconds) and, once held, that server never refreshed its estimate. Here two equal servers
    (one row at a time, every row the same length) get every row at once, and one's first
    request carries a warm-up delay: neither may be held at the tail, both serve to the end."""
    a = sims("--tokens-per-s", "200", "--max-running-requests", "1", "--first-request-delay-s", "1.5")
    b = sims("--tokens-per-s", "200", "--max-running-requests", "1")
    store = MemStore()
    items = [Request(f"r{i}", i + 1, [{"role": "user", "content": f"q {i}"}], {"max_tokens": 16, "ignore_eos": True})
             for i in range(80)]
    d = Dispatcher([a.endpoint("a"), b.endpoint("b")], store, gen(max_concurrency_per_server=1), **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 80 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    by = {s["name"]: s for s in summary.servers}
    assert by["a"]["held_s"] == 0 and by["b"]["held_s"] == 0, "an equal server was held back at the tail"
    assert by["a"]["requests"] >= 25 and by["b"]["requests"] >= 25, by
    for srv in by.values():   # the per-server record over time ends where the job did
        t, in_flight, done, tokens = srv["timeline"][-1]
        assert (in_flight, done, tokens) == (0, srv["requests"], srv["completion_tokens"])


def test_timeline_keeps_the_whole_job_in_bounded_memory() -> None:
    """A two-day job must not grow progress.json without bound: past `cap` points every other
    one is dropped and the interval doubles, so the record still spans the whole job."""
    from fleet.generation.hotpath.serverstate import Timeline

    tl = Timeline(every_s=2.0, cap=50)
    for t in range(0, 100_000, 1):
        tl.sample(float(t), 1, t, t * 10)
    rows = tl.rows()
    assert len(rows) < 50 and rows[0][0] == 0.0 and rows[-1][0] > 100_000 - 2 * tl.every_s
    gaps = [b[0] - a[0] for a, b in zip(rows, rows[1:])]
    assert max(gaps) <= 2 * min(gaps), "spread over the whole job, roughly evenly"


def test_slower_server_is_not_held_for_a_faster_one_that_stopped_finishing(sims) -> None:
    """Fault: at the tail a slower server leaves the last rows to a faster one — judged on the
    faster one's latency estimate, which goes stale the moment it wedges (nothing finishes, but
    until the watchdog takes it out it is still "up"). The slower server must take the rows
    instead of waiting for the watchdog: when the wedged server is marked down, no fresh row
    is left waiting in the queue."""
    slow = sims("--tokens-per-s", "100", "--max-running-requests", "4")
    fast_ = sims("--tokens-per-s", "400", "--max-running-requests", "8", "--hang-after", "150")
    store = MemStore()
    items = [Request(f"r{i}", i + 1, [{"role": "user", "content": f"q {i}"}], {"max_tokens": 16, "ignore_eos": True})
             for i in range(220)]
    at_down: dict[str, int] = {}

    async def recover(ep: Endpoint) -> bool:
        at_down.setdefault("queued", len(d.queue._fresh))   # its own rows, put back, are not counted
        await asyncio.Event().wait()
        return False

    # no backups: they would carry the wedged server's rows to the end before its probe decides
    d = Dispatcher([slow.endpoint("slow"), fast_.endpoint("fast")], store,
                   gen(stall_s=3, request_timeout_s=600, hedge_max_extra_fraction=0), on_server_down=recover, **fast())
    summary = asyncio.run(d.run(items))
    assert summary.complete and summary.completed == 220 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    assert at_down["queued"] == 0, "the slower server was held while the faster one finished nothing"
