"""A simulated SGLang server: same endpoints, same log lines, no GPU.

Used by tests, benchmarks and dry runs in place of real SGLang. The launcher copies this
one file to a node and runs it with a bare interpreter, so it imports nothing outside the
Python standard library (>= 3.10) and must keep it that way:

    python server.py --port 30000 [--startup-s 1.0] [--tokens-per-s 2000] ...

It is also importable as ``fleet.sim.server``; ``main(argv)`` is the entry point.

What it imitates (see DESIGN.md, "Facts: SGLang"):

* Startup: SGLang-shaped log lines (``Load weight end``, ``KV Cache is allocated``,
  ``Capture cuda graph begin/end``, ``max_total_num_tokens=...``, uvicorn's lines, ``The
  server is fired up and ready to roll!``) spread over ``--startup-s``. The port is bound
  at once (a real server binds late); until ready, ``/health`` and ``/health_generate``
  answer 503 and generation endpoints answer 503.
* Serving: ``/health``, ``/health_generate``, ``/model_info``, ``/get_model_info``,
  ``/server_info``, ``/get_server_info``, ``/v1/models``, ``/metrics``,
  ``/v1/chat/completions`` (also streamed), ``/v1/completions``, ``/generate``.
  Every generation is deterministic from ``--seed`` and a hash of the prompt; it takes
  ``completion_tokens / --tokens-per-s`` seconds and holds one of
  ``--max-running-requests`` slots (the rest queue, first come first served).
* While running: ``Prefill batch. ...`` and ``Decode batch. ...`` lines once a second.
* Faults: ``--oom-at-start``, ``--hang-at-start``, ``--crash-after N``,
  ``--hang-requests``, ``--hang-after N``, ``--error-rate F``; SIGUSR1 starts a burst of
  ``--burst-5xx N`` HTTP 500 answers.

Where real SGLang differs between versions, the older dotted form is printed
(``Decode batch. #running-req``; newer versions print ``Decode batch, #running-req``), so
log classifiers should match the prefix ``Decode batch``.

The HTTP layer is a small asyncio.Protocol (HTTP/1.1, keep-alive, pipelining,
Content-Length bodies, chunked responses for streaming) rather than asyncio streams: it
serves thousands of requests per second on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import json
import os
import random
import signal
import sys
import time
from collections import deque

__all__ = ["VERSION", "build_parser", "main"]

VERSION = "sim-0.1"

# Numbers printed in the startup log, shaped like one H200 running an 8B model.
_GPU_TOTAL_GB = 139.81
_WEIGHTS_GB = 15.26
_KV_BYTES_PER_TOKEN_HALF = 65536  # K (or V) bytes per token: 32 layers x 8 heads x 128 x bf16
_GRAPH_GB = 0.93
_DRAFT_WEIGHTS_GB = 0.92
_GB = 1 << 30
_CHUNKED_PREFILL = 8192
_MAX_PREFILL = 16384
_SPEC_NUM_STEPS = 3

_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
_FAST_S = 0.0005  # generations shorter than this are answered without a timer
_STREAM_CHUNK_S = 0.02  # a streamed response sends one chunk per this much decode time

_M64 = (1 << 64) - 1


# --------------------------------------------------------------------------- arguments


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,   # None: argparse names the script; `fleet sim` passes its own name
        description="Simulated SGLang server (stdlib only): SGLang's endpoints and log lines, no GPU.",
    )
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to bind")
    a("--port", type=int, required=True, help="port to bind")
    a("--model-name", default="sim-model", help="served model name (/v1/models id)")
    a("--model-path", default="/dev/shm/sim-model", help="only reported")
    a("--startup-s", type=float, default=1.0, help="seconds before ready (503 until then)")
    a("--first-request-delay-s", type=float, default=0.0,
      help="extra delay on the first generation request only (kernel warm-up)")
    a("--tokens-per-s", type=float, default=2000.0, help="decode speed per request stream")
    a("--max-running-requests", type=int, default=64, help="concurrent generations; more queue")
    a("--kv-cache-tokens", type=int, default=500000, help="reported KV cache size (#tokens)")
    a("--context-length", type=int, default=8192, help="model context length")
    a("--seed", type=int, default=0,
      help="same seed -> same outputs and same fault decisions for the same requests")
    a("--api-key", default=None,
      help="require 'Authorization: Bearer KEY' (not on /health*, /metrics, like SGLang); "
           "default: the environment variable FLEET_ENGINE_API_KEY (how fleet passes it: not in argv)")
    a("--speculative-algorithm", default=None,
      help="e.g. EAGLE: report an accept length in logs, /server_info and /metrics")
    a("--oom-at-start", nargs="?", const="kv-pool", default=None, choices=("kv-pool", "weights"),
      help="die before ready with SGLang's OOM lines, exit 1 "
           "(kv-pool: 'Not enough memory...', weights: torch.OutOfMemoryError)")
    a("--hang-at-start", action="store_true", help="never become ready; stay alive")
    a("--crash-after", type=int, default=None, metavar="N",
      help="die (exit 1) when the N-th generation request arrives")
    a("--hang-requests", action="store_true",
      help="ready and /health ok, but generations (and /health_generate) never answer")
    a("--hang-after", type=int, default=None, metavar="N",
      help="serve N generation requests, then hang like --hang-requests (a wedged scheduler: "
           "/health still answers, /health_generate and generations never do)")
    a("--burst-5xx", type=int, default=30, metavar="N",
      help="on SIGUSR1, answer the next N generation requests with HTTP 500 (a fault soak's burst)")
    a("--error-rate", type=float, default=0.0,
      help="share 0..1 of generation requests answered with HTTP 500 (deterministic)")
    a("--empty-rate", type=float, default=0.0,
      help="share 0..1 of chat answers with empty content (decided per prompt and request seed)")
    a("--think-leak-rate", type=float, default=0.0,
      help="share 0..1 of chat answers whose reasoning is left in the content as <think>...</think> "
           "(no reasoning_content): a missing reasoning parser")
    a("--loop-rate", type=float, default=0.0,
      help="share 0..1 of chat answers that end in one word repeated (degenerate repetition)")
    a("--max-output-tokens-default", type=int, default=64,
      help="max tokens when a request gives none")
    a("--log-interval-s", type=float, default=1.0,
      help="seconds between 'Decode batch' lines while running")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        p.error("--port must be 0..65535")
    if args.tokens_per_s <= 0:
        p.error("--tokens-per-s must be > 0")
    if args.max_running_requests < 1:
        p.error("--max-running-requests must be >= 1")
    if args.kv_cache_tokens < 1 or args.context_length < 2:
        p.error("--kv-cache-tokens must be >= 1 and --context-length >= 2")
    for flag in ("error_rate", "empty_rate", "think_leak_rate", "loop_rate"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            p.error(f"--{flag.replace('_', '-')} must be within 0..1")
    if args.crash_after is not None and args.crash_after < 1:
        p.error("--crash-after must be >= 1")
    if args.startup_s < 0 or args.first_request_delay_s < 0:
        p.error("--startup-s and --first-request-delay-s must be >= 0")
    if args.max_output_tokens_default < 1:
        p.error("--max-output-tokens-default must be >= 1")
    if args.log_interval_s <= 0:
        p.error("--log-interval-s must be > 0")


# --------------------------------------------------------------------------- logging


class Log:
    """SGLang's log shape: ``[YYYY-mm-dd HH:MM:SS] msg``, ``[... TP0] msg`` from the scheduler.

    Every line is flushed: the launcher redirects stdout into a log file that fleet tails.
    """

    def __init__(self, out=None) -> None:
        self.out = out if out is not None else sys.stdout
        self._sec = -1
        self._stamp = ""

    def _ts(self) -> str:
        now = int(time.time())
        if now != self._sec:
            self._sec = now
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        return self._stamp

    def info(self, msg: str, tp: bool = False) -> None:
        self.write(f"[{self._ts()}{' TP0' if tp else ''}] {msg}\n")

    def write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            pass  # a closed or broken log must not take the server down


# --------------------------------------------------------------------------- determinism


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a fast, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _hash(*parts: int) -> int:
    h = 0
    for part in parts:
        h = _mix64(h ^ (part & _M64))
    return h


def _unit(*parts: int) -> float:
    return _hash(*parts) / 2.0**64


def _digest(obj) -> int:
    """A stable 64-bit key of a JSON-able value (the messages or the prompt)."""
    if isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
    else:
        data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


_SALT_LEN, _SALT_ERR, _SALT_TEXT, _SALT_ID, _SALT_SPEC = 11, 13, 17, 19, 23
_SALT_EMPTY, _SALT_LEAK, _SALT_LOOP = 29, 31, 37

_COMMON = ("the", "of", "and", "to", "in", "is", "it", "on", "as", "by", "we", "so", "a", "or")
_POOL_SIZE = 1 << 16
_pool: list[str] = []


def _word_pool() -> list[str]:
    """65,536 pseudo-words (about four characters per word with its space, like a token)."""
    if not _pool:
        rnd = random.Random(20261129)
        cons, vows = "bcdfghjklmnprstvwz", "aeiou"
        vocab = list(_COMMON)
        while len(vocab) < 600:
            w = "".join(rnd.choice(cons) + rnd.choice(vows) for _ in range(rnd.choice((1, 1, 2))))
            if rnd.random() < 0.3:
                w += rnd.choice(cons)
            vocab.append(w)
        _pool.extend(rnd.choices(vocab, k=_POOL_SIZE))
    return _pool


def _words(key: int, n: int) -> list[str]:
    pool = _word_pool()
    start = key % _POOL_SIZE
    if start + n <= _POOL_SIZE:
        return pool[start : start + n]
    out = pool[start:]
    while len(out) < n:
        out.extend(pool[: n - len(out)])
    return out


# --------------------------------------------------------------------------- engine


class Plan:
    """One generation, decided in full when the request arrives."""

    __slots__ = ("rid", "prompt_tokens", "completion_tokens", "max_tokens", "key", "finish",
                 "duration", "t_decode", "t_arrive")

    def __init__(self, rid: int, prompt_tokens: int, completion_tokens: int, max_tokens: int,
                 key: int, tokens_per_s: float) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.max_tokens = max_tokens
        self.key = key
        self.finish = "length" if completion_tokens >= max_tokens else "stop"
        self.duration = completion_tokens / tokens_per_s
        self.t_decode = 0.0
        self.t_arrive = time.monotonic()


class Engine:
    """Slots, counters and the periodic scheduler log: the simulated GPU."""

    def __init__(self, args: argparse.Namespace, log: Log) -> None:
        self.args = args
        self.log = log
        self.tps = float(args.tokens_per_s)
        self.ready = False
        self.free = int(args.max_running_requests)
        self.waiters: deque[asyncio.Future] = deque()
        self.running: dict[int, Plan] = {}
        self.warm = False
        self.gen_counter = 0  # generation requests arrived (fault decisions key on it)
        self.burst_left = 0   # generation requests still to answer 500 (SIGUSR1 starts a burst)
        self.rid_counter = 0
        # metrics
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.finished_decode_tokens = 0  # decoded by finished or aborted requests
        self.latency_buckets = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
        self.latency_counts = [0] * (len(self.latency_buckets) + 1)
        self.latency_sum = 0.0
        # interval stats for the scheduler log
        self.new_seqs = 0
        self.new_tokens = 0
        self.last_gen_throughput = 0.0
        self.spec_accept = 2.5 + _unit(args.seed, _SALT_SPEC) if args.speculative_algorithm else 0.0

    # -- slots ------------------------------------------------------------------------

    def try_admit(self) -> bool:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def admit(self) -> None:
        if self.try_admit():
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as the client went away
            else:
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1

    # -- requests ---------------------------------------------------------------------

    def next_rid(self) -> int:
        self.rid_counter += 1
        return self.rid_counter

    def start(self, plan: Plan) -> float:
        """A slot is held: the plan starts decoding. Returns the extra warm-up delay."""
        delay = 0.0
        if not self.warm:
            self.warm = True
            delay = float(self.args.first_request_delay_s)
        plan.t_decode = time.monotonic() + delay
        self.running[plan.rid] = plan
        self.new_seqs += 1
        self.new_tokens += plan.prompt_tokens
        self.prompt_tokens_total += plan.prompt_tokens
        return delay

    def progress(self, plan: Plan, now: float) -> int:
        done = (now - plan.t_decode) * self.tps
        if done <= 0:
            return 0
        return min(plan.completion_tokens, int(done))

    def finish(self, plan: Plan, completed: bool = True) -> None:
        if self.running.pop(plan.rid, None) is None:
            return
        now = time.monotonic()
        tokens = plan.completion_tokens if completed else self.progress(plan, now)
        self.finished_decode_tokens += tokens
        if completed:
            self.generation_tokens_total += tokens
            self.requests_total += 1
            latency = now - plan.t_arrive
            self.latency_sum += latency
            self.latency_counts[bisect.bisect_left(self.latency_buckets, latency)] += 1
        self.release()

    def used_tokens(self, now: float) -> int:
        return sum(p.prompt_tokens + self.progress(p, now) for p in self.running.values())

    def decoded_tokens(self, now: float) -> int:
        return self.finished_decode_tokens + sum(self.progress(p, now) for p in self.running.values())

    def accept_len(self) -> float:
        # a little wobble per log line, centred on the server's own accept length
        return self.spec_accept + (random.random() - 0.5) * 0.1

    async def scheduler_log(self) -> None:
        """``Prefill batch`` / ``Decode batch`` lines while there is work, like SGLang's scheduler."""
        interval = float(self.args.log_interval_s)
        last_t = time.monotonic()
        last_decoded = self.decoded_tokens(last_t)
        kv = self.args.kv_cache_tokens
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            decoded = self.decoded_tokens(now)
            self.last_gen_throughput = (decoded - last_decoded) / max(now - last_t, 1e-9)
            last_t, last_decoded = now, decoded
            queued = len(self.waiters)
            used = self.used_tokens(now)
            usage = min(used / kv, 1.0)
            if self.new_seqs:
                self.log.info(
                    f"Prefill batch. #new-seq: {self.new_seqs}, #new-token: {self.new_tokens}, "
                    f"#cached-token: 0, token usage: {usage:.2f}, "
                    f"#running-req: {len(self.running)}, #queue-req: {queued}, ",
                    tp=True,
                )
                self.new_seqs = self.new_tokens = 0
            if self.running or self.last_gen_throughput > 0:
                spec = f"accept len: {self.accept_len():.2f}, " if self.spec_accept else ""
                self.log.info(
                    f"Decode batch. #running-req: {len(self.running)}, #token: {used}, "
                    f"token usage: {usage:.2f}, {spec}cuda graph: True, "
                    f"gen throughput (token/s): {self.last_gen_throughput:.2f}, "
                    f"#queue-req: {queued}, ",
                    tp=True,
                )


