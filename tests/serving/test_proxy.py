"""The capturing proxy with the official openai and anthropic SDKs as clients."""

from __future__ import annotations

import itertools
import json

import aiohttp
import anthropic
import numpy as np
import openai
import pytest

from pipeline.messages import CallFailed, CallStarted, ModelCall, floats, ids
from pipeline.serving.labels import detect_label
from pipeline.serving.scripted import Script
from pipeline.tokens.from_wire import from_anthropic, from_chat
from tests.helpers.proxyutil import (
    DONE,
    TOOLS_ANTHROPIC,
    TOOLS_CHAT,
    TOOLS_RESPONSES,
    model_calls,
    running_proxy,
    sdk_anthropic,
    sdk_openai,
)

pytestmark = pytest.mark.anyio


def prefix_chain_ok(calls: list[ModelCall]) -> bool:
    for a, b in itertools.pairwise(calls):
        full = np.concatenate([ids(a.input_ids), ids(a.output_ids)])
        if not np.array_equal(ids(b.input_ids)[: len(full)], full):
            return False
    return True


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completions_tool_loop(stream):
    async with running_proxy() as (p, records, token):
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=0)
        msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "write files"}]
        for turn in range(3):
            if stream:
                s = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS_CHAT, stream=True,
                                                    stream_options={"include_usage": True})
                content, calls, finish, usage = "", {}, None, None
                async for ch in s:
                    if not ch.choices:
                        usage = ch.usage
                        continue
                    d = ch.choices[0].delta
                    content += d.content or ""
                    for tc in d.tool_calls or []:
                        slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        slot["id"] = tc.id or slot["id"]
                        slot["name"] = (tc.function.name or "") or slot["name"]
                        slot["arguments"] += tc.function.arguments or ""
                    finish = ch.choices[0].finish_reason or finish
                assert usage is not None and usage.completion_tokens > 0
                tool_calls = [{"id": v["id"], "type": "function",
                               "function": {"name": v["name"], "arguments": v["arguments"]}}
                              for _k, v in sorted(calls.items())]
            else:
                r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS_CHAT)
                m = r.choices[0].message
                content, finish = m.content or "", r.choices[0].finish_reason
                tool_calls = [tc.model_dump() for tc in m.tool_calls or []]
                assert r.usage.prompt_tokens > 0
            if turn == 0:
                assert finish == "tool_calls" and len(tool_calls) == 1
                assert json.loads(tool_calls[0]["function"]["arguments"]) == {"path": "a.txt", "content": "hi"}
            elif turn == 1:
                assert content == "Writing both." and [t["function"]["name"] for t in tool_calls] == ["write_file", "bash"]
                assert json.loads(tool_calls[0]["function"]["arguments"])["content"] == 'ü ✓ {"n": [1, {"x": null}]}'
                assert json.loads(tool_calls[1]["function"]["arguments"]) == {"command": "ls -la", "env": {"A": [1, 2]}}
            else:
                assert finish == "stop" and content == "Done." and not tool_calls
                break
            # the harness re-serializes arguments with other spacing and key order: splicing must still match
            for t in tool_calls:
                t["function"]["arguments"] = json.dumps(json.loads(t["function"]["arguments"]), sort_keys=True,
                                                        indent=1)
            msgs.append({"role": "assistant", "content": content or None, "tool_calls": tool_calls})
            for t in tool_calls:
                msgs.append({"role": "tool", "tool_call_id": t["id"], "content": "ok"})
    calls = model_calls(records)
    assert len(calls) == 3 and [c.seq for c in calls] == [0, 1, 2]
    assert prefix_chain_ok(calls)
    assert [c.spliced_turns for c in calls] == [0, 1, 2] and all(c.rendered_turns == 0 for c in calls)
    assert [type(r) for r in records] == [CallStarted, ModelCall] * 3
    assert all(c.protocol == "chat" and c.label == "main" for c in calls)
    assert len(ids(calls[0].output_ids)) == len(floats(calls[0].logprobs))


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages_tool_loop(stream):
    async with running_proxy() as (p, records, token):
        a = sdk_anthropic(p, base_url=p.base_url, api_key=token, max_retries=0)
        msgs = [{"role": "user", "content": [{"type": "text", "text": "write files"}]}]
        for turn in range(3):
            kw = {"model": "policy", "max_tokens": 1000, "system": [{"type": "text", "text": "Be terse."}],
                  "messages": msgs, "tools": TOOLS_ANTHROPIC}
            if stream:
                async with a.messages.stream(**kw) as s:
                    m = await s.get_final_message()
            else:
                m = await a.messages.create(**kw)
            uses = [b for b in m.content if b.type == "tool_use"]
            if turn == 0:
                assert m.stop_reason == "tool_use" and uses[0].input == {"path": "a.txt", "content": "hi"}
            elif turn == 1:
                assert [u.name for u in uses] == ["write_file", "bash"]
                assert [b.text for b in m.content if b.type == "text"] == ["Writing both."]
            else:
                assert m.stop_reason == "end_turn"
                assert [b.type for b in m.content] == ["thinking", "text"]
                assert m.content[0].thinking == "all files written" and m.content[1].text == "Done."
                break
            # Claude Code sends assistant turns back as blocks; results as tool_result blocks with content arrays
            msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": [{"type": "text", "text": "ok"}]}
                for u in uses]})
        n = await a.messages.count_tokens(model="policy", messages=msgs, tools=TOOLS_ANTHROPIC)
        assert n.input_tokens > 50
    calls = model_calls(records)
    assert len(calls) == 3 and prefix_chain_ok(calls)
    assert all(c.protocol == "anthropic" for c in calls)


