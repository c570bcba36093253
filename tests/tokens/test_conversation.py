import pytest

from pipeline.tokens.conversation import IMAGE_PLACEHOLDER, Message, RequestedSampling, Tool, ToolCall
from pipeline.tokens.from_wire import ConversionError, from_anthropic, from_chat, from_responses


# ----------------------------------------------------------------------------------- chat completions
def test_chat_tool_history_developer_and_sampling():
    body = {
        "model": "policy",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 512,
        "max_tokens": 99,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": "END",
        "messages": [
            {"role": "developer", "content": "Be terse."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look at"},
                    {"type": "image_url", "image_url": {"url": "data:"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read", "arguments": '{"path": "a.py"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "bash", "arguments": "not json"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "err"}]},
            {"role": "assistant", "content": "done", "reasoning_content": "checked"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "read", "description": "Read a file", "parameters": {"type": "object"}},
            },
        ],
    }
    c = from_chat(body)
    assert c.protocol == "chat" and c.model == "policy"
    assert c.sampling == RequestedSampling(max_tokens=512, temperature=0.7, top_p=0.9, stop=["END"], stream=True)
    assert [m.role for m in c.messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert c.messages[0].content == "Be terse."
    assert c.messages[1].content == "look at\n" + IMAGE_PLACEHOLDER and c.messages[1].images == 1
    assert c.messages[2].tool_calls == [
        ToolCall(id="call_1", name="read", arguments={"path": "a.py"}),
        ToolCall(id="call_2", name="bash", arguments="not json"),
    ]
    assert c.messages[3] == Message(role="tool", content="print(1)", tool_call_id="call_1", name="read")
    assert c.messages[4].name == "bash" and c.messages[4].content == "err"
    assert c.messages[5].thinking == "checked"
    assert c.tools == [Tool(name="read", description="Read a file", parameters={"type": "object"})]


def test_chat_errors_name_the_field():
    with pytest.raises(ConversionError, match=r"messages\[0\]\.role"):
        from_chat({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(ConversionError, match="messages"):
        from_chat({})
    with pytest.raises(ConversionError, match="temperature"):
        from_chat({"messages": [], "temperature": "hot"})
    with pytest.raises(ConversionError, match=r"tool_calls\[0\]\.function"):
        from_chat({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]})


# ---------------------------------------------------------------------------------- anthropic / claude code
CLAUDE_CODE_BODY = {
    "model": "policy",
    "max_tokens": 64000,
    "stream": True,
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": "u"},
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ],
    "tools": [
        {
            "name": "Bash",
            "description": "Run bash",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                {"type": "text", "text": "Fix the bug", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look first.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "cat a"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a\nb"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "is_error": True,
                    "content": [
                        {"type": "text", "text": "cat: a: No such file"},
                        {"type": "image", "source": {"type": "base64"}},
                    ],
                },
                {"type": "text", "text": "<system-reminder>todo list empty</system-reminder>"},
            ],
        },
        {"role": "system", "content": "Context was cleared."},
        {"role": "assistant", "content": "Done."},
    ],
    "stop_sequences": ["</stop>"],
    "temperature": 1,
    "top_k": 40,
}


def test_claude_code_fingerprint_never_splits_prompts():
    # Claude Code's attribution block carries a fingerprint of the first user message: two tasks' requests differ
    # there and nowhere else in the system prompt, so with it rendered no two tasks would share a prefix
    import copy

    other = copy.deepcopy(CLAUDE_CODE_BODY)
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.6bd; cc_entrypoint=sdk-cli;"
    assert from_anthropic(other) == from_anthropic(CLAUDE_CODE_BODY)
    plain = copy.deepcopy(CLAUDE_CODE_BODY)  # a plain string system prompt is the client's, kept whole
    plain["system"] = "x-anthropic-billing-header: said as text"
    assert from_anthropic(plain).messages[0].content == "x-anthropic-billing-header: said as text"


def test_anthropic_claude_code_shape():
    c = from_anthropic(CLAUDE_CODE_BODY)
    assert c.protocol == "anthropic"
    assert c.sampling == RequestedSampling(max_tokens=64000, temperature=1.0, top_k=40, stop=["</stop>"], stream=True)
    roles = [m.role for m in c.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user", "system", "assistant"]
    # the attribution block (a fingerprint of the first user message) is metadata: the policy never sees it
    assert c.messages[0].content == "You are Claude Code."
    assert c.messages[1].content == "<system-reminder>ctx</system-reminder>\nFix the bug"
    a = c.messages[2]
    assert a.thinking == "Look first." and a.content == "Checking."
    assert a.tool_calls == [
        ToolCall(id="toolu_1", name="Bash", arguments={"command": "ls"}),
        ToolCall(id="toolu_2", name="Bash", arguments={"command": "cat a"}),
    ]
    assert c.messages[3] == Message(role="tool", content="a\nb", tool_call_id="toolu_1", name="Bash")
    assert c.messages[4].is_error and c.messages[4].content == "cat: a: No such file\n" + IMAGE_PLACEHOLDER
    assert c.messages[4].images == 1
    assert c.messages[5].content == "<system-reminder>todo list empty</system-reminder>"
    assert c.messages[6].content == "Context was cleared."
    assert c.messages[7].content == "Done."
    assert [t.name for t in c.tools] == ["Bash"]  # the hosted web_search tool is not ours to call
    assert c.tools[0].parameters["properties"]["command"] == {"type": "string"}


def test_anthropic_plain_strings_and_errors():
    c = from_anthropic({"system": "S", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert [(m.role, m.content) for m in c.messages] == [("system", "S"), ("user", "hi")]
    with pytest.raises(ConversionError, match=r"messages\[0\]\.content\[0\]\.name"):
        from_anthropic(
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]}
        )
    with pytest.raises(ConversionError, match="max_tokens"):
        from_anthropic({"messages": [], "max_tokens": "lots"})


# ------------------------------------------------------------------------------------- responses / codex
CODEX_BODY = {
    "model": "policy",
    "instructions": "You are Codex.",
    "stream": True,
    "store": False,
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "k",
    "client_metadata": {"x-codex-turn-metadata": "{}"},
    "tools": [
        {
            "type": "function",
            "name": "shell",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "array"}}},
        },
        {
            "type": "namespace",
            "name": "multi_agent_v1",
            "description": "agents",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn_agent",
                    "description": "Spawn",
                    "parameters": {"type": "object"},
                },
                {"type": "function", "name": "wait", "parameters": {"type": "object"}},
            ],
        },
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Patch files",
            "format": {"type": "grammar"},
        },
        {"type": "web_search"},
    ],
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "<permissions>full</permissions>"}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "<environment_context/>"},
                {"type": "input_text", "text": "Fix it"},
            ],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "Plan: look."}],
            "encrypted_content": "gAAA",
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
        },
        {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_1"},
        {
            "type": "function_call",
            "name": "spawn_agent",
            "namespace": "multi_agent_v1",
            "arguments": "{}",
            "call_id": "call_2",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "agent 7"}],
        },
        {
            "type": "reasoning",
            "id": "rs_2",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Patch now."}],
        },
        {"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch", "call_id": "call_3"},
        {"type": "custom_tool_call_output", "call_id": "call_3", "output": "ok"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"role": "user", "content": "thanks"},
    ],
}


