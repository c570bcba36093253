"""What an evaluation runs: ``[eval]`` settings, the (task, harness) pairs with their column, held-out tasks, and the
bookkeeping of one evaluation round (docs/evaluation.md).

Columns follow the Harness Scaling paper: a white-box configuration of the space's training set is **in-space**,
one of its held-out set is **held-out** (in-space, never trained on), any other harness (the black-box ones) is
**out-of-space**; a white-box configuration in neither set is **custom**. In a training run in scaling mode the space
is the scheduler's, so in-space means trained on.

Held-out tasks. The evaluation's tasks come from their own source (``[eval].tasks``: a folder, or built-in families
with their own seed), which may not be the training source. Generated families can still produce the same task
from two seeds, so the rule is by content: an evaluation task whose instruction, environment and tests equal a
training or demonstration task's is dropped, and the count is logged and reported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from pipeline.core.config import ConfigError, NonNegInt, PosFloat, PosInt, Section
from pipeline.eval.report import Column
from pipeline.messages import (
    EvalTag,
    RolloutRequest,
    SamplingParams,
    SettledRollout,
    rollout_token,
    sampling_seed,
)
from pipeline.rollout.harness_space import HarnessConfig, Space, design
from pipeline.rollout.harnesses import harness_problem
from pipeline.rollout.scheduling import TaskSource
from pipeline.rollout.tasks import Task


class EvalSettings(Section):
    """``[eval]``: what an evaluation samples, how often, and what counts as a success."""

    tasks: TaskSource = msgspec.field(default_factory=lambda: TaskSource(seed=1_000_003))  # the held-out tasks
    harnesses: list[str] = msgspec.field(default_factory=list)  # explicit harnesses (black-box: out-of-space)
    # white-box configurations added per column: every configuration of the space's training set ("in-space")
    # and of its held-out set ("held-out"); configs_per_column > 0 takes that many of each, spread evenly
    columns: list[Literal["in-space", "held-out"]] = msgspec.field(default_factory=list)
    # the harness space whose sets the columns are (harness_space.design); a scaling run's must be its scheduler's
    space: Space = "published"
    space_seed: int = 0  # the draw of space = "random18", as [scheduler].space_seed
    configs_per_column: NonNegInt = 0  # 0: every configuration of each column's set
    # task folders never to evaluate on, besides this run's own training and demonstration tasks (run.py --eval
    # --checkpoint RUN_DIR adds that run's)
    exclude: list[str] = msgspec.field(default_factory=list)
    samples: PosInt = 4  # n rollouts per (task, harness) pair
    ks: Annotated[list[PosInt], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=lambda: [1])  # pass@k and pass^k for each k <= samples
    threshold: float = 1.0  # a rollout succeeds when its status is ok and its reward is at least this
    every_steps: NonNegInt = 0  # during training: a round after every N RL steps and after the cold start
    # set by run.py --eval (a graph with no learner): one round of the served policy at once, then stop
    standalone: bool = False
    max_groups_in_flight: PosInt = 4  # groups issued and not settled, at most
    temperature: PosFloat = 1.0  # the policy's sampling temperature
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # nucleus sampling (1: off)
    max_new_tokens: PosInt = 256  # per model call
    timeout_s: PosFloat = 300.0  # a rollout's wall-clock limit
    seed: int = 0  # sampling; [experiment].seed by default
    reloadable = frozenset({"every_steps", "max_groups_in_flight"})

    def check(self, name: str, exp: Any) -> None:
        if (why := self.tasks.problem()):
            raise ConfigError(f"{exp.source}: [{name}].tasks: {why}")
        if bad := [k for k in self.ks if k > self.samples]:
            raise ConfigError(f"{exp.source}: [{name}].ks = {bad} needs at least that many samples per pair; "
                              f"[{name}].samples = {self.samples}")
        if not self.harnesses and not self.columns:
            raise ConfigError(f"{exp.source}: [{name}]: nothing to evaluate; give harnesses, columns or both")
        for harness in self.harnesses:
            if why := harness_problem(harness):
                raise ConfigError(f"{exp.source}: [{name}].harnesses: {why}")
        sched = exp.kind_section("scheduler")
        if sched is not None and sched[1].mode == "scaling":
            theirs, ours = (sched[1].space, sched[1].space_seed), (self.space, self.space_seed)
            if theirs != ours:
                raise ConfigError(
                    f"{exp.source}: [{name}].space = {self.space!r}, space_seed = {self.space_seed} but "
                    f"[{sched[0]}] trains on space = {theirs[0]!r}, space_seed = {theirs[1]}: the in-space column "
                    f"would not be the configurations trained on; give [{name}] the same two settings")
        if sched is not None:
            for label in ("tasks", "sft_tasks"):
                src = getattr(sched[1], label)
                if src is not None and _same_source(src, self.tasks):
                    raise ConfigError(
                        f"{exp.source}: [{name}].tasks is [{sched[0]}].{label}: evaluation tasks must be held out "
                        "(another folder, or the built-in families with another seed)")
        has_learner = "learner" in exp.graph.actors.values()
        if self.standalone and has_learner:
            raise ConfigError(f"{exp.source}: [{name}].standalone evaluates the served policy once; it is set by "
                              "run.py --eval, whose graph has no learner")
        if self.every_steps and has_learner and name not in exp.graph.stop_after:
            raise ConfigError(f"{exp.source}: [{name}].every_steps = {self.every_steps}: add {name!r} to "
                              "[graph].stop_after, or the run ends before its last evaluation round")


def _same_source(a: TaskSource, b: TaskSource) -> bool:
    if a.tasks.startswith("builtin:") or b.tasks.startswith("builtin:"):
        return a.tasks == b.tasks and a.seed == b.seed
    return Path(a.tasks).resolve() == Path(b.tasks).resolve()


# ------------------------------------------------------------------------------------------------ pairs
def column_of(harness: str, space: Space = "published", seed: int = 0) -> Column:
    """A trained configuration is in-space even where the space also lists it as held out (space "all")."""
    name, _, variant = harness.partition(":")
    if name != "whitebox":
        return "out-of-space"
    train, held = design(space, seed)
    cfg = HarnessConfig.parse(variant or "S0T0O0C0W0")
    return "in-space" if cfg in train else "held-out" if cfg in held else "custom"


T = TypeVar("T")


def spread(items: Sequence[T], n: int) -> list[T]:
    """``n`` of ``items`` spread evenly from the first (all of them for n = 0 or n >= len)."""
    if not n:
        return list(items)
    return list(items[:: max(1, len(items) // n)][:n])


def harnesses(s: EvalSettings) -> list[tuple[str, Column]]:
    """Every harness the evaluation runs, with its column, in a stable order without repeats."""
    train, held = design(s.space, s.space_seed)
    out: list[str] = []
    for col in s.columns:
        out += ["whitebox:" + c.name for c in spread(train if col == "in-space" else held, s.configs_per_column)]
    out += s.harnesses
    return [(h, column_of(h, s.space, s.space_seed)) for h in dict.fromkeys(out)]


def content_hash(task: Task) -> str:
    """Identity of what a task asks and checks: its instruction, environment and tests (not its name or seed)."""
    h = hashlib.sha256(task.instruction.encode())
    root = task.root
    for sub in ("environment", "tests"):
        for p in sorted((root / sub).rglob("*")):
            if p.is_file() and not p.is_symlink():
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def held_out(tasks: list[Task], training: Iterable[Task]) -> tuple[list[Task], list[str]]:
    """(the tasks to evaluate, the ids dropped because a training or demonstration task has the same content)."""
    seen = {content_hash(t) for t in training}
    kept, dropped = [], []
    for t in tasks:
        (dropped if content_hash(t) in seen else kept).append(t)
    return kept, [t.id for t in dropped]


def oracle_steps(task: Task) -> int:
    """The reference solution's length in calls: its actions plus the final answer (0: no oracle)."""
    return len(task.oracle_actions) + 1 if task.oracle_actions else 0


