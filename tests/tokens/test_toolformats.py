"""The tool-call format registry: each format parsed from what ITS OWN chat template writes (local fixture folders
modelled on the public templates, tests/tokens/templates), detection, malformed output, the splicer's path, and the
start-up template check on those folders."""

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import HFTemplateRenderer, load_renderer, qwen3_renderer
from pipeline.tokens.splice import Splicer
from pipeline.tokens.template_check import TemplateMismatch, check_template, startup_check
from pipeline.tokens.templates import QWEN3_CHAT_TEMPLATE
from pipeline.tokens.toolparse import FORMATS, detect_tool_format, tool_format
from tests.helpers.model_folders import broken_chatml, model_folder, template

BASH = Tool(name="bash", description="Run a command.",
            parameters={"type": "object", "properties": {"command": {"type": "string"}}})
READ = Tool(name="read_file", description="Read a file.",
            parameters={"type": "object", "properties": {"path": {"type": "string"}}})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama3": model_folder(root / "llama3", "llama3", template("llama3_json")),
        "mistral": model_folder(root / "mistral", "mistral", template("mistral_v3")),
        "chatml": model_folder(root / "chatml", "chatml", QWEN3_CHAT_TEMPLATE),
    }


def renderer(folders, family: str) -> HFTemplateRenderer:
    r = load_renderer(str(folders[family]))
    assert isinstance(r, HFTemplateRenderer)
    return r


def agent_conv(calls_per_turn: list[list[ToolCall]], ids: list[list[str]]) -> Conversation:
    """system, user, then per turn: assistant with calls + one result per call; a final answer."""
    msgs = [Message(role="system", content="You are an agent."), Message(role="user", content="Look at café/ ✓")]
    for calls, cids in zip(calls_per_turn, ids, strict=True):
        calls = [msgspec.structs.replace(c, id=i) for c, i in zip(calls, cids, strict=True)]
        msgs.append(Message(role="assistant", content="", tool_calls=calls))
        msgs += [Message(role="tool", tool_call_id=c.id, name=c.name, content=f"result of {c.name}") for c in calls]
    msgs.append(Message(role="assistant", content="Done."))
    return Conversation(messages=msgs, tools=[BASH, READ])


# ----------------------------------------------------------------------------------------- detection
def test_detects_each_family_from_its_template_and_config(folders):
    assert renderer(folders, "llama3").tool_format.name == "llama3_json"
    assert renderer(folders, "mistral").tool_format.name == "mistral"
    assert renderer(folders, "chatml").tool_format.name == "hermes"
    assert qwen3_renderer().tool_format.name == "hermes"
    # no marker in the template: config.json's model_type decides; nothing known: hermes
    assert detect_tool_format("{{ messages }}", {"model_type": "mistral"})[0] == "mistral"
    assert detect_tool_format("{{ messages }}", {"model_type": "llama"})[0] == "llama3_json"
    assert detect_tool_format("{{ messages }}", {})[0] == "hermes"
    # a Llama fine-tune with a Hermes template (Hermes-3-Llama-3.1) writes Hermes calls
    assert detect_tool_format("... <tool_call> ...", {"model_type": "llama"})[0] == "hermes"


def test_explicit_tool_format_overrides_detection(folders):
    r = load_renderer(str(folders["llama3"]), tool_format="hermes")
    assert r.tool_format.name == "hermes" and r.tool_format_reason == "set explicitly"
    with pytest.raises(ValueError, match="tool_format: unknown tool-call format 'nope'; known: hermes"):
        load_renderer(str(folders["llama3"]), tool_format="nope")


# ------------------------------------------------------------- each format through its own template
def _spans(r: HFTemplateRenderer, conv: Conversation) -> list[str]:
    """The model-side text of every assistant turn as the template renders the whole conversation."""
    rt = r.render_text(conv, add_generation_prompt=False, causal=False)
    assert rt is not None
    out = [rt.text[t.start : t.end] for t in rt.turns]
    assert len(out) == sum(m.role == "assistant" for m in conv.messages)
    assert all(s.startswith(r.generation_prompt) for s in out)
    return [s[len(r.generation_prompt) :] for s in out]


