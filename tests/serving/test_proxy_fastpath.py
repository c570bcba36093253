"""The proxy's per-call paths: quick answers in one piece, slow ones with an early head and keep-alives, dropped
clients aborting the engine, and tokenization in a worker thread giving exactly the inline ids."""

from __future__ import annotations

import aiohttp
import anyio
import numpy as np
import pytest

from pipeline.messages import CallFailed, ids
from pipeline.serving.scripted import Script
from tests.helpers.proxyutil import (
    DONE,
    TOOLS_ANTHROPIC,
    TOOLS_CHAT,
    TOOLS_RESPONSES,
    TWO,
    WRITE,
    model_calls,
    running_proxy,
    sdk_openai,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class AbortSpy:
    """Wraps an engine; records the rids it was asked to abort."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.aborted: list[str] = []

    async def abort(self, rid=None):
        self.aborted.append(rid)
        await self.inner.abort(rid)

    def __getattr__(self, k):
        return getattr(self.inner, k)


def sse_events(raw: bytes) -> list[str]:
    return [line[7:] for line in raw.decode().splitlines() if line.startswith("event: ")]


async def test_a_quick_stream_is_complete_and_a_slow_one_opens_early_with_keepalives():
    body = {"model": "policy", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with running_proxy(Script(default=[DONE]), keepalive_s=0.2) as (p, records, token), \
            aiohttp.ClientSession() as s:
        r = await s.post(p.base_url + "/v1/messages", headers={"x-api-key": token}, json=body)
        assert r.headers["Content-Type"].startswith("text/event-stream")
        quick = sse_events(await r.read())
        p.engine.script.latency_s = 0.5  # past the stream head (20 ms) and a keep-alive period (0.2 s)
        async with s.post(p.base_url + "/v1/messages", headers={"x-api-key": token}, json=body) as r:
            first = await r.content.readuntil(b"\n\n")  # the head arrives while the engine still works
            assert first.startswith(b"event: message_start") and len(model_calls(records)) == 1
            slow = sse_events(first + await r.read())
    assert quick[0] == "message_start" and quick[-1] == "message_stop" and "ping" not in quick
    assert slow[0] == "message_start" and "ping" in slow and slow[-1] == "message_stop"
    assert slow.index("ping") < slow.index("content_block_start") and "content_block_start" in quick
    assert len(model_calls(records)) == 2


class AnswerSpy:
    """Wraps an engine; says whether it has answered yet."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.answered = False

    async def generate(self, *a, **kw):
        res = await self.inner.generate(*a, **kw)
        self.answered = True
        return res

    def __getattr__(self, k):
        return getattr(self.inner, k)


async def test_a_slower_answer_gets_its_head_before_the_engine_answers():
    # keepalive_s 5 s, longer than the engine takes: only stream_head_s sends the head
    body = {"model": "policy", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with running_proxy(Script(default=[DONE], latency_s=0.3), keepalive_s=5.0) as (p, records, token), \
            aiohttp.ClientSession() as s:
        p.engine = spy = AnswerSpy(p.engine)
        async with s.post(p.base_url + "/v1/messages", headers={"x-api-key": token}, json=body) as r:
            first = await r.content.readuntil(b"\n\n")
            assert first.startswith(b"event: message_start") and not spy.answered
            assert r.headers.get("Transfer-Encoding") == "chunked"  # the head went out before the length was known
            events = sse_events(first + await r.read())
        assert spy.answered and events[0] == "message_start" and events[-1] == "message_stop"
        assert "ping" not in events and len(model_calls(records)) == 1


@pytest.mark.parametrize("head_s", [0.0, 1000.0])
async def test_stream_head_s_zero_sends_the_head_before_waiting_even_for_a_fast_engine(head_s):
    body = {"model": "policy", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with running_proxy(Script(default=[DONE]), stream_head_s=head_s) as (p, records, token), \
            aiohttp.ClientSession() as s:
        async with s.post(p.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                          json=body) as r:
            raw = await r.read()
        assert raw.rstrip().endswith(b"data: [DONE]") and len(model_calls(records)) == 1
        if head_s == 0:  # head sent while the engine task had not even started: no length to send
            assert r.headers.get("Transfer-Encoding") == "chunked" and "Content-Length" not in r.headers
        else:  # waited for the whole answer: one write with a length
            assert "Transfer-Encoding" not in r.headers and int(r.headers["Content-Length"]) == len(raw)


@pytest.mark.parametrize("wait_s,head_s", [(0.05, 0.5), (0.6, 0.02)])  # before the head was sent, and after
async def test_a_dropped_client_aborts_its_engine_request(wait_s, head_s):
    async with running_proxy(Script(default=[DONE], latency_s=30.0), keepalive_s=0.25,
                             stream_head_s=head_s) as (p, records, token):
        p.engine = AbortSpy(p.engine)
        async with aiohttp.ClientSession() as s:
            with anyio.move_on_after(wait_s):
                r = await s.post(p.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                                 json={"model": "policy", "stream": True,
                                       "messages": [{"role": "user", "content": "x"}]})
                await r.read()
        with anyio.fail_after(10):
            [failed] = await records.wait_for(lambda x: isinstance(x, CallFailed))
        assert failed.reason == "client disconnected"
        assert p.engine.aborted == [f"r1|{failed.call_id}"]
        assert p.pending("r1") == 0 and model_calls(records) == []


async def _tool_loop(**settings) -> list:
    async with running_proxy(Script(default=[WRITE, TWO, DONE]), **settings) as (p, records, token):
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=0)
        msgs = [{"role": "system", "content": "You are terse. " + "Keep it short. " * 300},
                {"role": "user", "content": "write files"}]
        for _ in range(3):
            r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS_CHAT)
            m = r.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            for tc in m.tool_calls or []:
                msgs.append({"role": "tool", "tool_call_id": tc.id, "content": "ok"})
        return model_calls(records)


async def test_tokenizing_in_a_worker_thread_gives_the_inline_ids():
    inline = await _tool_loop(render_thread_chars=0)
    threaded = await _tool_loop(render_thread_chars=1)
    assert len(inline) == len(threaded) == 3
    for a, b in zip(inline, threaded, strict=True):
        assert np.array_equal(ids(a.input_ids), ids(b.input_ids))
        assert a.spliced_turns == b.spliced_turns and a.rendered_turns == b.rendered_turns
    assert threaded[-1].spliced_turns == 2  # later calls reuse the sampled ids of earlier answers


async def test_parallel_calls_of_one_rollout_render_in_threads_without_mixing():
    async with running_proxy(Script(default=[DONE]), render_thread_chars=1) as (p, records, token):
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=0)
        texts = [f"task {i}: " + "lorem ipsum " * (50 * (i + 1)) for i in range(6)]

        async def one(t: str) -> None:
            await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": t}])

        async with anyio.create_task_group() as tg:
            for t in texts:
                tg.start_soon(one, t)
        calls = model_calls(records)
        renderer = p.renderer
        from pipeline.tokens.from_wire import from_chat

        expected = {len(renderer.render_ids(from_chat({"messages": [{"role": "user", "content": t}]})))
                    for t in texts}
        assert {len(ids(m.input_ids)) for m in calls} == expected


