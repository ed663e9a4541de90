"""The generation hot path: one chat completion over a kept-alive aiohttp session.

Measured on a 2-core machine against instant servers (DESIGN.md, "HTTP client cost"):
`AsyncOpenAI` + a semaphore ≈ 850 req/s, a raw httpx pool ≈ 410, raw aiohttp ≈ 8,500. So
the runner speaks HTTP through aiohttp directly, one `ClientSession` per server (its own
connection pool, `limit` = that server's concurrency), body encoded once (orjson when it is
importable: Prefect depends on it), answer parsed and validated in one pass (`answer.py`).

`chat()` never raises for anything the server or the network does: it returns an
`Outcome` whose `kind` tells the dispatcher what to do next:

| kind | when | dispatcher |
| --- | --- | --- |
| ok | HTTP 200 with a completion that passed `parse_completion` | store the result |
| permanent | other 4xx (400: prompt longer than the context, bad parameter) | another server first; errors file when a second one agrees (or none other can be asked) |
| transient | HTTP 408/409/425/429/5xx, finish_reason "abort" | retry with backoff, elsewhere when it can; a 429 (or 503 with Retry-After: `Outcome.rate_limited`) is uncharged and pauses the server |
| invalid | a 200 body that is not a chat completion (cut, not JSON, wrong types), an answer over `max_bytes`, a status no chat endpoint answers (1xx, another 2xx, 3xx, ≥ 600) | a suspect: the server is out after a few in a row, or when a probe is not answered right either |
| connection | refused, reset, disconnected, a truncated body | retry; counts toward "server down" |
| timeout | no answer within the request timeout | retry; counts toward "server down" |
| unusable | 401/403/404: wrong key, wrong model, wrong URL | the *server* is wrong, not the row: take it out |

Every answer is judged, never trusted: a 200 body goes through `answer.parse_answer` (a strict
schema; see there), which gives a typed answer or the reason it is none.

The body is read in chunks up to `max_bytes` (`generation.max_response_mib`): a bigger answer
(or a Content-Length that announces one) ends the request at once, with no more read than the cap.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from fleet.answer import implausible_usage, parse_answer, same_model
from fleet.generation.data.jsonl import dumps, loads

if TYPE_CHECKING:
    from fleet.generation.data.rows import Request

__all__ = ["DEFAULT_MAX_BYTES", "Outcome", "TRANSIENT_STATUS", "TooLarge", "chat", "classify_status", "new_session",
           "parse_completion", "parse_retry_after", "read_capped"]

# Retried statuses, as the OpenAI SDK and speculators' scripts do: request timeout,
# conflict, too early, rate limited, and every server-side error.
TRANSIENT_STATUS = frozenset({408, 409, 425, 429})
# The server, not the row, is wrong: every other row would fail the same way.
UNUSABLE_STATUS = frozenset({401, 403, 404})

DEFAULT_MAX_BYTES = 64 << 20   # generation.max_response_mib's default: far above any real answer

_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError, OSError)


@dataclass(slots=True)
class Outcome:
    """What one chat request came to."""

    kind: str                              # ok | permanent | transient | invalid | connection | timeout | unusable
    status: int | None = None              # HTTP status; None when no answer came
    error: str | None = None               # one line: what went wrong (None when ok)
    completion: str = ""
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_token_ids: list[int] | None = None   # with return_token_ids (vLLM): the rendered prompt
    token_ids: list[int] | None = None          # ... and the completion's ids as sampled
    latency_s: float = 0.0
    started_at: float = 0.0                # wall clock (time.time()) when the request was sent
    finished_at: float = 0.0
    model: str | None = None               # the model the answer names (None: none)
    model_mismatch: bool = False           # ... and it is not the one asked for (the `model_mismatch` gate)
    usage_problem: str | None = None       # token counts no engine gives in this time (`implausible_usage` gate):
                                           # then prompt_tokens and completion_tokens are None, never counted
    retry_after_s: float | None = None     # a 429/503's Retry-After, in seconds from now (parse_retry_after)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def rate_limited(self) -> bool:
        """The server says it is busy, not broken: a 429, or a 503 that says when to come back
        (RFC 9110 §15.6.4: a 503 without Retry-After is an outage, handled as a 5xx)."""
        return self.status == 429 or (self.status == 503 and self.retry_after_s is not None)

    @property
    def server_fault(self) -> bool:
        """The failure says something about the server's health (not just this request)."""
        return self.kind in ("connection", "timeout", "unusable", "invalid")