# ------------------------------------------------------------------------------------------------ rounds
@dataclass
class Round:
    """One evaluation of one policy: every (task, harness) pair x samples, issued in groups, collected settled."""

    step: int  # the RL step whose policy is evaluated (-1: a standalone evaluation)
    groups: list[tuple[Task, str, Column]]
    settings: EvalSettings
    version: int = 0
    issued: int = 0
    settled: list[SettledRollout] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)  # group id -> rollouts not settled

    @property
    def expected(self) -> int:
        return len(self.groups) * self.settings.samples

    @property
    def done(self) -> bool:
        return len(self.settled) >= self.expected

    def next(self) -> list[RolloutRequest]:
        """The rollouts that may go out now (at most max_groups_in_flight groups unsettled)."""
        s = self.settings
        out: list[RolloutRequest] = []
        while self.issued < len(self.groups) and len(self.in_flight) < s.max_groups_in_flight:
            task, harness, column = self.groups[self.issued]
            gid = f"eval{max(self.step, 0):05d}-{self.issued:04d}" + ("" if self.step >= 0 else "-x")
            tag = EvalTag(step=self.step, column=column, family=str(task.config.metadata.get("family", "")),
                          oracle_steps=oracle_steps(task))
            sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
            out += [RolloutRequest(
                rollout_id=f"{gid}-r{i}", group_id=gid, index=i, group_size=s.samples, task_id=task.id,
                harness=harness, token=rollout_token(), policy_version=self.version,
                sampling=msgspec.structs.replace(sampling, seed=sampling_seed(s.seed, f"{gid}-r{i}")),
                timeout_s=s.timeout_s, purpose="eval", task_path=task.path, eval=tag,
            ) for i in range(s.samples)]
            self.in_flight[gid] = s.samples
            self.issued += 1
        return out

    def add(self, r: SettledRollout) -> bool:
        """A settled rollout; False when it is not one of this round's."""
        left = self.in_flight.get(r.request.group_id)
        if left is None:
            return False
        self.settled.append(r)
        if left <= 1:
            del self.in_flight[r.request.group_id]
        else:
            self.in_flight[r.request.group_id] = left - 1
        return True


