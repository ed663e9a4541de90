"""Smoke: one chat completion per server, retried with backoff, and the cross-server comparison.

The first request to a fresh server can pay for CUDA graph capture and kernel
compilation (well over 30 s), so it gets its own, longer timeout. Later attempts use the
normal timeout and back off exponentially with jitter.

Like readiness, a smoke watches the server while it waits (`ServerWatch`, passed as
`watch`): before each attempt, every `watch_every_s` while a request is in flight, and
through each backoff. A process that dies or logs a fatal line during its smoke fails it
at once with what the log says, instead of retrying a dead port until the attempts run out.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from fleet.backoff import backoff_delay as backoff
from fleet.config import SmokeConfig
from fleet.errors import ServerFailed
from fleet.answer import parse_answer
from fleet.interrupt import check_stop
from fleet.net import tls_context

if TYPE_CHECKING:
    from fleet.engines import LogVerdict
    from fleet.node import Node


@dataclass
class Attempt:
    n: int
    started_s: float        # seconds since the smoke began
    seconds: float
    timeout_s: float
    outcome: str            # "ok" or the error


@dataclass
class SmokeResult:
    node: str
    index: int
    url: str
    ok: bool
    latency_s: float | None
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str | None
    attempts: list[Attempt] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def timeline(self) -> str:
        return "; ".join(f"#{a.n} at {a.started_s:.1f}s: {a.outcome} after {a.seconds:.1f}s (timeout {a.timeout_s:g}s)"
                         for a in self.attempts)


SMOKE_MAX_BYTES = 16 << 20   # a smoke answer is a few hundred bytes
CLOCK_TICKS = 100            # /proc's clock ticks per second (USER_HZ: 100 on Linux)
LIFE_TICKS = 100             # CPU time a server must use within smoke.stall_s to count as working


def backoff_delay(attempt: int, cfg: SmokeConfig, rng: random.Random) -> float:
    """Delay before retry number `attempt` (1-based): base * 2^(n-1), capped, plus up to jitter share."""
    return backoff(attempt, cfg.backoff_s, max_s=cfg.backoff_max_s, jitter=cfg.jitter, rng=rng)


def check_answer(body: bytes | dict[str, Any]) -> tuple[str, int | None, int | None, str | None]:
    """(content, prompt_tokens, completion_tokens, finish_reason); raise ValueError when unusable:
    not a chat completion by the runner's own strict reading (`parse_answer`), empty, or no usage."""
    a = parse_answer(body)
    content = a.content + (a.reasoning_content or "")
    if not content.strip():
        raise ValueError("empty content")
    if not a.completion_tokens or a.prompt_tokens is None:
        raise ValueError(f"no usage counts in the answer (prompt_tokens {a.prompt_tokens}, "
                         f"completion_tokens {a.completion_tokens})")
    return content, a.prompt_tokens, a.completion_tokens, a.finish_reason