def classify_status(status: int) -> str:
    """The Outcome kind of a non-200 HTTP status.

    A 4xx speaks of the request (permanent) or of our key/model/URL (unusable); a 5xx is the
    server's passing trouble (transient). Anything else (1xx, another 2xx, a redirect, a code
    past 599) is no answer a chat endpoint gives: invalid, the server's fault, not the row's."""
    if status in TRANSIENT_STATUS or 500 <= status <= 599:
        return "transient"
    if status in UNUSABLE_STATUS:
        return "unusable"
    if 400 <= status <= 499:
        return "permanent"
    return "invalid"


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header in seconds from `now` (wall clock): delay-seconds or an HTTP-date
    (RFC 9110 §10.2.3); None when absent or unreadable; a date in the past is 0."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        from email.utils import parsedate_to_datetime

        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def new_session(concurrency: int, *, api_key: str | None = None) -> aiohttp.ClientSession:
    """A session for one server: a keep-alive pool as wide as its concurrency, auth set once.

    Must be created inside the running event loop.
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    connector = aiohttp.TCPConnector(limit=max(1, concurrency), limit_per_host=0, keepalive_timeout=60,
                                     enable_cleanup_closed=True, ttl_dns_cache=None)
    # No session-wide timeout: each request passes its own.
    return aiohttp.ClientSession(connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                 json_serialize=json.dumps, auto_decompress=True, skip_auto_headers=("User-Agent",),
                                 raise_for_status=False)


_TIMEOUTS: dict[float, aiohttp.ClientTimeout] = {}


def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    t = _TIMEOUTS.get(seconds)
    if t is None:
        # connect within a bounded time even when the whole request may take half an hour:
        # a refused or black-holed server must be noticed in seconds, not at the deadline.
        t = _TIMEOUTS[seconds] = aiohttp.ClientTimeout(total=seconds, sock_connect=min(seconds, 10.0))
    return t


def _error_message(body: bytes | bytearray, status: int) -> str:
    """The server's own message from an OpenAI/SGLang error body, else the raw text."""
    text = body[:2000].decode("utf-8", "replace")
    try:
        doc = loads(bytes(body))   # an error body: small (the caller passes 64 KiB at most)
    except ValueError:
        return f"HTTP {status}: {text.strip()[:500]}"
    msg = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict):
            msg = err.get("message")
        elif isinstance(err, str):
            msg = err
        msg = msg or doc.get("message") or doc.get("detail")
    return f"HTTP {status}: {str(msg if msg else text)[:1000]}"


def parse_completion(body: bytes | bytearray | str | dict[str, Any], out: Outcome) -> None:
    """Fill `out` from a chat.completion body (`answer.parse_answer`); ValueError with the reason
    when it is not one."""
    a = parse_answer(body)
    out.completion, out.reasoning_content, out.tool_calls = a.content, a.reasoning_content, a.tool_calls
    out.finish_reason, out.prompt_tokens, out.completion_tokens = a.finish_reason, a.prompt_tokens, a.completion_tokens
    out.prompt_token_ids, out.token_ids = a.prompt_token_ids, a.token_ids
    out.model = a.model


class TooLarge(ValueError):
    """An answer over the size cap."""


