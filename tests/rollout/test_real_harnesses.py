"""Real Claude Code and Codex, unmodified, driven by the scripted engine through the proxy (local processes).

Needs the harness binaries (`npm install @anthropic-ai/claude-code @openai/codex`; point BRIDLE_HARNESS_BIN at the
node_modules/.bin folder or put them on PATH). Skipped on a laptop without them; required in CI.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.messages import ids
from pipeline.rollout.harnesses import find_binary, harness_for
from pipeline.serving.scripted import ScriptCall, ScriptResponse
from tests.helpers.ci import require
from tests.helpers.harness_run import check_prefix, run_harness
from tests.helpers.proxyutil import model_calls, renderer

pytestmark = [pytest.mark.anyio, pytest.mark.harness]


async def drive(harness: str, tmp_path: Path, first_call: ScriptResponse) -> tuple[subprocess.CompletedProcess, list, Path]:
    binary = find_binary(harness_for(harness)[0].executable)
    require(binary is not None, f"{harness} binary not installed (set BRIDLE_HARNESS_BIN)")
    return await run_harness(harness, tmp_path, first_call, binary)


async def test_claude_code_tool_call_round_trip(tmp_path):
    target = tmp_path / "ws" / "hello.txt"
    proc, records, _ws = await drive("claude-code", tmp_path, ScriptResponse(tool_calls=[
        ScriptCall(name="Write", arguments={"file_path": str(target), "content": "hello from bridle\n"})]))
    out = proc.stdout.decode()
    assert proc.returncode == 0, out[-2000:] + proc.stderr.decode()[-2000:]
    assert target.read_text() == "hello from bridle\n"
    assert '"result":"The file is written."' in out
    calls = model_calls(records)
    assert len(calls) == 2 and all(c.protocol == "anthropic" for c in calls)
    assert calls[1].spliced_turns == 1 and calls[1].rendered_turns == 0
    k, n, text = check_prefix(calls)
    print("claude-code: call 2 extends call 1 up to token", k, "of", n, ":", text)
    assert k == n, f"Claude Code rewrote history at token {k}: {text}"


async def test_claude_code_lean_prompt_ends_with_the_task(tmp_path):
    """The "lean" variant (Claude Code's own --disable-slash-commands, --disallowedTools Agent) drops the system
    message Claude Code otherwise puts after the task (its agent types and skills, ~1,370 tokens): the task is the
    end of the prompt, and the tools still work."""
    target = tmp_path / "ws" / "hello.txt"
    proc, records, _ws = await drive("claude-code:lean", tmp_path, ScriptResponse(tool_calls=[
        ScriptCall(name="Write", arguments={"file_path": str(target), "content": "hello from bridle\n"})]))
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
    assert target.read_text() == "hello from bridle\n"
    calls = model_calls(records)
    tok = renderer().tokenizer
    prompt = tok.decode(ids(calls[0].input_ids).tolist())
    assert "Available agent types" not in prompt and "skills" not in prompt.lower().split("hello from bridle")[-1]
    after = prompt.rsplit("Create hello.txt containing: hello from bridle", 1)[1]
    assert len(tok.encode(after)) <= 12, f"the prompt goes on after the task: {after[:300]!r}"


async def test_codex_tool_call_round_trip(tmp_path):
    proc, records, ws = await drive("codex", tmp_path, ScriptResponse(tool_calls=[
        ScriptCall(name="exec_command", arguments={"cmd": "printf 'hello from bridle\\n' > hello.txt"})]))
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
    assert (ws / "hello.txt").read_text() == "hello from bridle\n"
    assert "The file is written." in proc.stdout.decode()
    calls = model_calls(records)
    assert len(calls) == 2 and all(c.protocol == "responses" for c in calls)
    assert calls[1].spliced_turns == 1 and calls[1].rendered_turns == 0
    k, n, text = check_prefix(calls)
    print("codex: call 2 extends call 1 up to token", k, "of", n, ":", text)
    assert k == n, f"Codex rewrote history at token {k}: {text}"
