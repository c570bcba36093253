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

An optional rubric judge (any OpenAI-compatible ``/chat/completions`` endpoint) scores the workspace against
the task's rubric; the reward is then ``(1 - w) * rule + w * rubric`` (w = 0.3 by default).

test.sh runs as the current user: the local backend isolates the verifier from the harness in time, not by a
security boundary. The built-in tasks' checker adds one where it can (a child process as another uid when run as
root; see ``pipeline/rollout/taskgen/check_template.py``). Use the Docker backend for untrusted policies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, Literal

import aiohttp
import anyio
import msgspec

from pipeline.core.logs import get_logger
from pipeline.rollout.tasks import OracleAction, Task
from pipeline.rollout.untrusted import (
    RewardError,
    UntrustedFileError,
    fresh_dir,
    printable,
    read_reward,
    read_under,
    walk_files,
)

__all__ = ["RewardError", "read_reward"]  # re-exported: where the verifiers' callers have always found them

log = get_logger(component="verify")

DEFAULT_RUBRIC_WEIGHT = 0.3
TAIL_CHARS = 4000


class VerifierResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: Literal["ok", "verifier_error"]
    reward: float = 0.0
    rewards: dict[str, float] = msgspec.field(default_factory=dict)  # rule, rubric, and named parts
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


# ------------------------------------------------------------------------------------------------ judge
class JudgeConfig(msgspec.Struct, kw_only=True):
    base_url: str  # e.g. "http://127.0.0.1:8000/v1"
    model: str
    api_key: str = ""
    timeout_s: float = 120.0
    max_tokens: int = 512
    temperature: float = 0.0
    attempts: int = 2
    max_workspace_chars: int = 24_000
    max_file_chars: int = 4_000


class JudgeError(RuntimeError):
    pass


JUDGE_SYSTEM = (
    "You grade the work of an AI agent against a rubric. Read the task, the rubric and the final state of the "
    'agent\'s workspace. Reply with only a JSON object: {"score": <number from 0 to 1>, "reason": '
    '"<one sentence>"}.'
)


def workspace_snapshot(workspace: Path, max_chars: int, max_file_chars: int) -> str:
    """File list plus the head of each text file, capped at ``max_chars`` (what the judge sees).

    Only the workspace's own regular files are read: a symbolic link (to a file elsewhere on this host, say) is
    listed but never followed, nor is a file with other hard links; hidden files and ``__pycache__`` are left out.
    """
    parts: list[str] = []
    used = 0
    files = [
        (rel, st)
        for rel, st in walk_files(workspace)
        if not any(s.startswith(".") or s == "__pycache__" for s in rel.split("/"))
    ]
    for rel, st in files:
        body = f"=== {rel} === ({_not_shown(st)}, not shown)\n" if _not_shown(st) else ""
        if not body:
            try:
                data = read_under(workspace, rel, max_file_chars * 4, head=True)
                text = data[: max_file_chars * 4].decode("utf-8")[:max_file_chars]
                body = f"=== {rel} ===\n{text}\n"
            except UnicodeDecodeError:
                body = f"=== {rel} === (binary, {st.st_size} bytes)\n"
            except (OSError, UntrustedFileError):
                body = f"=== {rel} === (changed while read, not shown)\n"
        if used + len(body) > max_chars:
            parts.append(f"... {len(files) - len(parts)} more files not shown\n")
            break
        parts.append(body)
        used += len(body)
    return "".join(parts) or "(empty workspace)\n"


def _not_shown(st: os.stat_result) -> str:
    """Why a workspace entry's content is not shown to the judge ("" when it is)."""
    if stat.S_ISLNK(st.st_mode):
        return "symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink > 1:
        return "hard link"
    return ""


def parse_judge_score(content: str) -> tuple[float, str]:
    for m in re.finditer(r"\{.*?\}", content, re.DOTALL):
        try:
            obj = json.loads(m.group(0))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "score" in obj:
            score, reason = obj["score"], str(obj.get("reason", ""))
            break
    else:
        m2 = re.search(r"score\"?\s*[:=]\s*(-?[0-9.]+)", content)
        if not m2:
            raise JudgeError(f"judge reply has no score: {content[:200]!r}")
        score, reason = m2.group(1), ""
    try:
        x = float(score)
    except (TypeError, ValueError):
        raise JudgeError(f"judge score is not a number: {score!r}") from None
    if not (0.0 <= x <= 1.0):
        raise JudgeError(f"judge score {x} is outside [0, 1]")
    return x, reason