# --------------------------------------------------------------------------- HTTP


_REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
    405: "Method Not Allowed", 411: "Length Required", 413: "Request Entity Too Large",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable",
}
_JSON = b"application/json"
_TEXT = b"text/plain; charset=utf-8"
_SSE = b"text/event-stream"


class Request:
    __slots__ = ("method", "path", "target", "version", "headers", "body", "keep_alive")

    def __init__(self, method: str, target: str, version: str, headers: dict[bytes, bytes]) -> None:
        self.method = method
        self.target = target
        self.path = target.split("?", 1)[0]
        self.version = version
        self.headers = headers
        self.body = b""
        conn = headers.get(b"connection", b"").lower()
        if version == "1.1":
            self.keep_alive = b"close" not in conn
        else:
            self.keep_alive = b"keep-alive" in conn


class Resp:
    __slots__ = ("status", "body", "ctype")

    def __init__(self, status: int, body: bytes = b"", ctype: bytes = _JSON) -> None:
        self.status = status
        self.body = body
        self.ctype = ctype


def _json(status: int, obj) -> Resp:
    return Resp(status, json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode())


def _error(status: int, message: str, type_: str) -> Resp:
    """SGLang's OpenAI-compatible error body (``ErrorResponse``)."""
    return _json(status, {"object": "error", "message": message, "type": type_, "param": None,
                          "code": status})


