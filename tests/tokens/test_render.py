import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import HFTemplateRenderer, Qwen3Renderer, qwen3_renderer
from pipeline.tokens.tokenizer import HFTokenizer, qwen_hf_folder

IM_START, IM_END, NL, NLNL = 151644, 151645, 198, 271
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
THINK, END_THINK, TOOL_CALL, END_TOOL_CALL, TOOL_RESP, END_TOOL_RESP = (
    151667,
    151668,
    151657,
    151658,
    151665,
    151666,
)

TOOLS_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "bash", "description": "Run a command.", '
    '"parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
BASH = Tool(
    name="bash",
    description="Run a command.",
    parameters={"type": "object", "properties": {"cmd": {"type": "string"}}},
)


@pytest.fixture(scope="module")
def qwen() -> Qwen3Renderer:
    return qwen3_renderer()


@pytest.fixture(scope="module")
def hf_qwen() -> HFTemplateRenderer:
    return HFTemplateRenderer(HFTokenizer(qwen_hf_folder()))


def whole(r, conv, gen=True):
    return r.render_text(conv, add_generation_prompt=gen, causal=False).text


# ------------------------------------------------------------------------------------ exact, by hand
def test_plain_chat_exact_ids(qwen):
    conv = Conversation(
        messages=[Message(role="system", content="hi"), Message(role="user", content="Hello world")]
    )
    assert (
        whole(qwen, conv)
        == "<|im_start|>system\nhi<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = qwen.render_ids(conv).tolist()
    assert ids == [
        IM_START,
        SYSTEM,
        NL,
        6023,
        IM_END,
        NL,
        IM_START,
        USER,
        NL,
        9707,
        1879,
        IM_END,
        NL,
        IM_START,
        ASSISTANT,
        NL,
    ]


def test_generation_prompt_without_thinking():
    r = qwen3_renderer(enable_thinking=False)
    conv = Conversation(messages=[Message(role="user", content="hi")])
    assert r.render_ids(conv).tolist() == [
        IM_START,
        USER,
        NL,
        6023,
        IM_END,
        NL,
        IM_START,
        ASSISTANT,
        NL,
        THINK,
        NLNL,
        END_THINK,
        NLNL,
    ]


def test_tools_in_system_prompt(qwen):
    conv = Conversation(
        tools=[BASH],
        messages=[Message(role="system", content="Be careful."), Message(role="user", content="hi")],
    )
    assert whole(qwen, conv) == (
        "<|im_start|>system\nBe careful.\n\n"
        + TOOLS_TEXT
        + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_sys = Conversation(tools=[BASH], messages=[Message(role="user", content="hi")])
    assert whole(qwen, no_sys).startswith("<|im_start|>system\n# Tools\n")


def test_several_calls_nested_unicode_empty_content_and_tool_group(qwen):
    conv = Conversation(
        messages=[
            Message(role="user", content="go"),
            Message(
                role="assistant",
                content="",
                tool_calls=[
                    ToolCall(name="bash", arguments={"cmd": "ls café"}),
                    ToolCall(name="edit", arguments={"edits": [{"old": "a", "new": "✓", "o": {"n": 1}}]}),
                ],
            ),
            Message(role="tool", content="x"),
            Message(role="tool", content="ok ✓"),
        ]
    )
    assert whole(qwen, conv) == (
        "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls café"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "edit", "arguments": {"edits": [{"old": "a", "new": "✓", "o": {"n": 1}}]}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nx\n</tool_response>\n<tool_response>\nok ✓\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = qwen.render_ids(conv).tolist()
    # the assistant turn starts with <tool_call> right after "assistant\n" (empty content: no newline before it)
    k = ids.index(ASSISTANT)
    assert ids[k : k + 4] == [ASSISTANT, NL, TOOL_CALL, NL]
    assert ids[k + 4 : k + 8] == [4913, 606, 788, 330]  # '{"', 'name', '":', ' "'
    assert ids.count(TOOL_RESP) == 2 and ids.count(END_TOOL_RESP) == 2 and ids.count(END_TOOL_CALL) == 2
    # both results share one user turn
    assert ids.count(USER) == 2


def test_thinking_kept_in_current_turn_dropped_before_last_query(qwen):
    conv = Conversation(
        messages=[
            Message(role="user", content="q1"),
            Message(role="assistant", content="a1", thinking="t1"),
            Message(role="user", content="q2"),
            Message(
                role="assistant", content="a2", thinking="t2", tool_calls=[ToolCall(name="f", arguments={})]
            ),
            Message(role="tool", content="r"),
        ]
    )
    assert whole(qwen, conv) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\nt2\n</think>\n\na2\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # causal rendering (the splicer's) never rewrites an earlier turn: t1 stays
    causal = qwen.render_text(conv).text
    assert "<think>\nt1\n</think>\n\na1" in causal


def test_last_assistant_gets_empty_think_block(qwen):
    conv = Conversation(messages=[Message(role="user", content="q"), Message(role="assistant", content="a")])
    assert whole(qwen, conv, gen=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\na<|im_end|>\n"
    )


def test_think_tags_inside_content_are_split(qwen):
    conv = Conversation(
        messages=[
            Message(role="user", content="q"),
            Message(role="assistant", content="<think>\nhm\n</think>\n\nok"),
            Message(role="user", content="q2"),
        ]
    )
    assert "<|im_start|>assistant\nok<|im_end|>" in whole(qwen, conv)


def test_turn_spans_cover_generation_prompt_to_im_end(qwen):
    conv = Conversation(
        messages=[
            Message(role="user", content="q"),
            Message(role="assistant", content="a"),
            Message(role="tool", content="r"),
            Message(role="assistant", content="b"),
            Message(role="user", content="u"),
        ]
    )
    r = qwen.render_text(conv)
    for t in r.turns:
        span = r.text[t.start : t.end]
        assert span.startswith("<|im_start|>assistant\n") and span.endswith("<|im_end|>")
        assert r.text[t.end] == "\n"
    # the turn after a tool result starts after the tool group's closing <|im_end|>\n
    assert (
        r.text[r.turns[1].start - len("</tool_response><|im_end|>\n") : r.turns[1].start]
        == "</tool_response><|im_end|>\n"
    )


def test_partial_render_matches_suffix(qwen):
    conv = Conversation(
        tools=[BASH],
        messages=[
            Message(role="system", content="s"),
            Message(role="user", content="q"),
            Message(role="assistant", content="", tool_calls=[ToolCall(name="bash", arguments={"cmd": "x"})]),
            Message(role="tool", content="r"),
            Message(role="tool", content="r2"),
            Message(role="assistant", content="done"),
        ],
    )
    full = qwen.render_text(conv)
    for k in range(1, len(conv.messages) + 1):
        head = qwen.render_text(
            Conversation(tools=conv.tools, messages=conv.messages[:k]), add_generation_prompt=False
        )
        tail = qwen.render_text(conv, start=k)
        assert head.text[: head.boundary] + tail.text == full.text


# ----------------------------------------------------------------------------- HF template agreement
def test_hf_folder_template_matches_python_renderer(qwen, hf_qwen):
    conv = Conversation(
        tools=[BASH],
        messages=[
            Message(role="system", content="s"),
            Message(role="user", content="q"),
            Message(
                role="assistant",
                content="x",
                thinking="t",
                tool_calls=[ToolCall(name="bash", arguments={"cmd": "ü"})],
            ),
            Message(role="tool", content="r"),
        ],
    )
    assert hf_qwen.render_text(conv).text == whole(qwen, conv)
    assert np.array_equal(hf_qwen.render_ids(conv), qwen.render_ids(conv))
    assert hf_qwen.generation_prompt == qwen.generation_prompt


def test_hf_template_spans(hf_qwen):
    conv = Conversation(
        messages=[
            Message(role="user", content="q"),
            Message(role="assistant", content="a"),
            Message(role="tool", content="r"),
            Message(role="tool", content="r2"),
            Message(role="assistant", content="b"),
            Message(role="user", content="u"),
        ]
    )
    r = hf_qwen.render_text(conv)
    assert [t.message for t in r.turns] == [1, 4]
    for t in r.turns:
        assert r.text[t.start : t.end].startswith("<|im_start|>assistant\n") and r.text[
            t.start : t.end
        ].endswith("<|im_end|>")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=6,
)
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
call = st.builds(
    ToolCall,
    name=st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
    arguments=st.dictionaries(st.text(max_size=5), json_values, max_size=3),
)
message = st.one_of(
    st.builds(Message, role=st.just("user"), content=text),
    st.builds(Message, role=st.just("system"), content=text),
    st.builds(
        Message, role=st.just("assistant"), content=text, thinking=text, tool_calls=st.lists(call, max_size=3)
    ),
    st.builds(Message, role=st.just("tool"), content=text),
)
conversations = st.builds(
    Conversation,
    messages=st.lists(message, min_size=1, max_size=7),
    tools=st.lists(
        st.builds(
            Tool,
            name=st.from_regex(r"[a-z]{1,6}", fullmatch=True),
            description=text,
            parameters=st.dictionaries(st.text(max_size=4), json_values, max_size=2),
        ),
        max_size=2,
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv=conversations, gen=st.booleans())
def test_python_renderer_equals_jinja_template(qwen, hf_qwen, conv, gen):
    assert (
        qwen.render_text(conv, add_generation_prompt=gen, causal=False).text
        == hf_qwen.render_text(conv, add_generation_prompt=gen).text
    )


def test_tool_json_matches_hf_tojson(qwen):
    t = Tool(name="x", description="ü", parameters={"b": 1, "a": [1, {"c": None}]})
    assert json.dumps(
        {"type": "function", "function": {"name": "x", "description": "ü", "parameters": t.parameters}},
        ensure_ascii=False,
    ) in whole(qwen, Conversation(tools=[t], messages=[Message(role="user", content="q")]))
