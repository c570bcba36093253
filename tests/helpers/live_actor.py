"""One actor running for real in the test's event loop: an inbox the test writes to, outputs it reads."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import anyio

from pipeline.core.runtime import Actor, Output
from pipeline.messages import Message


class Live:
    def __init__(self, actor: Actor[Any], inbox: Any) -> None:
        self.actor = actor
        self.inbox = inbox
        self.sent: dict[str, list[Message]] = defaultdict(list)
        self.arrived = anyio.Condition()  # notified on every message an output sends
        self.stopped = anyio.Event()  # set when the actor's run() returns by itself

    async def wait_for(self, output: str, n: int, timeout_s: float = 10.0) -> list[Message]:
        """The first ``n`` messages of ``output``, waiting until they are there: at most ``timeout_s`` (a test
        that needs them sooner wraps the call in its own ``anyio.fail_after``; a longer wrap does not extend it)."""
        with anyio.fail_after(timeout_s):
            async with self.arrived:
                while len(self.sent[output]) < n:
                    await self.arrived.wait()
        return self.sent[output][:n]


@contextlib.asynccontextmanager
async def live(actor: Actor[Any], inbox_size: int = 64) -> AsyncIterator[Live]:
    send, recv = anyio.create_memory_object_stream[Message](max_buffer_size=inbox_size)
    actor.inbox = recv
    harness = Live(actor, send)

    async def drain(name: str, stream: Any) -> None:
        async for msg in stream:
            harness.sent[name].append(msg)
            async with harness.arrived:
                harness.arrived.notify_all()

    async with anyio.create_task_group() as tg:
        for name in type(actor).outputs:
            out_send, out_recv = anyio.create_memory_object_stream[Message](max_buffer_size=1000)
            actor.out[name] = Output(f"{actor.name}.{name}", None)
            actor.out[name].connect(out_send)
            tg.start_soon(drain, name, out_recv)

        async def run() -> None:
            await actor.run()
            harness.stopped.set()

        tg.start_soon(run)
        try:
            yield harness
        finally:
            tg.cancel_scope.cancel()