def test_llama3_json_calls_through_the_llama_template(folders):
    r = renderer(folders, "llama3")
    calls = [[ToolCall(name="bash", arguments={"command": "ls -la café"})],
             [ToolCall(name="read_file", arguments={"path": "a/b.py", "opts": {"n": [1, 2]}})]]
    conv = agent_conv(calls, [["call_1"], ["call_2"]])
    texts = _spans(r, conv)
    assert texts[0] == '{"name": "bash", "parameters": {"command": "ls -la café"}}<|eot_id|>'
    parsed = [r.tool_format.parse(t) for t in texts]
    assert [p.tool_calls for p in parsed[:2]] == [[ToolCall(name=c[0].name, arguments=c[0].arguments)] for c in calls]
    assert parsed[2].text == "Done." and not parsed[2].tool_calls
    assert not any(p.malformed for p in parsed)
    # through the renderer (decode of the sampled ids, stop token dropped)
    ids = r.tokenizer.encode(texts[1])
    assert r.parse(ids).tool_calls[0].arguments == {"path": "a/b.py", "opts": {"n": [1, 2]}}
    # Meta's template refuses two calls in one turn: the format says so, the check plays one call per turn
    assert r.tool_format.parallel_calls is False
    two = agent_conv([calls[0] + calls[1]], [["call_1", "call_2"]])
    with pytest.raises(Exception, match="only supports single tool-calls"):
        r.render_text(two)


def test_mistral_calls_through_the_mistral_template(folders):
    r = renderer(folders, "mistral")
    calls = [ToolCall(name="bash", arguments={"command": "ls -la café"}),
             ToolCall(name="read_file", arguments={"path": "x.py"})]
    ids = ["a1B2c3D4e", "Zz9Yy8Xx7"]
    conv = agent_conv([calls], [ids])
    conv = msgspec.structs.replace(conv, messages=conv.messages[1:])  # no system prompt: see the check test below
    texts = _spans(r, conv)
    assert texts[0] == ('[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls -la café"}, "id": "a1B2c3D4e"}, '
                        '{"name": "read_file", "arguments": {"path": "x.py"}, "id": "Zz9Yy8Xx7"}]</s>')
    p = r.tool_format.parse(texts[0])
    assert p.tool_calls == [msgspec.structs.replace(c, id=i) for c, i in zip(calls, ids, strict=True)]
    assert p.text == "" and not p.malformed
    final = r.tool_format.parse(texts[1])
    assert final.text == "Done." and not final.tool_calls
    # a call without an id (what the model usually writes) gets one the template accepts back
    q = r.parse(r.tokenizer.encode('[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}}]</s>'))
    (c,) = q.tool_calls
    assert len(c.id) == 9 and c.id.isalnum()
    history = Conversation(messages=[*conv.messages[:1], Message(role="assistant", tool_calls=[c]),
                                     Message(role="tool", tool_call_id=c.id, content="ok")], tools=conv.tools)
    assert r.render_text(history) is not None


def test_hermes_calls_through_the_qwen3_template(folders):
    r = renderer(folders, "chatml")
    calls = [ToolCall(name="bash", arguments={"command": "ls"}), ToolCall(name="read_file", arguments={"path": "é"})]
    conv = agent_conv([calls], [["call_1", "call_2"]])
    texts = _spans(r, conv)
    p = r.tool_format.parse(texts[0])
    assert p.tool_calls == calls and not p.malformed


# ----------------------------------------------------------------------------------------- malformed
@pytest.mark.parametrize(("fmt", "text", "calls", "malformed"), [
    ("llama3_json", "Sure, the answer is 4.", 0, False),
    ("llama3_json", '{"answer": 4}', 0, False),  # JSON, but no call: an answer
    ("llama3_json", '{"name": "bash", "parameters": {"command": "ls"}', 0, True),  # cut off
    ("llama3_json", '{"name": "bash", "parameters": [1]}', 0, True),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")<|eom_id|>', 0, True),  # built-in tools: Python
    ("llama3_json", '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}<|eom_id|>', 1, False),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', 2, False),
    ("llama3_json", '{"name": "a", "parameters": {}} and then some', 0, True),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"}", 0, True),
    ("mistral", '[TOOL_CALLS] {"name": "bash", "arguments": {}}', 0, True),  # not an array
    ("mistral", "[TOOL_CALLS]bash[ARGS]{}", 0, True),  # v11 format: not this one
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]', 0, True),
    ("mistral", ' Hello there. ', 0, False),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', 1, False),
])
def test_each_format_keeps_malformed_output_as_text(fmt, text, calls, malformed):
    p = tool_format(fmt).parse(text)
    assert len(p.tool_calls) == calls
    assert p.malformed is malformed
    if malformed:
        assert p.errors and p.text.strip()  # what the model wrote stays visible to the harness


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.sampled_from(list('{}[]":;, abn\n') + [
    "[TOOL_CALLS]", "<|python_tag|>", "<tool_call>", "</tool_call>", "<think>", "</think>", '"name"', '"arguments"',
    "<|eot_id|>", "</s>"]), max_size=30).map("".join))