def _head(status: int, ctype: bytes, length: int | None, keep_alive: bool) -> bytes:
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "Unknown").encode()),
             b"server: uvicorn\r\ncontent-type: ", ctype, b"\r\n"]
    if length is None:
        parts.append(b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n")
    else:
        parts.append(b"content-length: %d\r\n" % length)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order (pipelining-safe)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.cur: Request | None = None
        self.need = 0
        self.pending: deque[Request] = deque()
        self.busy = False
        self.task: asyncio.Task | None = None
        self.closed = False
        self.peer = "-"
        self.stream_status = 200
        self.streaming = False

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        self.app.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.app.conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: abort its generation, free the slot

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            self._parse()
        except _BadRequest as exc:
            self._fail(exc.status, exc.message)

    # -- parsing ------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self.buf
        while not self.closed:
            if self.cur is None:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > _MAX_HEAD:
                        raise _BadRequest(431, "request head too large")
                    return
                req = self._parse_head(bytes(buf[:end]))
                del buf[: end + 4]
                te = req.headers.get(b"transfer-encoding")
                if te is not None and te.lower() != b"identity":
                    raise _BadRequest(501, "chunked request bodies are not supported")
                cl = req.headers.get(b"content-length")
                try:
                    need = int(cl) if cl is not None else 0
                except ValueError:
                    raise _BadRequest(400, "bad content-length") from None
                if need < 0:
                    raise _BadRequest(400, "bad content-length")
                if need > _MAX_BODY:
                    raise _BadRequest(413, "body too large")
                if need > len(buf) and req.headers.get(b"expect", b"").lower() == b"100-continue":
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.cur, self.need = req, need
            if len(buf) < self.need:
                return
            req = self.cur
            if self.need:
                req.body = bytes(buf[: self.need])
                del buf[: self.need]
            self.cur, self.need = None, 0
            self.pending.append(req)
            self._pump()

    @staticmethod
    def _parse_head(head: bytes) -> Request:
        lines = head.split(b"\r\n")
        while lines and not lines[0]:
            lines.pop(0)  # tolerate stray CRLF between pipelined requests
        if not lines:
            raise _BadRequest(400, "empty request")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise _BadRequest(400, "bad request line")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise _BadRequest(400, "bad header line")
            headers[name.strip().lower()] = value.strip()
        return Request(parts[0].decode("latin-1"), parts[1].decode("latin-1"),
                       parts[2][5:].decode("latin-1"), headers)

    # -- answering ----------------------------------------------------------------------

    def _pump(self) -> None:
        while self.pending and not self.busy and not self.closed:
            req = self.pending.popleft()
            try:
                result = self.app.handle(req, self)
            except Exception as exc:  # a bug in a handler: answer 500, keep serving
                result = self.app.internal_error(exc)
            if isinstance(result, Resp):
                self.send(req, result)
            else:
                self.busy = True
                self.task = asyncio.get_running_loop().create_task(self._finish(req, result))

    async def _finish(self, req: Request, coro) -> None:
        try:
            result = await coro
        except asyncio.CancelledError:
            return
        except Exception as exc:
            if self.streaming:
                self.app.log_exception(exc)
                self.transport.close()
                return
            result = self.app.internal_error(exc)
        self.task = None
        self.busy = False
        if self.closed:
            return
        if result is None:  # streamed: head and chunks already written
            self.streaming = False
            self.app.access(self.peer, req, self.stream_status)
            if not req.keep_alive:
                self.transport.close()
                self.closed = True
                return
        else:
            self.send(req, result)
        self._pump()

    def send(self, req: Request, resp: Resp) -> None:
        if self.closed:
            return
        body = resp.body if req.method != "HEAD" else b""
        self.transport.write(_head(resp.status, resp.ctype, len(resp.body), req.keep_alive) + body)
        self.app.access(self.peer, req, resp.status)
        if not req.keep_alive:
            self.transport.close()
            self.closed = True

    def _fail(self, status: int, message: str) -> None:
        body = json.dumps({"detail": message}).encode()
        if self.transport is not None and not self.closed:
            self.transport.write(_head(status, _JSON, len(body), False) + body)
            self.transport.close()
        self.closed = True

    # -- streaming (used by handlers) ---------------------------------------------------

    def stream_start(self, req: Request, status: int = 200, ctype: bytes = _SSE) -> None:
        self.streaming = True
        self.stream_status = status
        if not self.closed:
            self.transport.write(_head(status, ctype, None, req.keep_alive))

    def stream_write(self, data: bytes) -> None:
        if data and not self.closed:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def stream_end(self) -> None:
        if not self.closed:
            self.transport.write(b"0\r\n\r\n")


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Reject(Exception):
    """Raised while validating a request; carries the response to send."""

    def __init__(self, resp: Resp) -> None:
        super().__init__(resp.status)
        self.resp = resp


# --------------------------------------------------------------------------- application


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _text_of(content) -> str:
    """The text of an OpenAI message content: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)


def _prompt_tokens_of_text(text: str) -> int:
    return len(text) // 4 + 1


class App:
    """Routes, validation, responses; the HTTP layer calls ``handle``."""

    def __init__(self, args: argparse.Namespace, log: Log, engine: Engine) -> None:
        self.args = args
        self.log = log
        self.engine = engine
        self.conns: set[HttpConnection] = set()
        self.created = int(time.time())
        self.models = {args.model_name, args.model_path, "default"}
        self.api_key = args.api_key.encode() if args.api_key else None
        self.routes = {
            "/health": ("GET", self.health),
            "/health_generate": ("GET", self.health_generate),
            "/model_info": ("GET", self.model_info),
            "/get_model_info": ("GET", self.model_info),
            "/server_info": ("GET", self.server_info),
            "/get_server_info": ("GET", self.server_info),
            "/v1/models": ("GET", self.list_models),
            "/metrics": ("GET", self.metrics),
            "/v1/chat/completions": ("POST", self.chat),
            "/v1/completions": ("POST", self.completions),
            "/generate": ("POST", self.generate),
        }

    # -- plumbing -----------------------------------------------------------------------

    def access(self, peer: str, req: Request, status: int) -> None:
        self.log.info(
            f'INFO:     {peer} - "{req.method} {req.target} HTTP/{req.version}" '
            f"{status} {_REASONS.get(status, '')}"
        )

    def log_exception(self, exc: BaseException) -> None:
        self.log.info(f"ERROR:    Exception in ASGI application: {type(exc).__name__}: {exc}")

    def internal_error(self, exc: BaseException) -> Resp:
        self.log_exception(exc)
        return _error(500, f"{type(exc).__name__}: {exc}", "InternalServerError")

    def handle(self, req: Request, conn: HttpConnection):
        route = self.routes.get(req.path)
        if route is None:
            return _json(404, {"detail": "Not Found"})
        method, fn = route
        if req.method != method and not (req.method == "HEAD" and method == "GET"):
            return _json(405, {"detail": "Method Not Allowed"})
        # like SGLang's middleware: /health* and /metrics stay open for probes and scrapers
        if self.api_key is not None and not (req.path.startswith("/health") or req.path == "/metrics"):
            auth = req.headers.get(b"authorization")
            if auth != b"Bearer " + self.api_key:
                return _json(401, {"error": "Unauthorized"})
        return fn(req, conn)

    # -- probes and info ----------------------------------------------------------------

    def health(self, req: Request, conn: HttpConnection) -> Resp:
        return Resp(200 if self.engine.ready else 503, b"", _TEXT)

    def health_generate(self, req: Request, conn: HttpConnection):
        if not self.engine.ready:
            return Resp(503, b"", _TEXT)
        if self._hung():
            return self._hang()
        # a one-token generation that does not wait for a slot (SGLang answers health
        # checks from recent scheduler activity when busy)
        return self._after(1.0 / self.engine.tps, Resp(200, b"", _TEXT))

    async def _after(self, seconds: float, resp: Resp) -> Resp:
        await asyncio.sleep(seconds)
        return resp

    def _hung(self) -> bool:
        a = self.args
        return a.hang_requests or (a.hang_after is not None and self.engine.gen_counter >= a.hang_after)

    async def _hang(self):
        await asyncio.get_running_loop().create_future()  # never resolves; cancelled on disconnect

    def model_info(self, req: Request, conn: HttpConnection) -> Resp:
        a = self.args
        return _json(200, {
            "model_path": a.model_path,
            "tokenizer_path": a.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "sim",
            "architectures": ["SimForCausalLM"],
        })

    def server_args(self) -> dict:
        a = self.args
        spec = a.speculative_algorithm
        return {
            "model_path": a.model_path,
            "tokenizer_path": a.model_path,
            "served_model_name": a.model_name,
            "host": a.host,
            "port": a.port,
            "context_length": a.context_length,
            "max_running_requests": a.max_running_requests,
            "max_total_tokens": None,
            "chunked_prefill_size": _CHUNKED_PREFILL,
            "max_prefill_tokens": _MAX_PREFILL,
            "mem_fraction_static": 0.88,
            "tp_size": 1,
            "dp_size": 1,
            "random_seed": a.seed,
            "trust_remote_code": True,
            "enable_metrics": True,
            "speculative_algorithm": spec,
            "speculative_num_steps": _SPEC_NUM_STEPS if spec else None,
            "speculative_eagle_topk": 1 if spec else None,
            "speculative_num_draft_tokens": _SPEC_NUM_STEPS + 1 if spec else None,
            "api_key_set": a.api_key is not None,
        }

    def server_info(self, req: Request, conn: HttpConnection) -> Resp:
        a, e = self.args, self.engine
        state = {
            "last_gen_throughput": round(e.last_gen_throughput, 2),
            "memory_usage": {
                "weight": _WEIGHTS_GB,
                "kvcache": round(2 * a.kv_cache_tokens * _KV_BYTES_PER_TOKEN_HALF / _GB, 2),
                "token_capacity": a.kv_cache_tokens,
                "graph": _GRAPH_GB,
            },
        }
        if e.spec_accept:
            state["avg_spec_accept_length"] = round(e.spec_accept, 4)
        info = self.server_args()
        info.update({
            "max_total_num_tokens": a.kv_cache_tokens,
            "max_req_input_len": min(a.context_length, a.kv_cache_tokens) - 1,
            "internal_states": [state],
            "version": VERSION,
            "sim": {
                "tokens_per_s": a.tokens_per_s,
                "startup_s": a.startup_s,
                "first_request_delay_s": a.first_request_delay_s,
                "max_output_tokens_default": a.max_output_tokens_default,
                "ready": e.ready,
                "generation_requests": e.gen_counter,   # arrived (tests count what reached the server)
                "faults": self.faults(),
            },
        })
        return _json(200, info)

    def faults(self) -> dict:
        a = self.args
        return {
            "oom_at_start": a.oom_at_start,
            "hang_at_start": a.hang_at_start,
            "crash_after": a.crash_after,
            "hang_requests": a.hang_requests,
            "hang_after": a.hang_after,
            "error_rate": a.error_rate,
        }

    def list_models(self, req: Request, conn: HttpConnection) -> Resp:
        a = self.args
        return _json(200, {"object": "list", "data": [{
            "id": a.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "sglang",
            "root": a.model_name,
            "parent": None,
            "max_model_len": a.context_length,
        }]})

    def metrics(self, req: Request, conn: HttpConnection) -> Resp:
        a, e = self.args, self.engine
        now = time.monotonic()
        labels = (f'model_name="{a.model_name}",engine_type="unified",tp_rank="0",pp_rank="0"')
        tl = f'model_name="{a.model_name}"'
        used = e.used_tokens(now)
        lines = []

        def metric(name: str, kind: str, help_: str, value, lab: str = labels) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{{{lab}}} {value}")

        metric("sglang:num_running_reqs", "gauge", "The number of running requests.",
               f"{len(e.running)}.0")
        metric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
               f"{len(e.waiters)}.0")
        metric("sglang:num_used_tokens", "gauge", "The number of used tokens.", f"{used}.0")
        metric("sglang:token_usage", "gauge", "The token usage.",
               f"{min(used / a.kv_cache_tokens, 1.0):.4f}")
        metric("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
               f"{e.last_gen_throughput:.2f}")
        metric("sglang:max_total_num_tokens", "gauge",
               "Maximum total number of tokens in the KV cache pool.", f"{a.kv_cache_tokens}.0")
        metric("sglang:max_running_requests", "gauge", "The maximum number of running requests.",
               f"{a.max_running_requests}.0")
        metric("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", "0.0")
        if e.spec_accept:
            metric("sglang:spec_accept_length", "gauge", "The average acceptance length of speculative decoding.",
                   f"{e.spec_accept:.4f}")
        metric("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               f"{e.prompt_tokens_total}.0", tl)
        metric("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
               f"{e.generation_tokens_total}.0", tl)
        metric("sglang:num_requests_total", "counter", "Number of requests processed.",
               f"{e.requests_total}.0", tl)
        name = "sglang:e2e_request_latency_seconds"
        lines.append(f"# HELP {name} Histogram of End-to-end request latency in seconds")
        lines.append(f"# TYPE {name} histogram")
        cum = 0
        for bound, count in zip(e.latency_buckets, e.latency_counts):
            cum += count
            lines.append(f'{name}_bucket{{{tl},le="{bound}"}} {cum}.0')
        cum += e.latency_counts[-1]
        lines.append(f'{name}_bucket{{{tl},le="+Inf"}} {cum}.0')
        lines.append(f"{name}_sum{{{tl}}} {e.latency_sum:.6f}")
        lines.append(f"{name}_count{{{tl}}} {cum}.0")
        return Resp(200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4; charset=utf-8")

    # -- generation: shared steps -------------------------------------------------------

    def _arrive(self) -> int:
        """Count a generation request; --crash-after dies here, on arrival of request N."""
        e = self.engine
        e.gen_counter += 1
        n = e.gen_counter
        if self.args.crash_after is not None and n >= self.args.crash_after:
            _crash(self.log, n)
        return n

    def _body(self, req: Request) -> dict:
        try:
            body = json.loads(req.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Reject(_error(400, f"Invalid JSON body: {exc}", "BadRequestError")) from None
        if not isinstance(body, dict):
            raise _Reject(_error(400, "The request body must be a JSON object.", "BadRequestError"))
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model not in self.models:
            raise _Reject(_error(404, f"The model `{model}` does not exist.", "NotFoundError"))

    def _max_tokens(self, value, prompt_tokens: int, generate: bool = False) -> int:
        """SGLang's context check (tokenizer_manager._validate_one_request), same wording."""
        ctx = self.args.context_length

        def reject(message: str) -> _Reject:
            if generate:
                return _Reject(_json(400, {"error": {"message": message}}))
            return _Reject(_error(400, message, "BadRequestError"))

        if prompt_tokens >= ctx:
            raise reject(f"The input ({prompt_tokens} tokens) is longer than the model's "
                         f"context length ({ctx} tokens).")
        if value is None:
            return max(0, min(self.args.max_output_tokens_default, ctx - prompt_tokens - 1))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise reject(f"max_tokens must be a non-negative integer, got {value!r}.")
        if value + prompt_tokens >= ctx:
            raise reject(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {value + prompt_tokens} tokens: "
                f"{prompt_tokens} tokens from the input messages and {value} tokens for the "
                f"completion. Please reduce the number of tokens in the input messages or the "
                f"completion to fit within the limit."
            )
        return value

    def _plan(self, key: int, prompt_tokens: int, max_tokens: int, body_seed, ignore_eos: bool) -> Plan:
        seed = self.args.seed
        if isinstance(body_seed, int) and not isinstance(body_seed, bool):
            key = _hash(key, body_seed)
        if ignore_eos or max_tokens == 0:
            n = max_tokens
        else:
            h = _hash(seed, _SALT_LEN, key)
            # one in eight runs into the limit; the rest stop somewhere in 1..max_tokens
            n = max_tokens if h % 8 == 0 else 1 + (h >> 3) % max_tokens
        return Plan(self.engine.next_rid(), prompt_tokens, n, max_tokens, _hash(seed, _SALT_TEXT, key),
                    self.engine.tps)

    def _faults(self, n: int):
        """After validation: --hang-requests and --error-rate. Returns a response or None."""
        if self.args.hang_requests or (self.args.hang_after is not None and n > self.args.hang_after):
            return self._hang()
        if self.engine.burst_left > 0:
            self.engine.burst_left -= 1
            return _error(500, "Internal server error (simulated burst, SIGUSR1).", "InternalServerError")
        rate = self.args.error_rate
        if rate > 0 and _unit(self.args.seed, _SALT_ERR, n) < rate:
            return _error(500, "Internal server error (simulated by --error-rate).",
                          "InternalServerError")
        return None

    def _id(self, prefix: str, plan: Plan) -> str:
        return f"{prefix}{_hash(self.args.seed, _SALT_ID, plan.rid, plan.key):016x}"

    def _run(self, plan: Plan, build):
        """Hold a slot for the plan's duration, then ``build()`` the response.

        Instant generations with a free slot are answered synchronously (no task, no timer):
        that is what lets one core serve thousands of requests per second.
        """
        e = self.engine
        if e.try_admit():
            delay = e.start(plan)
            wait = plan.duration + delay
            if wait <= _FAST_S:
                e.finish(plan)
                return build()
            return self._run_admitted(plan, wait, build)
        return self._run_queued(plan, build)

    async def _run_admitted(self, plan: Plan, wait: float, build):
        e = self.engine
        done = False
        try:
            await asyncio.sleep(wait)
            done = True
        finally:
            e.finish(plan, completed=done)
        return build()

    async def _run_queued(self, plan: Plan, build):
        e = self.engine
        await e.admit()
        delay = e.start(plan)
        return await self._run_admitted(plan, plan.duration + delay, build)

    async def _stream(self, req: Request, conn: HttpConnection, plan: Plan, chunks, first, last):
        """Hold a slot and write SSE events: ``first``, one per token group, ``last``."""
        e = self.engine
        if not e.try_admit():
            await e.admit()
        delay = e.start(plan)
        done = False
        try:
            if delay:
                await asyncio.sleep(delay)
            conn.stream_start(req)
            if first:
                conn.stream_write(first)
            per = max(1, int(e.tps * _STREAM_CHUNK_S))
            words = _words(plan.key, plan.completion_tokens)
            sent = 0
            for i in range(0, len(words), per):
                group = words[i : i + per]
                await asyncio.sleep(len(group) / e.tps)
                conn.stream_write(chunks(group, sent))
                sent += len(group)
            done = True
        finally:
            e.finish(plan, completed=done)
        conn.stream_write(last() if callable(last) else last)
        conn.stream_end()
        return None

    @staticmethod
    def _usage(plan: Plan) -> dict:
        return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": plan.completion_tokens,
                "total_tokens": plan.prompt_tokens + plan.completion_tokens}

    # -- /v1/chat/completions -----------------------------------------------------------

    def chat(self, req: Request, conn: HttpConnection):
        if not self.engine.ready:
            return _error(503, "The server is not ready yet.", "ServiceUnavailableError")
        n = self._arrive()
        try:
            body = self._body(req)
            self._check_model(body)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _Reject(_error(400, "messages: a non-empty list is required.", "BadRequestError"))
            prompt_tokens = 0
            for m in messages:
                if not isinstance(m, dict):
                    raise _Reject(_error(400, "messages: each message must be an object.", "BadRequestError"))
                prompt_tokens += _prompt_tokens_of_text(_text_of(m.get("content")))
            mt = body.get("max_completion_tokens")
            if mt is None:
                mt = body.get("max_tokens")
            max_tokens = self._max_tokens(mt, prompt_tokens)
        except _Reject as r:
            return r.resp
        fault = self._faults(n)
        if fault is not None:
            return fault
        plan = self._plan(_digest(messages), prompt_tokens, max_tokens, body.get("seed"),
                          bool(body.get("ignore_eos")))
        model = body.get("model") or self.args.model_name
        kwargs = body.get("chat_template_kwargs")
        thinking = isinstance(kwargs, dict) and bool(kwargs.get("enable_thinking"))
        n_reason = plan.completion_tokens // 3 if thinking and plan.completion_tokens >= 2 else 0
        cid = self._id("chatcmpl-", plan)
        created = int(time.time())

        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

            def chunk(delta: dict, finish=None) -> bytes:
                return _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": [{"index": 0, "delta": delta,
                             "logprobs": None, "finish_reason": finish}]})

            def chunks(group: list[str], sent: int) -> bytes:
                out = []
                reason_part = group[: max(0, n_reason - sent)]
                content_part = group[len(reason_part):]
                if reason_part:
                    text = " ".join(reason_part)
                    out.append(chunk({"reasoning_content": text if sent == 0 else " " + text}))
                if content_part:
                    text = " ".join(content_part)
                    first_content = sent + len(reason_part) == n_reason
                    out.append(chunk({"content": text if first_content else " " + text}))
                return b"".join(out)

            last = chunk({}, plan.finish)
            if include_usage:
                last += _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                              "model": model, "choices": [], "usage": self._usage(plan)})
            last += b"data: [DONE]\n\n"
            first = chunk({"role": "assistant", "content": ""})
            return self._stream(req, conn, plan, chunks, first, last)

        a = self.args

        def build() -> Resp:
            words = _words(plan.key, plan.completion_tokens)
            content = " ".join(words[n_reason:])
            reasoning = " ".join(words[:n_reason]) if thinking else None
            # answer-quality faults (non-streamed answers): decided by the prompt and the
            # request's seed, so asking again with another seed can come out clean
            if a.loop_rate > 0 and words and _unit(plan.key, _SALT_LOOP) < a.loop_rate:
                content = " ".join(words[n_reason:n_reason + 3] + [words[-1]] * 12)
            if a.think_leak_rate > 0 and _unit(plan.key, _SALT_LEAK) < a.think_leak_rate:
                content, reasoning = f"<think>{reasoning or ''}</think>{content}", None
            if a.empty_rate > 0 and _unit(plan.key, _SALT_EMPTY) < a.empty_rate:
                content = ""
            message = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            message["tool_calls"] = None
            return _json(200, {
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": plan.finish, "matched_stop": None}],
                "usage": self._usage(plan),
            })

        return self._run(plan, build)

    # -- /v1/completions ----------------------------------------------------------------

    def completions(self, req: Request, conn: HttpConnection):
        if not self.engine.ready:
            return _error(503, "The server is not ready yet.", "ServiceUnavailableError")
        n = self._arrive()
        try:
            body = self._body(req)
            self._check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_tokens = _prompt_tokens_of_text(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_tokens = len(prompt)
            else:
                raise _Reject(_error(400, "prompt: a string or a list of token ids is required.",
                                     "BadRequestError"))
            max_tokens = self._max_tokens(body.get("max_tokens"), prompt_tokens)
        except _Reject as r:
            return r.resp
        fault = self._faults(n)
        if fault is not None:
            return fault
        plan = self._plan(_digest(prompt), prompt_tokens, max_tokens, body.get("seed"),
                          bool(body.get("ignore_eos")))
        model = body.get("model") or self.args.model_name
        cid = self._id("cmpl-", plan)
        created = int(time.time())

        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

            def chunk(text: str, finish=None) -> bytes:
                return _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": text, "logprobs": None,
                                          "finish_reason": finish}]})

            def chunks(group: list[str], sent: int) -> bytes:
                text = " ".join(group)
                return chunk(text if sent == 0 else " " + text)

            last = chunk("", plan.finish)
            if include_usage:
                last += _sse({"id": cid, "object": "text_completion", "created": created,
                              "model": model, "choices": [], "usage": self._usage(plan)})
            last += b"data: [DONE]\n\n"
            return self._stream(req, conn, plan, chunks, b"", last)

        def build() -> Resp:
            text = " ".join(_words(plan.key, plan.completion_tokens))
            return _json(200, {
                "id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": plan.finish, "matched_stop": None}],
                "usage": self._usage(plan),
            })

        return self._run(plan, build)

    # -- /generate (SGLang native) ------------------------------------------------------

    def generate(self, req: Request, conn: HttpConnection):
        if not self.engine.ready:
            return _json(503, {"error": {"message": "The server is not ready yet."}})
        n = self._arrive()
        try:
            try:
                body = json.loads(req.body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise _Reject(_json(400, {"error": {"message": f"Invalid JSON body: {exc}"}})) from None
            if not isinstance(body, dict):
                raise _Reject(_json(400, {"error": {"message": "The request body must be a JSON object."}}))
            text, ids = body.get("text"), body.get("input_ids")
            if isinstance(text, str):
                prompt_tokens, key_src = _prompt_tokens_of_text(text), text
            elif isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
                prompt_tokens, key_src = len(ids), ids
            else:
                raise _Reject(_json(400, {"error": {"message":
                    "Either text (a string) or input_ids (a list of ints) is required; "
                    "batched /generate is not simulated."}}))
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise _Reject(_json(400, {"error": {"message": "sampling_params must be an object."}}))
            max_tokens = self._max_tokens(sp.get("max_new_tokens"), prompt_tokens, generate=True)
        except _Reject as r:
            return r.resp
        fault = self._faults(n)
        if fault is not None:
            if isinstance(fault, Resp):
                return _json(500, {"error": {"message": "Internal server error (simulated by --error-rate)."}})
            return fault
        plan = self._plan(_digest(key_src), prompt_tokens, max_tokens, sp.get("sampling_seed"),
                          bool(sp.get("ignore_eos")))
        rid = self._id("", plan)

        def meta(completion_tokens: int, finished: bool) -> dict:
            if not finished:
                reason = None
            elif plan.finish == "length":
                reason = {"type": "length", "length": plan.max_tokens}
            else:
                reason = {"type": "stop", "matched": 151645}
            return {"id": rid, "finish_reason": reason, "prompt_tokens": plan.prompt_tokens,
                    "completion_tokens": completion_tokens, "cached_tokens": 0,
                    "e2e_latency": round(time.monotonic() - plan.t_arrive, 6)}

        if body.get("stream"):
            acc: list[str] = []

            def chunks(group: list[str], sent: int) -> bytes:
                acc.extend(group)
                return _sse({"text": " ".join(acc), "meta_info": meta(len(acc), False)})

            def last() -> bytes:  # the final event repeats the full text, with the finish reason
                return (_sse({"text": " ".join(acc), "meta_info": meta(len(acc), True)})
                        + b"data: [DONE]\n\n")

            return self._stream(req, conn, plan, chunks, b"", last)

        def build() -> Resp:
            text = " ".join(_words(plan.key, plan.completion_tokens))
            return _json(200, {"text": text, "meta_info": meta(plan.completion_tokens, True)})

        return self._run(plan, build)


# --------------------------------------------------------------------------- faults


_SGL = "/usr/local/lib/python3.12/dist-packages/sglang/srt"


def _crash(log: Log, n: int) -> None:
    """--crash-after: SGLang's scheduler dies mid-run; the whole server goes with it."""
    log.info(f"sim: --crash-after reached on generation request #{n}; dying now")
    log.info(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{_SGL}/managers/scheduler.py", line 2741, in run_scheduler_process\n'
        "    scheduler.event_loop_overlap()\n"
        f'  File "{_SGL}/managers/scheduler.py", line 1012, in event_loop_overlap\n'
        "    batch_result = self.run_batch(batch)\n"
        f'  File "{_SGL}/managers/scheduler.py", line 1826, in run_batch\n'
        "    batch_result = self.model_worker.forward_batch_generation(model_worker_batch)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "CUDA kernel errors might be asynchronously reported at any other API call, "
        "so the stacktrace below might be incorrect.\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n",
        tp=True,
    )
    log.info("Received sigquit from a child process. It usually means the child failed.")
    os._exit(1)


def _oom_lines(log: Log, kind: str) -> None:
    if kind == "weights":
        log.info(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            f'  File "{_SGL}/managers/scheduler.py", line 2729, in run_scheduler_process\n'
            "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)\n"
            f'  File "{_SGL}/model_executor/model_runner.py", line 306, in __init__\n'
            "    self.initialize(min_per_gpu_memory)\n"
            f'  File "{_SGL}/model_executor/model_runner.py", line 389, in initialize\n'
            "    self.load_model()\n"
            f'  File "{_SGL}/model_loader/loader.py", line 585, in load_model\n'
            "    model = _initialize_model(model_config, self.load_config)\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.45 GiB. GPU 0 has a "
            "total capacity of 139.81 GiB of which 1.12 GiB is free. Including non-PyTorch memory, "
            "this process has 138.68 GiB memory in use. Of the allocated memory 137.20 GiB is "
            "allocated by PyTorch, and 0.61 GiB is reserved by PyTorch but unallocated. If reserved "
            "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n",
            tp=True,
        )
    else:
        log.info(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            f'  File "{_SGL}/managers/scheduler.py", line 2729, in run_scheduler_process\n'
            "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)\n"
            f'  File "{_SGL}/model_executor/model_runner.py", line 306, in __init__\n'
            "    self.initialize(min_per_gpu_memory)\n"
            f'  File "{_SGL}/model_executor/model_runner.py", line 421, in initialize\n'
            "    self.init_memory_pool(min_per_gpu_memory, server_args.max_running_requests, "
            "server_args.max_total_tokens)\n"
            f'  File "{_SGL}/model_executor/model_runner.py", line 1577, in init_memory_pool\n'
            "    raise RuntimeError(\n"
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            "Current value: mem_fraction_static=0.88\n",
            tp=True,
        )
    log.info("Received sigquit from a child process. It usually means the child failed.")


# --------------------------------------------------------------------------- startup


def _server_args_line(args: argparse.Namespace) -> str:
    spec = args.speculative_algorithm
    fields = [
        ("model_path", args.model_path), ("tokenizer_path", args.model_path),
        ("tokenizer_mode", "auto"), ("load_format", "auto"), ("trust_remote_code", True),
        ("context_length", args.context_length), ("dtype", "auto"),
        ("host", args.host), ("port", args.port), ("mem_fraction_static", 0.88),
        ("max_running_requests", args.max_running_requests), ("max_total_tokens", None),
        ("chunked_prefill_size", _CHUNKED_PREFILL), ("max_prefill_tokens", _MAX_PREFILL),
        ("tp_size", 1), ("random_seed", args.seed), ("api_key", "***" if args.api_key else None),
        ("served_model_name", args.model_name), ("enable_metrics", True),
        ("speculative_algorithm", spec),
        ("speculative_num_steps", _SPEC_NUM_STEPS if spec else None),
        ("speculative_num_draft_tokens", _SPEC_NUM_STEPS + 1 if spec else None),
    ]
    return "server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in fields) + ")"


