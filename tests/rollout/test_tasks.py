"""Task folders: loading, validation messages, directories of tasks, materializing."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from pipeline.rollout.taskgen import generate
from pipeline.rollout.tasks import (
    OracleAction,
    Task,
    TaskConfig,
    TaskError,
    TaskSpec,
    load_task,
    load_task_dir,
    materialize,
    seed_workspace,
    select_tasks,
)

TEST_SH = '#!/usr/bin/env bash\necho 1 > "${BRIDLE_LOGS:-/logs}/verifier/reward.txt"\n'


def make_task(
    root: Path,
    toml: str = 'version = "1.0"\n',
    *,
    instruction: str = "Do it.\n",
    test_sh: str | None = TEST_SH,
    env: bool = True,
) -> Path:
    root.mkdir(parents=True)
    if toml is not None:
        (root / "task.toml").write_text(toml)
    if instruction is not None:
        (root / "instruction.md").write_text(instruction)
    if env:
        (root / "environment").mkdir()
    if test_sh is not None:
        (root / "tests").mkdir()
        (root / "tests" / "test.sh").write_text(test_sh)
    return root


def problems_of(path: Path) -> list[str]:
    with pytest.raises(TaskError) as ei:
        load_task(path)
    assert str(path) in str(ei.value)
    return ei.value.problems


def test_minimal_task_loads_with_harbor_defaults(tmp_path):
    t = load_task(make_task(tmp_path / "t1"))
    assert t.id == "t1"
    assert t.instruction == "Do it.\n"
    assert t.config.verifier.timeout_sec == 120.0
    # unset: the scheduler's timeout_s alone bounds the harness; unset limits take the sandbox settings'
    assert t.config.agent.timeout_sec is None
    env = t.config.environment
    assert (env.cpus, env.memory, env.memory_mb, env.pids, env.allow_internet) == (None, None, None, None, False)
    assert t.dockerfile is None
    assert t.oracle_actions is None and t.solve_sh is None and t.workspace_seed is None
    assert t.family == "" and t.rubric is None


def test_full_harbor_toml_both_schema_styles(tmp_path):
    toml = """
