"""CallTrace from a converted request and a parsed output."""

import pytest

from pipeline.serving.trace import call_trace, failed
from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.toolparse import ParsedOutput


@pytest.mark.parametrize(("text", "bad"), [
    ("Exit code: 1\nWall time: 0.1 seconds\nOutput:\n", True),
    ("Process exited with code 2", True),
    ("exit code 0\nok", False),
    ("Traceback (most recent call last):\n  File ...", True),
    ("Error: file not found", True),
    ('{"status": "error", "tool": "exec"}', True),
    ("<tool_use_error>File has not been read yet</tool_use_error>", True),
    ("bash: foo: command not found", True),
    ("cat: x: No such file or directory", True),
    ("wrote 12 bytes to out.txt", False),
    ("the error handling looks right", False),  # the word alone, mid-sentence, is not a failure
])
def test_failure_text(text, bad):
    assert failed(text) is bad


def test_trace_of_a_call():
    conv = Conversation(
        tools=[Tool(name="Write"), Tool(name="Bash")],
        messages=[
            Message(role="user", content="do it"),
            Message(role="assistant", tool_calls=[ToolCall(name="Bash", id="a", arguments={"command": "ls"})]),
            Message(role="tool", tool_call_id="a", content="old result, before the last assistant turn",
                    is_error=True),
            Message(role="assistant", tool_calls=[ToolCall(name="Bash", id="b", arguments={"command": "x"}),
                                                  ToolCall(name="Write", id="c", arguments={"file_path": "f"})]),
            Message(role="tool", tool_call_id="b", content="bash: x: command not found"),
            Message(role="tool", tool_call_id="c", content="ok", is_error=False),
        ])
    t = call_trace(conv, ParsedOutput(tool_calls=[ToolCall(name="Write", arguments={"file_path": "a.txt",
                                                                                    "content": "z" * 1000,
                                                                                    "n": 3})]))
    assert t.offered == ["Write", "Bash"]
    assert [(o.name, o.error) for o in t.outcomes] == [("Bash", True), ("Write", False)]
    assert t.output == "tool_calls" and t.uses[0].name == "Write"
    assert t.uses[0].args["file_path"] == "a.txt" and len(t.uses[0].args["content"]) == 300
    assert t.uses[0].args["n"] == "3"


def test_output_kinds():
    conv = Conversation(messages=[Message(role="user", content="hi")])
    assert call_trace(conv, ParsedOutput(text="Done.")).output == "answer"
    assert call_trace(conv, ParsedOutput(text="<tool_call>{oops", malformed=True)).output == "malformed"
    assert call_trace(conv, ParsedOutput()).output == "empty"
    assert call_trace(conv, ParsedOutput()).outcomes == []