async def read_capped(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes | bytearray:
    """The body, read in chunks; TooLarge past `max_bytes` (nothing more is read).

    With a Content-Length (what the engines send for a whole answer) the chunks go straight into
    one buffer of that size: the body is held once, never twice (a list of chunks joined at the
    end held it twice at the moment of the join: 8 answers of 30 MB at once, 480 MB more). The
    parser reads the buffer as it is. Without one (chunked), the chunks are joined once."""
    announced = resp.content_length
    if announced is not None and announced > max_bytes:
        raise TooLarge(f"answer of {announced:,} bytes announced, over the cap of {max_bytes:,}")
    # a compressed body's Content-Length is its compressed size: aiohttp decompresses it on the way,
    # so only an uncompressed body fits a buffer of the announced size (a gateway may gzip answers)
    if announced and resp.headers.get("Content-Encoding", "identity").lower() in ("", "identity"):
        return await _read_into(resp, announced)
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"answer over the cap of {max_bytes:,} bytes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_into(resp: aiohttp.ClientResponse, size: int) -> bytearray:
    """A body of a known `size`, read into one buffer; a body longer than it announced is cut off
    by aiohttp (it reads Content-Length bytes); a shorter one is a broken answer."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    async for chunk in resp.content.iter_any():
        n = len(chunk)
        if got + n > size:
            raise aiohttp.ClientPayloadError(f"answer longer than its Content-Length of {size:,}")
        view[got:got + n] = chunk
        got += n
    view.release()
    if got != size:
        raise aiohttp.ClientPayloadError(f"answer of {got:,} bytes, its Content-Length said {size:,}")
    return buf   # a bytearray: the parser takes it as it is (no copy into bytes)


def _utf8(text: str) -> str:
    """`text`, when it is valid UTF-8 text; UnicodeEncodeError (a ValueError) for one with a lone
    surrogate. json.loads (the codec where orjson is missing: a node's runner venv) decodes the escape
    "\\ud83d" into one, pydantic keeps it, and the store cannot write it: its commit fails, again after
    every resume. Checked a block at a time (a copy of one block, never of the whole text)."""
    if not text.isascii():
        text.encode()
    return text


class _Text:
    """A text that arrives in many small pieces (a streamed answer's deltas, a token or a few each),
    joined in blocks as it grows: a list of every piece costs a string object (~50 bytes) per piece,
    several times the text itself, and joining it all at the end holds both at once."""

    __slots__ = ("blocks", "pieces")

    BLOCK = 1024   # pieces per block

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.pieces: list[str] = []

    def add(self, piece: str) -> None:
        self.pieces.append(piece)
        if len(self.pieces) >= self.BLOCK:
            self.blocks.append(_utf8("".join(self.pieces)))   # TypeError for a piece that is no string
            self.pieces.clear()

    def text(self) -> str:
        """The whole text; the blocks are let go (the text is the one copy left)."""
        self.blocks.append(_utf8("".join(self.pieces)))
        self.pieces.clear()
        whole = self.blocks[0] if len(self.blocks) == 1 else "".join(self.blocks)
        self.blocks.clear()
        return whole


class _Stream:
    """A streamed chat completion put back together, chunk by chunk (`chat(..., on_chunk=…)`)."""

    __slots__ = ("content", "reasoning", "calls", "finish", "usage", "model")

    def __init__(self) -> None:
        self.content = _Text()
        self.reasoning = _Text()
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}
        self.model: Any = None

    def add(self, doc: Any) -> None:
        if not isinstance(doc, dict):
            raise ValueError(f"not a chat completion chunk: {str(doc)[:200]}")
        if self.model is None and doc.get("model") is not None:
            self.model = doc["model"]
        if isinstance(doc.get("usage"), dict):
            self.usage = doc["usage"]
        for choice in doc.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.add(delta["content"])
            r = delta.get("reasoning_content") or delta.get("reasoning")
            if r:
                self.reasoning.add(r)
            for tc in delta.get("tool_calls") or ():
                blank = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                call = self.calls.setdefault(int(tc.get("index", len(self.calls))), blank)
                call["id"] = tc.get("id") or call["id"]
                call["type"] = tc.get("type") or call["type"]
                fn = tc.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
            self.finish = choice.get("finish_reason") or self.finish

    def completion(self) -> dict[str, Any]:
        """The whole chat.completion these chunks make, as a document for the strict parser (judged
        as it is: its texts are not encoded into a body and decoded again, two more copies of them)."""
        for call in self.calls.values():
            for text in (call["id"], call["type"], call["function"]["name"], call["function"]["arguments"]):
                if isinstance(text, str):
                    _utf8(text)
        if isinstance(self.finish, str):
            _utf8(self.finish)
        message = {"role": "assistant", "content": self.content.text(),
                   "reasoning_content": self.reasoning.text() or None,
                   "tool_calls": [self.calls[i] for i in sorted(self.calls)] or None}
        return {"choices": [{"message": message, "finish_reason": self.finish}], "usage": self.usage or None,
                "model": self.model}


class BadStream(ValueError):
    """A streamed answer whose chunks do not make a chat completion."""


def event_cap(max_tokens: int | None) -> int | None:
    """Events past which a stream for `max_tokens` is cut: an engine sends a token or more per
    event and stops at max_tokens, so twice that (and a few for the role, finish and usage
    events) is clearly more; a stream that goes on past it would run to request_timeout_s."""
    return None if max_tokens is None else 2 * max_tokens + 32


def _max_tokens(params: dict[str, Any] | None) -> int | None:
    value = (params or {}).get("max_completion_tokens") or (params or {}).get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def _read_stream(resp: aiohttp.ClientResponse, on_chunk: Callable[[], None],
                       max_bytes: int, max_tokens: int | None = None) -> dict[str, Any]:
    """Server-sent events of a streamed chat completion, put back together as one completion document
    (judged by `_judge` like an unstreamed one; a chunk that cannot be read makes it invalid);
    `on_chunk()` at each event; TooLarge past `max_bytes` of stream; BadStream past `event_cap`
    events (a server that does not stop at max_tokens: its fault, not the row's)."""
    acc = _Stream()
    done, size, events = False, 0, 0
    cap = event_cap(max_tokens)
    try:
        async for line in resp.content:
            size += len(line)
            if size > max_bytes:
                raise TooLarge(f"streamed answer over the cap of {max_bytes:,} bytes")
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            on_chunk()
            if data == b"[DONE]":
                done = True
                break
            events += 1
            if cap is not None and events > cap:
                raise _Runaway(f"the stream sent {events:,} chunks for max_tokens {max_tokens:,} and had not "
                               "ended: cut (a server that does not stop at max_tokens)")
            acc.add(loads(data))
        if not done and acc.finish is None:
            raise aiohttp.ClientPayloadError("the stream ended before the completion did")
        return acc.completion()
    except (TooLarge, _Runaway):
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadStream(f"a stream chunk is not a chat completion chunk: {type(exc).__name__}: {exc}"[:300]) from None


class _Runaway(BadStream):
    """A stream that went on clearly past its max_tokens."""


async def chat(session: aiohttp.ClientSession, url: str, model: str, request: Request,
               api_key: str | None = None, timeout: float = 1800.0,
               max_bytes: int = DEFAULT_MAX_BYTES, on_chunk: Callable[[], None] | None = None) -> Outcome:
    """POST one chat completion for `request` to the server at `url` (its base, e.g. http://h:p).

    `api_key` is normally set once on the session (`new_session`); pass it here only for a
    session made without it. `max_bytes` caps the answer's size (see the module docstring). With
    `on_chunk` the answer is streamed (usage included) and `on_chunk()` is called at every event:
    the token progress of engines that count none (`transformers serve`); the streamed answer is
    put back together and judged like a whole one, so the Outcome is the same as unstreamed.
    """
    body: dict[str, Any] = {"model": model, "messages": request.messages}
    if request.params:
        body.update(request.params)
    if on_chunk is not None:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    started = time.time()
    t0 = time.perf_counter()
    out = Outcome("ok", started_at=started)
    raw: bytes | bytearray | dict[str, Any] | None = None
    try:
        # no redirects: a chat endpoint that sends us elsewhere is not answering (and could send
        # the prompt and the key to another host)
        async with session.post(url + "/v1/chat/completions", data=dumps(body), headers=headers,
                                timeout=_timeout(timeout), allow_redirects=False) as resp:
            out.status = resp.status
            if resp.status in (429, 503):
                out.retry_after_s = parse_retry_after(resp.headers.get("Retry-After"))
            if on_chunk is not None and resp.status == 200:
                raw = await _read_stream(resp, on_chunk, max_bytes, _max_tokens(request.params))
            else:
                raw = await read_capped(resp, max_bytes)
    except asyncio.TimeoutError:
        out.kind, out.error = "timeout", f"no answer within {timeout:g} s"
    except TooLarge as exc:
        out.kind, out.error = "invalid", f"{exc} (generation.max_response_mib)"
    except BadStream as exc:
        out.kind, out.error = "invalid", f"unusable answer: {exc}"
    except _CONNECTION_ERRORS as exc:
        out.kind, out.error = "connection", f"{type(exc).__name__}: {exc}"[:500]
    else:
        assert raw is not None
        _judge(raw, out)
    out.latency_s = time.perf_counter() - t0
    out.finished_at = started + out.latency_s
    if out.kind == "ok":
        _check_claims(out, model, _max_tokens(request.params))
    return out


def _check_claims(out: Outcome, model: str, max_tokens: int | None) -> None:
    """What a good answer says of itself, checked: the model it names, and token counts an engine
    can give in its time. Neither fails the row (the text may be fine); each is a quality gate's
    (`model_mismatch`, `implausible_usage`: flagged by default), and counts that are no counts are
    dropped here, so throughput, cost and the row's own columns never add them up."""
    out.model_mismatch = not same_model(model, out.model)
    out.usage_problem = implausible_usage(out.prompt_tokens, out.completion_tokens, out.latency_s, max_tokens)
    if out.usage_problem is not None:
        out.prompt_tokens = out.completion_tokens = None


def _judge(raw: bytes | bytearray | dict[str, Any], out: Outcome) -> None:
    """The Outcome of a full answer: a completion, an invalid body, an abort or an HTTP error."""
    if out.status != 200:
        assert out.status is not None and not isinstance(raw, dict)   # only a 200 is streamed
        out.kind, out.error = classify_status(out.status), _error_message(raw[:65536], out.status)
        return
    try:
        parse_completion(raw, out)
    except ValueError as exc:
        out.kind, out.error = "invalid", f"unusable answer: {exc}"[:500]
        return
    if out.finish_reason == "abort":
        # SGLang answers 200 with finish_reason "abort" when it drops a request
        # (shutdown, retraction, a scheduler error): not a completion to keep.
        out.kind, out.error = "transient", "the server aborted the request (finish_reason 'abort')"
