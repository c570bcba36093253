"""Tasks in the Harbor format: load and validate task folders, write generated tasks to disk.

A task folder (the Harbor format, docs/rollout.md)::

    my-task/
      task.toml          # config + free-form [metadata] (family, difficulty, oracle_actions, ...)
      instruction.md     # what the agent is told
      environment/       # Dockerfile + its files (the Docker backend builds it; the workspace is its WORKDIR);
                         # without a Dockerfile, and on the local backend, environment/app/ is the workspace
      tests/test.sh      # verifier; writes $BRIDLE_LOGS/verifier/reward.txt (or reward.json)
      solution/          # optional: solve.sh and/or actions.json (oracle as neutral tool calls)

Scripts find their directories through environment variables with Harbor's fixed paths as defaults
(``${BRIDLE_WORKSPACE:-/app}``, ``${BRIDLE_TESTS:-/tests}``, ``${BRIDLE_LOGS:-/logs}``,
``${BRIDLE_SOLUTION:-/solution}``), so the same task runs in Docker and on the local backend.

``oracle_actions`` is the reference solution as tool calls a harness can replay: a list of
``{"tool": ..., "args": {...}}`` with the tools ``write_file{path, content}``, ``read_file{path}``,
``edit_file{path, old, new}`` (``old`` occurs exactly once) and ``bash{command}`` (run in the
workspace). Paths are relative to the workspace. It lives in ``solution/actions.json`` or in
``task.toml`` as ``[metadata] oracle_actions`` (a JSON string or an array of tables).
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomli_w

WORKSPACE_SUBDIR = "app"  # environment/app/ is copied into the workspace (Dockerfile: COPY app/ /app/)

ToolName = Literal["write_file", "read_file", "edit_file", "bash"]
TOOL_ARGS: dict[str, tuple[str, ...]] = {
    "write_file": ("path", "content"),
    "read_file": ("path",),
    "edit_file": ("path", "old", "new"),
    "bash": ("command",),
}

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class TaskError(ValueError):
    """A task folder (or a directory of them) is not valid; ``problems`` lists every issue found."""

    def __init__(self, where: Path | str, problems: list[str]):
        self.where = str(where)
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{where} is not a valid task folder:\n{lines}")


# ---------------------------------------------------------------------------------------------- task.toml
class _Section(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class VerifierSection(_Section, kw_only=True):
    timeout_sec: PositiveFloat = 120.0
    env: dict[str, str] = msgspec.field(default_factory=dict)


class AgentSection(_Section, kw_only=True):
    timeout_sec: PositiveFloat | None = None  # the harness's wall-clock limit; also bounded by the scheduler's timeout_s


class EnvironmentSection(_Section, kw_only=True):
    """The sandbox a task asks for. Unset limits take the sandbox settings' values, and the Docker backend caps
    each at its setting ([sandbox.docker] cpus, memory, pids; docs/rollout.md, "Task images")."""

    build_timeout_sec: PositiveFloat = 600.0
    cpus: Annotated[float, msgspec.Meta(gt=0)] | None = None
    memory: str | None = None  # "4G"
    memory_mb: Annotated[int, msgspec.Meta(gt=0)] | None = None  # older tasks
    pids: Annotated[int, msgspec.Meta(gt=0)] | None = None  # bridle's addition: the process limit
    storage: str | None = None
    allow_internet: bool = False  # reported, never honoured: the agent reaches only the proxy
    docker_image: str | None = None  # a local image to run instead of building environment/Dockerfile


class TaskConfig(_Section, kw_only=True):
    """``task.toml``. Unknown keys are accepted (the schema keeps evolving); known keys are type-checked."""

    version: str | None = None
    schema_version: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    verifier: VerifierSection = msgspec.field(default_factory=VerifierSection)
    agent: AgentSection = msgspec.field(default_factory=AgentSection)
    environment: EnvironmentSection = msgspec.field(default_factory=EnvironmentSection)


class OracleAction(msgspec.Struct, kw_only=True):
    tool: ToolName
    args: dict[str, str]


# ------------------------------------------------------------------------------------------------ task
class Task(msgspec.Struct, kw_only=True):
    """A validated task folder on disk."""

    id: str  # the folder name
    path: str
    instruction: str
    config: TaskConfig
    oracle_actions: list[OracleAction] | None = None

    @property
    def root(self) -> Path:
        return Path(self.path)

    @property
    def family(self) -> str:
        return str(self.config.metadata.get("family", ""))

    @property
    def difficulty(self) -> str:
        return str(self.config.metadata.get("difficulty", ""))

    @property
    def tests_dir(self) -> Path:
        return self.root / "tests"

    @property
    def environment_dir(self) -> Path:
        return self.root / "environment"

    @property
    def dockerfile(self) -> Path | None:
        p = self.environment_dir / "Dockerfile"
        return p if p.is_file() else None

    @property
    def workspace_seed(self) -> Path | None:
        """The workspace's starting files (``environment/app/``), or None when the task starts empty."""
        p = self.environment_dir / WORKSPACE_SUBDIR
        return p if p.is_dir() else None

    @property
    def solve_sh(self) -> Path | None:
        p = self.root / "solution" / "solve.sh"
        return p if p.is_file() else None

    @property
    def rubric(self) -> str | None:
        """Rubric for an LLM judge: ``tests/rubric.md`` (hidden from the agent) or ``[metadata] rubric``."""
        p = self.tests_dir / "rubric.md"
        if p.is_file():
            return p.read_text(encoding="utf-8")
        r = self.config.metadata.get("rubric")
        return str(r) if r else None


