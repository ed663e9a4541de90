"""What a server answers: the HTTP checks the dispatcher makes besides its rows.

Each takes the server's `Endpoint` and, where the caller has one, a session; each answers
rather than raises (a server that cannot be reached is an answer too), and none reads more
than `PROBE_MAX_BYTES` of an answer (a server must not fill the runner's memory through a probe):

| check | asks | used for |
| --- | --- | --- |
| `ping` | a path answers 200 (`/v1/models`: anything; with `missing_ok`, /health_generate → /health → /v1/models) | a connection failure: is the server there at all? recovery without a callback |
| `usable` | /health (none: /v1/models answers 200), then /v1/models with our key; an endpoint without a model: the first id listed | admission: healthy and takes our key |
| `server_info` | /server_info (or /get_server_info) | the server's max running requests, speculative stats |
| `generation_probe` | /health_generate, else a one-token chat | the stall watchdog: does it still generate? |
| `answer_probe` | a one-token chat, its answer judged like a row's | after an invalid answer: the row's fault or the server's? |
| `accept_len` | speculative accept length (server info, else /metrics; a 404 is not asked again) | the progress file |
| `token_count` | the engine's token counters in /metrics (`promtext.token_count`, `promtext.generated_tokens`) | the stall watchdog: do its tokens advance? The job's rate and ETA: how many did it generate? |
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any, Literal

import aiohttp

from fleet.generation.hotpath import promtext
from fleet.generation.hotpath.client import Outcome, TooLarge, parse_completion, read_capped
from fleet.generation.data.jsonl import dumps, loads
from fleet.generation.hotpath.serverstate import Endpoint

__all__ = ["PROBE_MAX_BYTES", "STATS_PATHS", "accept_len", "answer_probe", "first_model", "generation_probe",
           "max_running", "ping", "server_info", "token_count", "usable"]

PROBE_MAX_BYTES = 4 << 20   # /server_info of a big deployment is tens of KiB

_ACCEPT_METRIC = re.compile(r"^sglang:spec_accept_length(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def max_running(info: dict[str, Any]) -> int | None:
    """max_running_requests from SGLang's /server_info (top level, or its scheduler's internal state)."""
    v = info.get("max_running_requests")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    states = info.get("internal_states")
    for st in states if isinstance(states, list) else []:
        v = st.get("max_running_requests") if isinstance(st, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


async def server_info(ep: Endpoint, session: aiohttp.ClientSession,
                      missing: set[str] | None = None) -> dict[str, Any]:
    """SGLang's server info ({} when there is none: vLLM, transformers, or no answer).

    A path that answers 404 is added to `missing` and, given again, not asked again."""
    for path in ("/server_info", "/get_server_info"):
        if missing is not None and path in missing:
            continue
        try:
            async with session.get(ep.url + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                body = await read_capped(r, PROBE_MAX_BYTES)  # always read: unread, the connection closes
                if r.status == 200:
                    doc = loads(bytes(body))
                    return doc if isinstance(doc, dict) else {}
                if r.status != 404:
                    return {}
                if missing is not None:
                    missing.add(path)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, RecursionError):
            return {}
    return {}


def first_model(body: bytes | bytearray) -> str | None:
    """The first model id of a /v1/models answer (`{"data": [{"id": …}]}`), None when it lists none."""
    try:
        doc = loads(bytes(body))   # a small answer: the copy costs nothing
    except (ValueError, RecursionError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    mid = first.get("id") if isinstance(first, dict) else None
    return mid if isinstance(mid, str) and mid.strip() else None


async def _status(ep: Endpoint, session: aiohttp.ClientSession, path: str, timeout: float = 10.0) -> int | None:
    """The HTTP status `path` answers (its body read and dropped), None when it does not answer."""
    try:
        async with session.get(ep.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            await read_capped(r, PROBE_MAX_BYTES)
            return r.status
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, RuntimeError, TooLarge):  # RuntimeError: session closed
        return None


async def usable(ep: Endpoint, session: aiohttp.ClientSession) -> str | None:
    """None when the server is healthy and takes our key; else why not. A server without /health
    (a plain OpenAI-compatible one: a router, a deployment fleet did not start) is healthy when
    /v1/models answers 200. An endpoint given no model takes the first id /v1/models lists."""
    health = await _status(ep, session, "/health")
    if health is None or health >= 500:   # 503: starting or shutting down
        return f"not answering {ep.url}/health" + (f" (HTTP {health})" if health else "")
    try:
        # /health needs no key on SGLang; /v1/models does: a wrong key shows here, not on every row
        async with session.get(ep.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
            body = await read_capped(r, PROBE_MAX_BYTES)
            if r.status in (401, 403):
                return f"HTTP {r.status} from /v1/models: the server refuses our API key"
            if health != 200 and r.status != 200:   # no /health (404, or a gateway's 401 for any other path)
                return f"{ep.url}/health answered HTTP {health} and its /v1/models HTTP {r.status}"
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, TooLarge):
        return f"not answering {ep.url}/v1/models"
    if not ep.model:
        ep.model = (first_model(body) if r.status == 200 else None) or ""
        if not ep.model:
            # transformers serve 5.17 answers /v1/models with HTTP 500 when it has no Hugging Face cache
            # directory (DESIGN.md, round 4): the model name is the one thing the config can give instead
            return (f"{ep.url}/v1/models names no model (HTTP {r.status}): set `model` in this endpoint's "
                    "[[endpoints]] entry (the name its chat requests take)")
    return None


async def ping(ep: Endpoint, session: aiohttp.ClientSession | None = None, path: str = "/health",
               timeout: float = 10.0, missing_ok: bool = False) -> bool:
    """True when the server answers `path` with 200 (`/v1/models`: any answer at all; with
    `missing_ok`, a 404 falls back to /health — vLLM and transformers have no /health_generate —
    and a 4xx there to /v1/models answering 200: a plain OpenAI server has neither)."""
    own = session is None
    session = session or aiohttp.ClientSession(headers={"Authorization": f"Bearer {ep.api_key}"}
                                               if ep.api_key else None)
    try:
        async with session.get(ep.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            await read_capped(r, PROBE_MAX_BYTES)
            if missing_ok and path == "/health" and 400 <= r.status < 500:
                # a plain OpenAI server has no /health (404; a gateway may answer 401 for any
                # path it does not serve): /v1/models answering 200 is its health
                return await _status(ep, session, "/v1/models", timeout) == 200
            if r.status == 404 and missing_ok:
                return await ping(ep, session, "/health", timeout, missing_ok=True)
            return r.status == 200 or path == "/v1/models"
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, RuntimeError, TooLarge):  # RuntimeError: session closed
        return False
    finally:
        if own:
            await session.close()


async def generation_probe(ep: Endpoint, t: float) -> tuple[bool, str]:
    """(answers, why not): /health_generate (SGLang runs a generation for it), or a one-token
    chat where there is none (vLLM, transformers), within `t` seconds. Its own connection: the
    worker pool is full."""
    path = "/health_generate"
    session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {ep.api_key}"}
                                    if ep.api_key else None)
    try:
        async with session.get(ep.url + path, timeout=aiohttp.ClientTimeout(total=t)) as r:
            await read_capped(r, PROBE_MAX_BYTES)
            if r.status != 404:
                return r.status == 200, f"{path} answered HTTP {r.status}"
        path = "a one-token chat"
        body = {"model": ep.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        async with session.post(ep.url + "/v1/chat/completions", data=dumps(body),
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=t)) as r:
            await read_capped(r, PROBE_MAX_BYTES)
            return r.status == 200, f"{path} answered HTTP {r.status}"
    except asyncio.TimeoutError:
        return False, f"{path} did not answer within {t:g} s"
    except (aiohttp.ClientError, OSError, TooLarge) as exc:
        return False, f"{path} failed: {type(exc).__name__}: {exc}"[:300]
    finally:
        await session.close()


async def answer_probe(ep: Endpoint, t: float, max_bytes: int, request: Any = None) -> tuple[bool, str]:
    """(a valid completion, why not): a one-token chat on its own connection, within `t` seconds,
    its answer judged by `parse_completion` like a row's. With `request` (a row's `messages` and
    `params`: one the server refused with a 4xx that another answered) that request instead: a
    server out for its refusals is back only once it answers what it refused."""
    body: dict[str, Any] = {"model": ep.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    if request is not None:
        body = {"model": ep.model, "messages": request.messages, **(request.params or {})}
    what = "a one-token chat" if request is None else "the request it refused"
    headers = {"Content-Type": "application/json"}
    if ep.api_key:
        headers["Authorization"] = f"Bearer {ep.api_key}"
    async with aiohttp.ClientSession(headers=headers) as session:
        try:
            async with session.post(ep.url + "/v1/chat/completions", data=dumps(body), allow_redirects=False,
                                    timeout=aiohttp.ClientTimeout(total=t)) as r:
                raw = await read_capped(r, max_bytes)
                if r.status != 200:
                    return False, f"{what} answered HTTP {r.status}"
            parse_completion(raw, Outcome("ok"))
        except asyncio.TimeoutError:
            return False, f"{what} did not answer within {t:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return False, f"{what} failed: {type(exc).__name__}: {exc}"[:300]
        except ValueError as exc:   # TooLarge too
            return False, f"{what}: {exc}"[:300]
    return True, "a valid completion"


STATS_PATHS = frozenset({"/server_info", "/get_server_info", "/metrics"})


async def accept_len(ep: Endpoint, session: aiohttp.ClientSession, last: float | None,
                     missing: set[str] | None = None) -> float | None:
    """The speculative accept length, or `last` (the one known before) when the server does not say.

    Paths that answer 404 go into `missing` and are not asked again (transformers serve has
    none of them, vLLM no server info): once `missing` holds all of `STATS_PATHS` there is
    nothing left to ask."""
    info = await server_info(ep, session, missing)
    states = info.get("internal_states")
    for st in states if isinstance(states, list) else []:
        v = st.get("avg_spec_accept_length") if isinstance(st, dict) else None
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return round(float(v), 3)
    if missing is not None and "/metrics" in missing:
        return last
    try:
        async with session.get(ep.url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            body = await read_capped(r, PROBE_MAX_BYTES)
            if r.status == 200:
                m = _ACCEPT_METRIC.search(body.decode("utf-8", "replace"))
                if m and math.isfinite(metric := float(m.group(1))):
                    return round(metric, 3)
            elif r.status == 404 and missing is not None:
                missing.add("/metrics")
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        pass
    return last


CountKind = Literal["ok", "none", "failed"]


async def token_count(ep: Endpoint, session: aiohttp.ClientSession,
                      timeout: float) -> tuple[CountKind, float, float | None]:
    """The server's token-progress total from /metrics, and the tokens it generated so far where
    its counters say (`promtext.generated_tokens`, else None): ("ok", total, generated); ("none",
    0, None) when it has no such counters (no /metrics: `transformers serve`, SGLang without
    --enable-metrics); ("failed", 0, None) when it did not answer in `timeout` s (a stopped
    server: no progress either)."""
    headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else None
    try:
        async with session.get(ep.url + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            body = await read_capped(r, PROBE_MAX_BYTES)
            if r.status != 200:
                return ("none", 0.0, None) if r.status in (404, 405) else ("failed", 0.0, None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):   # ValueError: TooLarge
        return "failed", 0.0, None
    text = body.decode("utf-8", "replace")
    total = promtext.token_count(text)
    return ("none", 0.0, None) if total is None else ("ok", total, promtext.generated_tokens(text))
