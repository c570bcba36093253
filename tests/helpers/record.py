"""Record a real harness's model calls: the unmodified binary (or the white-box harness) as a local process,
driven by the scripted engine behind the real proxy. Used by the tree tests of every harness and to write the
recorded fixtures in tests/data."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio

from pipeline.messages import ModelCall, RolloutFinished, RolloutRequest, SettledRollout
from pipeline.rollout.harnesses import HARNESSES, LaunchContext, find_binary, launch_for
from pipeline.serving.scripted import Script, ScriptCall, ScriptResponse
from tests.helpers.ci import require
from tests.helpers.harness_run import write_files
from tests.helpers.proxyutil import model_calls, running_proxy


def tool(name: str, **arguments) -> ScriptResponse:
    return ScriptResponse(tool_calls=[ScriptCall(name=name, arguments=arguments)])


async def record(harness: str, tmp_path: Path, responses: list[ScriptResponse], instruction: str,
                 timeout_s: float = 300.0) -> tuple[subprocess.CompletedProcess, list[ModelCall], Path]:
    """Run ``harness`` once; returns (process, its model calls in order, the workspace)."""
    binary = ""
    if HARNESSES[harness.split(":")[0]].executable:
        found = find_binary(HARNESSES[harness.split(":")[0]].executable)
        require(found is not None, f"{harness} not installed (set BRIDLE_HARNESS_BIN)")
        binary = found or ""
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    rollout_id = harness.replace(":", "-")
    async with running_proxy(Script(rollouts={rollout_id: responses})) as (p, records, _token):
        token = p.open_rollout(rollout_id)
        ctx = LaunchContext(workspace=str(ws), home=str(home), base_url=p.base_url, token=token,
                            instruction=instruction, binary=binary)
        launch = launch_for(harness, ctx)
        write_files(launch)
        env = {"PATH": os.environ["PATH"], **launch.env}
        with anyio.fail_after(timeout_s):
            proc = await anyio.run_process(launch.argv, env=env, cwd=ws, stdin=subprocess.DEVNULL, check=False)
    return proc, model_calls(records), ws


def settled(calls: list[ModelCall], harness: str, reward: float = 1.0) -> SettledRollout:
    """The calls as the collector would hand them to the tree builder."""
    rid = calls[0].rollout_id if calls else "r"
    return SettledRollout(
        request=RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id="t", harness=harness,
                               token="tok", policy_version=0),
        finished=RolloutFinished(rollout_id=rid, group_id="g", status="ok", reward=reward),
        calls=calls)
