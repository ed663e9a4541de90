"""A stand-in chat server that answers every generation request with a fault, and the faults it draws.

`GarbageServer` speaks just enough HTTP/1.1 on loopback (raw asyncio streams, so that it can send
what no framework would: a cut body, a Content-Length that lies, a body dribbled a few bytes at a
time, a status no chat endpoint gives). /health and /v1/models answer 200, so it is admitted like
any server; each POST /v1/chat/completions takes the next `Reply` of its `script`, in a cycle.

`script()` is a hypothesis strategy of such scripts: every one holds at least one answer that is
*invalid* (a body of the right shape with a wrong type, a body that is no JSON or cut short, an
answer over the size cap, a status like 204, 302 or 600), mixed with the other faults a broken
server sends (a cut connection, 401/404, 429/5xx), some of them slow to start or dribbled.
No reply is a valid completion: every row this server takes must end on the good server.

`fuzz_job()` runs one job through the runner (`run_local`: the real dispatcher, store, relaunch
path) against a good sim server and this one, and says what came of it (`FuzzResult`).
tests/test_gen_answers.py runs it under hypothesis in the suite; bench/bench_faults.py --garbage
runs it longer.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

__all__ = ["FuzzResult", "GarbageServer", "Reply", "fuzz_job", "script"]

CAP_MIB = 0.25   # generation.max_response_mib of a fuzz job: an oversized answer stays small here


@dataclass(frozen=True)
class Reply:
    """One answer of the stand-in server, as bytes on the wire."""

    label: str                 # the fault, for the report: mistyped usage.prompt_tokens, status 302, ...
    status: int = 200
    body: bytes = b""
    length: int | None = None  # Content-Length sent: None = the body's; -1 = chunked, no length
    delay_s: float = 0.0       # before the status line (slow)
    piece: int = 0             # > 0: the body in pieces of this many bytes (dribbling) ...
    pause_s: float = 0.0       # ... with this pause between them
    close: bool = False        # close the connection after it (with a short body: a cut answer)
    hold_s: float = 0.0        # after the body, before its end (a chunked body's last chunk): held open
    headers: tuple[tuple[str, str], ...] = ()   # more header lines (Retry-After: a rate limit)


class GarbageServer:
    """The stand-in server on 127.0.0.1 (its own event loop in a thread); `script` may be replaced."""

    def __init__(self, script: list[Reply] | None = None, *, only_for: bytes | None = None,
                 then: Reply | None = None, models_status: int = 200) -> None:
        self.script: list[Reply] = list(script or [])
        self.only_for = only_for      # set: a valid completion, unless the request holds these bytes
        self.then = then              # set: the answer to every request once the script was served once
        self.models_status = models_status   # what /v1/models answers (500: transformers serve without a cache)
        self.served: list[str] = []   # labels, in order
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="garbage-server")
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._conn, "127.0.0.1", 0), self._loop).result(30)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_script(self, script: list[Reply]) -> None:
        self.script, self.served = list(script), []

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def _next(self) -> Reply:
        if self.then is not None and len(self.served) >= len(self.script):
            self.served.append(self.then.label)
            return self.then
        reply = self.script[len(self.served) % len(self.script)]
        self.served.append(reply.label)
        return reply

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                method, path = head.split(" ", 2)[:2]
                length = next((int(ln.split(":", 1)[1]) for ln in head.split("\r\n")
                               if ln.lower().startswith("content-length:")), 0)
                body = await reader.readexactly(length)
                reply = self._route(method, path, body)
                await self._send(writer, reply)
                if reply.close:
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError, IndexError):
            return
        finally:
            writer.close()

    def _route(self, method: str, path: str, body: bytes) -> Reply:
        if method == "POST" and path == "/v1/chat/completions":
            if self.only_for is not None and self.only_for not in body:
                return Reply("valid", body=_GOOD_BYTES)
            return self._next()
        if path == "/v1/models" and self.models_status != 200:
            return Reply("models", status=self.models_status, body=b'{"detail":"CacheNotFound"}')
        if path in ("/health", "/v1/models"):
            return Reply("ok", body=b'{"object":"list","data":[{"id":"bad-model"}]}')
        return Reply("not found", status=404, body=b'{"detail":"Not Found"}')

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, r: Reply) -> None:
        if r.delay_s:
            await asyncio.sleep(r.delay_s)
        head = [f"HTTP/1.1 {r.status} X", "Content-Type: application/json"]
        if r.length == -1:
            head.append("Transfer-Encoding: chunked")
        elif r.status not in (204, 304):
            head.append(f"Content-Length: {len(r.body) if r.length is None else r.length}")
        if r.close:
            head.append("Connection: close")
        head.extend(f"{k}: {v}" for k, v in r.headers)
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        body = r.body if r.status not in (204, 304) else b""
        step = r.piece or max(1, len(body))
        for i in range(0, len(body), step):
            piece = body[i:i + step]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if r.length == -1 else piece)
            await writer.drain()
            if r.pause_s:
                await asyncio.sleep(r.pause_s)
        if r.hold_s:
            await asyncio.sleep(r.hold_s)
        if r.length == -1:
            writer.write(b"0\r\n\r\n")
        await writer.drain()


# ---------------------------------------------------------------------------- the faults

GOOD: dict[str, Any] = {
    "id": "x", "object": "chat.completion", "model": "bad-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine", "reasoning_content": "hm",
                                         "tool_calls": None}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}

_small_text = st.text(max_size=6)
_not_str = st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                     st.lists(st.integers(), max_size=2), st.dictionaries(_small_text, st.integers(), max_size=2))
_not_int = st.one_of(_small_text, st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                     st.integers(max_value=-1), st.integers(min_value=(1 << 40) + 1, max_value=1 << 62),
                     st.lists(st.integers(), max_size=2), st.dictionaries(_small_text, st.integers(), max_size=1))
_not_obj = st.one_of(_small_text, st.integers(), st.booleans(), st.lists(st.integers(), max_size=2))
# each field a completion has, and values of a type it must not have there
_WRONG: dict[tuple[Any, ...], st.SearchStrategy[Any]] = {
    ("usage",): _not_obj,
    ("usage", "prompt_tokens"): _not_int,
    ("usage", "completion_tokens"): _not_int,
    ("choices",): st.one_of(_not_obj.filter(lambda v: not isinstance(v, list) or not v), st.just([])),
    ("choices", 0): st.one_of(_not_obj, st.none()),
    ("choices", 0, "message"): st.one_of(_not_obj, st.none()),
    ("choices", 0, "message", "content"): _not_str,
    ("choices", 0, "message", "reasoning_content"): _not_str,
    ("choices", 0, "message", "tool_calls"): st.one_of(_not_obj.filter(lambda v: not isinstance(v, list) or v != []),
                                                      st.lists(_not_obj, min_size=1, max_size=2)),
    ("choices", 0, "finish_reason"): _not_str,
}


def _mistyped(path: tuple[Any, ...], value: Any) -> Reply:
    doc = json.loads(json.dumps(GOOD))
    at = doc
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    return Reply(f"mistyped {'.'.join(map(str, path))}", body=json.dumps(doc).encode())


_GOOD_BYTES = json.dumps(GOOD).encode()
_mistyped_st = st.sampled_from(sorted(_WRONG, key=str)).flatmap(
    lambda p: _WRONG[p].map(lambda v: _mistyped(p, v)))
_malformed_st = st.one_of(
    st.binary(max_size=64).map(lambda b: Reply("random bytes", body=b)),
    st.integers(0, len(_GOOD_BYTES) - 1).map(lambda n: Reply("cut JSON", body=_GOOD_BYTES[:n])),
    st.sampled_from([b"[]", b"null", b'"ok"', b"7", b'{"object":"error"}', b'{"choices":[{"message":null}]}']).map(
        lambda b: Reply("wrong shape (not a completion object)", body=b)),
)
_cap = int(CAP_MIB * (1 << 20))
_big = b'{"choices":[{"message":{"content":"' + b"x" * (_cap + 1024) + b'"}}]}'
_oversized_st = st.sampled_from([
    Reply("oversized, announced", body=_big),
    Reply("oversized, chunked", body=_big, length=-1, piece=1 << 16),
    Reply("oversized, a lying length", body=b"{}", length=1 << 40, close=True),
])
_odd_status_st = st.sampled_from([201, 202, 204, 301, 302, 307, 600, 799]).map(
    lambda s: Reply(f"status {s}", status=s, body=_GOOD_BYTES if s < 300 else b""))
INVALID = st.one_of(_mistyped_st, _malformed_st, _oversized_st, _odd_status_st)
_other_st = st.one_of(
    st.integers(1, len(_GOOD_BYTES) - 1).map(
        lambda n: Reply("cut connection", body=_GOOD_BYTES[:n], length=len(_GOOD_BYTES), close=True)),
    st.sampled_from([401, 404, 408, 429, 500, 502, 503]).map(
        lambda s: Reply(f"status {s}", status=s, body=b'{"error":{"message":"no"}}')),
)


def _slow_or_dribbled(r: Reply) -> st.SearchStrategy[Reply]:
    if len(r.body) > 4096:
        return st.just(r)
    return st.one_of(
        st.just(r),
        st.floats(0.01, 0.3).map(lambda d: replace(r, label=f"slow {r.label}", delay_s=d)),
        st.integers(1, 16).map(lambda p: replace(r, label=f"dribbled {r.label}", piece=p,
                                                 pause_s=min(0.005, 0.3 * p / max(1, len(r.body))))),
    )


def script() -> st.SearchStrategy[list[Reply]]:
    """What a broken server answers, in a cycle: one invalid answer or more among other faults."""
    any_fault = st.one_of(INVALID, _other_st).flatmap(_slow_or_dribbled)
    return st.tuples(INVALID.flatmap(_slow_or_dribbled), st.lists(any_fault, max_size=5), st.integers(0, 5)).map(
        lambda t: [*t[1][:t[2]], t[0], *t[1][t[2]:]])


# ---------------------------------------------------------------------------- one job


@dataclass
class FuzzResult:
    rc: int
    account: dict[str, Any]            # checks.account: every input id in exactly one place
    counts: dict[str, int]             # the store's counts
    errors: int
    quality_rejects: int
    bad: dict[str, Any]                # the bad server's line in the manifest
    good: dict[str, Any]
    served: list[str] = field(default_factory=list)   # what the bad server answered, in order


def write_rows(path: Path, n: int, marked: frozenset[int] = frozenset()) -> list[str]:
    ids = [f"r{i}" for i in range(n)]
    path.write_text("".join(json.dumps({"id": f"r{i}", "messages": [
        {"role": "user", "content": f"question {i}" + (" MARKED" if i in marked else "")}]}) + "\n" for i in range(n)))
    return ids


def fuzz_job(work: Path, good_url: str | None, bad: GarbageServer, faults: list[Reply], *, rows: int,
             concurrency: int = 4, marked: frozenset[int] = frozenset()) -> FuzzResult:
    """One job of `rows` rows through a good sim (at `good_url`; None: none) and `bad` answering
    `faults`; the rows numbered in `marked` carry the word MARKED (for `GarbageServer(only_for=...)`)."""
    from fleet.config import FleetConfig
    from fleet.generation.data.checks import account
    from fleet.generation.data.manifest import read_manifest
    from fleet.generation.job.runner import ServerEntry, run_local

    bad.set_script(faults)
    work.mkdir(parents=True)
    inp, out = work / "in.jsonl", work / "out"
    write_rows(inp, rows, marked)
    cfg = FleetConfig.model_validate({
        "name": "fuzz", "engine": {"kind": "sim"},
        "generation": {"max_tokens": 8, "max_concurrency_per_server": concurrency, "max_response_mib": CAP_MIB},
        "smoke": {"attempts": 1, "first_timeout_s": 2.0, "timeout_s": 2.0}})
    servers: list[ServerEntry | dict[str, Any]] = [{"node": "local", "index": 1, "url": bad.url, "model": "sim-model"}]
    if good_url is not None:
        servers.insert(0, {"node": "local", "index": 0, "url": good_url, "model": "sim-model"})
    rc = run_local(cfg, inp, out, servers, flush_interval_s=0.5, progress_interval_s=0.1,
                   dispatch={"backoff_s": 0.05, "backoff_max_s": 0.2, "recovery_backoff_s": 0.2,
                             "recovery_backoff_max_s": 0.5, "probe_interval_s": 0.05, "stall_probe_timeout_s": 2.0})
    manifest = read_manifest(out) or {}
    by_name = {s["name"]: s for s in manifest.get("servers") or []}
    counts = dict(manifest.get("counts") or {})
    return FuzzResult(rc=rc, account=account(inp, out), counts=counts, errors=int(counts.get("errors") or 0),
                      quality_rejects=int(counts.get("quality_rejects") or 0), bad=by_name.get("local/1", {}),
                      good=by_name.get("local/0", {}), served=list(bad.served))