def test_responses_codex_shape():
    c = from_responses(CODEX_BODY)
    assert c.protocol == "responses" and c.sampling.stream
    roles = [m.role for m in c.messages]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool", "assistant", "tool", "user"]
    assert c.messages[0].content == "You are Codex."
    assert c.messages[1].content == "<permissions>full</permissions>"
    assert c.messages[2].content == "<environment_context/>\nFix it"
    a = c.messages[3]
    assert a.thinking == "Plan: look." and a.content == "Looking."
    assert a.tool_calls == [
        ToolCall(id="call_1", name="shell", arguments={"command": ["ls"]}),
        ToolCall(id="call_2", name="multi_agent_v1__spawn_agent", arguments={}),
    ]
    assert c.messages[4] == Message(role="tool", content="a.py", tool_call_id="call_1", name="shell")
    assert c.messages[5].content == "agent 7" and c.messages[5].name == "multi_agent_v1__spawn_agent"
    b = c.messages[6]
    assert b.thinking == "Patch now." and b.tool_calls == [
        ToolCall(id="call_3", name="apply_patch", arguments={"input": "*** Begin Patch"})
    ]
    assert c.messages[8].content == "thanks"
    names = [t.name for t in c.tools]
    assert names == ["shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait", "apply_patch"]
    assert c.tool("apply_patch").kind == "custom"
    assert c.wire_tool("multi_agent_v1__spawn_agent") == ("multi_agent_v1", "spawn_agent")
    assert c.wire_tool("shell") == ("", "shell")


def test_responses_string_input_sampling_and_errors():
    c = from_responses({"input": "hello", "max_output_tokens": 100, "temperature": 0.2})
    assert [(m.role, m.content) for m in c.messages] == [("user", "hello")]
    assert c.sampling == RequestedSampling(max_tokens=100, temperature=0.2)
    with pytest.raises(ConversionError, match=r"input\[0\]"):
        from_responses({"input": [{"content": "no type or role"}]})
    with pytest.raises(ConversionError, match=r"input\[0\]\.name"):
        from_responses({"input": [{"type": "function_call", "arguments": "{}", "call_id": "c"}]})


def test_responses_reasoning_after_calls_starts_new_turn():
    c = from_responses(
        {
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "name": "a", "arguments": "{}", "call_id": "1"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "next"}]},
                {"type": "function_call", "name": "b", "arguments": "{}", "call_id": "2"},
            ]
        }
    )
    assert [m.role for m in c.messages] == ["user", "assistant", "assistant"]
    assert c.messages[2].thinking == "next" and c.messages[2].tool_calls[0].name == "b"
