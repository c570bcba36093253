import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tokens.conversation import Message, ToolCall
from pipeline.tokens.render import Qwen3Renderer
from pipeline.tokens.tokenizer import Tokenizer
from pipeline.tokens.toolparse import parse_output, split_thinking


def test_text_only():
    p = parse_output("Hello there.<|im_end|>")
    assert (p.text, p.thinking, p.tool_calls, p.malformed) == ("Hello there.", "", [], False)


def test_thinking_then_text():
    p = parse_output("<think>\nLet me think.\nMore.\n</think>\n\nAnswer: 4<|im_end|>")
    assert p.thinking == "Let me think.\nMore."
    assert p.text == "Answer: 4"


def test_thinking_opened_by_prompt():
    # templates that put <think> in the generation prompt: the output starts inside the thinking
    assert split_thinking("plan\n</think>\n\nok") == ("plan", "ok")


def test_unclosed_thinking_is_thinking():
    p = parse_output("<think>\nstill going")
    assert p.thinking == "still going" and p.text == ""


def test_one_call_with_text():
    p = parse_output(
        'Let me check.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    )
    assert p.text == "Let me check."
    assert p.tool_calls == [ToolCall(name="bash", arguments={"command": "ls -la"})]
    assert not p.malformed


def test_several_calls_nested_unicode():
    out = (
        "<think>\nplan\n</think>\n\n"
        '<tool_call>\n{"name": "edit", "arguments": {"path": "café/ü.py", "edits": [{"old": "a", "new": "✓", '
        '"opts": {"n": 1, "flags": [true, null]}}]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "echo \\"</tool_call>\\" 🤖"}}\n</tool_call><|im_end|>'
    )
    p = parse_output(out)
    assert p.thinking == "plan"
    assert p.text == ""
    assert [c.name for c in p.tool_calls] == ["edit", "bash"]
    assert p.tool_calls[0].arguments["edits"][0]["opts"] == {"n": 1, "flags": [True, None]}
    assert p.tool_calls[0].arguments["path"] == "café/ü.py"
    assert p.tool_calls[1].arguments == {"command": 'echo "</tool_call>" 🤖'}
    assert not p.malformed


def test_string_arguments_and_parameters_alias():
    p = parse_output('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>')
    assert p.tool_calls == [ToolCall(name="f", arguments={"x": 1})]
    p = parse_output('<tool_call>\n{"name": "f", "parameters": {"y": 2}}\n</tool_call>')
    assert p.tool_calls == [ToolCall(name="f", arguments={"y": 2})]
    p = parse_output('<tool_call>\n{"name": "f"}\n</tool_call>')
    assert p.tool_calls == [ToolCall(name="f", arguments={})]


def test_malformed_json_stays_text_with_flag():
    raw = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>'
    p = parse_output("I will run it.\n" + raw + "<|im_end|>")
    assert p.malformed
    assert p.tool_calls == []
    assert p.text == "I will run it.\n" + raw
    assert p.errors and "invalid JSON" in p.errors[0]


def test_malformed_next_to_good_call():
    good = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    bad = "<tool_call>\nnot json\n</tool_call>"
    p = parse_output(good + "\n" + bad)
    assert p.tool_calls == [ToolCall(name="a", arguments={})]
    assert p.malformed and p.text == bad


def test_missing_name_and_non_object():
    assert parse_output('<tool_call>\n{"arguments": {}}\n</tool_call>').malformed
    assert parse_output("<tool_call>\n[1, 2]\n</tool_call>").malformed
    assert parse_output('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>').malformed


def test_cut_off_call():
    p = parse_output('ok\n<tool_call>\n{"name": "bash", "argu')
    assert p.malformed and p.tool_calls == []
    assert p.text == 'ok\n<tool_call>\n{"name": "bash", "argu'


def test_never_raises_on_garbage():
    for s in [
        "",
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think></think>",
        "<tool_call></tool_call>" * 3,
    ]:
        parse_output(s)


# ------------------------------------------------------------------------------------------ properties
json_scalars = st.none() | st.booleans() | st.integers(-(10**9), 10**9) | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
calls = st.lists(
    st.builds(ToolCall, name=names, arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
    max_size=4,
)
texts = st.text(max_size=40).filter(
    lambda s: "<tool_call>" not in s and "</think>" not in s and "<think>" not in s
)


class _NoTok(Tokenizer):
    stop_ids = ()


@settings(max_examples=100, deadline=None)
@given(calls=calls, text=texts, thinking=texts)
def test_parse_render_roundtrip(calls, text, thinking):
    r = Qwen3Renderer(_NoTok())
    body = r.assistant_body(
        Message(role="assistant", content=text, thinking=thinking, tool_calls=calls), True
    )
    out = body[len("<|im_start|>assistant\n") :]
    p = parse_output(out)
    assert p.tool_calls == [
        ToolCall(name=c.name, arguments=json.loads(json.dumps(c.arguments))) for c in calls
    ]
    assert not p.malformed
    if calls:
        assert p.text == text.strip("\n")
    else:
        assert p.text == text.lstrip("\n")
    assert p.thinking == thinking.strip("\n")


def test_a_tool_call_nested_past_any_decoder_is_an_unparsed_call_not_an_exception():
    # A policy can write this; Python's json recurses (RecursionError) and orjson stops at 255 levels on encoding.
    for depth in (100, 50_000):
        args = "[" * depth + "]" * depth
        for call in (f'{{"name": "f", "arguments": {{"a": {args}}}}}', f'{{"name": "f", "arguments": "{args}"}}'):
            out = parse_output(f"<tool_call>\n{call}\n</tool_call>")
            assert out.tool_calls == [] and out.malformed, (depth, out.errors)
    ok = parse_output('<tool_call>\n{"name": "f", "arguments": {"a": [[[1]]]}}\n</tool_call>')
    assert ok.tool_calls[0].arguments == {"a": [[[1]]]}
