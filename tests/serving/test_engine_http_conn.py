"""HttpEngine's own /generate connections against a raw HTTP server that answers in every framing HTTP/1.1 allows.

SGLang (uvicorn) answers with Content-Length and keeps connections alive (closing them when idle); a router or
another proxy in between may answer chunked, close after each answer, or speak HTTP/1.0.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.serving.engine import EngineProtocolError, EngineSampling, EngineUnavailable
from pipeline.serving.http_conn import Conn
from pipeline.serving.sglang_client import HttpEngine

ANSWER = {
    "output_ids": [7, 8],
    "meta_info": {"id": "x", "finish_reason": {"type": "stop", "matched": 8},
                  "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]]},
}


class RawServer:
    """Reads whole requests; answers each with ``frame(body_bytes)`` and closes when that says so."""

    def __init__(self, frame) -> None:
        self.frame = frame
        self.requests: list[dict] = []
        self.connections = 0
        self.disconnected = anyio.Event()  # a held request's client went away
        self.server: asyncio.AbstractServer | None = None
        self.hold = False  # never answer (a slow engine)
        self.piece = 0  # >0: write answers in pieces of this many bytes, one per event loop turn

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = json.loads(await reader.readexactly(length))
                self.requests.append(body)
                if self.hold:
                    await reader.read()  # until the client goes away
                    self.disconnected.set()
                    return
                data, close = self.frame(json.dumps({**ANSWER, "meta_info": {**ANSWER["meta_info"],
                                                                             "id": body["rid"]}}).encode())
                for i in range(0, len(data), self.piece or len(data)):
                    writer.write(data[i:i + (self.piece or len(data))])
                    await writer.drain()
                    if self.piece:
                        await asyncio.sleep(0.001)  # separate segments: the parser sees every split
                if close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()


def content_length(body: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body, False


def chunked(body: bytes) -> tuple[bytes, bool]:
    parts = [body[:5], body[5:17], body[17:]]
    out = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    for p in parts:
        out += b"%x;ext=1\r\n" % len(p) + p + b"\r\n"
    return out + b"0\r\nX-Trailer: 1\r\n\r\n", False


def until_close(body: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body, True


def close_after(body: bytes) -> tuple[bytes, bool]:
    return (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body, True


def continue_first(body: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.1 100 Continue\r\n\r\n" + content_length(body)[0], False


def trailing_garbage(body: bytes) -> tuple[bytes, bool]:
    return content_length(body)[0] + b"HTTP/1.1 2", False


@pytest.mark.parametrize("piece", [0, 7])
@pytest.mark.parametrize("frame,reused", [(content_length, True), (chunked, True), (until_close, False),
                                          (close_after, False), (continue_first, True), (trailing_garbage, False)])
def test_every_response_framing_and_connection_reuse(frame, reused, piece):
    async def main():
        srv = RawServer(frame)
        srv.piece = piece
        async with srv as url, HttpEngine(url) as eng:
            for i in range(3):
                res = await eng.generate([1, 2, 3], EngineSampling(), rid=f"r{i}")
                assert res.output_ids == [7, 8] and res.logprobs == [-0.5, -0.25] and res.rid == f"r{i}"
            assert [r["input_ids"] for r in srv.requests] == [[1, 2, 3]] * 3
            assert srv.connections == (1 if reused else 3)

    anyio.run(main)


def test_a_kept_alive_connection_the_server_closed_is_replaced():
    async def main():
        srv = RawServer(content_length)
        async with srv as url, HttpEngine(url) as eng:
            await eng.generate([1], EngineSampling(), rid="a")
            # the server drops its idle keep-alive connections (uvicorn does after 5 s)
            srv.frame = close_after
            await eng.generate([1], EngineSampling(), rid="b")  # answered, then closed by the server
            srv.frame = content_length
            res = await eng.generate([1], EngineSampling(), rid="c")
            assert res.rid == "c" and srv.connections == 2

    anyio.run(main)


def test_stale_pooled_connection_is_retried_once_on_a_fresh_one():
    async def main():
        srv = RawServer(content_length)
        async with srv as url, HttpEngine(url) as eng:
            await eng.generate([1], EngineSampling(), rid="a")
            [conn] = eng._idle
            # the server closed it, but the client has not noticed yet: mark it open again
            conn.transport.close()
            await anyio.sleep(0.05)
            conn.closed = False
            conn.transport = _WriteIntoVoid(conn)
            res = await eng.generate([1], EngineSampling(), rid="b")
            assert res.rid == "b" and srv.connections == 2

    anyio.run(main)


class _WriteIntoVoid:
    """A transport whose peer is gone: the write is lost and the connection reports the loss."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        asyncio.get_running_loop().call_soon(self.conn.connection_lost, ConnectionResetError("reset by peer"))

    def close(self) -> None:
        pass