def test_no_format_ever_raises(fmt, text):
    p = tool_format(fmt).parse(text)
    assert isinstance(p.text, str)


# ------------------------------------------------------------------------------------ round trips
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-999, 999) | st.text(max_size=8),
                           lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                                                       max_size=3), max_leaves=6)
call_st = st.builds(ToolCall, name=names, arguments=st.dictionaries(st.text(max_size=6), json_values, max_size=3))


@pytest.mark.parametrize(("family", "most"), [("llama3", 1), ("mistral", 3), ("chatml", 3)])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parse_reads_back_what_the_template_writes(folders, family, most, data):
    r = renderer(folders, family)
    calls = data.draw(st.lists(call_st, min_size=1, max_size=most))
    msg = Message(role="assistant", content="", tool_calls=calls)
    p = r.parse(r.tokenizer.encode(r.turn_text(msg)))
    assert [(c.name, c.arguments) for c in p.tool_calls] == [(c.name, json.loads(json.dumps(c.arguments)))
                                                              for c in calls]
    assert not p.malformed


# ------------------------------------------------------------------------ the splicer uses the registry
def test_splicer_records_and_splices_llama_calls(folders):
    r = renderer(folders, "llama3")
    sp = Splicer(r)
    conv = Conversation(messages=[Message(role="user", content="list files")], tools=[BASH])
    first = sp.render(conv)
    # the model's own spacing, which the template would not reproduce: only splicing keeps these ids
    out = np.asarray(r.tokenizer.encode('{"name":"bash","parameters":{"command":"ls"}}<|eot_id|>'), dtype=np.int32)
    parsed = r.parse(out)
    assert parsed.tool_calls == [ToolCall(name="bash", arguments={"command": "ls"})]
    sp.record(parsed, out)
    # the harness sends the call back re-serialized, with the id the proxy gave it
    back = Message(role="assistant", tool_calls=[ToolCall(id="call_9", name="bash", arguments='{"command": "ls"}')])
    nxt = sp.render(Conversation(messages=[*conv.messages, back,
                                           Message(role="tool", tool_call_id="call_9", content="a.txt")],
                                 tools=[BASH]))
    assert nxt.spliced_turns == [1]
    assert np.array_equal(nxt.ids[: len(first.ids) + len(out)], np.concatenate([first.ids, out]))


# ------------------------------------------------------------------------------------- the check
def test_check_passes_llama_and_hermes_templates(folders):
    for family in ("llama3", "chatml"):
        report = check_template(renderer(folders, family))
        assert report.ok, report.describe()
        assert report.calls >= 7


def test_check_refuses_mistral_v3_system_prompt_that_moves(folders):
    # Mistral-7B-Instruct-v0.3's template shows the system prompt only while a user message is the last one: the
    # prompt a call answered is not the start of the conversation once the answer follows it
    report = check_template(renderer(folders, "mistral"))
    assert not report.ok
    kinds = {d.kind for d in report.mismatches}
    assert kinds == {"history"}
    d = report.mismatches[0]
    assert "You are a coding agent" in d.expected_text and "Fix the failing test" in d.got_text
    assert d.expected_ids and d.got_ids and d.expected_ids != d.got_ids


def test_check_refuses_a_template_that_renders_history_differently(tmp_path):
    r = load_renderer(str(model_folder(tmp_path / "broken", "chatml", broken_chatml())))
    with pytest.raises(TemplateMismatch) as e:
        startup_check(r, "error")
    report = e.value.report
    (d,) = report.mismatches
    assert d.kind == "whole" and d.conversation == 0 and d.name.startswith("agent")
    assert d.expected_tokens[3] == "<tool_call>" and "".join(d.got_tokens[3:7]) == "Let "
    text = str(e.value)
    assert "first difference at token" in text and "Let me look." in text and str(d.got_ids) in text
    assert "accepted difference" in text  # the chat sample's dropped (empty) thinking, counted not shown
    warned = startup_check(r, "warn")  # warn: logs and returns, never raises
    assert warned is not None and not warned.ok


def test_wrong_tool_format_is_a_mismatch(folders):
    report = check_template(load_renderer(str(folders["chatml"]), tool_format="llama3_json"))
    assert [d.kind for d in report.mismatches] == ["parse"]
    assert "'llama3_json' tool-call parser read [] " in report.mismatches[0].detail
    # hermes plays two calls in a turn, which Meta's template refuses: the template's own error is the report
    report = check_template(load_renderer(str(folders["llama3"]), tool_format="hermes"))
    assert [d.kind for d in report.mismatches] == ["error"]
    assert "only supports single tool-calls" in report.mismatches[0].detail
