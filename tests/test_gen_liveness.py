"""Liveness from token progress: the engine's token counters decide whether a busy server
still works, whatever its row length (issue 22, item 1).

The pure reader is tested against /metrics lines the engines really printed
(tests/data/metrics/, each file names its source); the watchdog against simulated SGLang
servers (subprocesses) whose /metrics advance as they decode, stop when they wedge, and crawl
when they are slow. Every assertion counts (stall probes, downs, rows, counter values); none
compares durations.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import httpx

from fleet.generation.hotpath import probes, promtext
from fleet.generation.hotpath.dispatch import Dispatcher, Endpoint
from fleet.generation.data.rows import Request
from test_gen_dispatch import MemStore, assert_exactly_once, fast, gen, sims  # noqa: F401  (sims: a fixture)

DATA = Path(__file__).parent / "data" / "metrics"


def long_rows(n: int, tokens: int) -> list[Request]:
    """Rows that each decode exactly `tokens` tokens (ignore_eos): their length is known."""
    return [Request(f"r{i}", i + 1, [{"role": "user", "content": f"question {i}"}],
                    {"max_tokens": tokens, "ignore_eos": True}) for i in range(n)]


# ----------------------------------------------------------------------------- the reader (pure)


def test_token_count_of_real_sglang_and_vllm_metrics() -> None:
    """The progress total is the sum of the engines' token counters and nothing else: SGLang's
    finished-token counters (its docs' example), the scheduler's realtime counter of a newer
    build spelled `sglang_` (multiprocess mode), vLLM 0.30's per-step counters; a body with only
    gauges (SGLang 0.5.1's first lines) or per-request histograms (vLLM's
    request_generation_tokens, which look alike) has none."""
    read = {p.stem: promtext.token_count(p.read_text()) for p in DATA.glob("*.txt")}
    assert read == {
        "sglang_docs": 8.128902e06 + 7.557572e06,   # prompt_tokens_total + generation_tokens_total
        "sglang_multiprocess": 55.0,                # realtime_tokens_total{mode="prefill_compute"}
        "sglang_0_5_1": None,
        "vllm_0_30": 8.0 + 32.0,
        "vllm_dp2": None,
    }


def test_prometheus_lines_parsed_with_their_labels() -> None:
    """Labels (with escapes), exponents, +Inf, timestamps; malformed lines and unasked series skipped."""
    text = (DATA / "sglang_0_5_1.txt").read_text()
    [(name, labels, value)] = promtext.parse(text, ("sglang:num_running_reqs",))
    assert (name, value) == ("sglang:num_running_reqs", 1.0)
    assert labels == {"engine_type": "unified", "model_name": "Qwen-32B", "pp_rank": "0", "tp_rank": "0"}
    odd = "\n".join([
        'm_total{a="x\\"y",b="line\\nbreak"} 1.5e+03 1700000000000',
        'm_total 2',
        'm_total{le="+Inf"} +Inf',
        'm_total{broken="x} 3',
        'm_total{a="1"} not-a-number',
        'm_total_created{a="1"} 1.7e9',
        '# m_total{a="1"} 9',
    ])
    got = promtext.parse(odd, ("m_total",))
    assert got == [("m_total", {"a": 'x"y', "b": "line\nbreak"}, 1500.0), ("m_total", {}, 2.0),
                   ("m_total", {"le": "+Inf"}, float("inf"))]


# ----------------------------------------------------------------------------- the sim's counters


def _decode(text: str) -> float:
    return float(re.search(r'^sglang:realtime_tokens_total\{[^}]*mode="decode"\} (\S+)$', text, re.M)[1])


def _running(text: str) -> float:
    return float(re.search(r"^sglang:num_running_reqs\{[^}]*\} (\S+)$", text, re.M)[1])


def test_sim_token_counter_moves_while_decoding_and_stops_when_wedged(sims) -> None:
    """The sim exposes SGLang's realtime counter: it moves while a request decodes (a reading
    strictly between zero and the requests' total is seen before they end), and a wedged sim
    (--hang-after 2: two requests served, the next two hang) stops exactly at the tokens it
    decoded, with nothing running, while the hung requests are still in flight."""
    s = sims("--tokens-per-s", "10", "--max-running-requests", "4", "--hang-after", "2")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "q"}], "max_tokens": 20,
            "ignore_eos": True}

    async def go() -> tuple[list[float], list[str]]:
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            served = [asyncio.ensure_future(c.post("/v1/chat/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(0)
            hung = [asyncio.ensure_future(c.post("/v1/chat/completions", json=body)) for _ in range(2)]
            seen = []
            while not all(t.done() for t in served):
                seen.append(_decode((await c.get("/metrics")).text))
                await asyncio.sleep(0.02)
            assert all(t.result().status_code == 200 for t in served)
            after = [(await c.get("/metrics")).text for _ in range(5)]
            assert not any(t.done() for t in hung), "a wedged sim answered"
            for t in hung:
                t.cancel()
            return seen, after

    seen, after = asyncio.run(go())
    assert any(0 < v < 40 for v in seen), f"no partial progress seen while decoding: {seen[:20]}"
    assert [_decode(t) for t in after] == [40.0] * 5, "the counter moved with nothing decoding"
    assert [_running(t) for t in after] == [0.0] * 5


# ----------------------------------------------------------------------------- the watchdog


def test_wedged_server_with_long_rows_is_taken_out_by_its_tokens(sims, monkeypatch) -> None:
    """Fault (issue 22): a server wedges (/health answers, generations never do: --hang-after)
    while rows take far longer than stall_s. The row clock could not catch it here (its floor,
    stall_min_s, is 600 s: the job would wait for the request timeout); its token count stops,
    so after stall_s it is under suspicion, probed, and taken out — its rows go to the healthy
    server uncharged and every row is written exactly once. The suspicion is visible to the
    dispatcher while the probe runs."""
    good = sims("--tokens-per-s", "40", "--max-running-requests", "4")
    wedged = sims("--tokens-per-s", "40", "--max-running-requests", "4", "--hang-after", "4")
    store = MemStore()
    items = long_rows(16, 80)   # 2 s of decoding each: twice stall_s
    suspected: list[bool] = []
    real_probe = probes.generation_probe

    async def probe(ep: Endpoint, t: float) -> tuple[bool, str]:
        suspected.extend(s.under_suspicion for s in d.servers if s.ep is ep)
        return await real_probe(ep, t)

    monkeypatch.setattr(probes, "generation_probe", probe)

    async def stay_down(ep: Endpoint) -> bool:
        await asyncio.Event().wait()
        return False

    d = Dispatcher([good.endpoint("good"), wedged.endpoint("wedged")], store,
                   gen(stall_s=1.0, stall_min_s=600, stall_max_s=600, request_timeout_s=600),
                   on_server_down=stay_down, **fast())
    summary = asyncio.run(asyncio.wait_for(d.run(items), timeout=300))
    assert summary.complete and summary.completed == 16 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    w = {s["name"]: s for s in summary.servers}["wedged"]
    assert w["downs"] == 1 and w["requests"] <= 4 and w["progress"] == "metrics"
    assert (w["down_reason"] or "").startswith("stalled: no token progress for"), w["down_reason"]
    assert "/health_generate did not answer" in w["down_reason"]
    assert suspected and all(suspected), "the server was not under suspicion while its probe ran"
    assert not d.servers[1].under_suspicion, "a server taken out is no longer a suspect: it is out"
    assert all(r["attempts"] == 1 for r in store.results), "a wedged server's rows must not be charged"


def test_slow_server_with_long_rows_and_queued_requests_is_never_taken_out(sims) -> None:
    """A slow but working server is never a stall: 2 tokens/s per stream, rows of 6 tokens
    (3 s each: twice stall_s), and fleet's rows queued at the server for a while behind two
    requests of another client (a full server: SGLang's queue behind a full KV cache). Its
    tokens keep moving, so it is never probed — and a probe would fail here (the sim answers
    /health_generate after one token, 0.5 s, over the 0.2 s probe timeout), as would the row
    clock (1 s): only token progress keeps it in. Every row ends, none is charged."""
    s = sims("--tokens-per-s", "2", "--max-running-requests", "2", "--log-interval-s", "60")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "other client"}], "max_tokens": 6,
            "ignore_eos": True}
    others: list[int] = []

    def other_client() -> None:   # holds both slots first: fleet's first rows wait in the server's queue
        with httpx.Client(base_url=s.url, timeout=120) as c:
            threads = [threading.Thread(target=lambda: others.append(
                c.post("/v1/chat/completions", json=body).status_code)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    hog = threading.Thread(target=other_client)
    hog.start()
    assert asyncio.run(_until_running(s.url, 2)), "the other client's requests never started"
    store = MemStore()
    items = long_rows(6, 6)
    d = Dispatcher([s.endpoint("slow")], store,
                   gen(stall_s=1.5, stall_min_s=1, stall_max_s=1, request_timeout_s=600),
                   **fast(stall_probe_timeout_s=0.2))
    summary = asyncio.run(asyncio.wait_for(d.run(items), timeout=300))
    hog.join()
    assert others == [200, 200]
    assert summary.complete and summary.completed == 6 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    srv = summary.servers[0]
    assert (srv["stalls"], srv["downs"], srv["progress"]) == (0, 0, "metrics"), srv
    assert all(r["attempts"] == 1 for r in store.results)


async def _until_running(url: str, n: int) -> bool:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        for _ in range(3000):
            if _running((await c.get("/metrics")).text) >= n:
                return True
            await asyncio.sleep(0.01)
    return False


def test_engine_without_token_counters_is_judged_by_rows(sims) -> None:
    """A server whose /metrics counts no tokens (or answers 404: SGLang without --enable-metrics)
    must not be called stalled for it: the watchdog reads that once and falls back to the row clock."""
    s = sims("--tokens-per-s", "1000")
    d = Dispatcher([Endpoint("none", s.url + "/no-such-prefix", "sim-model"), s.endpoint("sim")], MemStore(),
                   gen(stall_s=1.0))

    async def read() -> list[Any]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for srv in d.servers:
                await d.health.read_progress(srv, session)
        return [(srv.progress, srv.tokens) for srv in d.servers]

    (none, counted) = asyncio.run(read())
    assert none == ("rows", None)
    assert counted[0] == "metrics" and counted[1] == 0.0
    assert d.health.stall_s(d.servers[0]) == d.health.row_stall_s(d.servers[0]) != 1.0
    assert d.health.stall_s(d.servers[1]) == 1.0


# ----------------------------------------------------------------------------- streamed answers


def test_streamed_answers_are_the_same_rows_as_unstreamed(sims) -> None:
    """Streaming (how the runner sees progress on an engine without counters) must not change a
    row: the sim decides each answer from the prompt, so the same rows streamed and unstreamed
    give the same completion, reasoning, finish reason and token counts, id for id."""
    s = sims("--tokens-per-s", "5000", "--max-running-requests", "8")
    items = [Request(f"r{i}", i + 1, [{"role": "user", "content": f"question {i}"}],
                     {"max_tokens": 40, "chat_template_kwargs": {"enable_thinking": True}}) for i in range(30)]
    keys = ("completion", "reasoning_content", "finish_reason", "prompt_tokens", "completion_tokens", "tool_calls")
    got = []
    for stream in (False, True):
        store = MemStore()
        d = Dispatcher([s.endpoint("s", stream=stream, streamed_rows=100)], store, gen(), **fast())   # every row
        summary = asyncio.run(d.run(items))
        assert summary.complete and summary.completed == 30 and not store.errors
        got.append({r["id"]: tuple(r.get(k) for k in keys) for r in store.results})
    assert got[0] == got[1]
    assert any(v[1] for v in got[1].values()), "no reasoning came through the stream"


def test_streamed_server_judged_by_its_chunks_wedged_out_slow_kept(sims) -> None:
    """On an engine without token counters the runner streams, and each chunk is progress: a
    wedged server (its next requests never stream a byte) is under suspicion after stall_s and
    taken out; a slow one (a token every 0.5 s, rows of 3 s: twice stall_s) is never probed,
    although its probe would fail (0.2 s timeout) and the row clock (1 s) would call it stalled."""
    slow = sims("--tokens-per-s", "2", "--max-running-requests", "2")
    wedged = sims("--tokens-per-s", "40", "--max-running-requests", "2", "--hang-after", "2")
    store = MemStore()
    items = long_rows(8, 6)

    async def stay_down(ep: Endpoint) -> bool:
        await asyncio.Event().wait()
        return False

    d = Dispatcher([slow.endpoint("slow", stream=True), wedged.endpoint("wedged", stream=True)], store,
                   gen(stall_s=1.5, stall_min_s=1, stall_max_s=1, request_timeout_s=600),
                   on_server_down=stay_down, **fast(stall_probe_timeout_s=0.2))
    summary = asyncio.run(asyncio.wait_for(d.run(items), timeout=300))
    assert summary.complete and summary.completed == 8 and not store.errors
    assert_exactly_once(store, [r.id for r in items])
    by = {s["name"]: s for s in summary.servers}
    assert (by["slow"]["stalls"], by["slow"]["downs"], by["slow"]["progress"]) == (0, 0, "stream"), by["slow"]
    assert by["wedged"]["downs"] == 1 and by["wedged"]["progress"] == "stream"
    assert (by["wedged"]["down_reason"] or "").startswith("stalled: no streamed token for"), by["wedged"]
    assert all(r["attempts"] == 1 for r in store.results)


def test_only_the_engine_without_counters_is_streamed() -> None:
    """Streaming costs client CPU per token (bench/bench_stream.py): the runner streams only
    where the engine counts no tokens (`transformers serve`), never for SGLang, vLLM or the sim."""
    from fleet.engines import PROFILES
    from fleet.generation.job.jobspec import ServerEntry
    from fleet.generation.job.runner import _endpoints

    assert {k: p.stream_progress for k, p in PROFILES.items()} == {
        "sglang": False, "vllm": False, "transformers": True, "sim": False}
    entry = ServerEntry(node="n", index=0, url="http://127.0.0.1:1", model="m")
    assert [e.stream for e in _endpoints([entry], "transformers")] == [True]
    assert [e.stream for e in _endpoints([entry], "sim")] == [False]
    # an endpoint fleet did not start streams unless its engine counts tokens ([[endpoints]] engine)
    endpoint = ServerEntry(node="endpoint", index=0, url="http://127.0.0.1:1", model="m", engine="openai")
    assert [e.stream for e in _endpoints([endpoint, ServerEntry(**{**endpoint.__dict__, "engine": "sglang"})],
                                         "sim")] == [True, False]


def test_streamed_tool_calls_and_usage_are_put_back_together() -> None:
    """The OpenAI stream splits a tool call over chunks (id and name first, the arguments in
    pieces, keyed by index) and sends usage in a last chunk without choices: the streamed
    Outcome must hold the same call and counts as a whole answer would (put back together, then
    judged by the same strict parser)."""
    from fleet.generation.hotpath.client import Outcome, _Stream, parse_completion

    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "the weather."}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                            "function": {"name": "get_weather", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 17, "total_tokens": 48}},
    ]
    acc, out = _Stream(), Outcome("ok")
    for c in chunks:
        acc.add(c)
    parse_completion(acc.completion(), out)
    assert (out.completion, out.reasoning_content, out.finish_reason) == ("", "The user wants the weather.", "tool_calls")
    assert out.tool_calls == [{"id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert (out.prompt_tokens, out.completion_tokens) == (31, 17)


def test_a_mistyped_streamed_answer_is_refused_like_a_whole_one() -> None:
    """A streamed answer is put back together and judged by the strict parser: a token count sent
    as a string (or content that is not text) is an invalid answer, never stored."""
    import pytest as _pytest

    from fleet.generation.hotpath.client import Outcome, _Stream, parse_completion

    acc = _Stream()
    acc.add({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    acc.add({"choices": [], "usage": {"prompt_tokens": "5", "completion_tokens": 1}})
    with _pytest.raises(ValueError, match="prompt_tokens"):
        parse_completion(acc.completion(), Outcome("ok"))
    bad = _Stream()
    bad.add({"choices": [{"index": 0, "delta": {"content": 12345}, "finish_reason": "stop"}]})
    with _pytest.raises(TypeError):
        bad.completion()   # _read_stream turns this into BadStream: an invalid answer


def test_served_s_is_generation_since_admission_not_a_first_reading_or_an_earlier_process(sims) -> None:
    """served_s is what a re-attaching bring-up takes as proof that a server serves instead of a
    smoke (fleet.jobs.judge_proof). It must mean the server generated: the first /metrics reading
    after an admission is a baseline, not progress (it called a server that had generated nothing
    "generated 0 s ago"), and an answer from before the server went down (and was relaunched on
    that port) proves nothing of the process admitted now."""
    import time

    import aiohttp

    s = sims("--tokens-per-s", "1000")
    d = Dispatcher([s.endpoint("sim")], MemStore(), gen(stall_s=1.0))
    srv = d.servers[0]

    def served() -> Any:
        return srv.snapshot(time.monotonic())["served_s"]

    async def go() -> list[Any]:
        seen = []
        async with aiohttp.ClientSession() as session:
            d.health.note_done(srv, 0.1)   # an answer from the process before it went down
            assert await d.health.admit(srv)
            for w in srv.workers:
                w.cancel()
            seen.append(served())
            await d.health.read_progress(srv, session)   # the first reading: nothing generated
            seen.append(served())
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                r = await c.post("/v1/chat/completions", json={"model": "sim-model", "max_tokens": 5,
                                                               "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
            await d.health.read_progress(srv, session)   # the total moved: it generated
            seen.append(served())
        return seen

    after_admit, after_first_reading, after_generating = asyncio.run(go())
    assert after_admit is None, "an answer of the earlier process counted for the one admitted now"
    assert after_first_reading is None, "a first /metrics reading counted as generation"
    assert after_generating is not None and after_generating < 5