async def _startup(args: argparse.Namespace, log: Log, engine: Engine) -> int | None:
    """Print SGLang's startup lines spread over --startup-s, then mark the engine ready.

    Returns 1 after an --oom-at-start death, never returns under --hang-at-start, None
    when ready.
    """
    t0 = time.monotonic()
    total = float(args.startup_s)

    async def at(frac: float) -> None:
        delay = t0 + frac * total - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    kv = args.kv_cache_tokens
    kv_half_gb = kv * _KV_BYTES_PER_TOKEN_HALF / _GB
    avail0 = _GPU_TOTAL_GB - 0.53
    avail_w = avail0 - _WEIGHTS_GB
    avail_kv = max(avail_w - 2 * kv_half_gb, 1.0)
    avail_g = max(avail_kv - _GRAPH_GB, 0.5)

    log.info(_server_args_line(args))
    log.info("Using default HuggingFace chat template with detected content format: string")
    await at(0.05)
    log.info("Init torch distributed begin.", tp=True)
    log.info("Init torch distributed ends. mem usage=0.00 GB", tp=True)
    await at(0.10)
    log.info(f"Load weight begin. avail mem={avail0:.2f} GB", tp=True)
    await at(0.35)
    if args.oom_at_start == "weights":
        _oom_lines(log, "weights")
        return 1
    log.info(f"Load weight end. type=SimForCausalLM, dtype=torch.bfloat16, avail mem={avail_w:.2f} GB, "
             f"mem usage={_WEIGHTS_GB:.2f} GB.", tp=True)
    await at(0.40)
    if args.oom_at_start:
        _oom_lines(log, "kv-pool")
        return 1
    log.info(f"KV Cache is allocated. #tokens: {kv}, K size: {kv_half_gb:.2f} GB, "
             f"V size: {kv_half_gb:.2f} GB", tp=True)
    log.info(f"Memory pool end. avail mem={avail_kv:.2f} GB", tp=True)
    await at(0.45)
    log.info(f"Capture cuda graph begin. This can take up to several minutes. "
             f"avail mem={avail_kv:.2f} GB", tp=True)
    if args.hang_at_start:
        log.info("sim: --hang-at-start: never becoming ready")
        await asyncio.get_running_loop().create_future()
    await at(0.75)
    graph_s = 0.30 * total
    log.info(f"Capture cuda graph end. Time elapsed: {graph_s:.2f} s. mem usage={_GRAPH_GB:.2f} GB. "
             f"avail mem={avail_g:.2f} GB.", tp=True)
    if args.speculative_algorithm:
        avail_d = max(avail_g - _DRAFT_WEIGHTS_GB, 0.5)
        log.info(f"Load weight begin. avail mem={avail_g:.2f} GB", tp=True)
        log.info(f"Load weight end. type=LlamaForCausalLMEagle3, dtype=torch.bfloat16, "
                 f"avail mem={avail_d:.2f} GB, mem usage={_DRAFT_WEIGHTS_GB:.2f} GB.", tp=True)
        log.info(f"KV Cache is allocated. #tokens: {kv}, K size: {kv_half_gb / 32:.2f} GB, "
                 f"V size: {kv_half_gb / 32:.2f} GB", tp=True)
        await at(0.80)
        log.info(f"Capture cuda graph begin. This can take up to several minutes. "
                 f"avail mem={avail_d:.2f} GB", tp=True)
        await at(0.85)
        log.info(f"Capture cuda graph end. Time elapsed: {0.05 * total:.2f} s. mem usage=0.21 GB. "
                 f"avail mem={max(avail_d - 0.21, 0.5):.2f} GB.", tp=True)
        avail_g = max(avail_d - 0.21, 0.5)
    await at(0.88)
    log.info(f"max_total_num_tokens={kv}, chunked_prefill_size={_CHUNKED_PREFILL}, "
             f"max_prefill_tokens={_MAX_PREFILL}, max_running_requests={args.max_running_requests}, "
             f"context_len={args.context_length}, available_gpu_mem={avail_g:.2f} GB", tp=True)
    await at(0.90)
    log.info(f"INFO:     Started server process [{os.getpid()}]")
    log.info("INFO:     Waiting for application startup.")
    log.info("INFO:     Application startup complete.")
    log.info(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
    await at(0.93)
    log.info(f'INFO:     127.0.0.1:{_warmup_port(args)} - "GET /model_info HTTP/1.1" 200 OK')
    log.info("Prefill batch. #new-seq: 1, #new-token: 7, #cached-token: 0, token usage: 0.00, "
             "#running-req: 0, #queue-req: 0, ", tp=True)
    await at(1.0)
    log.info(f'INFO:     127.0.0.1:{_warmup_port(args) + 2} - "POST /generate HTTP/1.1" 200 OK')
    engine.ready = True
    log.info("The server is fired up and ready to roll!")
    return None


def _warmup_port(args: argparse.Namespace) -> int:
    return 40000 + (_hash(args.seed, args.port) % 20000)


# --------------------------------------------------------------------------- main


async def _serve(args: argparse.Namespace, log: Log) -> int:
    loop = asyncio.get_running_loop()
    engine = Engine(args, log)
    app = App(args, log, engine)
    try:
        server = await loop.create_server(lambda: HttpConnection(app), args.host, args.port,
                                          reuse_address=True, backlog=2048)
    except OSError as exc:
        log.info(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
                 f"({args.host!r}, {args.port}): {(exc.strerror or str(exc)).lower()}")
        return 1

    stop = loop.create_future()

    def on_signal(signame: str) -> None:
        if not stop.done():
            stop.set_result(signame)

    for signame in ("SIGTERM", "SIGINT"):
        try:
            loop.add_signal_handler(getattr(signal, signame), on_signal, signame)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (embedded use): the caller stops us

    def burst() -> None:
        engine.burst_left = int(args.burst_5xx)
        log.info(f"sim: SIGUSR1: the next {engine.burst_left} generation requests answer HTTP 500")

    try:
        loop.add_signal_handler(signal.SIGUSR1, burst)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        pass

    faults = {k: v for k, v in app.faults().items() if v}
    log.info(f"sim: simulated SGLang server {VERSION}, pid {os.getpid()}, faults: {faults or 'none'}")
    startup = loop.create_task(_startup(args, log, engine))
    sched = loop.create_task(engine.scheduler_log())
    code = 0
    try:
        done, _ = await asyncio.wait({startup, stop}, return_when=asyncio.FIRST_COMPLETED)
        if startup in done and startup.result() == 1:
            code = 1
        else:
            await stop
            log.info("INFO:     Shutting down")
    finally:
        for task in (startup, sched):
            task.cancel()
        server.close()
        for conn in list(app.conns):
            if conn.transport is not None:
                conn.transport.abort()
        if code == 0:
            log.info("INFO:     Waiting for application shutdown.")
            log.info("INFO:     Application shutdown complete.")
            log.info(f"INFO:     Finished server process [{os.getpid()}]")
    return code


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    # fleet hands the key over in the environment, never in argv (/proc/<pid>/cmdline is
    # world-readable); dropped from the environment once read, like the SGLang shim does.
    env_key = os.environ.pop("FLEET_ENGINE_API_KEY", "")
    if args.api_key is None and env_key:
        args.api_key = env_key
    _check_args(parser, args)
    log = Log()
    try:
        return asyncio.run(_serve(args, log))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
