"""How the proxy's answer goes out while the engine works: the stream's head only once the engine is slower
than ``stream_head_s``, protocol keep-alives every ``keepalive_s``, the rest in one write, and a dropped client
noticed (its engine request aborted) as soon as its connection is lost.

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
    """Wait for the engine ``task``; a dropped client aborts the engine request ``rid``. Streams send their head only
    when the engine has not answered within stream_head_s (so a quick answer goes out as one write: head, events
    and end together), then a protocol keep-alive every keepalive_s. Returns (the stream whose head was sent, or
    None; whether the client disconnected); the task is done on return.

    Event-driven: the task's end, the connection's loss and the stream's timer wake this call; nothing polls, so a
    thousand calls waiting on a slow engine cost the loop nothing between their keep-alives."""
    loop = asyncio.get_running_loop()
    resp: Stream | None = None
    woken: asyncio.Future[None] = loop.create_future()
    timer: asyncio.TimerHandle | None = None

    def wake(_: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    def beat() -> None:  # the head first, then a keep-alive each period
        nonlocal resp, timer
        try:
            if resp is None:
                resp = request.stream(200, SSE_HEADERS, proto.stream_open(sstate))
            else:
                resp.write(proto.keepalive(sstate))
        except ConnectionError:
            wake()
            return
        timer = loop.call_later(keepalive_s, beat)

    task.add_done_callback(wake)
    unhook = request.on_disconnect(wake)
    try:
        if stream and not task.done():
            if stream_head_s > 0:
                timer = loop.call_later(stream_head_s, beat)
            else:
                beat()
        await woken
        if task.done():
            return resp, False
        with anyio.move_on_after(10):  # the client is gone
            await engine.abort(rid)
        return resp, True
    finally:
        if timer is not None:
            timer.cancel()
        task.remove_done_callback(wake)
        unhook()
        if not task.done():  # the client left, or this handler was cancelled (server shutdown)
            task.cancel()
            await asyncio.wait((task,))


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
