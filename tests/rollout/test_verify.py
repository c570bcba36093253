"""Local verifier runner: reward files, isolation of tests/ and logs/, timeouts, process groups (the rubric judge: test_judge.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.rollout.tasks import OracleAction, TaskConfig, TaskSpec, materialize
from pipeline.rollout.verify import (
    RewardError,
    read_reward,
    replay_actions_local,
    run_solution_local,
    run_verifier_local_sync,
)


@pytest.fixture(autouse=True)
def fast_python3(monkeypatch):
    # Task scripts call `python3`; put this interpreter first so a slow shim (pyenv) does not dominate test time.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def task_with(
    tmp_path: Path,
    test_sh: str,
    *,
    tests: dict | None = None,
    solution: dict | None = None,
    timeout: float = 20.0,
    name: str = "t",
):
    spec = TaskSpec(
        id=name,
        instruction="Write ok into a.txt.\n",
        config=TaskConfig(version="1.0", metadata={"family": "test"}),
        environment={"Dockerfile": "FROM debian\n"},
        tests={"test.sh": test_sh, **(tests or {})},
        solution=solution or {},
    )
    spec.config.verifier.timeout_sec = timeout
    return materialize(spec, tmp_path / name)


LOGS = 'L="${BRIDLE_LOGS:-/logs}/verifier"\n'


def test_a_module_left_in_the_workspace_does_not_shadow_what_test_sh_imports(tmp_path):
    """`python3 -c` from the workspace (test.sh's working directory) imports the standard json, not the agent's
    json.py; a task that clears PYTHONSAFEPATH in its [verifier] env gets the agent's (the control)."""
    sh = LOGS + ("""if [ "$(python3 -c 'import json; print(json.dumps([1]))')" = "[1]" ]; """
                 'then echo 1 > "$L/reward.txt"; else echo 0 > "$L/reward.txt"; fi\n')
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "json.py").write_text("def dumps(x):\n    return 'forged'\n")
    task = task_with(tmp_path, sh)
    assert run_verifier_local_sync(task, ws).reward == 1.0
    task.config.verifier.env["PYTHONSAFEPATH"] = ""
    assert run_verifier_local_sync(task, ws).reward == 0.0


def test_reward_txt_env_paths_and_stdout(tmp_path):
    sh = LOGS + (
        'echo "ws=$BRIDLE_WORKSPACE tests=$BRIDLE_TESTS pwd=$(pwd)"\n'
        'test -f "$BRIDLE_TESTS/helper.txt" || exit 3\n'
        'if [ "$(cat "$BRIDLE_WORKSPACE/a.txt")" = ok ]; then echo 1 > "$L/reward.txt"; else echo 0 > "$L/reward.txt"; fi\n'
    )
    task = task_with(tmp_path, sh, tests={"helper.txt": "x"})
    ws = tmp_path / "ws"
    ws.mkdir()
    logs = tmp_path / "logs"
    r0 = run_verifier_local_sync(task, ws, logs_dir=logs)
    assert (r0.status, r0.reward, r0.exit_code) == ("ok", 0.0, 0)
    (ws / "a.txt").write_text("ok")
    r1 = run_verifier_local_sync(task, ws, logs_dir=logs)
    assert (r1.status, r1.reward, r1.rewards) == ("ok", 1.0, {"rule": 1.0})
    assert f"ws={ws.resolve()}" in r1.stdout_tail and f"pwd={ws.resolve()}" in r1.stdout_tail
    assert (
        "tests=" in r1.stdout_tail and str(task.tests_dir) not in r1.stdout_tail
    )  # a fresh copy, not the task's
    assert (logs / "verifier" / "test-stdout.txt").read_text().startswith("ws=")


def test_planted_reward_is_removed_before_verifying(tmp_path):
    task = task_with(tmp_path, LOGS + "true\n")  # writes no reward itself
    logs = tmp_path / "logs"
    (logs / "verifier").mkdir(parents=True)
    (logs / "verifier" / "reward.txt").write_text("1")
    ws = tmp_path / "ws"
    ws.mkdir()
    r = run_verifier_local_sync(task, ws, logs_dir=logs)
    assert r.status == "verifier_error" and "neither" in r.error and r.reward == 0.0
    assert r.summary() == r.error


