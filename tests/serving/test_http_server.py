"""The proxy's HTTP/1.1 server (pipeline/serving/http_server.py) on the wire: framing, keep-alive, pipelining, limits,
streams, disconnects and shutdown, checked with raw sockets (byte-exact) and aiohttp's client (a real parser)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pipeline.serving.http_server import MAX_HEAD_BYTES, HttpServer, Request, Response, Stream, json_response

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class App:
    """Handlers that show what the server handed them."""

    def __init__(self) -> None:
        self.seen: list[Request] = []
        self.release = asyncio.Event()
        self.stream_gone = asyncio.Event()
        self.unhooked: list[object] = []

    async def echo(self, req: Request) -> Response:
        self.seen.append(req)
        return json_response({"path": req.path, "query": req.query, "n": len(req.body), "too_large": req.too_large,
                              "auth": req.headers.get("authorization", "")})

    async def slow(self, req: Request) -> Response:
        await self.release.wait()
        return Response(200, b"slow", content_type="text/plain")

    async def stream(self, req: Request) -> Stream:
        s = req.stream(200, {"Content-Type": "text/event-stream"})
        s.write(b"data: 1\n\n")
        await asyncio.sleep(0.05)
        s.end(b"data: 2\n\n")
        return s

    async def held_stream(self, req: Request) -> Stream:
        s = req.stream(200, {"Content-Type": "text/event-stream"})
        s.write(b"data: open\n\n")
        gone = asyncio.Event()
        req.on_disconnect(gone.set)  # as the proxy's watch waits for it
        req.on_disconnect(self.unhooked.append)()  # unregistered at once: never called
        await asyncio.wait_for(gone.wait(), 5)
        assert req.disconnected()
        with pytest.raises(ConnectionError):
            s.write(b"data: late\n\n")
        late = asyncio.Event()
        req.on_disconnect(late.set)  # registered after the loss: called all the same
        await asyncio.wait_for(late.wait(), 5)
        self.stream_gone.set()
        return s

    async def boom(self, req: Request) -> Response:
        raise ValueError("handler bug")


@contextlib.asynccontextmanager
async def serving(max_body: int = 1000, keepalive_s: float = 75.0, **limits: float) -> AsyncIterator[
        tuple[App, HttpServer, int]]:
    app = App()
    server = HttpServer({("POST", "/echo"): app.echo, ("GET", "/echo"): app.echo, ("GET", "/slow"): app.slow,
                         ("GET", "/stream"): app.stream, ("GET", "/held"): app.held_stream,
                         ("GET", "/boom"): app.boom, ("HEAD", "/echo"): app.echo},
                        max_body_bytes=max_body, keepalive_timeout_s=keepalive_s, **limits)
    port = await server.listen_tcp("127.0.0.1", 0)
    try:
        yield app, server, port
    finally:
        await server.close()


async def raw(port: int, data: bytes, *, until_close: bool = True, read_s: float = 5.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = b""
    try:
        if until_close:
            out = await asyncio.wait_for(r.read(), read_s)
        else:
            with contextlib.suppress(TimeoutError):
                while True:
                    chunk = await asyncio.wait_for(r.read(65536), 0.3)
                    if not chunk:
                        break
                    out += chunk
    finally:
        w.close()
    return out


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in extra)
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode() + body


async def test_keep_alive_requests_are_answered_with_their_lengths():
    async with serving() as (app, _, port), aiohttp.ClientSession() as s:
        for i in range(3):
            async with s.post(f"http://127.0.0.1:{port}/echo?beta=true", data=b"x" * i,
                              headers={"Authorization": "Bearer t"}) as r:
                assert r.status == 200 and r.headers["Content-Length"] == str(len(await r.read()))
                assert await r.json() == {"path": "/echo", "query": "beta=true", "n": i, "too_large": False,
                                          "auth": "Bearer t"}
        assert len(app.seen) == 3


async def test_pipelined_requests_are_answered_in_order():
    async with serving() as (app, _, port):
        task = asyncio.create_task(raw(port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + post("/echo", b"abc"),
                                       until_close=False))
        await asyncio.sleep(0.2)
        assert app.seen == []  # the second waits for the first's answer
        app.release.set()
        out = await task
    assert out.index(b"slow") < out.index(b'"n":3')


async def test_expect_100_continue_gets_continue_then_the_answer():
    async with serving() as (_, _, port):
        out = await raw(port, post("/echo", b"hello", "Expect: 100-continue"), until_close=False)
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n") and b'"n":5' in out


async def test_a_chunked_body_arrives_whole():
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    async with serving() as (app, _, port):
        out = await raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body,
                        until_close=False)
    assert b'"n":11' in out and app.seen[0].body == b"hello world"


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_over_the_limit_is_dropped_and_marked_and_the_connection_goes_on(chunked):
    big = b"y" * 5000
    if chunked:
        req = (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
    else:
        req = post("/echo", big)
    async with serving(max_body=1000) as (app, _, port):
        out = await raw(port, req + post("/echo", b"ok"), until_close=False)
    assert app.seen[0].too_large and app.seen[0].body == b""
    assert b'"too_large":true' in out and b'"n":2' in out  # the next request on the same connection


async def test_http_1_0_gets_connection_close_and_the_connection_ends():
    async with serving() as (_, _, port):
        out = await raw(port, b"GET /echo HTTP/1.0\r\n\r\n")
        stream = await raw(port, b"GET /stream HTTP/1.0\r\n\r\n")
    assert b"Connection: close\r\n" in out and out.endswith(b'"auth":""}')
    head, _, body = stream.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head and body == b"data: 1\n\ndata: 2\n\n"  # read until the close


async def test_a_stream_is_chunked():
    async with serving() as (_, _, port):
        out = await raw(port, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", until_close=False)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/stream") as r:
            assert r.headers["Transfer-Encoding"] == "chunked" and await r.read() == b"data: 1\n\ndata: 2\n\n"
    assert out.endswith(b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")


async def test_unknown_paths_methods_and_head():
    async with serving() as (_, _, port), aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/nope") as r:
            assert r.status == 404
        async with s.delete(f"http://127.0.0.1:{port}/echo") as r:
            assert r.status == 405
        async with s.head(f"http://127.0.0.1:{port}/echo") as r:
            assert r.status == 200 and int(r.headers["Content-Length"]) > 0 and await r.read() == b""
        async with s.get(f"http://127.0.0.1:{port}/echo") as r:  # the connection survived the bodiless answer
            assert r.status == 200


async def test_malformed_or_oversized_heads_are_refused_and_the_connection_closes():
    async with serving() as (app, _, port):
        bad = await raw(port, b"NOT HTTP AT ALL\r\n\r\n")
        huge = await raw(port, b"GET /echo HTTP/1.1\r\nX-Big: " + b"z" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in bad
    assert huge.startswith(b"HTTP/1.1 431 ") and b"headers over 65536 bytes" in huge and app.seen == []


async def test_a_failing_handler_is_a_500_and_the_server_goes_on():
    async with serving() as (_, _, port), aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/boom") as r:
            assert r.status == 500 and "ValueError" in (await r.json())["error"]["message"]
        async with s.get(f"http://127.0.0.1:{port}/echo") as r:
            assert r.status == 200


async def test_a_client_that_leaves_mid_stream_is_seen_as_gone():
    async with serving() as (app, _, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"data: open" in await asyncio.wait_for(r.readuntil(b"data: open\n\n"), 5)
        w.close()
        await asyncio.wait_for(app.stream_gone.wait(), 5)
        assert app.unhooked == []


async def test_send_raises_when_the_client_is_gone():
    async with serving() as (app, server, port):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        conn = next(iter(server.connections))
        req = Request(conn, "GET", b"/slow", {}, b"", True, False)
        w.close()
        await asyncio.sleep(0.1)
        assert req.disconnected()
        with pytest.raises(ConnectionError):
            req.send(Response(200, b"late"))
        app.release.set()


async def test_idle_keep_alive_connections_close_and_busy_ones_stay():
    async with serving(keepalive_s=0.2) as (app, _, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(r.readuntil(b'"auth":""}'), 5)
        busy_r, busy_w = await asyncio.open_connection("127.0.0.1", port)
        busy_w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(r.read(), 5) == b""  # the idle one was closed by the server
        app.release.set()
        assert (await asyncio.wait_for(busy_r.read(65536), 5)).endswith(b"slow")  # the busy one was answered
        w.close()
        busy_w.close()


async def test_close_cancels_what_is_being_answered_and_closes_connections():
    app_server: list[HttpServer] = []
    async with serving() as (_, server, port):
        app_server.append(server)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        await asyncio.wait_for(server.close(timeout_s=2), 5)
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
    assert not app_server[0].connections


async def test_unix_socket(tmp_path):
    app = App()
    server = HttpServer({("POST", "/echo"): app.echo}, max_body_bytes=100)
    path = str(tmp_path / "s.sock")
    await server.listen_unix(path)
    try:
        r, w = await asyncio.open_unix_connection(path)
        w.write(post("/echo", b"12345"))
        out = await asyncio.wait_for(r.readuntil(b"}"), 5)
        assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b'"n":5' in out
        w.close()
    finally:
        await server.close()


# ------------------------------------------------------------------------------------- what a client can hold
async def slowloris(port: int, n: int) -> list[asyncio.StreamWriter]:
    """``n`` connections that each start a request head and then send nothing more."""
    writers = []
    for _ in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        writers.append(w)
    return writers


async def test_a_request_that_does_not_arrive_in_time_gets_a_408_and_its_connection_closes():
    async with serving(request_timeout_s=0.4) as (app, server, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly part of it")
        for _ in range(3):  # a byte now and then keeps the connection active, not the request in time
            await asyncio.sleep(0.1)
            w.write(b"x")
        out = await asyncio.wait_for(r.read(), 5)
        assert out.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 0.4s" in out
        assert app.seen == [] and server.connections == set()


async def test_slow_clients_over_the_connection_cap_do_not_starve_a_good_one():
    async with serving(request_timeout_s=30.0, max_connections=50) as (_, server, port):
        held = await slowloris(port, 300)
        await asyncio.sleep(0.2)
        assert len(server.connections) <= 50
        async with aiohttp.ClientSession() as s:
            for _ in range(20):  # each on a new connection: every one gets in and is answered
                async with s.post(f"http://127.0.0.1:{port}/echo", data=b"{}", headers={"Connection": "close"}) as r:
                    assert r.status == 200
        for w in held:
            w.close()


async def slow_requests(port: int, n: int, head: bytes = b"") -> list[tuple[asyncio.StreamReader,
                                                                         asyncio.StreamWriter]]:
    """``n`` connections, each with a /slow request the app answers only once released."""
    out = []
    for _ in range(n):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
        out.append((r, w))
    await asyncio.sleep(0.1)
    return out


async def test_a_busy_server_refuses_a_new_connection_with_a_503():
    async with serving(max_connections=2) as (app, _, port):
        busy = await slow_requests(port, 2)
        assert (await raw(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 503 ")
        app.release.set()
        for r, w in busy:
            assert (await asyncio.wait_for(r.read(65536), 5)).endswith(b"slow")
            w.close()


async def test_one_credential_holds_a_bounded_number_of_requests_and_others_are_unaffected():
    async with serving(max_connections_per_token=3) as (app, _, port):
        held = await slow_requests(port, 3, b"Authorization: Bearer rollout-a\r\n")
        fourth = await raw(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nx-api-key: rollout-a\r\n\r\n")
        assert fourth.startswith(b"HTTP/1.1 429 ") and b"more than 3 requests at once" in fourth
        other = await raw(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer rollout-b\r\n"
                                b"Connection: close\r\n\r\n")
        assert other.startswith(b"HTTP/1.1 200 ")
        app.release.set()
        for r, _ in held:
            assert (await asyncio.wait_for(r.read(65536), 5)).endswith(b"slow")
        # answered, they hold nothing: the credential is served again
        again = await raw(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nx-api-key: rollout-a\r\nConnection: close\r\n\r\n")
        assert again.startswith(b"HTTP/1.1 200 ")
        for _, w in held:
            w.close()
