"""How the proxy's answer goes out while the engine works: the stream's head only once the engine is slower
than ``stream_head_s``, protocol keep-alives every ``keepalive_s``, the rest in one write, and a dropped client
noticed (its engine request aborted) as soon as its connection is lost.

The engine call is a plain asyncio task (the proxy's server runs on asyncio). The protocol supplies the
bytes (``Protocol.stream_open`` / ``keepalive`` / ``stream_rest`` in wire.py); this module decides when they go.
"""

from __future__ import annotations

import asyncio
import contextlib

import anyio

from pipeline.serving.engine import Engine, EngineError
from pipeline.serving.http_server import Request, Response, Stream
from pipeline.serving.wire import Protocol, StreamState

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class _Watch:
    """What :func:`watch_engine` needs in its callbacks. A class, not closures: the stream's timer re-arms itself, and
    a closure that names itself is a reference cycle, which kept each call's request (and its body) alive until a
    generation-1 collection found it; without the cycles the capture costs 7–27 % less CPU per call
    (benchmarks/results/2026-12-05-proxy-cycles.md). Cancelling the timer and dropping it on the way out leaves
    nothing cyclic behind."""

    __slots__ = ("keepalive_s", "loop", "proto", "request", "resp", "sstate", "timer", "woken")

    def __init__(self, request: Request, proto: Protocol, sstate: StreamState, keepalive_s: float) -> None:
        self.request = request
        self.proto = proto
        self.sstate = sstate
        self.keepalive_s = keepalive_s
        self.loop = asyncio.get_running_loop()
        self.woken: asyncio.Future[None] = self.loop.create_future()
        self.resp: Stream | None = None
        self.timer: asyncio.TimerHandle | None = None

    def wake(self, _: object = None) -> None:
        if not self.woken.done():
            self.woken.set_result(None)

    def beat(self) -> None:  # the head first, then a keep-alive each period
        try:
            if self.resp is None:
                self.resp = self.request.stream(200, SSE_HEADERS, self.proto.stream_open(self.sstate))
            else:
                self.resp.write(self.proto.keepalive(self.sstate))
        except ConnectionError:
            self.timer = None
            self.wake()
            return
        self.timer = self.loop.call_later(self.keepalive_s, self.beat)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


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
    w = _Watch(request, proto, sstate, keepalive_s)
    task.add_done_callback(w.wake)
    unhook = request.on_disconnect(w.wake)
    try:
        if stream and not task.done():
            if stream_head_s > 0:
                w.timer = w.loop.call_later(stream_head_s, w.beat)
            else:
                w.beat()
        await w.woken
        if task.done():
            return w.resp, False
        # The client is gone. An engine that cannot take the abort (it is gone too: a run being killed) has
        # nothing left to abort; the caller's handler must not fail for it.
        with anyio.move_on_after(10), contextlib.suppress(EngineError):
            await engine.abort(rid)
        return w.resp, True
    finally:
        w.stop()
        task.remove_done_callback(w.wake)
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
