"""One keep-alive HTTP/1.1 client connection driven directly on asyncio, for the hot ``/generate`` path of
:class:`pipeline.serving.sglang_client.HttpEngine` (why not aiohttp there: that class's docstring)."""

from __future__ import annotations

import asyncio
from typing import Any

import httptools

from pipeline.serving.engine import EngineProtocolError


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time. httptools (llhttp, in C) frames the
    response as it arrives: Content-Length, chunked, or (HTTP/1.0, no length) until the server closes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.got_bytes = False  # any response byte since the request was sent
        self.reusable = False
        self._parser = httptools.HttpResponseParser(self)
        self._status = 0
        self._body = bytearray()
        self._framed = False  # the response says where its body ends (a length or chunks), not "at close"
        self._in_body = False  # the final response's headers are in; its body may be running
        self._complete = False

    def start(self) -> asyncio.Future[tuple[int, bytes]]:
        self._body.clear()
        self.got_bytes = self.reusable = self._complete = self._framed = self._in_body = False
        self._status = 0
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    # httptools callbacks (from inside feed_data)
    def on_message_begin(self) -> None:
        if self._complete:  # bytes after the answer: this connection cannot carry another request
            self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an informational response (100 Continue): the real one follows
            self._framed = False
            return
        self._status = status
        self._in_body = True

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        if not self._in_body or self._complete:
            return
        self._complete = True
        self.reusable = self._parser.should_keep_alive()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        w = self.waiter
        if w is None or w.done():
            return
        if self._complete or (self._in_body and not self._framed):  # the close ends a body framed "until close"
            w.set_result((self._status, bytes(self._body)))
        else:  # cut off mid-response: a connection failure, not a malformed reply
            w.set_exception(exc or ConnectionResetError("the engine closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        w = self.waiter
        if w is None or w.done():  # bytes nobody asked for: this connection cannot carry another request
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self.reusable = False
            if not self._complete:
                self.closed = True
                w.set_exception(EngineProtocolError(f"malformed HTTP response from the engine: {e}"))
                return
        if self._complete:
            w.set_result((self._status, bytes(self._body)))


def expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
