"""Real Claude Code and Codex, unmodified, driven by the scripted engine through the proxy (local processes).

Needs the harness binaries (`npm install @anthropic-ai/claude-code @openai/codex`; point BRIDLE_HARNESS_BIN at the
node_modules/.bin folder or put them on PATH). Skipped on a laptop without them; required in CI.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import numpy as np
import pytest
from conftest import require
from proxyutil import model_calls, renderer, running_proxy

from pipeline.harnesses import LaunchContext, find_binary, launch_for
from pipeline.messages import ids
from pipeline.scripted_engine import Script, ScriptCall, ScriptResponse

pytestmark = [pytest.mark.anyio, pytest.mark.harness]


def first_divergence(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


async def drive(harness: str, tmp_path: Path, first_call: ScriptResponse) -> tuple[subprocess.CompletedProcess, list, Path]:
    binary = find_binary({"claude-code": "claude", "codex": "codex"}[harness])
    require(binary is not None, f"{harness} binary not installed (set BRIDLE_HARNESS_BIN)")
    return await run_harness(harness, tmp_path, first_call, binary)


async def run_harness(harness: str, tmp_path: Path, first_call: ScriptResponse, binary: str,
                      ) -> tuple[subprocess.CompletedProcess, list, Path]:
    """One scripted tool call then a final answer, through the real proxy; returns the process and the records."""
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    home.mkdir()
    script = Script(default=[first_call, ScriptResponse(text="The file is written.")])
    async with running_proxy(script) as (p, records, _token):
        token = p.open_rollout(f"{harness}-1")
        ctx = LaunchContext(workspace=str(ws), home=str(home), base_url=p.base_url, token=token,
                            instruction="Create hello.txt containing: hello from bridle", binary=binary)
        launch = launch_for(harness, ctx)
        for path, content in launch.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
        env = {"PATH": os.environ["PATH"], **launch.env}
        with anyio.fail_after(240):
            proc = await anyio.run_process(launch.argv, env=env, cwd=ws, stdin=subprocess.DEVNULL, check=False)
    return proc, records, ws


def check_prefix(calls) -> tuple[int, int, str]:
    """(where call 2 diverges from call 1's input + output, len of that, the rewritten text)."""
    a = np.concatenate([ids(calls[0].input_ids), ids(calls[0].output_ids)])
    b = ids(calls[1].input_ids)
    k = first_divergence(a, b)
    tok = renderer().tokenizer
    return k, len(a), tok.decode(a[k:k + 40].tolist()) + " || " + tok.decode(b[k:k + 40].tolist())


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