def smoke(url: str, model: str, cfg: SmokeConfig, *, node: str = "", index: int = 0,
          api_key: str | None = None, seed: int | None = None, temperature: float = 0.0,
          sleep: Callable[[float], None] = time.sleep, watch: Callable[[], None] | None = None,
          watch_every_s: float = 0.5) -> SmokeResult:
    """Smoke one server; raise ServerFailed with the attempt timeline when every attempt failed.

    `watch` (a `ServerWatch`) raises ServerFailed the moment the server dies or logs a
    fatal line; it is called before each attempt, every `watch_every_s` while one is in
    flight, after a failed one and through the backoff.

    `temperature` should be the job's: `transformers serve --continuous-batching` fixes its
    sampling settings from the first request it sees.
    """
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    payload = {"model": model, "messages": [{"role": "user", "content": cfg.prompt}],
               "max_tokens": cfg.max_tokens, "temperature": temperature}
    result = SmokeResult(node, index, url, False, None, "", None, None, None)
    t0 = time.monotonic()

    def look() -> None:
        """Each turn of a wait: was the run cancelled (fleet/interrupt.py), is the server still alive?"""
        check_stop(f"the smoke of server {index} at {url}")
        if watch is not None:
            watch()

    def in_flight(timeout: float) -> Callable[[], None]:
        """`look`, and while a request with a long allowance waits: is the server doing anything?"""
        if not isinstance(watch, ServerWatch) or not cfg.stall_s or timeout <= cfg.stall_s:
            return look
        watch.mark()

        def check() -> None:
            look()
            watch.check_stall(cfg.stall_s, timeout)
        return check

    def pause(seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            sleep(min(left, watch_every_s))
            look()

    with httpx.Client(headers=headers, verify=tls_context(url)) as client:
        for n in range(1, cfg.attempts + 1):
            timeout = cfg.first_timeout_s if n == 1 else cfg.timeout_s
            look()
            start = time.monotonic()
            try:
                r = _post(client, f"{url}/v1/chat/completions", payload, timeout, in_flight(timeout), watch_every_s)
                if r.status_code != 200:
                    raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
                content, pt, ct, fr = check_answer(r.content)
            except (httpx.HTTPError, ValueError) as exc:
                kind = "timeout" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
                result.attempts.append(Attempt(n, start - t0, time.monotonic() - start, timeout, f"{kind}: {exc}"[:300]))
                look()  # a refused or reset connection is often the process dying: say so now
                if n < cfg.attempts:
                    pause(backoff_delay(n, cfg, rng))
                continue
            latency = time.monotonic() - start
            result.attempts.append(Attempt(n, start - t0, latency, timeout, "ok"))
            result.ok, result.latency_s, result.content = True, latency, content
            result.prompt_tokens, result.completion_tokens, result.finish_reason = pt, ct, fr
            return result
    raise ServerFailed(
        f"server {index} at {url}: smoke failed after {cfg.attempts} attempts in {time.monotonic() - t0:.1f} s "
        f"— {result.timeline()}",
        host=node or None,
        remedy="read the server log; if the first request only needs longer (large model, graph capture), "
               "raise smoke.first_timeout_s",
    )


def _post_capped(client: httpx.Client, url: str, payload: dict[str, Any], timeout: float) -> httpx.Response:
    """POST and read the answer within `timeout` in all (httpx's own timeout is per read: a server
    dribbling a byte a second would hold it for ever) and up to SMOKE_MAX_BYTES (ValueError past it)."""
    deadline = time.monotonic() + timeout
    with client.stream("POST", url, json=payload, timeout=timeout) as r:
        buf = bytearray()
        for chunk in r.iter_bytes():
            buf += chunk
            if len(buf) > SMOKE_MAX_BYTES:
                raise ValueError(f"an answer over {SMOKE_MAX_BYTES:,} bytes")
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"the answer took over {timeout:g} s", request=r.request)
        return httpx.Response(r.status_code, content=bytes(buf), request=r.request)


def _post(client: httpx.Client, url: str, payload: dict[str, Any], timeout: float,
          watch: Callable[[], None] | None, watch_every_s: float) -> httpx.Response:
    """POST, calling `watch` every `watch_every_s` while the request is in flight (it raises to give up).

    The request runs in a daemon thread so that a server stuck after a fatal error (its
    process alive, its connection open) does not hold the smoke for the whole timeout; a
    request given up on ends by its own timeout, on its own.
    """
    if watch is None:
        return _post_capped(client, url, payload, timeout)
    responses: list[httpx.Response] = []
    errors: list[BaseException] = []

    def send() -> None:
        try:
            responses.append(_post_capped(client, url, payload, timeout))
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=send, name="fleet-smoke-request", daemon=True)
    thread.start()
    while True:
        thread.join(watch_every_s)
        if not thread.is_alive():
            break
        watch()
    if errors:
        raise errors[0]
    return responses[0]