def test_tests_are_not_in_workspace_and_changes_do_not_leak_back(tmp_path):
    sh = LOGS + 'echo tampered > "$BRIDLE_TESTS/secret.txt"; echo 1 > "$L/reward.txt"\n'
    task = task_with(tmp_path, sh, tests={"secret.txt": "s"})
    ws = tmp_path / "ws"
    ws.mkdir()
    assert run_verifier_local_sync(task, ws).reward == 1.0
    assert (task.tests_dir / "secret.txt").read_text() == "s"
    assert list(ws.iterdir()) == []


def test_reward_json_named_parts(tmp_path):
    sh = LOGS + 'echo \'{"reward": 0.75, "style": 0.5}\' > "$L/reward.json"\n'
    r = run_verifier_local_sync(task_with(tmp_path, sh), tmp_path)
    assert (r.status, r.reward, r.rewards) == ("ok", 0.75, {"style": 0.5, "rule": 0.75})


def test_nonzero_exit_with_reward_is_ok(tmp_path):
    r = run_verifier_local_sync(task_with(tmp_path, LOGS + 'echo 0.5 > "$L/reward.txt"; exit 4\n'), tmp_path)
    assert (r.status, r.reward, r.exit_code) == ("ok", 0.5, 4)


@pytest.mark.slow
def test_timeout_kills_process_group(tmp_path):
    marker = tmp_path / "survivor"
    sh = LOGS + f'(sleep 3; touch {marker}) &\nsleep 30\necho 1 > "$L/reward.txt"\n'
    r = run_verifier_local_sync(task_with(tmp_path, sh, timeout=0.5), tmp_path)
    assert r.status == "verifier_error" and "timed out after 0.5s" in r.error
    anyio.run(anyio.sleep, 3.5)
    assert not marker.exists()


@pytest.mark.slow
def test_background_children_do_not_outlive_a_normal_exit(tmp_path):
    marker = tmp_path / "survivor"
    sh = LOGS + f'(sleep 2; touch {marker}) &\necho 1 > "$L/reward.txt"\n'
    r = run_verifier_local_sync(task_with(tmp_path, sh), tmp_path)
    assert r.reward == 1.0
    anyio.run(anyio.sleep, 2.5)
    assert not marker.exists()


