"""Verifiers on the local backend: run a task's ``tests/test.sh`` over a finished workspace, read the reward.

The contract is Harbor's (docs/rollout.md, "Verifiers"): only after the harness has exited, ``tests/`` is copied into a
fresh directory the harness never saw, ``logs/verifier/`` is emptied (so nothing planted there counts),
``bash test.sh`` runs from the workspace under the verifier timeout in its own process group (the whole group is
killed afterwards, so stragglers cannot outlive it), and the reward is read from ``logs/verifier/reward.txt`` or
``reward.json``. Scripts find the directories through ``BRIDLE_WORKSPACE``, ``BRIDLE_TESTS``, ``BRIDLE_LOGS``
and ``BRIDLE_SOLUTION``.

What the sandbox wrote is read through :mod:`pipeline.rollout.untrusted` (no links followed, size caps) and never
quoted into errors: :meth:`VerifierResult.summary` and ``error`` are bridle's own words. ``stdout_tail`` (test.sh's
output, control characters removed) is for a person at a terminal, never for ``RolloutFinished.details``.

The rubric judge that may mix its score into this rule reward is :mod:`pipeline.rollout.judge`.

test.sh runs as the current user: the local backend isolates the verifier from the harness in time, not by a
security boundary. The built-in tasks' checker adds one where it can (a child process as another uid when run as
root; see ``pipeline/rollout/taskgen/check_template.py``). Use the Docker backend for untrusted policies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec

from pipeline.rollout.tasks import OracleAction, Task
from pipeline.rollout.untrusted import (
    RewardError,
    fresh_dir,
    printable,
    read_reward,
)

__all__ = ["RewardError", "read_reward"]  # re-exported: where the verifiers' callers have always found them

TAIL_CHARS = 4000
DEFAULT_AGENT_TIMEOUT_S = 300.0  # the oracle's limit for a task whose [agent] gives none


class VerifierResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: Literal["ok", "verifier_error"]
    reward: float = 0.0
    rewards: dict[str, float] = msgspec.field(default_factory=dict)  # rule, and the named parts of reward.json
    exit_code: int | None = None
    stdout_tail: str = ""  # test.sh's output, for a person; never put into RolloutFinished.details
    error: str = ""  # why status is verifier_error, in bridle's words (no byte of what the sandbox wrote)
    duration_s: float = 0.0

    def summary(self) -> str:
        """One line about the verdict for ``RolloutFinished.details``: bridle's words only."""
        return summarize(self.reward, self.rewards, self.exit_code) if self.status == "ok" else self.error


def summarize(reward: float, rewards: dict[str, float], exit_code: int | None) -> str:
    """``reward 1 (rule 1); test.sh exit code 0``: a verdict in bridle's words (part names are checked plain names)."""
    parts = ", ".join(f"{k} {v:g}" for k, v in sorted(rewards.items()))
    return f"reward {reward:g} ({parts}); test.sh exit code {exit_code}"


class ScriptResult(msgspec.Struct, kw_only=True):
    exit_code: int | None  # None when it timed out
    timed_out: bool
    output_tail: str  # control characters removed


# ------------------------------------------------------------------------------------------ processes
def _kill_group(pgid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _tail_of(f: Any, limit: int = TAIL_CHARS) -> str:
    """The end of the open file ``f`` (read through the descriptor the host wrote with: a link put in its place
    later is not followed)."""
    f.flush()
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - limit * 4))
    return printable(f.read().decode("utf-8", "replace")[-limit:])


def script_env(
    workspace: Path,
    *,
    tests: Path | None,
    logs: Path,
    home: Path,
    solution: Path | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """A small environment for task scripts: no inherited secrets, the BRIDLE_* paths, a throw-away HOME."""
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "BRIDLE_WORKSPACE": str(workspace),
        "BRIDLE_LOGS": str(logs),
    }
    if tests is not None:
        env["BRIDLE_TESTS"] = str(tests)
    if solution is not None:
        env["BRIDLE_SOLUTION"] = str(solution)
    env.update(extra or {})
    return env


