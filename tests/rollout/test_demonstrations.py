"""Oracle demonstrations in each harness's own tools: exact small cases, and the shell forms (Codex, Qwen Code)
checked against the reference meaning of the neutral tools (pipeline.rollout.verify.replay_actions_local)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.rollout.demonstrations import DemoTools, ToolForm
from pipeline.rollout.harnesses import CODEX_TOOLS, HARNESSES, QWEN_CODE_TOOLS
from pipeline.rollout.scheduling import oracle_script
from pipeline.rollout.taskgen import family_names, generate
from pipeline.rollout.tasks import OracleAction, materialize, seed_workspace
from pipeline.rollout.verify import replay_actions_local

BUGFIX = [("read_file", {"path": "test_calc.py"}),
          ("edit_file", {"path": "calc.py", "old": "n)", "new": "n + 1)"}),
          ("bash", {"command": "python3 -m unittest test_calc"})]


def calls(harness: str, actions=BUGFIX) -> list[tuple[str, dict]]:
    return HARNESSES[harness].demo_tools("").calls(actions)


def test_claude_code_reads_a_file_before_it_edits_it():
    assert calls("claude-code") == [
        ("Read", {"file_path": "test_calc.py"}),
        ("Read", {"file_path": "calc.py"}),  # inserted: Claude Code refuses to edit a file it has not read
        ("Edit", {"replace_all": False, "file_path": "calc.py", "old_string": "n)", "new_string": "n + 1)"}),
        ("Bash", {"command": "python3 -m unittest test_calc", "description": "Run the command"}),
    ]
    written = [("write_file", {"path": "a.txt", "content": "x"}), ("edit_file", {"path": "a.txt", "old": "x", "new": "y"})]
    assert [n for n, _ in calls("claude-code", written)] == ["Write", "Edit"]


def test_openclaw_edit_takes_a_list_of_edits():
    assert calls("openclaw")[1] == ("edit", {"path": "calc.py", "edits": [{"oldText": "n)", "newText": "n + 1)"}]})
    assert calls("openclaw", [("write_file", {"path": "a", "content": "{x}"})]) == [
        ("write", {"path": "a", "content": "{x}"})]  # braces in a value are not templates


def test_shell_harnesses_call_one_tool():
    assert {n for n, _ in calls("codex")} == {"exec_command"}
    assert {n for n, _ in calls("qwen-code")} == {"run_shell_command"}
    assert calls("codex")[2] == ("exec_command", {"cmd": "python3 -m unittest test_calc"})
    assert calls("codex")[0] == ("exec_command", {"cmd": "cat test_calc.py"})


def test_whitebox_keeps_the_neutral_arguments_under_its_tool_names():
    plain = HARNESSES["whitebox"].demo_tools("S0T0O0C0W0").calls(BUGFIX)
    assert plain == [(t, a) for t, a in BUGFIX]
    opaque = HARNESSES["whitebox"].demo_tools("S0T2O0C0W0").calls(BUGFIX)
    assert [a for _, a in opaque] == [a for _, a in BUGFIX] and opaque[0][0] != "read_file"


def test_a_form_naming_a_missing_argument_says_which():
    tools = DemoTools({t: ToolForm("x", {"a": "{nope}"}) for t in ("write_file", "read_file", "edit_file", "bash")})
    with pytest.raises(ValueError, match="nope"):
        tools.calls([("read_file", {"path": "a"})])
    with pytest.raises(ValueError, match="no form"):
        DemoTools({"write_file": ToolForm("x", {})})


@pytest.mark.parametrize("harness", [h for h in HARNESSES if HARNESSES[h].demo_tools is not None])
def test_every_script_ends_with_a_final_answer(tmp_path, harness):
    task = materialize(generate("bugfix", 0), tmp_path / "t")
    script = oracle_script(task, harness)
    assert script[-1] == {"text": "Done."}
    assert all(len(r["tool_calls"]) == 1 for r in script[:-1])


def run_shell(tools: DemoTools, actions: list[tuple[str, dict]], ws: Path) -> None:
    """Run a shell harness's calls with bash in ``ws``, as the harness would."""
    for _name, args in tools.calls(actions):
        cmd = args.get("cmd") or args["command"]
        subprocess.run(["bash", "-c", cmd], cwd=ws, check=True, capture_output=True, timeout=60)


def snapshot(ws: Path) -> dict[str, bytes]:
    return {p.relative_to(ws).as_posix(): p.read_bytes() for p in sorted(ws.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.anyio
@pytest.mark.parametrize("tools", [CODEX_TOOLS, QWEN_CODE_TOOLS], ids=["codex", "qwen-code"])
@pytest.mark.parametrize("family", family_names())
async def test_shell_forms_mean_what_the_neutral_tools_mean(tmp_path, tools, family):
    task = materialize(generate(family, 3), tmp_path / "task")
    ref, got = seed_workspace(task, tmp_path / "ref"), seed_workspace(task, tmp_path / "got")
    await replay_actions_local(task.oracle_actions, ref)
    run_shell(tools, [(a.tool, a.args) for a in task.oracle_actions], got)
    assert snapshot(got) == snapshot(ref)


TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=TEXT, old_new=st.tuples(TEXT.filter(bool), TEXT))
def test_shell_write_and_edit_keep_any_text_exact(tmp_path_factory, content, old_new):
    old, new = old_new
    ws = tmp_path_factory.mktemp("ws")
    body = "<" + old + ">" + content
    actions = [("write_file", {"path": "sub/f.txt", "content": body})]
    if body.count(old) == 1:
        actions.append(("edit_file", {"path": "sub/f.txt", "old": old, "new": new}))
    run_shell(CODEX_TOOLS, actions, ws)
    want = body.replace(old, new) if len(actions) == 2 else body
    assert (ws / "sub" / "f.txt").read_bytes() == want.encode()


def test_shell_quoting_is_posix_quoting():
    (_, args), = CODEX_TOOLS.calls([("read_file", {"path": "it's here.txt"})])
    assert shlex.split(args["cmd"]) == ["cat", "it's here.txt"]
    assert OracleAction(tool="read_file", args={"path": "a"}).tool == "read_file"