def test_missing_workspace_is_verifier_error(tmp_path):
    r = run_verifier_local_sync(task_with(tmp_path, LOGS), tmp_path / "nope")
    assert r.status == "verifier_error" and "does not exist" in r.error


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"reward.txt": "1\n"}, (1.0, {})),
        ({"reward.txt": " 0.25 "}, (0.25, {})),
        ({"reward.json": '{"reward": 1, "a": 0}'}, (1.0, {"a": 0.0})),
        ({"reward.json": '{"a": 1, "b": 0}'}, (0.5, {"a": 1.0, "b": 0.0})),
        ({"reward.json": "0.5"}, (0.5, {})),
        ({"reward.txt": "0", "reward.json": '{"reward": 1}'}, (0.0, {})),
    ],
)
def test_read_reward(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert read_reward(tmp_path) == expected


@pytest.mark.parametrize(
    "name, text, msg",
    [
        ("reward.txt", "pass", r"reward.txt is not one number \(4 bytes\)"),
        ("reward.txt", "nan", "finite"),
        ("reward.json", "{", r"not valid JSON \(1 bytes\)"),
        ("reward.json", '{"a b": 1}', "key #1 is not a plain name"),
        ("reward.txt", "1" * 5000, "more than the 4096 allowed"),
        ("reward.json", '{"reward": "1"}', "expected a number"),
        ("reward.json", "[]", "expected an object"),
        ("reward.json", '{"reward": true}', "expected a number"),
    ],
)
def test_read_reward_errors(tmp_path, name, text, msg):
    (tmp_path / name).write_text(text)
    with pytest.raises(RewardError, match=msg):
        read_reward(tmp_path)


def test_read_reward_follows_no_link(tmp_path):
    """A reward file, or the verifier folder, replaced by a link to a file elsewhere is an error, and unread."""
    elsewhere = tmp_path / "host.txt"
    elsewhere.write_text("1")
    vdir = tmp_path / "verifier"
    vdir.mkdir()
    (vdir / "reward.txt").symlink_to(elsewhere)
    with pytest.raises(RewardError, match="reward.txt: .*symbolic link"):
        read_reward(vdir)
    (vdir / "reward.txt").unlink()
    os.mkfifo(vdir / "reward.json")  # would block a plain open()
    with pytest.raises(RewardError, match="not a regular file"):
        read_reward(vdir)
    real = tmp_path / "real"
    real.mkdir()
    (real / "reward.txt").write_text("1")
    linked = tmp_path / "linked"
    linked.symlink_to(real, target_is_directory=True)
    with pytest.raises(RewardError, match="symbolic link"):
        read_reward(linked)


@given(st.text(min_size=1, max_size=200).filter(lambda t: t.strip()), st.sampled_from(["reward.txt", "reward.json"]))
def test_reward_errors_never_quote_the_file(tmp_path_factory, text, name):
    d = tmp_path_factory.mktemp("v")
    content = f"\u2603{text}"  # a snowman first: never a number nor JSON, and in no message bridle writes
    (d / name).write_text(content)
    with pytest.raises(RewardError) as e:
        read_reward(d)
    assert "\u2603" not in str(e.value) and content not in str(e.value)


def test_verifier_output_is_not_followed_nor_summarized(tmp_path):
    """test.sh swaps its own output file for a link: the tail is read from the file bridle opened."""
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-CONTENT")
    sh = LOGS + f'echo visible\nln -sf {secret} "$L/test-stdout.txt"\necho 1 > "$L/reward.txt"\n'
    ws = tmp_path / "ws"
    ws.mkdir()
    r = run_verifier_local_sync(task_with(tmp_path, sh), ws)
    assert r.status == "ok" and "visible" in r.stdout_tail and "SECRET" not in r.stdout_tail
    assert r.summary() == "reward 1 (rule 1); test.sh exit code 0"


# -------------------------------------------------------------------------------------------- oracle
def test_solution_and_action_replay(tmp_path):
    sh = LOGS + 'if [ "$(cat a.txt)" = ok ]; then echo 1; else echo 0; fi > "$L/reward.txt"\n'
    solve = '#!/bin/bash\nset -e\ncd "${BRIDLE_WORKSPACE:-/app}"\ncat "$BRIDLE_SOLUTION/x" > a.txt\n'
    task = task_with(tmp_path, sh, solution={"solve.sh": solve, "x": "ok"})
    ws = tmp_path / "ws1"
    ws.mkdir()
    res = anyio.run(run_solution_local, task, ws)
    assert res.exit_code == 0 and (ws / "a.txt").read_text() == "ok"
    ws2 = tmp_path / "ws2"
    ws2.mkdir()
    (ws2 / "a.txt").write_text("no")
    actions = [
        OracleAction(tool="read_file", args={"path": "a.txt"}),
        OracleAction(tool="edit_file", args={"path": "a.txt", "old": "no", "new": "o"}),
        OracleAction(tool="bash", args={"command": "printf k >> a.txt && mkdir -p d"}),
        OracleAction(tool="write_file", args={"path": "d/e/f.txt", "content": "deep"}),
    ]
    out = anyio.run(replay_actions_local, actions, ws2)
    assert out[0] == "no"
    assert (ws2 / "a.txt").read_text() == "ok" and (ws2 / "d/e/f.txt").read_text() == "deep"
    assert run_verifier_local_sync(task, ws2).reward == 1.0


@pytest.mark.parametrize(
    "action, msg",
    [
        (
            OracleAction(tool="edit_file", args={"path": "a.txt", "old": "z", "new": ""}),
            "occurs 0 times",
        ),
        (OracleAction(tool="bash", args={"command": "exit 2"}), "bash exited with 2"),
        (OracleAction(tool="write_file", args={"path": "../x", "content": ""}), "leaves the workspace"),
    ],
)
def test_replay_errors(tmp_path, action, msg):
    (tmp_path / "a.txt").write_text("aa")
    with pytest.raises(ValueError, match=msg):
        anyio.run(replay_actions_local, [action], tmp_path)


def test_reward_json_written_by_python_checker(tmp_path):
    sh = (
        LOGS
        + "python3 -c \"import json,sys; json.dump({'reward': 0.2}, open(sys.argv[1], 'w'))\" \"$L/reward.json\"\n"
    )
    r = run_verifier_local_sync(task_with(tmp_path, sh), tmp_path)
    assert r.reward == pytest.approx(0.2) and json.loads(json.dumps(r.rewards)) == {"rule": 0.2}
