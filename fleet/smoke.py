"""Smoke: one chat completion per server, retried with backoff, and the cross-server comparison.

The first request to a fresh server can pay for CUDA graph capture and kernel
compilation (well over 30 s), so it gets its own, longer timeout. Later attempts use the
normal timeout and back off exponentially with jitter.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from fleet.config import SmokeConfig
from fleet.errors import ServerFailed


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


def backoff_delay(attempt: int, cfg: SmokeConfig, rng: random.Random) -> float:
    """Delay before retry number `attempt` (1-based): base * 2^(n-1), capped, plus up to jitter share."""
    base = min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1))
    return base * (1 + cfg.jitter * rng.random())


def check_answer(body: Any) -> tuple[str, int | None, int | None, str | None]:
    """(content, prompt_tokens, completion_tokens, finish_reason); raise ValueError when unusable."""
    try:
        choice = body["choices"][0]
        msg = choice.get("message") or {}
        content = (msg.get("content") or "") + (msg.get("reasoning_content") or "")
        usage = body.get("usage") or {}
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"not a chat completion: {str(body)[:200]}") from None
    if not content.strip():
        raise ValueError("empty content")
    if not usage.get("completion_tokens") or usage.get("prompt_tokens") is None:
        raise ValueError(f"no usage counts in the answer: {usage}")
    return content, usage.get("prompt_tokens"), usage.get("completion_tokens"), choice.get("finish_reason")


def smoke(url: str, model: str, cfg: SmokeConfig, *, node: str = "", index: int = 0,
          api_key: str | None = None, seed: int | None = None, temperature: float = 0.0,
          sleep: Callable[[float], None] = time.sleep) -> SmokeResult:
    """Smoke one server; raise ServerFailed with the attempt timeline when every attempt failed.

    `temperature` should be the job's: `transformers serve --continuous-batching` fixes its
    sampling settings from the first request it sees.
    """
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    payload = {"model": model, "messages": [{"role": "user", "content": cfg.prompt}],
               "max_tokens": cfg.max_tokens, "temperature": temperature}
    result = SmokeResult(node, index, url, False, None, "", None, None, None)
    t0 = time.monotonic()
    with httpx.Client(headers=headers) as client:
        for n in range(1, cfg.attempts + 1):
            timeout = cfg.first_timeout_s if n == 1 else cfg.timeout_s
            start = time.monotonic()
            try:
                r = client.post(f"{url}/v1/chat/completions", json=payload, timeout=timeout)
                if r.status_code != 200:
                    raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")
                content, pt, ct, fr = check_answer(r.json())
            except (httpx.HTTPError, ValueError) as exc:
                kind = "timeout" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
                result.attempts.append(Attempt(n, start - t0, time.monotonic() - start, timeout, f"{kind}: {exc}"[:300]))
                if n < cfg.attempts:
                    sleep(backoff_delay(n, cfg, rng))
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


def fetch_server_info(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """What the server says of itself: SGLang's /server_info (older /get_server_info) and /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info: dict[str, Any] = {}
    with httpx.Client(headers=headers, timeout=timeout) as client:
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
        if isinstance(si.get(key), int):
            return si[key]
    for st in si.get("internal_states") or []:
        if isinstance(st, dict) and isinstance(st.get("max_running_requests"), int):
            return st["max_running_requests"]
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
