"""The proxy's HTTP/1.1 server: asyncio protocols with httptools (llhttp, Node's parser, in C) framing requests.

Why not aiohttp's server, which the proxy used before: the proxy's event loop is its throughput limit, and with
aiohttp's web stack (request and response objects, router, payload writers, per-request bookkeeping) it spent
6-10 % more CPU per call (median over interleaved rounds, ``benchmarks/proxy_ab.py``; fresh 2k-token prompts,
zero-latency engine). This server keeps only what the proxy needs: requests with a body framed by Content-Length or
chunks (``Expect: 100-continue`` answered), keep-alive and pipelining (answered in order), a body limit (the request
still reaches its handler, marked ``too_large``, so the refusal is in the endpoint's protocol), answers of known
length written in one buffer, and streamed answers (SSE) in chunks. Idle keep-alive connections close after
``keepalive_timeout_s``; a malformed request gets a 400 and the connection closes.

What a client can hold is bounded, because a sandboxed policy is a client: a request must arrive whole (head and
body) within ``request_timeout_s`` of its first byte, or it gets a 408 and its connection closes (a client that
sends a byte a second holds nothing for long); at most ``max_connections`` connections are open, and a new one over
the cap takes the place of the one idle or reading the longest, or is refused when every one is being answered; a
credential (``x-api-key`` / bearer token, one per rollout) holds at most ``max_connections_per_token`` requests
being read or answered, and one more gets a 429.

A handler gets a :class:`Request` and returns a :class:`Response`, or the :class:`Stream` it opened with
:meth:`Request.stream` and ended. :meth:`Request.send` writes an answer at once and raises ConnectionError when the
client is gone, for a caller that must know whether its answer was delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import anyio
import httptools
import orjson

from pipeline.core.logs import get_logger

log = get_logger(actor="proxy")
MAX_HEAD_BYTES = 64 << 10  # request line + headers; harnesses send a few KB (a sandboxed agent could send more)
MAX_PIPELINED = 16  # requests read ahead of their answers on one connection before reading pauses


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _head(status: int, headers: dict[str, str], extra: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
    return b"".join(lines) + extra + b"\r\n"


class _HeadTooLarge(Exception):
    pass


class _TooManyForToken(Exception):
    pass


def request_credential(headers: dict[str, str]) -> str:
    """The request's credential: ``x-api-key``, else the bearer token of ``authorization`` ("" when none)."""
    key = headers.get("x-api-key", "")
    if key:
        return key.strip()
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


class Response:
    """An answer of known length: status, headers, body (sent with its Content-Length)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None,
                 content_type: str = "application/json") -> None:
        self.status = status
        self.body = body
        self.headers = {"Content-Type": content_type, **(headers or {})}


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, orjson.dumps(obj), headers)


class Stream:
    """A streamed answer whose head went out: each write is a chunk; :meth:`end` sends the last one."""

    __slots__ = ("_conn", "_request", "ended")

    def __init__(self, request: Request, status: int, headers: dict[str, str], first: bytes = b"") -> None:
        self._request = request
        self._conn = request._conn
        self.ended = False
        # an HTTP/1.0 client reads a stream until the connection closes
        extra = b"Transfer-Encoding: chunked\r\n" if request.keep_alive else b"Connection: close\r\n"
        self._conn.write(_head(status, headers, extra) + self._framed(first))

    def _framed(self, data: bytes) -> bytes:
        if not self._request.keep_alive:  # read until the connection closes: no framing
            return data
        return b"%x\r\n%s\r\n" % (len(data), data) if data else b""

    def write(self, data: bytes) -> None:
        if data:
            self._conn.write(self._framed(data))

    def end(self, data: bytes = b"") -> None:
        """The rest and the end of the stream, in one write."""
        if self.ended:
            return
        self.ended = True
        self._conn.write(self._framed(data) + (b"0\r\n\r\n" if self._request.keep_alive else b""))
        if not self._request.keep_alive:
            self._conn.close()
        self._request.answered = True


class Request:
    """One parsed request. ``headers``: lower-case names (repeated ones joined by ", ")."""

    __slots__ = ("_conn", "answered", "body", "headers", "keep_alive", "method", "path", "query", "too_large")

    def __init__(self, conn: _Connection, method: str, url: bytes, headers: dict[str, str], body: bytes,
                 keep_alive: bool, too_large: bool) -> None:
        self._conn = conn
        parsed = httptools.parse_url(url)
        self.method = method
        self.path = parsed.path.decode("latin-1")
        self.query = (parsed.query or b"").decode("latin-1")
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.too_large = too_large
        self.answered = False

    def disconnected(self) -> bool:
        return self._conn.closed

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (once, on the event loop) when the client's connection is lost, at once if it is gone
        already; returns the function that unregisters it."""
        conn = self._conn
        if conn.closed:
            asyncio.get_running_loop().call_soon(callback)
            return lambda: None
        conn.lost_callbacks.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                conn.lost_callbacks.remove(callback)

        return remove

    def stream(self, status: int, headers: dict[str, str], first: bytes = b"") -> Stream:
        """Send a streamed answer's head now, and its ``first`` chunk in the same write (raises ConnectionError
        when the client is gone)."""
        self._conn.check()
        return Stream(self, status, headers, first)

    def send(self, resp: Response) -> Response:
        """Write ``resp`` now, raising ConnectionError when the client is gone; the server then sends nothing."""
        self._conn.check()
        self._conn.write_response(self, resp)
        self.answered = True
        return resp