def _field_error(file: str, err: msgspec.ValidationError) -> str:
    msg = str(err)
    m = re.search(r" - at `\$\.?(.*)`$", msg)
    if m:
        field = m.group(1) or "(top level)"
        return f"{file}: field `{field}`: {msg[: m.start()]}; fix the value in {file}"
    return f"{file}: {msg}; fix {file}"


def _parse_actions(raw: Any, where: str, problems: list[str]) -> list[OracleAction] | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            problems.append(f"{where}: not valid JSON ({e}); write a JSON list of {{tool, args}} objects")
            return None
    try:
        actions = msgspec.convert(raw, list[OracleAction])
    except msgspec.ValidationError as e:
        problems.append(
            _field_error(where, e) + ' (each action is {"tool": write_file|read_file|edit_file|bash, '
            '"args": {name: string}})'
        )
        return None
    for i, a in enumerate(actions):
        want = set(TOOL_ARGS[a.tool])
        got = set(a.args)
        if got != want:
            problems.append(
                f"{where}: action {i} ({a.tool}) has args {sorted(got)}; {a.tool} takes exactly {sorted(want)}"
            )
    return actions


def _read_config(root: Path, problems: list[str]) -> TaskConfig:
    toml_path = root / "task.toml"
    if not toml_path.is_file():
        problems.append('task.toml is missing; create it (it may be as small as `version = "1.0"`)')
        return TaskConfig()
    try:
        raw = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        problems.append(f"task.toml: not valid TOML ({e}); fix the syntax")
        return TaskConfig()
    try:
        return msgspec.convert(raw, TaskConfig)
    except msgspec.ValidationError as e:
        problems.append(_field_error("task.toml", e))
        return TaskConfig()


def _read_instruction(root: Path, problems: list[str]) -> str:
    ipath = root / "instruction.md"
    if not ipath.is_file():
        problems.append("instruction.md is missing; write the agent's instruction into it")
        return ""
    instruction = ipath.read_text(encoding="utf-8")
    if not instruction.strip():
        problems.append("instruction.md is empty; write the agent's instruction into it")
    return instruction