async def test_responses_streaming_function_calls_like_codex():
    async with running_proxy() as (p, records, token):
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=0)
        inp = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "write files"}]}]
        for turn in range(3):
            stream = await c.responses.create(model="policy", instructions="Be terse.", input=inp,
                                              tools=TOOLS_RESPONSES, stream=True, store=False)
            types, seqs, done_items, completed = [], [], [], None
            async for ev in stream:
                types.append(ev.type)
                seqs.append(ev.sequence_number)
                if ev.type == "response.output_item.done":
                    done_items.append(ev.item)
                if ev.type == "response.completed":
                    completed = ev.response
            assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            assert completed.usage.input_tokens > 0 and completed.id
            fcs = [i for i in done_items if i.type == "function_call"]
            if turn == 2:
                assert [i.type for i in done_items] == ["reasoning", "message"]
                break
            assert fcs and json.loads(fcs[0].arguments)
            for i in done_items:
                inp.append(i.model_dump(exclude_none=True))
            for f in fcs:
                inp.append({"type": "function_call_output", "call_id": f.call_id, "output": "ok"})
    calls = model_calls(records)
    assert len(calls) == 3 and prefix_chain_ok(calls)


async def test_unknown_token_gets_401_and_nothing_is_recorded():
    async with running_proxy() as (p, records, token):
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key="not-a-token", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        a = sdk_anthropic(p, base_url=p.base_url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await a.messages.create(model="policy", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        # a forgotten (settled) rollout's token stops working
        p.forget("r1")
        c2 = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await c2.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    assert records == []


async def test_bad_requests_are_protocol_errors_that_say_what_is_wrong():
    async with running_proxy(max_body_bytes=300_000) as (p, records, token), aiohttp.ClientSession() as s:
        h = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        r = await s.post(p.base_url + "/v1/chat/completions", data=b"{not json", headers=h)
        body = await r.json()
        assert r.status == 400 and "not valid JSON" in body["error"]["message"]
        assert r.headers["x-should-retry"] == "false"
        r = await s.post(p.base_url + "/v1/chat/completions", json={"messages": "hi"}, headers=h)
        assert r.status == 400 and "messages" in (await r.json())["error"]["message"]
        r = await s.post(p.base_url + "/v1/messages", json={"messages": [{"role": "user", "content": "x" * 400_000}]},
                         headers={"x-api-key": token})
        body = await r.json()
        assert r.status == 413 and body["type"] == "error" and body["error"]["type"] == "request_too_large"
        for depth in (200, 100_000):  # orjson refuses the deeper one; json would recurse: both are a 400
            deep = b'{"messages": [{"role": "user", "content": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}]}"
            r = await s.post(p.base_url + "/v1/chat/completions", data=deep, headers=h)
            assert r.status == 400 and "nested deeper" in (await r.json())["error"]["message"], depth
        r = await s.get(p.base_url + "/v1/models")
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "policy"
        r = await s.head(p.base_url + "/")
        assert r.status == 200
    assert not model_calls(records)


async def test_context_length_is_a_non_retried_error_per_protocol():
    async with running_proxy(context_len=50) as (p, records, token):
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "word " * 200}])
        assert e.value.body["code"] == "context_length_exceeded"
        # Codex does not retry a 400 (it would re-send the same prompt five times on other errors)
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.create(model="policy", input="word " * 200, stream=True)
        assert e.value.body["code"] == "context_length_exceeded"
    assert records == []