Handler = Callable[[Request], Awaitable["Response | Stream"]]


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()  # pipelined requests waiting for the one being answered
        self.task: asyncio.Task[None] | None = None
        self.lost_callbacks: list[Callable[[], None]] = []  # Request.on_disconnect
        self.last_active = time.monotonic()
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._head_bytes = 0
        self._too_large = False
        self.reading_since: float | None = None  # monotonic time of the first byte of a request still arriving
        self.token = ""  # the credential of the request being read or answered (per-token cap)

    # ---------------------------------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.server.admit(self):
            body = orjson.dumps({"error": {"message": "the server holds too many connections",
                                           "type": "server_error"}})
            transport.write(_head(503, {"Content-Type": "application/json"},  # type: ignore[attr-defined]
                                  b"Content-Length: %d\r\nConnection: close\r\n" % len(body)) + body)
            self.close()
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.queue.clear()
        self.server.connections.discard(self)
        callbacks, self.lost_callbacks = self.lost_callbacks, []
        for cb in callbacks:
            cb()
        # the parser (its callbacks) and the transport point back at this protocol: dropped, the connection is freed
        # by reference counting, not left for the cyclic collector
        self.parser = None
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # lost
            return
        self.last_active = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "connection upgrades are not supported")
        except httptools.HttpParserError as e:
            cause = e.__cause__ or e.__context__  # what a callback raised
            if isinstance(cause, _HeadTooLarge):
                self._refuse(431, str(cause))
            elif isinstance(cause, _TooManyForToken):
                self._refuse(429, str(cause))
            else:
                self._refuse(400, f"malformed HTTP request: {e}")

    def check(self) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            self.closed = True
            raise ConnectionResetError("the client closed the connection")

    def write(self, data: bytes) -> None:
        self.check()
        self.transport.write(data)  # type: ignore[union-attr]

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def write_response(self, req: Request, resp: Response) -> None:
        body = b"" if req.method == "HEAD" else resp.body
        extra = b"Content-Length: %d\r\n" % len(resp.body)
        if not req.keep_alive:
            extra += b"Connection: close\r\n"
        self.write(_head(resp.status, resp.headers, extra) + body)
        if not req.keep_alive:
            self.close()

    def _refuse(self, status: int, message: str) -> None:
        if not self.closed and self.transport is not None:
            body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error"}})
            self.transport.write(_head(status, {"Content-Type": "application/json"},
                                       b"Content-Length: %d\r\nConnection: close\r\n" % len(body)) + body)
        self.close()

    # ---------------------------------------------------------------------------- httptools callbacks
    def on_message_begin(self) -> None:
        self.reading_since = time.monotonic()
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0
        self._head_bytes = 0
        self._too_large = False

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge(f"request line and headers over {MAX_HEAD_BYTES} bytes")

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        self._headers[k] = f"{self._headers[k]}, {v}" if k in self._headers else v

    def on_headers_complete(self) -> None:
        self.token = request_credential(self._headers)
        if self.token and self.server.token_load(self.token) > self.server.max_connections_per_token:
            raise _TooManyForToken(f"more than {self.server.max_connections_per_token} requests at once with one "
                                   "credential")
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > self.server.max_body_bytes:
            self._too_large = True
        elif self._headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._size += len(body)
        if self._size > self.server.max_body_bytes:
            self._too_large = True
            self._body = []
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self.reading_since = None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        parser = self.parser
        assert parser is not None  # it is calling
        req = Request(self, parser.get_method().decode("latin-1"), self._url, self._headers, body,
                      parser.should_keep_alive(), self._too_large)
        self._body = []
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._answer(req))
        else:
            self.queue.append(req)
            if len(self.queue) >= MAX_PIPELINED and self.transport is not None:
                self.transport.pause_reading()  # a client that sends without reading waits for its answers

    # ------------------------------------------------------------------------------------------ answers
    async def _answer(self, req: Request) -> None:
        while True:
            try:
                resp = await self.server.dispatch(req)
                if not req.answered and not self.closed:
                    if isinstance(resp, Stream):
                        resp.end()
                    else:
                        self.write_response(req, resp)
            except ConnectionError:
                self.close()
            self.last_active = time.monotonic()
            if not self.queue or self.closed:
                self.task = None
                if self.reading_since is None:
                    self.token = ""
                return
            req = self.queue.popleft()
            if len(self.queue) == MAX_PIPELINED - 1 and self.transport is not None:
                self.transport.resume_reading()