async def run_script(
    argv: list[str], *, cwd: Path, env: dict[str, str], limit_s: float, output: Path
) -> ScriptResult:
    """Run ``argv`` in its own process group with stdout+stderr to ``output`` (a new file); after ``limit_s``
    seconds, or when it exits, kill the group."""
    fd = await anyio.to_thread.run_sync(
        partial(os.open, output, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    )
    with os.fdopen(fd, "w+b") as out:
        proc = await anyio.open_process(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with anyio.move_on_after(limit_s) as scope:
                await proc.wait()
        finally:
            # Also on normal exit: background children of the script must not outlive it.
            _kill_group(proc.pid)
            with anyio.CancelScope(shield=True):
                await proc.wait()
        tail = await anyio.to_thread.run_sync(_tail_of, out)
    timed_out = scope.cancelled_caught
    return ScriptResult(exit_code=None if timed_out else proc.returncode, timed_out=timed_out, output_tail=tail)


# --------------------------------------------------------------------------------------------- verifier
def _lay_out(task: Task, tmp: Path, logs_dir: str | Path | None) -> tuple[Path, Path]:
    """(tests, logs) for one verification: a fresh copy of ``tests/`` in ``tmp`` (a private folder: 0700, so a
    process of another uid cannot reach it) and an empty ``logs/verifier/`` (0700)."""
    logs = Path(logs_dir).absolute() if logs_dir is not None else tmp / "logs"
    if logs.is_symlink() or not logs.is_dir():
        fresh_dir(logs)
    fresh_dir(logs / "verifier", 0o700)
    tests = tmp / "tests"
    # Links inside the task's own tests/ are the task author's (trusted); they are kept as they are.
    shutil.copytree(task.tests_dir, tests, symlinks=True)
    (tmp / "home").mkdir()
    return tests, logs


async def run_verifier_local(
    task: Task,
    workspace: str | Path,
    timeout_s: float | None = None,
    *,
    logs_dir: str | Path | None = None,
    tmp_prefix: str = "bridle-verify-",
) -> VerifierResult:
    """Score ``workspace`` with the task's verifier. Call only after the harness has exited.

    ``logs_dir`` receives ``verifier/`` (reward, test-stdout.txt); a temporary one is used when omitted. The
    verifier's own folder (tests, HOME) is a fresh temporary one named ``tmp_prefix...`` (a run's prefix lets its
    restart remove what a kill -9 left).
    """
    ws = Path(await anyio.Path(workspace).resolve())
    limit_s = timeout_s if timeout_s is not None else task.config.verifier.timeout_sec
    t0 = time.monotonic()
    if not await anyio.Path(ws).is_dir():
        return VerifierResult(status="verifier_error", error=f"workspace {ws} does not exist")
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp_s:
        tests, logs = await anyio.to_thread.run_sync(_lay_out, task, Path(tmp_s), logs_dir)
        # PYTHONSAFEPATH: `python -m` / `-c` from the workspace must not import what the agent left there (as in
        # Docker; a task's [verifier] env may set it otherwise).
        env = script_env(ws, tests=tests, logs=logs, home=Path(tmp_s) / "home",
                         extra={"PYTHONSAFEPATH": "1", **task.config.verifier.env})
        try:
            res = await run_script(["bash", str(tests / "test.sh")], cwd=ws, env=env, limit_s=limit_s,
                                   output=logs / "verifier" / "test-stdout.txt")
        except OSError as e:
            return VerifierResult(status="verifier_error", error=f"could not start bash test.sh: {e.strerror}")
        done = partial(VerifierResult, exit_code=res.exit_code, stdout_tail=res.output_tail)
        if res.timed_out:
            return done(status="verifier_error", error=f"test.sh timed out after {limit_s:g}s",
                        duration_s=time.monotonic() - t0)
        try:
            rule, parts = await anyio.to_thread.run_sync(read_reward, logs / "verifier")
        except RewardError as e:
            return done(status="verifier_error", error=f"{e} (test.sh exit code {res.exit_code})",
                        duration_s=time.monotonic() - t0)
    rewards = {**parts, "rule": rule}
    return done(status="ok", reward=rule, rewards=rewards, duration_s=time.monotonic() - t0)


def run_verifier_local_sync(
    task: Task, workspace: str | Path, timeout_s: float | None = None, **kw: Any
) -> VerifierResult:
    return anyio.run(partial(run_verifier_local, task, workspace, timeout_s, **kw))


# ----------------------------------------------------------------------------------------------- oracle
def _oracle_dirs(task: Task, tmp: Path) -> Path:
    import shutil

    sol = tmp / "solution"
    shutil.copytree(task.root / "solution", sol, symlinks=True)
    (tmp / "home").mkdir()
    return sol


async def run_solution_local(task: Task, workspace: str | Path, timeout_s: float | None = None) -> ScriptResult:
    """Run ``solution/solve.sh`` over ``workspace`` (the oracle agent)."""
    if task.solve_sh is None:
        raise FileNotFoundError(f"task {task.id} has no solution/solve.sh")
    ws = Path(await anyio.Path(workspace).resolve())
    limit_s = timeout_s if timeout_s is not None else (task.config.agent.timeout_sec or DEFAULT_AGENT_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="bridle-oracle-") as tmp_s:
        tmp = Path(tmp_s)
        sol = await anyio.to_thread.run_sync(_oracle_dirs, task, tmp)
        env = script_env(ws, tests=None, logs=tmp / "logs", home=tmp / "home", solution=sol)
        return await run_script(
            ["bash", str(sol / "solve.sh")], cwd=ws, env=env, limit_s=limit_s, output=tmp / "out.txt"
        )


def _inside(workspace: Path, rel: str) -> Path:
    p = (workspace / rel).resolve()
    if p != workspace and workspace not in p.parents:
        raise ValueError(f"path {rel!r} leaves the workspace {workspace}")
    return p


def _apply_file_action(ws: Path, i: int, a: OracleAction) -> str:
    """One write_file / read_file / edit_file action on ``ws``; returns its result."""
    if a.tool == "write_file":
        p = _inside(ws, a.args["path"])
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(a.args["content"], encoding="utf-8")
        return f"wrote {len(a.args['content'])} characters to {a.args['path']}"
    if a.tool == "read_file":
        return _inside(ws, a.args["path"]).read_text(encoding="utf-8")
    p = _inside(ws, a.args["path"])
    text = p.read_text(encoding="utf-8")
    n = text.count(a.args["old"])
    if n != 1:
        raise ValueError(f"action {i}: edit_file old occurs {n} times in {a.args['path']}, need 1")
    p.write_text(text.replace(a.args["old"], a.args["new"]), encoding="utf-8")
    return f"edited {a.args['path']}"


async def replay_actions_local(
    actions: list[OracleAction], workspace: str | Path, bash_timeout_s: float = 60.0
) -> list[str]:
    """Apply neutral tool calls to ``workspace`` with the reference semantics; return each call's result.

    This is the meaning a harness must give these tools when it replays ``oracle_actions``: paths are relative
    to the workspace, ``write_file`` creates parent directories, ``edit_file`` replaces ``old`` which must
    occur exactly once, ``bash`` runs in the workspace. Raises ``ValueError`` when an action cannot apply.
    """
    ws = Path(await anyio.Path(workspace).resolve())
    results: list[str] = []
    for i, a in enumerate(actions):
        if a.tool != "bash":
            results.append(await anyio.to_thread.run_sync(_apply_file_action, ws, i, a))
            continue
        with tempfile.TemporaryDirectory(prefix="bridle-bash-") as tmp_s:
            tmp = Path(tmp_s)
            env = script_env(ws, tests=None, logs=tmp / "logs", home=tmp)
            r = await run_script(["bash", "-c", a.args["command"]], cwd=ws, env=env, limit_s=bash_timeout_s,
                                 output=tmp / "out.txt")
        if r.exit_code != 0:
            raise ValueError(
                f"action {i}: bash exited with {r.exit_code} (timed out: {r.timed_out}): {r.output_tail[-500:]}"
            )
        results.append(r.output_tail)
    return results