def test_cancelling_a_generation_closes_its_connection_and_the_engine_sees_it():
    async def main():
        srv = RawServer(content_length)
        srv.hold = True
        async with srv as url, HttpEngine(url) as eng:
            with anyio.move_on_after(0.2):
                await eng.generate([1], EngineSampling(), rid="slow")
            with anyio.fail_after(5):
                await srv.disconnected.wait()
            assert eng._idle == []

    anyio.run(main)


def test_timeouts_errors_and_garbage():
    async def main():
        srv = RawServer(content_length)
        srv.hold = True
        async with srv as url:
            async with HttpEngine(url, timeout_s=0.2) as eng:
                with pytest.raises(EngineUnavailable, match="timed out"):
                    await eng.generate([1], EngineSampling(), rid="slow")
            srv.hold = False
            srv.frame = lambda body: (b"HTTP/1.1 abc\r\n\r\n", True)
            async with HttpEngine(url) as eng:
                with pytest.raises(EngineProtocolError, match="malformed HTTP response"):
                    await eng.generate([1], EngineSampling(), rid="bad")
            srv.frame = lambda body: (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", True)
            async with HttpEngine(url) as eng:
                with pytest.raises(EngineUnavailable, match="failed"):
                    await eng.generate([1], EngineSampling(), rid="cut")
            srv.frame = lambda body: (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy", False)
            async with HttpEngine(url) as eng:
                with pytest.raises(EngineUnavailable, match="HTTP 503: busy"):
                    await eng.generate([1], EngineSampling(), rid="busy")

    anyio.run(main)


class _Sink:
    """A transport for a connection driven by hand: nothing to send, never closing."""

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=300),
    framing=st.sampled_from(["length", "chunked", "until_close", "continue"]),
    chunk_sizes=st.lists(st.integers(1, 64), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=12),
    status=st.sampled_from([200, 400, 503]),
)
def test_any_split_of_any_framing_gives_the_same_answer(body, framing, chunk_sizes, cuts, status):
    """However the bytes arrive, the connection hands over exactly the status and body the server framed."""
    head = b"HTTP/1.1 %d X\r\n" % status
    if framing == "chunked":
        out, i, k = head + b"Transfer-Encoding: chunked\r\n\r\n", 0, 0
        while i < len(body):
            n = chunk_sizes[k % len(chunk_sizes)]
            out += b"%x\r\n" % len(body[i:i + n]) + body[i:i + n] + b"\r\n"
            i, k = i + n, k + 1
        wire = out + b"0\r\n\r\n"
    elif framing == "until_close":
        wire = b"HTTP/1.0 %d X\r\n\r\n" % status + body
    else:
        wire = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        if framing == "continue":
            wire = b"HTTP/1.1 100 Continue\r\n\r\n" + wire
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})

    async def main():
        conn = Conn()
        conn.connection_made(_Sink())
        waiter = conn.start()
        for a, b in itertools.pairwise(points):
            conn.data_received(wire[a:b])
        if framing == "until_close":
            assert not waiter.done()  # only the close ends such a body
            conn.connection_lost(None)
        assert await waiter == (status, body)
        assert conn.reusable == (framing in ("length", "chunked", "continue"))

    asyncio.run(main())
