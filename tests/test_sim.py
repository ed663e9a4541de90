"""The simulated SGLang server, driven as a real subprocess over real HTTP.

Every server here is `python -m fleet.sim --port P ...` (or the zip a node runs, `python
fleet_sim.pyz ...`) with its output in a log file (as the launcher runs it); waits poll with
a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port

SIM_DIR = Path(__file__).resolve().parents[1] / "fleet" / "sim"
SERVER = ("-m", "fleet.sim")
FAST = ("--tokens-per-s", "1000000")  # generations answer at once


class Sim:
    """One simulated server process and its log file."""

    def __init__(self, tmp: Path, *flags: str, python_flags: tuple[str, ...] = (), port: int | None = None,
                 entry: tuple[str, ...] = SERVER):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"sim-{self.port}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, *python_flags, *entry, "--port", str(self.port), *flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    # Deadlines below are generous on purpose: they fail only when something is broken, never
    # because the machine is busy (the CI runs beside other work).
    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds from launch until /health answered 200; fails at once if the process dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"sim exited with {self.proc.returncode} before ready:\n{self.log()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.TransportError:
                pass
            time.sleep(0.01)
        pytest.fail(f"sim not ready within {timeout}s:\n{self.log()[-2000:]}")

    def wait_log(self, pattern: str, timeout: float = 30.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log())
            if m:
                return m
            time.sleep(0.02)
        pytest.fail(f"{pattern!r} not in the log within {timeout}s:\n{self.log()[-2000:]}")

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"sim still running after {timeout}s:\n{self.log()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def sims(tmp_path):
    started: list[Sim] = []

    def start(*flags: str, **kw) -> Sim:
        sim = Sim(tmp_path, *flags, **kw)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """A shared, ready, fast server for the shape tests."""
    s = Sim(tmp_path_factory.mktemp("sim"), "--startup-s", "0.2", *FAST, "--context-length", "4096",
            "--max-running-requests", "48", "--kv-cache-tokens", "123456")
    s.wait_ready()
    yield s
    s.stop()


def chat_body(content: str = "hello there", **extra) -> dict:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --------------------------------------------------------------------------- startup


def test_ready_after_startup_s_with_sglang_log_lines(sims):
    """503 while starting, 200 after --startup-s; the log carries SGLang's startup lines.
    Not timed from above: under load the first poll may come late (3 s of 503 leaves room)."""
    s = sims("--startup-s", "3.0", "--kv-cache-tokens", "777777", "--max-running-requests", "37",
             "--context-length", "16384")
    seen_503 = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            code = httpx.get(s.url + "/health", timeout=1).status_code
        except httpx.TransportError:
            time.sleep(0.01)
            continue
        if code == 503:
            seen_503 = True
            assert httpx.get(s.url + "/health_generate", timeout=10).status_code in (503, 200)
        elif code == 200:
            break
        time.sleep(0.01)
    ready_s = time.monotonic() - s.started
    assert seen_503 and code == 200
    assert ready_s >= 3.0, ready_s
    log = s.log()
    for line in (
        r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] Load weight end\. type=\w+, dtype=\S+, avail mem=[\d.]+ GB, mem usage=[\d.]+ GB\.",
        r"TP0\] KV Cache is allocated\. #tokens: 777777, K size: [\d.]+ GB, V size: [\d.]+ GB",
        r"TP0\] Capture cuda graph begin\. This can take up to several minutes\. avail mem=[\d.]+ GB",
        r"TP0\] Capture cuda graph end\. Time elapsed: [\d.]+ s\.",
        r"TP0\] max_total_num_tokens=777777, chunked_prefill_size=\d+, max_prefill_tokens=\d+, "
        r"max_running_requests=37, context_len=16384, available_gpu_mem=[\d.]+ GB",
        rf"\] INFO:     Uvicorn running on http://127\.0\.0\.1:{s.port}",
        r"\d\] The server is fired up and ready to roll!",
    ):
        assert re.search(line, log), line
    order = [log.index(t) for t in ("Load weight end", "KV Cache is allocated", "Capture cuda graph end",
                                    "max_total_num_tokens=", "Uvicorn running", "fired up")]
    assert order == sorted(order)
    assert httpx.get(s.url + "/health_generate", timeout=10).status_code == 200


# --------------------------------------------------------------------------- shapes


def test_info_endpoints(sim):
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(sim.url + path).json()
        assert info["model_path"] == "/dev/shm/sim-model"
        assert info["tokenizer_path"] == "/dev/shm/sim-model"
        assert info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(sim.url + path).json()
        assert info["model_path"] == "/dev/shm/sim-model"
        assert info["port"] == sim.port
        assert info["max_running_requests"] == 48
        assert info["context_length"] == 4096
        assert info["speculative_algorithm"] is None
        assert info["max_total_num_tokens"] == 123456
        assert info["version"] == "sim-0.1"
        assert "avg_spec_accept_length" not in info["internal_states"][0]
    models = httpx.get(sim.url + "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0] | {"created": 0} == {
        "id": "sim-model", "object": "model", "owned_by": "sglang", "max_model_len": 4096,
        "created": 0, "root": "sim-model", "parent": None,
    }
    assert httpx.get(sim.url + "/nope").status_code == 404
    assert httpx.post(sim.url + "/health").status_code == 405


def test_chat_completion_shape_and_usage(sim):
    r = httpx.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=50))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "sim-model"
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len("hello there") // 4 + 1
    assert 1 <= usage["completion_tokens"] <= 50
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(choice["message"]["content"].split()) == usage["completion_tokens"]
    assert (choice["finish_reason"] == "length") == (usage["completion_tokens"] == 50)


def test_finish_reasons_cover_stop_and_length(sim):
    """Lengths vary with the prompt; some requests run into max_tokens."""
    with httpx.Client(base_url=sim.url) as c:
        results = [c.post("/v1/chat/completions", json=chat_body(f"q{i}", max_tokens=8)).json()
                   for i in range(60)]
    reasons = {r["choices"][0]["finish_reason"] for r in results}
    assert reasons == {"stop", "length"}
    lengths = {r["usage"]["completion_tokens"] for r in results}
    assert len(lengths) > 3 and max(lengths) == 8 and min(lengths) >= 1
    # ignore_eos, like SGLang's extra parameter, always runs to the limit
    r = httpx.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=33, ignore_eos=True)).json()
    assert r["usage"]["completion_tokens"] == 33 and r["choices"][0]["finish_reason"] == "length"


def test_reasoning_content_when_thinking(sim):
    r = httpx.post(sim.url + "/v1/chat/completions", json=chat_body(
        max_tokens=30, ignore_eos=True, chat_template_kwargs={"enable_thinking": True})).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"]
    assert len(msg["reasoning_content"].split()) + len(msg["content"].split()) == 30


def test_streaming_with_usage_matches_non_streaming(sim):
    body = chat_body("stream me", max_tokens=200, ignore_eos=True)
    plain = httpx.post(sim.url + "/v1/chat/completions", json=body).json()
    r = httpx.post(sim.url + "/v1/chat/completions",
                   json=body | {"stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    # without include_usage: no usage chunk
    events = sse_events(httpx.post(sim.url + "/v1/chat/completions", json=body | {"stream": True}).text)
    assert all("usage" not in e for e in events if isinstance(e, dict))


def test_completions_and_native_generate(sim):
    r = httpx.post(sim.url + "/v1/completions", json={"model": "sim-model", "prompt": "Once", "max_tokens": 12})
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == 2
    r = httpx.post(sim.url + "/generate", json={"text": "Once upon", "sampling_params": {"max_new_tokens": 9}})
    body = r.json()
    meta = body["meta_info"]
    assert body["text"]
    assert meta["prompt_tokens"] == len("Once upon") // 4 + 1
    assert 1 <= meta["completion_tokens"] <= 9
    assert meta["finish_reason"]["type"] == ("length" if meta["completion_tokens"] == 9 else "stop")
    events = sse_events(httpx.post(sim.url + "/generate", json={
        "text": "Once upon", "sampling_params": {"max_new_tokens": 9}, "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["text"] == body["text"]
    assert events[-2]["meta_info"]["finish_reason"] == meta["finish_reason"]


def test_validation_errors(sim):
    url = sim.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["object"] == "error"
    r = httpx.post(url, json=chat_body() | {"model": "gpt-9"})
    assert r.status_code == 404
    assert r.json()["message"] == "The model `gpt-9` does not exist."
    # prompt (41 tokens) + max_tokens reaching the 4096 context: SGLang's wording
    r = httpx.post(url, json=chat_body("x" * 160, max_tokens=4096 - 41))
    assert r.status_code == 400
    err = r.json()
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert err["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 4096 tokens. "
        "You requested a total of 4096 tokens: 41 tokens from the input messages and 4055 tokens")
    assert httpx.post(url, json=chat_body("x" * 160, max_tokens=4096 - 42)).status_code == 200
    r = httpx.post(url, json=chat_body("x" * 20000))
    assert r.status_code == 400 and "longer than the model's context length (4096 tokens)" in r.json()["message"]
    r = httpx.post(sim.url + "/generate", json={"text": "x" * 160, "sampling_params": {"max_new_tokens": 5000}})
    assert r.status_code == 400 and "maximum context length of 4096" in r.json()["error"]["message"]


def test_metrics(sim):
    httpx.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=5))
    text = httpx.get(sim.url + "/metrics").text
    assert re.search(r'^sglang:max_total_num_tokens\{[^}]*\} 123456\.0$', text, re.M)
    assert re.search(r"^sglang:num_running_reqs\{[^}]*\} \d+\.0$", text, re.M)
    assert int(float(re.search(r"^sglang:prompt_tokens_total\{[^}]*\} ([\d.]+)$", text, re.M)[1])) > 0
    assert int(float(re.search(r"^sglang:generation_tokens_total\{[^}]*\} ([\d.]+)$", text, re.M)[1])) > 0
    assert "sglang:spec_accept_length" not in text


def test_keep_alive_and_pipelining(sim):
    """Two requests in one write on one connection get two answers, in order."""
    body = json.dumps(chat_body(max_tokens=4)).encode()
    post = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))
    get = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as s:
        s.sendall(post + get)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert data.index(b"chat.completion") < data.rindex(b"HTTP/1.1 200 OK")


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_outputs(sims):
    a, b, c = sims("--startup-s", "0", *FAST, "--seed", "7"), sims("--startup-s", "0", *FAST, "--seed", "7"), \
        sims("--startup-s", "0", *FAST, "--seed", "8")
    for s in (a, b, c):
        s.wait_ready()

    def run(s: Sim) -> list:
        with httpx.Client(base_url=s.url) as cl:
            return [(r["choices"][0]["message"]["content"], r["usage"], r["choices"][0]["finish_reason"])
                    for r in (cl.post("/v1/chat/completions", json=chat_body(f"p{i}", max_tokens=40)).json()
                              for i in range(20))]

    assert run(a) == run(b)
    assert run(a) != run(c)


# --------------------------------------------------------------------------- auth


def test_api_key(sims):
    s = sims("--startup-s", "0", *FAST, "--api-key", "sekrit")
    s.wait_ready()
    assert httpx.get(s.url + "/health").status_code == 200
    assert httpx.get(s.url + "/v1/models").status_code == 401
    r = httpx.post(s.url + "/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    auth = {"Authorization": "Bearer sekrit"}
    assert httpx.get(s.url + "/v1/models", headers=auth).status_code == 200
    assert httpx.post(s.url + "/v1/chat/completions", json=chat_body(), headers=auth).status_code == 200
    assert "sekrit" not in s.log()


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("kind,line", [
    ("kv-pool", "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."),
    ("weights", "torch.OutOfMemoryError: CUDA out of memory."),
])
def test_oom_at_start(sims, kind, line):
    s = sims("--startup-s", "0.5", "--oom-at-start", *([kind] if kind != "kv-pool" else []))
    assert s.wait_exit() == 1
    log = s.log()
    assert line in log
    assert log.index("Scheduler hit an exception:") < log.index(line) < log.index(
        "Received sigquit from a child process. It usually means the child failed.")
    assert "fired up" not in log


def test_hang_at_start_never_ready(sims):
    s = sims("--startup-s", "0.2", "--hang-at-start")
    s.wait_log("Capture cuda graph begin")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert s.proc.poll() is None
        assert httpx.get(s.url + "/health", timeout=10).status_code == 503
        time.sleep(0.1)
    assert "fired up" not in s.log()


def test_crash_after_n(sims):
    s = sims("--startup-s", "0", *FAST, "--crash-after", "3")
    s.wait_ready()
    with httpx.Client(base_url=s.url) as c:
        for _ in range(2):
            assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
            assert c.get("/health_generate").status_code == 200  # probes do not count
        with pytest.raises(httpx.TransportError):
            c.post("/v1/chat/completions", json=chat_body())
    assert s.wait_exit() == 1
    log = s.log()
    assert "Scheduler hit an exception:" in log and "Received sigquit from a child process" in log


def test_hang_requests(sims):
    s = sims("--startup-s", "0", *FAST, "--hang-requests")
    s.wait_ready()
    assert httpx.get(s.url + "/v1/models").status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", json=chat_body(), timeout=0.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(s.url + "/health_generate", timeout=0.5)
    assert httpx.get(s.url + "/health").status_code == 200


def test_error_rate_share_and_determinism(sims):
    a = sims("--startup-s", "0", *FAST, "--error-rate", "0.25", "--seed", "3")
    b = sims("--startup-s", "0", *FAST, "--error-rate", "0.25", "--seed", "3")

    def codes(s: Sim) -> list[int]:
        s.wait_ready()
        with httpx.Client(base_url=s.url) as c:
            return [c.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code for _ in range(200)]

    ca, cb = codes(a), codes(b)
    assert ca == cb
    assert set(ca) == {200, 500}
    assert 0.15 <= ca.count(500) / 200 <= 0.35


def test_queueing_beyond_max_running_requests(sims):
    """8 requests on 4 slots: 4 run and 4 queue (seen in /metrics), and the queued ones run only
    once slots free, so the 8 end in two waves. Checked by counts and lower bounds, which a busy
    machine cannot break (it only makes things slower), not by how long the waves take."""
    s = sims("--startup-s", "0", "--tokens-per-s", "50", "--max-running-requests", "4")
    s.wait_ready()
    per_request = 2.0
    body = chat_body(max_tokens=int(50 * per_request), ignore_eos=True)

    def counts(metrics: str) -> tuple[float, float]:
        running, queued = re.findall(r"^sglang:num_(?:running|queue)_reqs\{[^}]*\} (\S+)$", metrics, re.M)
        return float(running), float(queued)

    async def burst() -> tuple[list[float], list[tuple[float, float]]]:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            await asyncio.gather(*(c.get("/health") for _ in range(9)))  # open the connections first
            t = time.monotonic()

            async def one() -> float:
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                return time.monotonic() - t

            tasks = [asyncio.ensure_future(one()) for _ in range(8)]
            seen = []
            while not all(task.done() for task in tasks):
                seen.append(counts((await c.get("/metrics")).text))
                await asyncio.sleep(0.05)
            return sorted(await asyncio.gather(*tasks)), seen

    ends, seen = asyncio.run(burst())
    assert max(running for running, _ in seen) == 4, seen     # never more than the slots
    assert (4, 4) in seen, seen   # the extra four waited in the queue (a 2 s window to see it)
    # a queued request starts only when a running one ends: the second wave ends at least two
    # request-times after the burst began (the first wave cannot end before one)
    assert all(e >= per_request for e in ends[:4]) and all(e >= 2 * per_request for e in ends[4:]), ends


def test_disconnect_frees_the_slot(sims):
    """A client that gives up must not keep its slot (SGLang aborts the request). The abandoned
    request would hold the only slot for 500 s; the next one must be answered well before."""
    s = sims("--startup-s", "0", "--tokens-per-s", "10", "--max-running-requests", "1")
    s.wait_ready()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", json=chat_body(max_tokens=5000, ignore_eos=True), timeout=0.3)
    r = httpx.post(s.url + "/v1/chat/completions", json=chat_body(max_tokens=2, ignore_eos=True), timeout=60)
    assert r.status_code == 200


def test_first_request_delay(sims):
    """The first generation waits --first-request-delay-s, later ones do not: the second one
    ends before the delay would have (a wide margin: the delay is 3 s, the request instant)."""
    s = sims("--startup-s", "0", *FAST, "--first-request-delay-s", "3")
    s.wait_ready()
    with httpx.Client(base_url=s.url, timeout=60) as c:
        t = time.monotonic()
        c.post("/v1/chat/completions", json=chat_body())
        first = time.monotonic() - t
        t = time.monotonic()
        c.post("/v1/chat/completions", json=chat_body())
        second = time.monotonic() - t
    assert first >= 3 and second < 3


def test_speculative_accept_length_and_decode_log(sims):
    s = sims("--startup-s", "0", "--tokens-per-s", "200", "--speculative-algorithm", "EAGLE",
             "--log-interval-s", "0.2")
    s.wait_ready()
    info = httpx.get(s.url + "/server_info").json()
    assert info["speculative_algorithm"] == "EAGLE"
    assert 2.5 <= info["internal_states"][0]["avg_spec_accept_length"] <= 3.5
    assert re.search(r"^sglang:spec_accept_length\{[^}]*\} [\d.]+$", httpx.get(s.url + "/metrics").text, re.M)
    httpx.post(s.url + "/v1/chat/completions", json=chat_body(max_tokens=100, ignore_eos=True), timeout=60)
    # Fault (CI under load): the first Decode line can come before any token (gen throughput
    # 0.00, as in SGLang); the line after the request's tokens has a rate > 0, so wait for one.
    line = (r"TP0\] Decode batch\. #running-req: \d+, #token: \d+, token usage: [\d.]+, "
            r"accept len: ([\d.]+), cuda graph: True, gen throughput \(token/s\): ([\d.]+), #queue-req: \d+")
    s.wait_log(line.replace(r"([\d.]+), #queue", r"(0*[1-9][\d.]*|0\.\d*[1-9]\d*), #queue"))
    found = re.findall(line, s.log())
    assert found and all(2.3 <= float(accept) <= 3.7 for accept, _ in found), found
    assert any(float(rate) > 0 for _, rate in found), found


# --------------------------------------------------------------------------- process


def test_runs_isolated_without_site_packages(sims, tmp_path):
    """-S -I: no site-packages, no PYTHON* env, no cwd on sys.path -> stdlib only.

    Protects: the zip a node runs (`fleet.sim.bundle`) serving with a bare interpreter, every
    module of the package inside it and none of them importing beyond the standard library.
    """
    from fleet.sim.bundle import build_pyz

    pyz = tmp_path / "fleet_sim.pyz"
    pyz.write_bytes(build_pyz())
    s = sims("--startup-s", "0", *FAST, python_flags=("-S", "-I"), entry=(str(pyz),))
    s.wait_ready()
    assert httpx.post(s.url + "/v1/chat/completions", json=chat_body()).status_code == 200


def test_sigterm_exits_zero_promptly(sims):
    s = sims("--startup-s", "0", "--tokens-per-s", "1")
    s.wait_ready()
    with httpx.Client(base_url=s.url) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json=chat_body(max_tokens=50, ignore_eos=True), timeout=0.2)
    t = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    # the in-flight request would take 50 s: exiting well before that is "promptly"
    assert time.monotonic() - t < 25
    assert "INFO:     Shutting down" in s.log()


def test_port_in_use_fails_like_uvicorn(sims):
    s = sims("--startup-s", "0", *FAST)
    s.wait_ready()
    other = sims("--startup-s", "0", port=s.port)
    assert other.wait_exit() == 1
    assert "error while attempting to bind on address" in other.log()


def test_importable_main_rejects_bad_flags():
    from fleet.sim.server import main

    with pytest.raises(SystemExit) as exc:
        main(["--port", "1", "--error-rate", "2"])
    assert exc.value.code == 2


def test_bundle_holds_every_module_and_is_deterministic():
    """Protects: a module added to fleet/sim but left out of the zip a node runs (the sim
    would fail there with ModuleNotFoundError only), and a zip whose bytes change from build
    to build (every launch would upload a "new" file)."""
    import io
    import zipfile

    from fleet.sim.bundle import build_pyz

    data = build_pyz()
    assert data == build_pyz()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert sorted(names) == sorted(["__main__.py", "fleet/__init__.py",
                                    *(f"fleet/sim/{p.name}" for p in SIM_DIR.glob("*.py"))])


def test_sim_imports_only_the_standard_library():
    """Protects: a node runs the sim with a bare interpreter, so a module of fleet/sim that
    imports fleet's other code or a third-party package works here and fails there."""
    import ast

    for path in SIM_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert name.startswith("fleet.sim") or top in sys.stdlib_module_names or top == "__future__", \
                    f"{path.name} imports {name}"
