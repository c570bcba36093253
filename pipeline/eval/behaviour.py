"""Behavioural metrics from recorded trajectories, with no judge (docs/evaluation.md has the exact definitions).

Each metric reads the main-agent calls of settled rollouts (their :class:`~pipeline.messages.CallTrace`, recorded by
the proxy) and is reported with the number of rollouts (or calls) it was measured on. Where a metric's condition
never occurred (no failed tool result, nothing written, no success) it is missing, never 0 or 100 %:

- **format robustness**: the share of main calls whose output is a well-formed tool call to an offered tool, or a
  final answer (text with no tool call). Calls that end with malformed tool-call markup, call a tool that was not
  offered, or produce nothing are failures. Pooled over calls.
- **error recovery**: of the rollouts in which at least one tool result was a failure, the share that succeeded.
- **self-verification**: of the rollouts that wrote something (a write or edit tool, or a shell command that writes
  a file), the share in which a read of a written path or a shell command (running or inspecting the work) came
  after the last write.
- **tool coverage**: per rollout, distinct tools used / distinct tools offered; mean over rollouts.
- **step efficiency**: per successful rollout, the task's oracle length (its actions plus the final answer) /
  the main calls it took, capped at 1; mean over successful rollouts of tasks that have an oracle.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Literal

import msgspec

from pipeline.eval.estimators import Estimate, mean_ci
from pipeline.messages import CallTrace, SettledRollout, ToolUse
from pipeline.rollout.harness_space import CANONICAL_TOOLS, HarnessConfig, tool_name_for
from pipeline.rollout.harnesses import HARNESSES

Role = Literal["write", "edit", "read", "shell", "other"]
RoleOf = Callable[[str], Role]  # a harness's tool name -> what the tool does

PATH_KEYS = ("file_path", "path", "filename", "file", "absolute_path")
COMMAND_KEYS = ("command", "cmd", "script", "code")
# A shell command that writes a file: a redirection into a path, tee, or a heredoc into cat (how shell-only
# harnesses such as Codex write files).
_SHELL_WRITE = re.compile(r"(?<![<>&0-9])>{1,2}\s*[^\s&|>]|\btee\b|\bcat\s*<<|\bsed\s+-i\b|\bapply_patch\b")

METRICS = ("format_robustness", "error_recovery", "self_verification", "tool_coverage", "step_efficiency")


class Behaviour(msgspec.Struct, kw_only=True):
    """One metric per field, each a mean with its 95 % interval and the count it was measured on."""

    format_robustness: Estimate
    error_recovery: Estimate
    self_verification: Estimate
    tool_coverage: Estimate
    step_efficiency: Estimate
    rollouts: int
    calls: int

    def values(self) -> dict[str, float]:
        """The measured means (missing ones left out), for metrics.jsonl."""
        return {m: e.mean for m in METRICS if (e := getattr(self, m)).mean is not None}


# The white-box harness's canonical tools; its T realizations rename them (tool_name_for).
_CANONICAL_ROLES: dict[str, Role] = {"write_file": "write", "edit_file": "edit", "read_file": "read", "bash": "shell",
                                     "python": "shell"}
def tool_roles(harness: str) -> RoleOf:
    """What each of ``harness``'s tools does (write, edit, read, shell, other)."""
    name, _, variant = harness.partition(":")
    if name == "whitebox":
        cfg = HarnessConfig.parse(variant or "S0T0O0C0W0")
        table = {tool_name_for(cfg, c): _CANONICAL_ROLES.get(c, "other") for c in CANONICAL_TOOLS}
    else:
        adapter = HARNESSES.get(name)
        table = dict(adapter.tool_roles) if adapter else {}
    return lambda tool: table.get(tool, "other")  # type: ignore[return-value]


def target(use: ToolUse) -> str:
    for k in PATH_KEYS:
        if use.args.get(k):
            return use.args[k].removeprefix("./")
    return ""


def command(use: ToolUse) -> str:
    return next((use.args[k] for k in COMMAND_KEYS if use.args.get(k)), "")


def _is_write(use: ToolUse, role: Role) -> bool:
    return role in ("write", "edit") or (role == "shell" and bool(_SHELL_WRITE.search(command(use))))


def _main_traces(r: SettledRollout) -> list[CallTrace]:
    return [c.trace for c in sorted(r.calls, key=lambda c: c.seq) if c.label == "main" and c.trace is not None]


def _well_formed(t: CallTrace) -> bool:
    if t.output == "answer":
        return True
    return t.output == "tool_calls" and all(u.name in t.offered for u in t.uses)


def _verified(uses: list[tuple[ToolUse, Role]]) -> bool | None:
    """None: nothing was written; else whether a read of a written path or a shell command followed the last write."""
    last = max((i for i, (u, role) in enumerate(uses) if _is_write(u, role)), default=None)
    if last is None:
        return None
    written = {target(u) for u, role in uses[: last + 1] if role in ("write", "edit") and target(u)}
    for u, role in uses[last + 1 :]:
        if role == "shell" or (role == "read" and (not written or target(u) in written)):
            return True
    return False


def behaviour(rollouts: Iterable[SettledRollout], role_of: Callable[[str], RoleOf] = tool_roles, *,
              succeeded: Callable[[SettledRollout], bool], oracle_steps: Callable[[str], int | None]) -> Behaviour:
    """The five metrics over ``rollouts``. ``role_of(harness)`` maps that harness's tool names to roles;
    ``succeeded`` says whether a rollout counts as a success; ``oracle_steps(task_id)`` is the length of the task's
    reference solution in calls (None: no oracle)."""
    formed: list[float] = []
    recovery: list[float] = []
    verification: list[float] = []
    coverage: list[float] = []
    efficiency: list[float] = []
    n = 0
    for r in rollouts:
        traces = _main_traces(r)
        if not traces:
            continue
        n += 1
        roles = role_of(r.request.harness)
        ok = succeeded(r)
        formed += [float(_well_formed(t)) for t in traces]
        if any(o.error for t in traces for o in t.outcomes):
            recovery.append(float(ok))
        uses = [(u, roles(u.name)) for t in traces for u in t.uses]
        if (v := _verified(uses)) is not None:
            verification.append(float(v))
        offered = {name for t in traces for name in t.offered}
        if offered:
            coverage.append(len({u.name for u, _ in uses} & offered) / len(offered))
        steps = oracle_steps(r.request.task_id)
        if ok and steps:
            efficiency.append(min(1.0, steps / len(traces)))
    return Behaviour(format_robustness=mean_ci(formed), error_recovery=mean_ci(recovery),
                     self_verification=mean_ci(verification), tool_coverage=mean_ci(coverage),
                     step_efficiency=mean_ci(efficiency), rollouts=n, calls=len(formed))
