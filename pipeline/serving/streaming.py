"""How the proxy's answer goes out while the engine works: the stream's head only once the engine is slower
than ``stream_head_s``, protocol keep-alives every ``keepalive_s``, the rest in one write, and a dropped client
noticed (its engine request aborted) within a tick.

The engine call is a plain asyncio task (the proxy's server runs on asyncio). The protocol supplies the
bytes (``Protocol.stream_open`` / ``keepalive`` / ``stream_rest`` in wire.py); this module decides when they go.
"""

from __future__ import annotations

import asyncio

import anyio

from pipeline.serving.engine import Engine
from pipeline.serving.http_server import Request, Response, Stream
from pipeline.serving.wire import Protocol, StreamState

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def watch_engine(
    request: Request, proto: Protocol, sstate: StreamState, stream: bool, task: asyncio.Task,
    engine: Engine, rid: str, *, stream_head_s: float, keepalive_s: float,
) -> tuple[Stream | None, bool]:
    """Wait for the engine ``task``, watching the connection every tick: a dropped client aborts the engine
    request ``rid``. Streams send their head only when the engine has not answered within stream_head_s (so a
    quick answer goes out as one write: head, events and end together), then a protocol keep-alive every
    keepalive_s. Returns (the stream whose head was sent, or None; whether the client disconnected); the
    task is done on return."""
    loop = asyncio.get_running_loop()
    resp: Stream | None = None
    tick = min(0.5, keepalive_s)
    next_keepalive = loop.time() + keepalive_s
    wait_s = stream_head_s if stream else tick
    try:
        while not task.done():
            if wait_s > 0:
                await asyncio.wait((task,), timeout=wait_s)
                if task.done():
                    break
            wait_s = tick
            gone = request.disconnected()
            if not gone and stream:
                try:
                    if resp is None:
                        resp = request.stream(200, SSE_HEADERS, proto.stream_open(sstate))
                    if loop.time() >= next_keepalive:
                        next_keepalive = loop.time() + keepalive_s
                        resp.write(proto.keepalive(sstate))
                except ConnectionError:
                    gone = True
            if gone:
                with anyio.move_on_after(10):
                    await engine.abort(rid)
                return resp, True
    finally:
        if not task.done():  # the client left, or this handler was cancelled (server shutdown)
            task.cancel()
            await asyncio.wait((task,))
    return resp, False


def finish_stream(request: Request, resp: Stream | None, head: bytes, rest: bytes, *,
                  strict: bool = False) -> Stream | Response:
    """Send the rest of a stream and end it, in one write: with the status line and head when the head was
    not sent yet (then as a body with a length instead of chunks: the same bytes to SSE clients).

    ``strict`` lets a write failure (the client left) raise; otherwise it is ignored, since there is nothing
    left to tell that client."""
    try:
        if resp is None:
            return request.send(Response(200, head + rest, SSE_HEADERS, content_type="text/event-stream"))
        resp.end(rest)
    except ConnectionError:
        if strict:
            raise
    return resp if resp is not None else Response(499)
