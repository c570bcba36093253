"""The teacher engine's mapping to and from Chat Completions, and its answer rendered in the policy's tokens."""

import contextlib
import json

import pytest
from aiohttp import web

from pipeline.serving.engine import EngineBadRequest, EngineSampling, EngineUnavailable
from pipeline.serving.engine_call import run_engine
from pipeline.serving.teacher import TeacherEngine, answer_message, api_key_from, chat_request
from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import load_renderer

CONV = Conversation(
    messages=[
        Message(role="system", content="be brief"),
        Message(role="user", content="write a.txt"),
        Message(role="assistant", content="", thinking="plan", tool_calls=[
            ToolCall(name="write_file", arguments={"path": "a.txt", "content": "hi"}, id="c1"),
            ToolCall(name="shell", arguments="not json", id="")]),
        Message(role="tool", content="ok", tool_call_id="c1"),
        Message(role="tool", content="done"),  # no id (an Anthropic-less harness): the pending call's
    ],
    tools=[Tool(name="write_file", description="w", parameters={"type": "object"}),
           Tool(name="apply_patch", kind="custom")],
)


def test_chat_request_carries_the_conversation():
    body = chat_request(CONV, "teacher-7b", EngineSampling(temperature=0.6, max_new_tokens=99, seed=3))
    assert body["model"] == "teacher-7b" and body["max_tokens"] == 99 and body["seed"] == 3
    assert body["temperature"] == 0.6 and body["stream"] is False
    sys_, user, asst, t1, t2 = body["messages"]
    assert sys_ == {"role": "system", "content": "be brief"} and user["content"] == "write a.txt"
    assert asst["content"] is None
    assert asst["tool_calls"][0] == {"id": "c1", "type": "function", "function": {
        "name": "write_file", "arguments": json.dumps({"path": "a.txt", "content": "hi"})}}
    assert asst["tool_calls"][1]["function"]["arguments"] == "not json"
    assert t1 == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    assert t2["tool_call_id"] == asst["tool_calls"][1]["id"] == "call_2_1"
    assert body["tools"][1]["function"]["parameters"]["required"] == ["input"]


def test_answer_message_reads_text_reasoning_and_calls():
    msg, finish = answer_message({"choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "x", "function": {"name": "write_file", "arguments": '{"path": "b"}'}},
                       {"id": "y", "function": {"name": "shell", "arguments": "{broken"}}]}}]})
    assert finish == "stop" and msg.thinking == "think" and msg.content == ""
    assert msg.tool_calls[0].arguments == {"path": "b"} and msg.tool_calls[1].arguments == "{broken"
    assert answer_message({"choices": [{"finish_reason": "length", "message": {"content": "a"}}]})[1] == "length"


def test_api_key_names_the_missing_variable(monkeypatch):
    monkeypatch.delenv("BRIDLE_TEST_NO_SUCH_KEY", raising=False)
    assert api_key_from("") == ""
    with pytest.raises(ValueError, match="BRIDLE_TEST_NO_SUCH_KEY"):
        api_key_from("BRIDLE_TEST_NO_SUCH_KEY")


@contextlib.asynccontextmanager
async def endpoint():
    """A real Chat Completions endpoint on a local port: the first call answers with a tool call, later ones fail
    with HTTP 500."""
    seen = []

    async def chat(request):
        seen.append((request.headers.get("Authorization"), await request.json()))
        if len(seen) == 1:
            return web.json_response({"choices": [{"finish_reason": "tool_calls", "message": {
                "content": "", "tool_calls": [{"id": "q", "function": {
                    "name": "write_file", "arguments": '{"path": "a.txt", "content": "hi"}'}}]}}]})
        return web.json_response({"error": "down"}, status=500)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1", seen
    finally:
        await runner.cleanup()


@pytest.mark.anyio
async def test_the_answer_is_the_policys_tokens_and_errors_are_engine_errors():
    renderer = load_renderer("qwen3")
    async with endpoint() as (url, seen):
        teacher = TeacherEngine(renderer, url, "t", api_key="k")
        sampling = EngineSampling(max_new_tokens=200, stop_token_ids=(renderer.tokenizer.encode("<|im_end|>")[0],))
        try:
            res, err = await run_engine(teacher, [1, 2, 3], sampling, "r|c", 0, CONV)
            assert err is None and res is not None
            want = renderer.turn_text(Message(role="assistant", tool_calls=[
                ToolCall(name="write_file", arguments={"path": "a.txt", "content": "hi"}, id="q")]))
            assert renderer.tokenizer.decode(res.output_ids) == want
            assert res.logprobs == [0.0] * len(res.output_ids) and res.finish_reason == "stop"
            assert res.matched_stop == res.output_ids[-1] and res.prompt_tokens == 3
            assert seen[0][0] == "Bearer k" and seen[0][1]["messages"][1]["content"] == "write a.txt"
            with pytest.raises(EngineUnavailable, match="HTTP 500"):
                await teacher.answer(CONV, [1], sampling, rid="r|d")
            res, err = await run_engine(teacher, [1], sampling, "r|e", 1, CONV)  # asked again, then told
            assert res is None and err[0] == "server" and "2 attempts" in err[1]
            with pytest.raises(EngineBadRequest):
                await teacher.generate([1], sampling)
        finally:
            await teacher.aclose()
