"""The HTTP front: a small asyncio.Protocol speaking HTTP/1.1 the way uvicorn answers.

Keep-alive, pipelining, Content-Length bodies, chunked responses for streaming; asyncio
streams would be simpler but this serves thousands of requests per second on one core.
The routes behind it (``fleet.sim.app``) are reached through the ``Routes`` protocol.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Coroutine
from typing import Any, Protocol, TypeAlias, cast

_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024


REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
    405: "Method Not Allowed", 411: "Length Required", 413: "Request Entity Too Large",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable",
}
JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"
SSE = b"text/event-stream"


class Request:
    """One parsed request: method, target, headers (lower-cased names) and body."""

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
    """A whole response, sent at once (streamed answers write through the connection)."""

    __slots__ = ("status", "body", "ctype")

    def __init__(self, status: int, body: bytes = b"", ctype: bytes = JSON) -> None:
        self.status = status
        self.body = body
        self.ctype = ctype


#: What a route answers: a response now, or a coroutine that answers later (None: it streamed).
Answer: TypeAlias = "Resp | Coroutine[Any, Any, Resp | None]"


def json_resp(status: int, obj: Any) -> Resp:
    return Resp(status, json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode())


def error_resp(status: int, message: str, type_: str) -> Resp:
    """SGLang's OpenAI-compatible error body (``ErrorResponse``)."""
    return json_resp(status, {"object": "error", "message": message, "type": type_, "param": None,
                              "code": status})


def _head(status: int, ctype: bytes, length: int | None, keep_alive: bool) -> bytes:
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, "Unknown").encode()),
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

    transport: asyncio.Transport  # set by connection_made, before any other call

    def __init__(self, app: Routes) -> None:
        self.app = app
        self.buf = bytearray()
        self.cur: Request | None = None
        self.need = 0
        self.pending: deque[Request] = deque()
        self.busy = False
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.peer = "-"
        self.stream_status = 200
        self.streaming = False

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_server gives stream transports
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        self.app.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
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

    async def _finish(self, req: Request, coro: Coroutine[Any, Any, Resp | None]) -> None:
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
        if not self.closed:
            self.transport.write(_head(status, JSON, len(body), False) + body)
            self.transport.close()
        self.closed = True

    # -- streaming (used by handlers) ---------------------------------------------------

    def stream_start(self, req: Request, status: int = 200, ctype: bytes = SSE) -> None:
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


class Routes(Protocol):
    """What a connection needs from the application behind it (``fleet.sim.app.App``)."""

    conns: set[HttpConnection]

    def handle(self, req: Request, conn: HttpConnection) -> Answer: ...

    def internal_error(self, exc: BaseException) -> Resp: ...

    def log_exception(self, exc: BaseException) -> None: ...

    def access(self, peer: str, req: Request, status: int) -> None: ...