@pytest.mark.parametrize(("failures", "retries"), [(1, 1), (2, 1), (1, 0)])
async def test_a_failing_engine_is_asked_again_before_the_harness_is_told(failures, retries):
    """Codex and Qwen Code end the rollout at the first engine error (Claude Code, OpenClaw and the white-box
    harness make one more call): a transient engine failure is retried by the proxy, invisibly, once."""
    script = Script(default=[DONE], fail_calls=list(range(failures)), latency_s=0.05)
    async with running_proxy(script, engine_retries=retries) as (p, records, token):
        c = sdk_openai(p, base_url=f"{p.base_url}/v1", api_key=token, max_retries=0)
        recovered = failures <= retries
        if recovered:
            r = await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content == "Done."
        else:
            import openai

            with pytest.raises(openai.APIStatusError) as e:
                await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            assert e.value.response.headers.get("x-should-retry") == "false"
            assert f"({retries + 1} attempts)" in str(e.value) or retries == 0
    failed = [r for r in records if isinstance(r, CallFailed)]
    assert (len(model_calls(records)), len(failed)) == ((1, 0) if recovered else (0, 1))


def _bridle_garbage(garbage: list) -> list[str]:
    """What of the collector's finds is the proxy's: its objects, functions / cells it made (closures), and frames
    or coroutines running its code."""
    found = []
    for o in garbage:
        if type(o).__name__ == "cell":
            try:
                o = o.cell_contents
            except ValueError:
                continue
        code = getattr(o, "f_code", None) or getattr(o, "cr_code", None)
        if code is not None:
            if "/pipeline/" in code.co_filename.replace("\\", "/"):
                found.append(f"{type(o).__name__} {code.co_qualname}")
            continue
        mod = (getattr(o, "__module__", None) if callable(o) and not isinstance(o, type) else type(o).__module__) or ""
        if mod.startswith("pipeline."):
            found.append(getattr(o, "__qualname__", type(o).__qualname__))
    return found


async def test_a_call_leaves_no_reference_cycle_for_the_collector():
    # A cycle (a self-rescheduling closure) held each call's request and body until a generation-1 collection, 63
    # of them per 1,000 calls at 64 clients. Quick and slow streams (head, keep-alives), and whole answers, on each
    # protocol: nothing of bridle's may be left for gc.
    import gc

    args = '{"path": "a.txt", "content": "hi"}'
    bodies = {  # a second turn: a tool call and its result, with the tools declared, answered with two tool calls
        "/v1/chat/completions": {"model": "policy", "tools": TOOLS_CHAT, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
        "/v1/messages": {"model": "policy", "max_tokens": 50, "tools": TOOLS_ANTHROPIC, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "c1", "name": "write_file", "input": {"path": "a.txt", "content": "hi"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"}]}]},
        "/v1/responses": {"model": "policy", "tools": TOOLS_RESPONSES, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
            {"type": "function_call", "call_id": "c1", "name": "write_file", "arguments": args},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
    }
    async with running_proxy(Script(default=[TWO]), keepalive_s=0.05) as (p, records, token):
        headers = {"Authorization": f"Bearer {token}", "x-api-key": token}
        async with aiohttp.ClientSession() as s:
            for path, body in bodies.items():  # warm: first-use caches are not garbage
                await (await s.post(p.base_url + path, headers=headers, json=body)).read()
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            # a session of its own: its connections open and close while the collector keeps what it finds
            async with aiohttp.ClientSession() as s:
                for latency in (0.0, 0.15):  # 0.15 s: past the stream head (20 ms) and two keep-alive periods
                    p.engine.script.latency_s = latency
                    for path, body in bodies.items():
                        for stream in (True, False):
                            r = await s.post(p.base_url + path, headers=headers, json={**body, "stream": stream})
                            assert r.status == 200, await r.text()
                            raw = await r.read()
                            if stream and latency:  # the early head and the keep-alives were on this path
                                assert r.headers.get("Transfer-Encoding") == "chunked"
                                assert b"keepalive" in raw or b"ping" in raw, raw[:300]
            for _ in range(50):  # the server sees the connections close
                if not p.server.connections:
                    break
                await anyio.sleep(0.02)
            assert not p.server.connections
            gc.collect()
            ours = _bridle_garbage(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert len(model_calls(records)) == 3 + 12
    assert ours == [], ours