schema_version = "1.1"
some_future_key = 3
[metadata]
author_name = "x"
difficulty = "hard"
family = "mine"
tags = ["a", "b"]
[verifier]
timeout_sec = 30
[verifier.env]
FOO = "bar"
[agent]
timeout_sec = 99.5
[environment]
build_timeout_sec = 600.0
cpus = 2
memory_mb = 2048
storage = "10G"
allow_internet = false
"""
    t = load_task(make_task(tmp_path / "t", toml))
    assert t.config.schema_version == "1.1" and t.config.version is None
    assert t.config.verifier.timeout_sec == 30.0 and t.config.verifier.env == {"FOO": "bar"}
    assert t.config.environment.memory_mb == 2048 and t.config.environment.cpus == 2
    assert (t.family, t.difficulty) == ("mine", "hard")


def test_missing_pieces_are_all_reported_at_once(tmp_path):
    root = make_task(tmp_path / "bad", toml=None, instruction=None, test_sh=None, env=False)
    probs = problems_of(root)
    text = "\n".join(probs)
    assert len(probs) == 4
    assert "task.toml is missing" in text
    assert "instruction.md is missing" in text
    assert "environment/ is missing" in text
    assert "tests/test.sh is missing" in text and "reward.txt" in text


def test_wrong_field_type_names_file_and_field(tmp_path):
    probs = problems_of(make_task(tmp_path / "t", '[verifier]\ntimeout_sec = "soon"\n'))
    assert len(probs) == 1
    assert probs[0].startswith("task.toml: field `verifier.timeout_sec`: Expected `float`, got `str`")
    assert "fix the value in task.toml" in probs[0]


def test_nonpositive_timeout_rejected(tmp_path):
    probs = problems_of(make_task(tmp_path / "t", "[agent]\ntimeout_sec = 0\n"))
    assert "`agent.timeout_sec`" in probs[0] and ">" in probs[0]


def test_bad_toml_syntax_and_empty_instruction(tmp_path):
    probs = problems_of(make_task(tmp_path / "t", "version = \n", instruction="  \n"))
    assert any(p.startswith("task.toml: not valid TOML") for p in probs)
    assert any("instruction.md is empty" in p for p in probs)


def test_oracle_actions_from_metadata_json_string_and_table_array(tmp_path):
    acts = [{"tool": "write_file", "args": {"path": "a.txt", "content": "hi"}}]
    t = load_task(make_task(tmp_path / "s", f"[metadata]\noracle_actions = {json.dumps(json.dumps(acts))}\n"))
    assert t.oracle_actions == [OracleAction(tool="write_file", args={"path": "a.txt", "content": "hi"})]
    toml = '[[metadata.oracle_actions]]\ntool = "bash"\nargs = { command = "ls" }\n'
    t2 = load_task(make_task(tmp_path / "t", toml))
    assert t2.oracle_actions == [OracleAction(tool="bash", args={"command": "ls"})]


@pytest.mark.parametrize(
    "actions, needle",
    [
        ([{"tool": "rm_rf", "args": {}}], "solution/actions.json: field `[0].tool`"),
        (
            [{"tool": "edit_file", "args": {"path": "a", "old_string": "x", "new_string": "y"}}],
            "action 0 (edit_file) has args ['new_string', 'old_string', 'path']; edit_file takes exactly",
        ),
        (
            {"tool": "bash"},
            "solution/actions.json: Expected `array`, got `object`; fix solution/actions.json",
        ),
    ],
)
def test_bad_actions_json_explained(tmp_path, actions, needle):
    root = make_task(tmp_path / "t")
    (root / "solution").mkdir()
    (root / "solution" / "actions.json").write_text(json.dumps(actions))
    probs = problems_of(root)
    assert len(probs) == 1 and needle in probs[0], probs


def test_solution_dir_without_solver_is_an_error(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "solution").mkdir()
    assert "solution/ has neither solve.sh nor actions.json" in problems_of(root)[0]


def test_not_a_directory(tmp_path):
    assert "does not exist" in problems_of(tmp_path / "nope")[0]


def test_load_task_dir_sorted_and_bad_ones_named(tmp_path):
    make_task(tmp_path / "b")
    make_task(tmp_path / "a")
    (tmp_path / ".hidden").mkdir()
    assert [t.id for t in load_task_dir(tmp_path)] == ["a", "b"]
    assert [t.id for t in load_task_dir(tmp_path / "a")] == ["a"]  # a task folder itself
    make_task(tmp_path / "c", "[agent]\ntimeout_sec = -1\n")
    (tmp_path / "d").mkdir()
    with pytest.raises(TaskError) as ei:
        load_task_dir(tmp_path)
    assert len(ei.value.problems) == 2
    assert ei.value.problems[0].startswith("c/task.toml: field `agent.timeout_sec`")
    assert ei.value.problems[1].startswith("d/: no task.toml")


def test_load_task_dir_empty(tmp_path):
    with pytest.raises(TaskError, match="no tasks found"):
        load_task_dir(tmp_path)


def test_materialize_spec_roundtrip_and_copy(tmp_path):
    spec = TaskSpec(
        id="x",
        instruction="Say hi.\n",
        config=TaskConfig(version="1.0", metadata={"family": "f", "difficulty": "easy"}),
        environment={"Dockerfile": "FROM debian\n"},
        workspace={"sub/a.txt": "A"},
        tests={"test.sh": TEST_SH, "rubric.md": "Be nice."},
        solution={
            "solve.sh": "#!/bin/bash\n",
            "actions.json": '[{"tool": "read_file", "args": {"path": "sub/a.txt"}}]',
        },
    )
    t = materialize(spec, tmp_path / "x")
    assert isinstance(t, Task) and t.family == "f" and t.difficulty == "easy"
    assert t.rubric == "Be nice."
    assert t.oracle_actions == [OracleAction(tool="read_file", args={"path": "sub/a.txt"})]
    assert os.stat(t.tests_dir / "test.sh").st_mode & stat.S_IXUSR
    assert (t.workspace_seed / "sub" / "a.txt").read_text() == "A"
    with pytest.raises(FileExistsError):
        materialize(spec, tmp_path / "x")
    t2 = materialize(t, tmp_path / "copy")
    assert t2.id == "copy" and t2.config == t.config and t2.instruction == t.instruction
    ws = seed_workspace(t2, tmp_path / "ws")
    assert (ws / "sub" / "a.txt").read_text() == "A"


def test_materialize_rejects_escaping_paths(tmp_path):
    spec = TaskSpec(id="x", instruction="i", config=TaskConfig(), tests={"../evil.sh": ""})
    with pytest.raises(ValueError, match="must be relative"):
        materialize(spec, tmp_path / "x")


def test_generated_task_is_a_valid_harbor_folder(tmp_path):
    t = materialize(generate("create_file", 3), tmp_path / "t")
    assert t.family == "create_file" and t.difficulty == "trivial"
    assert t.config.metadata["seed"] == 3
    assert (t.environment_dir / "Dockerfile").read_text().count("WORKDIR /app") == 1
    assert t.solve_sh is not None and len(t.oracle_actions) == 1


def test_select_tasks_by_family_and_difficulty(tmp_path):
    tasks = [
        load_task(make_task(tmp_path / n, f'[metadata]\nfamily = "{f}"\ndifficulty = "{d}"\n'))
        for n, f, d in [
            ("a", "create_file", "trivial"),
            ("b", "bugfix", "medium"),
            ("c", "csv_query", "medium"),
        ]
    ]
    assert [t.id for t in select_tasks(tasks, families=["bugfix", "create_file"])] == ["a", "b"]
    assert [t.id for t in select_tasks(tasks, difficulties=["medium"])] == ["b", "c"]
    assert select_tasks(tasks) == tasks
    with pytest.raises(ValueError, match="no task matches"):
        select_tasks(tasks, families=["nope"])


# ------------------------------------------------------------------------- solve.sh as a demonstration
def _solution(tmp_path, text: str, *extra: str):
    sol = tmp_path / "solution"
    sol.mkdir(exist_ok=True)
    (sol / "solve.sh").write_text(text)
    for name in extra:
        (sol / name).write_text("x")
    return sol


def test_solve_sh_alone_becomes_one_bash_action_that_runs_it_exactly(tmp_path):
    import subprocess

    from pipeline.rollout.tasks import SOLVE_SH_END, solve_sh_action

    # a script that names the delimiter itself, and writes text a shell would otherwise expand
    text = f"#!/usr/bin/env bash\nset -e\ncat > out.txt <<'X'\n$HOME `id` {SOLVE_SH_END}\nX\necho done\n"
    (action,) = solve_sh_action(_solution(tmp_path, text))
    assert action.tool == "bash"
    ws = tmp_path / "ws"
    ws.mkdir()
    r = subprocess.run(["bash", "-c", action.args["command"]], cwd=ws, capture_output=True, text=True, check=True)
    assert r.stdout == "done\n" and (ws / "out.txt").read_text() == f"$HOME `id` {SOLVE_SH_END}\n"


def test_solve_sh_with_other_solution_files_gets_no_inline_demonstration(tmp_path):
    from pipeline.rollout.tasks import solve_sh_action

    assert solve_sh_action(_solution(tmp_path, "cp /solution/answer.txt .\n", "answer.txt")) is None
    assert solve_sh_action(tmp_path / "nothing") is None
