"""The white-box harness's parts one by one: the SSE stream parser, tool arguments, observations, turn groups, the
tools against a workspace and the tool spec. Whole scripted episodes: test_whitebox.py."""

from __future__ import annotations

import io
import json

import pytest

from harness_images.whitebox.agent.client import assemble_stream, iter_sse_data
from harness_images.whitebox.agent.components import SYSTEM_PROMPTS, TOOLS_SPEC
from harness_images.whitebox.agent.context import turn_groups
from harness_images.whitebox.agent.errors import ApiError, ToolError
from harness_images.whitebox.agent.observe import observe
from harness_images.whitebox.agent.tools import ToolResult, Tools, parse_arguments
from pipeline.rollout.harness_space import CANONICAL_TOOLS


# ------------------------------------------------------------------------------------------ stream parsing
def sse(*frames: str) -> io.BytesIO:
    return io.BytesIO("".join(frames).encode())


def test_sse_assembles_interleaved_tool_call_fragments():
    def chunk(d: dict, fin: str | None = None) -> str:
        return (
            "data: "
            + json.dumps({"id": "x", "choices": [{"index": 0, "delta": d, "finish_reason": fin}]})
            + "\r\n\r\n"
        )

    stream = sse(
        ": keepalive\n\n",
        chunk({"role": "assistant", "content": ""}),
        "event: ignored\n" + chunk({"content": "Let me "}),
        ": keepalive\n\n",
        chunk({"content": "look."}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "bash", "arguments": ""},
                    }
                ]
            }
        ),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"pa'},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command": '}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": 'th": "a"}'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]}),
        chunk({}, "tool_calls"),
        'data: {"id": "x", "choices": [], "usage": {"total_tokens": 3}}\n\n',
        "data: [DONE]\n\n",
    )
    got = assemble_stream(iter_sse_data(stream))
    assert got.content == "Let me look."
    assert got.tool_calls == [
        {"id": "c0", "name": "bash", "arguments": '{"command": "ls"}'},
        {"id": "c1", "name": "read_file", "arguments": '{"path": "a"}'},
    ]
    assert got.finish_reason == "tool_calls" and got.usage == {"total_tokens": 3}


def test_sse_joins_multiline_data():
    assert list(iter_sse_data(sse('data: {"a":\ndata: 1}\n\n', ": c\n\n"))) == ['{"a":\n1}']


@pytest.mark.parametrize(
    "frames,msg",
    [
        (['data: {"error": {"message": "boom"}}\n\n'], "boom"),
        (['data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'], "before \\[DONE\\]"),
        (["data: not json\n\n"], "not JSON"),
    ],
)
def test_sse_failures_are_retryable_api_errors(frames, msg):
    with pytest.raises(ApiError, match=msg) as e:
        assemble_stream(iter_sse_data(sse(*frames)))
    assert e.value.retryable


# ------------------------------------------------------------------------------------------ pieces
@pytest.mark.parametrize(
    "raw,msg",
    [
        ('{"path": ', "not valid JSON"),
        ("[1]", "JSON object"),
        ("{}", "missing \\['path'\\]"),
        ('{"path": "a", "mode": "r"}', "unexpected \\['mode'\\]"),
        ('{"path": 3}', "must be strings"),
    ],
)
def test_bad_arguments_are_tool_errors(raw, msg):
    with pytest.raises(ToolError, match=msg):
        parse_arguments(raw, ["path"])


def test_observation_keeps_the_result_unchanged():
    result = ToolResult("line 1\nline 2", True, 0)
    raw, infra, meta = (observe(level, result, "tool_a7", 3, 12) for level in range(3))
    assert raw == result.output
    assert result.output in infra and infra.startswith("[sandbox-runner] job 0003")
    assert (
        meta.endswith("--- output ---\nline 1\nline 2") and "exit_code: 0" in meta and "tool: tool_a7" in meta
    )


def test_turn_groups_keep_tool_results_with_their_call():
    body = [
        {"role": "user", "content": "summary"},
        {"role": "assistant", "tool_calls": [1]},
        {"role": "tool"},
        {"role": "tool"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "check"},
    ]
    assert [len(g) for g in turn_groups(body)] == [1, 3, 2]


def test_system_prompts_are_short():
    assert len(SYSTEM_PROMPTS[0].split()) < 60
    assert all(len(p.split()) < 75 for p in SYSTEM_PROMPTS)


def test_tools_against_a_workspace(tmp_path):
    (tmp_path / "corpus" / "web").mkdir(parents=True)
    (tmp_path / "corpus" / "web" / "page.html").write_text("<p>Release notes: version 2 ships tomorrow.</p>")
    (tmp_path / "corpus" / "other.md").write_text("nothing relevant")
    (tmp_path / "corpus" / "urls.json").write_text(json.dumps({"https://example.org/rel": "web/page.html"}))
    tools = Tools(tmp_path, tmp_path / "corpus", command_timeout=1, max_output_chars=200)
    assert tools.run("write_file", {"path": "d/x.py", "content": "print(6 * 7)\n"}).ok
    assert tools.run("python", {"code": "import runpy; runpy.run_path('d/x.py')"}).output == "42\n"
    bash = tools.run("bash", {"command": "echo hi; exit 3"})
    assert (bash.ok, bash.exit_code, bash.output) == (False, 3, "hi\n\n(exit code 3)")
    assert tools.run("edit_file", {"path": "d/x.py", "old": "6 * 7", "new": "6 * 8"}).ok
    assert (
        tools.run("edit_file", {"path": "d/x.py", "old": "6 * 7", "new": "x"}).output
        == "Error: old text not found in d/x.py"
    )
    assert tools.run("write_file", {"path": "twice.txt", "content": "a a"}).ok
    assert (
        tools.run("edit_file", {"path": "twice.txt", "old": "a", "new": "b"}).output
        == "Error: old text occurs 2 times in twice.txt; include more context"
    )
    assert tools.run("read_file", {"path": "nope"}).output == "Error: nope does not exist"
    found = tools.run("search", {"query": "release version"})
    assert found.output.startswith("corpus://web/page.html")
    assert "ships tomorrow" in tools.run("fetch", {"url": "https://example.org/rel"}).output
    assert "ships tomorrow" in tools.run("fetch", {"url": "corpus://web/page.html"}).output
    assert "not in the local corpus" in tools.run("fetch", {"url": "corpus://../d/x.py"}).output
    slow = tools.run("bash", {"command": "echo started; sleep 30 & wait"})
    assert not slow.ok and "timed out after 1 s" in slow.output and "started" in slow.output
    long = tools.run("python", {"code": "print('x' * 500)"})
    assert long.output.endswith("[... 301 more characters]")


def test_tool_spec_names_every_tool_at_every_level():
    """tools.json: every T level offers each of the seven tools under a name of its own; where it fixes an
    order, that order lists exactly those names and the level's distractors."""
    expected = {"read_file", "write_file", "edit_file", "bash", "python", "search", "fetch"}
    assert set(CANONICAL_TOOLS) == set(TOOLS_SPEC["functions"]) == expected
    for level in range(3):
        key = f"T{level}"
        names = TOOLS_SPEC["names"][key]
        assert set(names) == expected and len(set(names.values())) == len(expected)
        distractors = [d["name"] for d in TOOLS_SPEC["distractors"].get(key, [])]
        if key in TOOLS_SPEC["order"]:
            assert sorted(TOOLS_SPEC["order"][key]) == sorted([*names.values(), *distractors])