class HttpServer:
    """Routes by (method, path); listens on TCP and Unix sockets; :meth:`close` stops it."""

    def __init__(self, routes: dict[tuple[str, str], Handler], *, max_body_bytes: int,
                 keepalive_timeout_s: float = 75.0, request_timeout_s: float = 60.0, max_connections: int = 1024,
                 max_connections_per_token: int = 64) -> None:
        self.routes = routes
        self.paths = {path for _, path in routes}
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout_s = keepalive_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.max_connections_per_token = max_connections_per_token
        self.connections: set[_Connection] = set()
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.Task[None] | None = None

    def admit(self, conn: _Connection) -> bool:
        """Whether a new connection may open: under the cap, or once the connection idle or reading the longest
        (not one being answered) made room."""
        if len(self.connections) < self.max_connections:
            return True
        spare = [c for c in self.connections if c.task is None]
        if not spare:
            return False
        oldest = min(spare, key=lambda c: c.reading_since if c.reading_since is not None else c.last_active)
        oldest._refuse(503, "closed to make room for a new connection")
        self.connections.discard(oldest)
        return True

    def token_load(self, token: str) -> int:
        """Requests being read or answered with credential ``token``, the one asking included."""
        return sum(1 for c in self.connections if c.token == token)

    async def dispatch(self, req: Request) -> Response | Stream:
        handler = self.routes.get((req.method, req.path))
        if handler is None:
            status = 405 if req.path in self.paths else 404
            return json_response({"error": {"message": f"{req.method} {req.path}: {HTTPStatus(status).phrase}",
                                            "type": "invalid_request_error"}}, status)
        try:
            return await handler(req)
        except ConnectionError:
            raise
        except Exception as e:
            log.exception("request handler failed", path=req.path, error=repr(e))
            return json_response({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error"}},
                                 500)

    async def listen_tcp(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(lambda: _Connection(self), host, port, backlog=1024)
        self._servers.append(srv)
        self._start_sweeper()
        return int(srv.sockets[0].getsockname()[1])

    async def listen_unix(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        await anyio.Path(path).unlink(missing_ok=True)
        srv = await loop.create_unix_server(lambda: _Connection(self), path, backlog=1024)
        self._servers.append(srv)
        self._start_sweeper()

    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close keep-alive connections idle (no request being answered) for keepalive_timeout_s, and refuse
        requests still arriving request_timeout_s after their first byte."""
        while True:
            await asyncio.sleep(min(10.0, self.keepalive_timeout_s, self.request_timeout_s / 2))
            now = time.monotonic()
            for c in list(self.connections):
                if c.reading_since is not None and now - c.reading_since > self.request_timeout_s:
                    c._refuse(408, f"the request did not arrive within {self.request_timeout_s:g}s")
                elif c.task is None and c.reading_since is None and now - c.last_active > self.keepalive_timeout_s:
                    c.close()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, cancel the requests being answered, close every connection."""
        for srv in self._servers:
            srv.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [c.task for c in self.connections if c.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for c in list(self.connections):
            c.close()
        for srv in self._servers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(srv.wait_closed(), timeout_s)
        self._servers = []
        self._sweeper = None
