"""A proxy over the scripted engine, for tests: started on 127.0.0.1, records what it emits."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from pipeline.messages import ModelCall
from pipeline.serving.proxy import Proxy, ProxySettings
from pipeline.serving.scripted import Script, ScriptCall, ScriptedEngine, ScriptResponse
from pipeline.tokens.render import qwen3_renderer

WRITE = ScriptResponse(tool_calls=[ScriptCall(name="write_file", arguments={"path": "a.txt", "content": "hi"})])
TWO = ScriptResponse(text="Writing both.", tool_calls=[
    ScriptCall(name="write_file", arguments={"path": "b.txt", "content": "ü ✓ {\"n\": [1, {\"x\": null}]}"}),
    ScriptCall(name="bash", arguments={"command": "ls -la", "env": {"A": [1, 2]}}),
])
DONE = ScriptResponse(text="Done.", thinking="all files written")

_RENDERER = None


def renderer():
    global _RENDERER
    if _RENDERER is None:
        _RENDERER = qwen3_renderer()
    return _RENDERER


class Records(list):
    """What the proxy emitted, in order."""

    def __init__(self) -> None:
        super().__init__()
        self._added = anyio.Condition()

    async def add(self, record: Any) -> None:
        self.append(record)
        async with self._added:
            self._added.notify_all()

    async def wait_for(self, pred: Callable[[Any], bool]) -> list:
        """The records ``pred`` accepts, once there is at least one (bound the wait with ``anyio.fail_after``)."""
        async with self._added:
            while not (hits := [r for r in self if pred(r)]):
                await self._added.wait()
        return hits


@contextlib.asynccontextmanager
async def running_proxy(script: Script | None = None, **settings: Any) -> AsyncIterator[tuple[Proxy, Records, str]]:
    script = script or Script(default=[WRITE, TWO, DONE])
    eng = ScriptedEngine(renderer(), script)
    records = Records()
    p = Proxy(eng, renderer(), records.add, ProxySettings(**settings))
    p._test_clients = []  # type: ignore[attr-defined]
    await p.start()
    token = p.open_rollout("r1")
    try:
        yield p, records, token
    finally:
        for c in p._test_clients:  # type: ignore[attr-defined]
            await c.close()
        await p.stop()


def sdk_openai(p: Proxy, **kw: Any):
    import openai

    c = openai.AsyncOpenAI(**kw)
    p._test_clients.append(c)  # type: ignore[attr-defined]
    return c


def sdk_anthropic(p: Proxy, **kw: Any):
    import anthropic

    c = anthropic.AsyncAnthropic(**kw)
    p._test_clients.append(c)  # type: ignore[attr-defined]
    return c


def model_calls(records) -> list[ModelCall]:
    return [r for r in records if isinstance(r, ModelCall)]


TOOLS_CHAT = [
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
]
TOOLS_ANTHROPIC = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS_CHAT]
TOOLS_RESPONSES = [{"type": "function", **t["function"]} for t in TOOLS_CHAT]