def plan_round(step: int, tasks: list[Task], s: EvalSettings, version: int = 0) -> Round:
    pairs = [(t, h, c) for t in tasks for h, c in harnesses(s)]
    return Round(step=step, groups=pairs, settings=s, version=version)


@dataclass
class Rounds:
    """Which policy is evaluated when. Standalone (``run.py --eval``): one round of the served policy, at once.
    During training: with ``every_steps = N``, a round after the cold start (the learner's step-0 update), after
    every N-th RL step and after the last step; with ``every_steps = 0`` none (a hot reload can turn them on). One
    round at a time; later ones wait. Pure bookkeeping: the actor feeds it and sends."""

    settings: EvalSettings
    steps: int  # the run's RL steps
    current: Round | None = None
    waiting: list[tuple[int, int]] = field(default_factory=list)  # (step, version)
    complete: bool = False

    def updated(self, step: int, version: int) -> bool:
        """The learner published the policy of ``step``; True when it is to be evaluated."""
        every = self.settings.every_steps
        if every and (step % every == 0 or step >= self.steps):
            self.waiting.append((step, version))
            return True
        if step >= self.steps and self.current is None and not self.waiting:
            self.complete = True  # the last step, nothing (more) to evaluate
        return False

    def start(self, tasks: list[Task]) -> Round | None:
        """The next round to issue, if none is running and one is due."""
        if self.current is not None or self.complete:
            return None
        if self.settings.standalone:
            self.current = plan_round(-1, tasks, self.settings)
        elif self.waiting:
            step, version = self.waiting.pop(0)
            self.current = plan_round(step, tasks, self.settings, version)
        return self.current

    def settled(self, r: SettledRollout) -> Round | None:
        """A settled rollout; the round it completed, if it did."""
        rnd = self.current
        if rnd is None or not rnd.add(r) or not rnd.done:
            return None
        self.current = None
        if rnd.step < 0 or rnd.step >= self.steps:
            self.complete = True
        return rnd