class RubricJudge:
    """LLM-as-judge through an OpenAI-compatible Chat Completions endpoint."""

    def __init__(self, config: JudgeConfig):
        self.config = config

    async def score(
        self, *, instruction: str, rubric: str, workspace: Path, transcript: str | None = None
    ) -> tuple[float, str]:
        c = self.config
        user = (
            f"## Task given to the agent\n{instruction.strip()}\n\n## Rubric\n{rubric.strip()}\n\n"
            f"## Final workspace\n{workspace_snapshot(workspace, c.max_workspace_chars, c.max_file_chars)}"
        )
        if transcript:
            user += f"\n## Agent transcript (end)\n{transcript[-c.max_workspace_chars // 2 :]}\n"
        body = {
            "model": c.model,
            "messages": [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": c.max_tokens,
            "temperature": c.temperature,
        }
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        url = c.base_url.rstrip("/") + "/chat/completions"
        last = ""
        for attempt in range(1, c.attempts + 1):
            try:
                timeout = aiohttp.ClientTimeout(total=c.timeout_s)
                async with (
                    aiohttp.ClientSession(timeout=timeout) as s,
                    s.post(url, json=body, headers=headers) as r,
                ):
                    text = await r.text()
                    status = r.status
                if status != 200:
                    last = f"HTTP {status} from {url}: {text[:300]}"
                    if status < 500 and status != 429:
                        break
                    await anyio.sleep(0.5 * attempt)
                    continue
                data = json.loads(text)
                content = data["choices"][0]["message"]["content"] or ""
                return parse_judge_score(content)
            except (aiohttp.ClientError, TimeoutError) as e:
                last = f"{type(e).__name__} talking to {url}: {e}"
                log.warning("judge_retry", attempt=attempt, error=last)
                await anyio.sleep(0.5 * attempt)
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise JudgeError(f"unexpected reply from {url} ({type(e).__name__}: {e})") from None
        raise JudgeError(last or f"judge at {url} gave no answer")


def mix_rewards(rule: float, rubric: float, rubric_weight: float = DEFAULT_RUBRIC_WEIGHT) -> float:
    if not 0.0 <= rubric_weight <= 1.0:
        raise ValueError(f"rubric_weight must be in [0, 1], got {rubric_weight}")
    return (1.0 - rubric_weight) * rule + rubric_weight * rubric


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
    judge: RubricJudge | None = None,
    rubric_weight: float = DEFAULT_RUBRIC_WEIGHT,
    transcript: str | None = None,
) -> VerifierResult:
    """Score ``workspace`` with the task's verifier. Call only after the harness has exited.

    ``logs_dir`` receives ``verifier/`` (reward, test-stdout.txt); a temporary one is used when omitted.
    With a ``judge`` and a task rubric, the reward is the weighted mix of rule and rubric scores.
    """
    ws = Path(await anyio.Path(workspace).resolve())
    limit_s = timeout_s if timeout_s is not None else task.config.verifier.timeout_sec
    t0 = time.monotonic()
    if not await anyio.Path(ws).is_dir():
        return VerifierResult(status="verifier_error", error=f"workspace {ws} does not exist")
    with tempfile.TemporaryDirectory(prefix="bridle-verify-") as tmp_s:
        tests, logs = await anyio.to_thread.run_sync(_lay_out, task, Path(tmp_s), logs_dir)
        env = script_env(ws, tests=tests, logs=logs, home=Path(tmp_s) / "home", extra=task.config.verifier.env)
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
    reward = rule
    if judge is not None and task.rubric:
        try:
            score, reason = await judge.score(
                instruction=task.instruction, rubric=task.rubric, workspace=ws, transcript=transcript
            )
        except JudgeError as e:
            return done(status="verifier_error", error=f"rubric judge failed: {e}", rewards=rewards,
                        duration_s=time.monotonic() - t0)
        rewards["rubric"] = score
        reward = mix_rewards(rule, score, rubric_weight)
        log.info("judged", task=task.id, rule=rule, rubric=score, reason=reason[:200])
    return done(status="ok", reward=reward, rewards=rewards, duration_s=time.monotonic() - t0)


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
    limit_s = timeout_s if timeout_s is not None else task.config.agent.timeout_sec
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