def _read_actions(root: Path, config: TaskConfig, problems: list[str]) -> list[OracleAction] | None:
    sol = root / "solution"
    if sol.is_dir() and not (sol / "solve.sh").is_file() and not (sol / "actions.json").is_file():
        problems.append("solution/ has neither solve.sh nor actions.json; add one or remove solution/")
    if "oracle_actions" in config.metadata:
        return _parse_actions(config.metadata["oracle_actions"], "task.toml [metadata] oracle_actions", problems)
    if not (sol / "actions.json").is_file():
        return solve_sh_action(sol)
    try:
        raw_actions = json.loads((sol / "actions.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problems.append(f"solution/actions.json: not valid JSON ({e}); fix the file")
        return None
    return _parse_actions(raw_actions, "solution/actions.json", problems)


SOLVE_SH_END = "BRIDLE_SOLVE_SH"


def solve_sh_action(sol: Path) -> list[OracleAction] | None:
    """A standard Harbor task's ``solution/solve.sh`` as one neutral ``bash`` action: the script itself, given to
    bash on its standard input from the workspace, so any harness with a shell tool plays it as its own tool call
    (a cold start without actions.json). None when there is no solve.sh, or when solution/ holds other files the
    script may read (one inline call cannot bring them: give those tasks an actions.json)."""
    script = sol / "solve.sh"
    if not script.is_file() or any(p.name != "solve.sh" for p in sol.iterdir()):
        return None
    try:
        text = script.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
    end = SOLVE_SH_END
    while end in text:
        end += "_"
    body = text if text.endswith("\n") else text + "\n"
    return [OracleAction(tool="bash", args={"command": f"bash <<'{end}'\n{body}{end}"})]


def load_task(path: str | Path) -> Task:
    """Load and validate one task folder; raise :class:`TaskError` listing every problem found."""
    root = Path(path)
    if not root.is_dir():
        raise TaskError(root, [f"{root} does not exist or is not a directory; pass a task folder"])
    problems: list[str] = []
    config = _read_config(root, problems)
    instruction = _read_instruction(root, problems)
    if not (root / "environment").is_dir():
        problems.append(
            "environment/ is missing; create it with a Dockerfile and/or environment/app/ holding the "
            "workspace's starting files"
        )
    if not (root / "tests" / "test.sh").is_file():
        problems.append(
            "tests/test.sh is missing; it must run the checks and write a number to "
            "${BRIDLE_LOGS:-/logs}/verifier/reward.txt"
        )
    actions = _read_actions(root, config, problems)
    if problems:
        raise TaskError(root, problems)
    return Task(id=root.name, path=str(root), instruction=instruction, config=config, oracle_actions=actions)


def load_task_dir(root: str | Path) -> list[Task]:
    """Load every task under ``root`` (``root/<task>/task.toml``), or ``root`` itself if it is a task.

    Every bad folder is reported in one :class:`TaskError`, so a large set can be fixed in one pass.
    """
    root = Path(root)
    if (root / "task.toml").is_file():
        return [load_task(root)]
    if not root.is_dir():
        raise TaskError(root, [f"{root} does not exist or is not a directory; pass a folder of task folders"])
    tasks: list[Task] = []
    problems: list[str] = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        if not (sub / "task.toml").is_file():
            problems.append(f"{sub.name}/: no task.toml; every folder under {root} must be a task folder")
            continue
        try:
            tasks.append(load_task(sub))
        except TaskError as e:
            problems.extend(f"{sub.name}/{p}" for p in e.problems)
    if problems:
        raise TaskError(root, problems)
    if not tasks:
        raise TaskError(root, [f"no tasks found; expected {root}/<task>/task.toml"])
    return tasks


def select_tasks(
    tasks: list[Task], families: list[str] | None = None, difficulties: list[str] | None = None
) -> list[Task]:
    """Keep the tasks whose ``[metadata] family`` / ``difficulty`` is listed (None keeps all)."""
    chosen = [
        t
        for t in tasks
        if (families is None or t.family in families)
        and (difficulties is None or t.difficulty in difficulties)
    ]
    if tasks and not chosen:
        have = sorted({(t.family, t.difficulty) for t in tasks})
        raise ValueError(
            f"no task matches families={families} difficulties={difficulties}; the set has (family, difficulty) {have}"
        )
    return chosen


# --------------------------------------------------------------------------------------- writing tasks
class TaskSpec(msgspec.Struct, kw_only=True):
    """A task held in memory (what generators return); :func:`materialize` writes it as a task folder.

    Each file map is relative path -> text. ``workspace`` becomes ``environment/app/``; ``*.sh`` files are
    written executable.
    """

    id: str
    instruction: str
    config: TaskConfig
    environment: dict[str, str] = msgspec.field(default_factory=dict)
    workspace: dict[str, str] = msgspec.field(default_factory=dict)
    tests: dict[str, str] = msgspec.field(default_factory=dict)
    solution: dict[str, str] = msgspec.field(default_factory=dict)


def _write_tree(base: Path, files: dict[str, str]) -> None:
    base.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        p = base / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"file path {rel!r} must be relative and stay inside {base}")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        if p.suffix == ".sh":
            p.chmod(0o755)


def materialize(task: TaskSpec | Task, dest: str | Path) -> Task:
    """Write ``task`` as a task folder at ``dest`` (which must not exist yet) and load it back validated."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists; materialize into a new path")
    if isinstance(task, Task):
        shutil.copytree(task.root, dest, symlinks=True)
        return load_task(dest)
    dest.mkdir(parents=True)
    (dest / "task.toml").write_text(tomli_w.dumps(msgspec.to_builtins(task.config)), encoding="utf-8")
    (dest / "instruction.md").write_text(task.instruction, encoding="utf-8")
    _write_tree(dest / "environment", task.environment)
    _write_tree(dest / "environment" / WORKSPACE_SUBDIR, task.workspace)
    _write_tree(dest / "tests", task.tests)
    # What would give the answers away is readable by this user only: a verifier's child process that runs as
    # another uid (see taskgen/check_template.py) must not find them on a shared host.
    (dest / "tests").chmod(0o700)
    if task.solution:
        _write_tree(dest / "solution", task.solution)
        (dest / "solution").chmod(0o700)
    return load_task(dest)


def seed_workspace(task: Task, dest: str | Path) -> Path:
    """Copy the task's starting files into the (possibly existing) workspace directory ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if task.workspace_seed is not None:
        shutil.copytree(task.workspace_seed, dest, symlinks=True, dirs_exist_ok=True)
    return dest