class BrokenEngine:
    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    async def generate(self, input_ids, sampling, *, rid=None):
        from pipeline.serving.engine import EngineUnavailable
        self.calls += 1
        raise EngineUnavailable("HTTP 500: boom")

    def __getattr__(self, k):
        return getattr(self.inner, k)


async def test_engine_error_becomes_a_protocol_error_and_a_call_failed():
    async with running_proxy() as (p, records, token):
        p.engine = BrokenEngine(p.engine)
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=3)
        with pytest.raises(openai.InternalServerError) as e:
            await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        assert "boom" in str(e.value) and "(2 attempts)" in str(e.value)
        assert p.engine.calls == 2  # the proxy's one retry; x-should-retry: false stops the SDK's own retries
        a = sdk_anthropic(p, base_url=p.base_url, api_key=token, max_retries=0)
        with pytest.raises(anthropic.APIStatusError):
            async with a.messages.stream(model="policy", max_tokens=5, messages=[{"role": "user", "content": "x"}]) as s:
                await s.get_final_message()
    assert [type(r).__name__ for r in records] == ["CallStarted", "CallFailed"] * 2
    assert all("boom" in r.reason for r in records if isinstance(r, CallFailed))


async def test_keepalives_while_the_engine_is_slow_and_clients_still_parse():
    script = Script(default=[DONE], latency_s=0.35)
    async with running_proxy(script, keepalive_s=0.1) as (p, _records, token):
        async with aiohttp.ClientSession() as s:
            r = await s.post(p.base_url + "/v1/messages", headers={"x-api-key": token}, json={
                "model": "policy", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "x"}]})
            text = await r.text()
        events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert events[0] == "message_start" and "ping" in events and events[-1] == "message_stop"
        assert events.index("ping") < events.index("content_block_start")
        c = sdk_openai(p, base_url=p.base_url + "/v1", api_key=token, max_retries=0)
        s2 = await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], stream=True)
        assert "".join([ch.choices[0].delta.content or "" async for ch in s2 if ch.choices]) == "Done."
        s3 = await c.responses.create(model="policy", input="x", stream=True)
        kinds = [ev.type async for ev in s3]
        assert kinds[-1] == "response.completed"


def test_labels_from_request_features():
    conv = from_anthropic({"model": "policy", "max_tokens": 5, "messages": [
        {"role": "user", "content": "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\nSummarize."}]})
    assert detect_label("anthropic", {}, {}, conv, "policy-subagent") == "compaction"
    conv = from_anthropic({"model": "policy-subagent", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert detect_label("anthropic", {}, {}, conv, "policy-subagent") == "subagent"
    assert detect_label("anthropic", {"x-claude-code-agent-id": "a1"}, {}, from_anthropic(
        {"model": "policy", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}), "s") == "subagent"
    # cc_is_subagent=true in Claude Code's attribution block, which the rendered prompt leaves out
    body = {"model": "policy", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.2a3; cc_is_subagent=true;"},
        {"type": "text", "text": "You are Claude Code."}]}
    conv = from_anthropic(body)
    assert [m.content for m in conv.messages if m.role == "system"] == ["You are Claude Code."]
    assert detect_label("anthropic", {}, body, conv, "s") == "subagent"
    body["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.2a3;"
    assert detect_label("anthropic", {}, body, conv, "s") == "main"
    plain = from_chat({"messages": [{"role": "user", "content": "x"}]})
    meta = json.dumps({"request_kind": "compaction", "thread_source": "user"})
    assert detect_label("responses", {"x-codex-turn-metadata": meta}, {}, plain, "s") == "compaction"
    meta = json.dumps({"request_kind": "turn", "thread_source": "subagent"})
    assert detect_label("responses", {"x-codex-turn-metadata": meta}, {}, plain, "s") == "subagent"
    assert detect_label("chat", {"x-bridle-call-label": "compaction"}, {}, plain, "s") == "compaction"
    sub = from_chat({"messages": [{"role": "system", "content": "You are a subagent working for a parent agent."},
                                  {"role": "user", "content": "x"}]})
    assert detect_label("chat", {}, {}, sub, "s") == "subagent"
    # OpenClaw's subagent section comes after ~20,000 characters of system prompt
    openclaw = from_chat({"messages": [
        {"role": "system", "content": "You are a personal assistant running inside OpenClaw.\n" + "x" * 19_800
         + "\n## Subagent Context\n# Subagent Context\n\nSubagent spawned by main agent; one specific task."},
        {"role": "user", "content": "[Subagent Task] Create notes.txt."}]})
    assert detect_label("chat", {}, {}, openclaw, "s") == "subagent"
    assert detect_label("chat", {}, {}, plain, "s") == "main"