@dataclass
class ServerWatch:
    """Is the server still alive, and has its log printed a fatal line since the smoke began?

    Called by `smoke` between and during attempts; raises ServerFailed naming the exit or
    the fatal line, with the log's tail, at the first sign. One round trip per call
    (`Node.watch`); the log is read from where it stood when the watch was made, so a
    long-running server's whole log is never read.
    """

    node: Node
    pid: int
    log_path: str
    classify: Callable[[str], LogVerdict]
    index: int = 0
    port: int | None = None
    secrets: list[str | None] = field(default_factory=list)
    offset: int = 0
    text: str = ""
    started: float = field(default_factory=time.monotonic)
    ticks: int | None = None         # CPU time of the server's process group, at the last call
    life_at: float = field(default_factory=time.monotonic)   # its last sign of life: a log line or CPU used
    life_ticks: int | None = None    # the CPU time then

    @classmethod
    def start(cls, node: Node, pid: int, log_path: str, classify: Callable[[str], LogVerdict], *,
              index: int = 0, port: int | None = None, secrets: list[str | None] | None = None) -> ServerWatch:
        res = node.run(["sh", "-c", 'wc -c < "$1" 2>/dev/null || echo 0', "fleet-log-size", log_path],
                       check=False, timeout=60)
        size = res.stdout.strip()
        return cls(node, pid, log_path, classify, index, port, list(secrets or []),
                   offset=int(size) if size.isdigit() else 0)

    def _where(self) -> str:
        return f"server {self.index}" + (f" on port {self.port}" if self.port else "")

    def _tail(self) -> str:
        from fleet.servers import excerpt

        return excerpt(self.node.read_text(self.log_path, tail_bytes=64_000), 0, 25, self.secrets)

    def mark(self) -> None:
        """A request goes out: the stall clock starts now (an idle server between attempts is not hung)."""
        self.life_at, self.life_ticks = time.monotonic(), self.ticks

    def check_stall(self, stall_s: float, allowance: float) -> None:
        """ServerFailed when the server showed no sign of life for `stall_s` while a request waited.

        Why CPU time and the log: a first request may take minutes (CUDA graph capture, kernel
        compilation), and a server doing that uses CPU (compilers, kernel launches, the spinning
        wait on the GPU) or logs. A stopped or deadlocked one does neither, and waiting out the
        whole first-request allowance for it held the bring-up for minutes (issue 23)."""
        quiet = time.monotonic() - self.life_at
        if quiet <= stall_s:
            return
        raise ServerFailed(
            f"{self._where()}: no sign of life for {quiet:.0f} s while its smoke request waited (under "
            f"{LIFE_TICKS / CLOCK_TICKS:g} CPU-second used, no log line): hung, not warming up; not waited "
            f"for the rest of its {allowance:g} s allowance",
            host=self.node.host, stderr=self._tail(),
            remedy=f"read {self.log_path} on the node; if this engine warms up without using CPU or logging, raise "
                   "smoke.stall_s (0: off)",
        )

    def __call__(self) -> None:
        state, new, ticks = self.node.watch_cpu(self.pid, self.log_path, self.offset)
        self.ticks = ticks
        if self.life_ticks is None:
            self.life_ticks = ticks
        if new or (ticks is not None and self.life_ticks is not None and ticks - self.life_ticks >= LIFE_TICKS):
            self.life_at, self.life_ticks = time.monotonic(), ticks
        self.offset += len(new.encode())
        self.text = (self.text + new)[-1_000_000:]
        verdict = self.classify(self.text)
        after = time.monotonic() - self.started
        if verdict.fatal:
            raise ServerFailed(
                f"{self._where()}: fatal log line during the smoke, after {after:.1f} s: "
                f"{(verdict.reason or '')[:300]}" + ("" if state != "dead" else f"; process {self.pid} exited"),
                host=self.node.host, stderr=self._tail(),
                remedy=f"read {self.log_path} on the node: the server failed on a real request; fix the cause "
                       "(memory fraction, model, engine flags) and re-run",
            )
        if state == "stopped":
            raise ServerFailed(
                f"{self._where()}: process {self.pid} is stopped (SIGSTOP) during the smoke, after {after:.1f} s",
                host=self.node.host, stderr=self._tail(),
                remedy=f"continue it (`kill -CONT -{self.pid}` on the node) or stop it (`fleet down`), then re-run",
            )
        if state == "dead":
            raise ServerFailed(
                f"{self._where()}: process {self.pid} exited during the smoke, after {after:.1f} s",
                host=self.node.host, stderr=self._tail(),
                remedy=f"read {self.log_path} on the node for the cause: the server died on its first requests",
            )


def fetch_server_info(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """What the server says of itself: SGLang's /server_info (older /get_server_info) and /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info: dict[str, Any] = {}
    with httpx.Client(headers=headers, timeout=timeout, verify=tls_context(url)) as client:
        for path in ("/server_info", "/get_server_info"):
            try:
                r = client.get(url + path)
            except httpx.HTTPError:
                break
            if r.status_code == 200:
                try:
                    info["server_info"] = r.json()
                except ValueError:
                    pass
                break
        try:
            r = client.get(url + "/v1/models")
            if r.status_code == 200:
                info["models"] = r.json().get("data", [])
        except (httpx.HTTPError, ValueError):
            pass
    return info


def max_running_requests(info: dict[str, Any], facts: dict[str, Any]) -> int | None:
    """The server's concurrency limit, from its info or its log."""
    si = info.get("server_info") or {}
    for key in ("max_running_requests",):
        top = si.get(key)
        if isinstance(top, int):
            return top
    for st in si.get("internal_states") or []:
        per_state = st.get("max_running_requests") if isinstance(st, dict) else None
        if isinstance(per_state, int):
            return per_state
    val = facts.get("max_running_requests")
    return int(val) if isinstance(val, int | float) else None


def compare_kv(kv_by_server: dict[str, int | None], min_ratio: float) -> dict[str, str]:
    """Servers whose KV cache is markedly below their peers' median → a reason each."""
    known = {k: v for k, v in kv_by_server.items() if v}
    if len(known) < 2:
        return {}
    median = statistics.median(known.values())
    return {k: f"KV cache {v:,} tokens is {v / median:.0%} of the peers' median {median:,.0f} "
               f"(below {min_ratio:.0%}): another process may hold memory on its GPU"
            for k, v in known.items() if v < min_ratio * median}
