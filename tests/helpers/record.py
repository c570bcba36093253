"""Record a real harness's model calls: the unmodified binary (or the white-box harness) as a local process,
driven by the scripted engine behind the real proxy. Used by the tree tests of every harness, the harness
benchmark's tests, and to write the recorded fixtures in tests/data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc

from pipeline.messages import ModelCall, RolloutFinished, RolloutRequest, SettledRollout
from pipeline.rollout.harnesses import HARNESSES, Launch, LaunchContext, find_binary, find_node, launch_for
from pipeline.serving.scripted import Script, ScriptCall, ScriptResponse, ScriptRoute
from tests.helpers.ci import require
from tests.helpers.harness_run import write_files
from tests.helpers.proxyutil import model_calls, running_proxy


def tool(name: str, **arguments) -> ScriptResponse:
    return ScriptResponse(tool_calls=[ScriptCall(name=name, arguments=arguments)])


def harness_binary(harness: str) -> str:
    """The harness's executable (required in CI), "" for one that runs on Python or bash."""
    executable = HARNESSES[harness.split(":")[0]].executable
    if not executable:
        return ""
    found = find_binary(executable)
    require(found is not None, f"{harness} not installed (set BRIDLE_HARNESS_BIN)")
    return found or ""


async def record(harness: str, tmp_path: Path, responses: list[ScriptResponse], instruction: str,
                 timeout_s: float = 300.0, *, routes: list[ScriptRoute] | None = None,
                 env: dict[str, str] | None = None, edit: Callable[[Launch], None] | None = None,
                 ) -> tuple[subprocess.CompletedProcess, list[ModelCall], Path]:
    """Run ``harness`` once; returns (process, its model calls in order, the workspace). ``routes`` give side
    conversations (subagents) their own responses; ``env`` is added to the launch's environment and ``edit`` may
    change the launch (its config files) before it is written."""
    binary = harness_binary(harness)
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    rollout_id = harness.replace(":", "-")
    async with running_proxy(Script(rollouts={rollout_id: responses}, routes=routes or [])) as (p, records, _token):
        token = p.open_rollout(rollout_id)
        ctx = LaunchContext(workspace=str(ws), home=str(home), base_url=p.base_url, token=token,
                            instruction=instruction, binary=binary)
        launch = launch_for(harness, ctx)
        if edit is not None:
            edit(launch)
        write_files(launch)
        full_env = {"PATH": os.environ["PATH"], **launch.env, **(env or {})}
        with anyio.fail_after(timeout_s):
            proc = await anyio.run_process(launch.argv, env=full_env, cwd=ws, stdin=subprocess.DEVNULL, check=False)
    return proc, model_calls(records), ws


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _port_open(port: int, proc: anyio.abc.Process, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while proc.returncode is None:
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.5)
                continue
            await stream.aclose()
            return
    raise RuntimeError(f"the OpenClaw gateway exited with {proc.returncode} before listening")


async def record_openclaw_gateway(tmp_path: Path, responses: list[ScriptResponse], instruction: str, *,
                                  routes: list[ScriptRoute] | None = None, timeout_s: float = 300.0,
                                  ) -> tuple[subprocess.CompletedProcess, list[ModelCall], Path]:
    """OpenClaw through its gateway, the mode that has subagents (``sessions_spawn``): bridle's OpenClaw config
    plus a loopback gateway section, ``openclaw gateway run`` in the background, then one ``openclaw agent`` turn
    against it. Returns (the agent process, the model calls, the workspace)."""
    binary = harness_binary("openclaw")
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    port = _free_port()
    async with running_proxy(Script(rollouts={"openclaw": responses}, routes=routes or [])) as (p, records, _tok):
        token = p.open_rollout("openclaw")
        ctx = LaunchContext(workspace=str(ws), home=str(home), base_url=p.base_url, token=token,
                            instruction=instruction, binary=binary)
        launch = launch_for("openclaw", ctx)
        config_path = launch.argv[launch.argv.index("--config") + 1]
        config = json.loads(launch.files[config_path])
        config["agents"]["defaults"]["workspace"] = str(ws)
        config["gateway"] = {"mode": "local", "bind": "loopback", "port": port,
                             "auth": {"mode": "token", "token": "bridle-test"}}
        launch.files[config_path] = json.dumps(config, indent=1)
        write_files(launch)
        env = {"PATH": os.environ["PATH"], **launch.env, "OPENCLAW_CONFIG_PATH": config_path,
               "OPENCLAW_GATEWAY_TOKEN": "bridle-test"}
        node = find_node()
        with (tmp_path / "gateway.log").open("wb") as log:
            gateway = await anyio.open_process([node, binary, "gateway", "run", "--port", str(port)], env=env,
                                               cwd=ws, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            await _port_open(port, gateway, 120)
            with anyio.fail_after(timeout_s):
                proc = await anyio.run_process(
                    [node, binary, "agent", "--agent", "main", "--session-id", "bridle", "--message-file",
                     str(home / "instruction.md"), "--json", "--timeout", str(int(timeout_s))],
                    env=env, cwd=ws, stdin=subprocess.DEVNULL, check=False)
        finally:
            gateway.terminate()
            with anyio.move_on_after(30, shield=True) as scope:
                await gateway.wait()
            if scope.cancelled_caught:
                gateway.kill()
                await gateway.wait()
            await gateway.aclose()
    return proc, model_calls(records), ws


def settled(calls: list[ModelCall], harness: str, reward: float = 1.0) -> SettledRollout:
    """The calls as the collector would hand them to the tree builder."""
    rid = calls[0].rollout_id if calls else "r"
    return SettledRollout(
        request=RolloutRequest(rollout_id=rid, group_id="g", index=0, group_size=1, task_id="t", harness=harness,
                               token="tok", policy_version=0),
        finished=RolloutFinished(rollout_id=rid, group_id="g", status="ok", reward=reward),
        calls=calls)
