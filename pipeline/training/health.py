"""Could an RL step learn anything? What the learner reports per step beside the optimizer's numbers
(docs/learner.md, "When a step cannot learn").

A GRPO advantage is a rollout's reward minus its group's mean, so a group whose rollouts all scored alike (zero
reward variance) adds nothing to the policy gradient, and a step made only of such groups moves the policy by its
KL and entropy terms alone. A run whose rollouts all fail, or all score 0 (a user's tasks the policy never
solves), would otherwise train with a zero policy gradient step after step and say nothing.

:func:`assess` counts, per step: the groups trained, dropped by the tree builder and left out as stale; the trained
groups without a reward spread; every rollout of the step's groups by status, trained or left out of the loss,
with the reasons they were left out. :meth:`StepHealth.warning` says in one line when the step could not learn.
Everything it quotes is bridle's own (statuses, exit codes, the tree builder's reasons, task ids and harness
names), never text a sandbox wrote: ``RolloutFinished.details`` does not reach the learner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import get_args

import numpy as np

from pipeline.messages import GroupDropped, LeftOut, RolloutStatus, TreeGroup
from pipeline.training import advantages as adv

STATUSES: tuple[str, ...] = get_args(RolloutStatus)
FIRST_REASONS = 3  # kinds of failure a warning names; the counts cover all of them
_TASK_CHARS = 60  # a task id is a folder name: long ones are cut in a warning line


@dataclass
class Failure:
    """One kind of left-out rollout: how many, and where it was seen first."""

    what: str  # "harness_error, exit code 1", "no usable calls", "group too stale"
    task_id: str
    harness: str
    count: int = 0

    def text(self) -> str:
        task = self.task_id if len(self.task_id) <= _TASK_CHARS else self.task_id[:_TASK_CHARS - 3] + "..."
        where = ", ".join(x for x in (f"task {task}" if task else "", self.harness) if x)
        return f"{self.count}x {self.what}" + (f" (first: {where})" if where else "")


@dataclass
class StepHealth:
    step: int
    groups: int = 0  # trained
    zero_variance: int = 0  # trained groups without a reward spread
    dropped: int = 0  # by the tree builder
    stale: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # every rollout the step's groups list
    trained_rollouts: int = 0  # in the loss
    left_out: int = 0  # listed but not in the loss
    rewards: list[float] = field(default_factory=list)  # of the rollouts in the loss
    failures: dict[str, Failure] = field(default_factory=dict)  # by ``what``, in order of first appearance
    resampled: int | None = None  # dynamic sampling: groups replaced for want of a reward spread (None: off)

    @property
    def rollouts(self) -> int:
        return sum(self.statuses.values())

    @property
    def cause(self) -> str:
        """Why the step could not learn ("" when it could): no_successful_rollout, nothing_trained,
        no_reward_spread."""
        if self.rollouts and not self.statuses["ok"]:
            return "no_successful_rollout"
        if not self.groups:
            return "nothing_trained"
        if self.zero_variance == self.groups:
            return "no_reward_spread"
        return ""

    def values(self) -> dict[str, float]:
        """The step's counts for metrics.jsonl. Counts with nothing to count are absent, never 0: no zero-variance
        fraction without a trained group, no rollout counts when the groups list no rollout (logs recorded
        before GroupDropped listed them)."""
        v: dict[str, float] = {"groups": self.groups, "groups_dropped": self.dropped, "stale_groups": self.stale}
        if self.resampled is not None:
            v["groups_resampled"] = self.resampled
        if self.groups:
            v["zero_var_groups"] = self.zero_variance
            v["zero_var_frac"] = self.zero_variance / self.groups
        if self.rollouts:
            v["rollouts"] = self.rollouts
            v.update({f"rollouts_{s}": self.statuses[s] for s in STATUSES})
            v.update({f"rollouts_{s}": n for s, n in self.statuses.items() if s not in STATUSES})
            v["rollouts_trained"] = self.trained_rollouts
            v["rollouts_left_out"] = self.left_out
        return v

    def warning(self, advantage: str = "grpo") -> str | None:
        """One line when the step could not learn, None when it could (``advantage``: the learner's estimator)."""
        cause = self.cause
        if not cause:
            return None
        rollouts = f"rollouts: {self.status_text()}"
        if cause == "no_successful_rollout":
            line = f"step {self.step}: no successful rollout: {self.status_text()}"
        elif cause == "nothing_trained":
            parts = [f"{self.dropped} groups dropped by the tree builder" if self.dropped else "",
                     f"{self.stale} too stale" if self.stale else ""]
            line = f"step {self.step}: nothing trained: {', '.join(p for p in parts if p)}; {rollouts}"
        else:
            equal = set(self.rewards)
            alike = (f"all rewards {_reward(equal.pop())}" if len(equal) == 1
                     else "each group's rollouts scored alike")
            effect = ("the policy gradient is zero" if advantage == "grpo"
                      else "only the value baseline's error moves the policy")
            line = (f"step {self.step}: no reward spread in {self.zero_variance}/{self.groups} groups ({alike}): "
                    f"{effect}; {rollouts}")
        if self.failures:
            kinds = list(self.failures.values())
            more = len(kinds) - FIRST_REASONS
            line += "; left out: " + "; ".join(f.text() for f in kinds[:FIRST_REASONS])
            if more > 0:
                line += f"; {more} more kind{'s' if more > 1 else ''}"
        if self.resampled:
            line += f"; {self.resampled} group{'s' if self.resampled > 1 else ''} already replaced (dynamic sampling)"
        if not self.groups:
            line += "; the policy is unchanged"
        return line

    def status_text(self) -> str:
        if not self.rollouts:
            return "n/a (the step's groups list none)"
        order = [*STATUSES, *sorted(set(self.statuses) - set(STATUSES))]
        return ", ".join(f"{self.statuses[s]} {s}" for s in order if self.statuses[s])


def _reward(x: float) -> str:
    return f"{x:.1f}" if x == round(x, 1) else f"{x:.3g}"


def assess(step: int, batch: Sequence[TreeGroup], untrained: Iterable[TreeGroup | GroupDropped],
           train_statuses: Iterable[str] = adv.DEFAULT_TRAIN_STATUSES,
           resampled: Sequence[TreeGroup] | None = None) -> StepHealth:
    """Count step ``step``: ``batch`` the groups it trains, ``untrained`` the others it counted (dropped by the tree
    builder, or stale); ``train_statuses`` as the learner's (the rollouts it scores and trains); ``resampled`` the
    groups dynamic sampling replaced (None: it is off)."""
    allowed = list(train_statuses)
    h = StepHealth(step=step, resampled=None if resampled is None else len(resampled))
    for g in batch:
        h.groups += 1
        valid = adv.rollout_valid(g.rollouts, allowed)
        rewards = np.array([r.reward for r in g.rollouts], dtype=np.float64)
        h.zero_variance += not adv.reward_spread(rewards, valid)
        h.rewards += rewards[valid].tolist()
        h.trained_rollouts += int(valid.sum())
        for r, ok in zip(g.rollouts, valid, strict=True):
            h.statuses[r.status] += 1
            if not ok:
                _fail(h, f"{r.status} (not in train_statuses)", g.task_id, g.harness)
        _left_out(h, g.left_out, g.task_id, g.harness)
    for g in untrained:
        if isinstance(g, GroupDropped):
            h.dropped += 1
            _left_out(h, g.left_out, g.task_id, g.harness)
            continue
        h.stale += 1
        for r in g.rollouts:
            h.statuses[r.status] += 1
            _fail(h, "group too stale", g.task_id, g.harness)
        _left_out(h, g.left_out, g.task_id, g.harness)
    return h


def _left_out(h: StepHealth, rollouts: list[LeftOut], task_id: str, harness: str) -> None:
    for r in rollouts:
        h.statuses[r.status] += 1
        if r.status != "ok":
            what = r.status + ("" if r.exit_code is None else f", exit code {r.exit_code}")
        elif r.reason == "group dropped":
            h.left_out += 1  # usable, in a group too small to train: its group's failures say why
            continue
        else:
            what = r.reason or "unusable"
        _fail(h, what, task_id, harness)


def _fail(h: StepHealth, what: str, task_id: str, harness: str) -> None:
    h.left_out += 1
    f = h.failures.setdefault(what, Failure(what, task_id, harness))
    f.count += 1
