"""The learner's bookkeeping apart from the optimizer: when cold-start SFT runs, when an RL step is complete, which
groups are too stale, when to checkpoint, where a resumed run stands.

The learner actor feeds :class:`LearnerLoop` every TreeGroup / GroupDropped it receives and carries out what it
returns (:class:`ColdStartReady`, :class:`StepReady`); the loop itself touches no model, so every rule is
unit-tested (tests/training/test_loop.py).

- Demonstration packs (``purpose == "sft"``) are collected until as many as the tree builder announced
  (``packs``) have arrived, trained or dropped; then the cold start runs once.
- RL steps are counted in training groups *received*, trained or dropped: every ``groups_per_step`` of them make
  one step, so the scheduler's staleness bound (which counts issued groups) and the learner agree on step numbers
  and a dropped group never stalls the run.
- Dynamic sampling (``dynamic_sampling`` > 0): a training group without a reward spread whose ``resample`` number
  is below the bound is neither trained nor counted; the learner asks the scheduler for the next group of its slot
  (:class:`Resample`). The scheduler issues every one asked for, so the step's count still completes. Stale and
  dropped groups count as before: a replacement would be no fresher.
- A group whose issue version lags the learner's by more than ``max_staleness`` is not trained (a backstop: the
  scheduler already bounds it).
- A step is checkpointed before it is announced when it is the last one or a multiple of ``checkpoint_every``, so a
  step the event log shows as done is always in a checkpoint and ``--resume`` neither repeats nor skips one.
- The cold start's SFT updates (:func:`sft_plan`): every pack once per epoch, in an order shuffled anew each epoch
  by a generator seeded once for the whole plan, ``batch_groups`` packs per update (the last one of an epoch may be
  smaller).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pipeline.messages import GroupDropped, TreeGroup


@dataclass
class ColdStartReady:
    """Every demonstration pack has arrived: run SFT on ``packs`` (``dropped`` packs were unusable)."""

    packs: list[TreeGroup]
    dropped: int


@dataclass
class SftUpdate:
    """One optimizer update of the cold start: ``packs`` trained together, in pass ``epoch`` (0-based)."""

    epoch: int
    packs: list[TreeGroup]


def sft_plan(packs: list[TreeGroup], *, epochs: int, batch_groups: int, seed: int) -> list[SftUpdate]:
    """The cold start's updates, in order. The same packs and seed give the same plan (replay depends on it)."""
    rng = random.Random(seed)
    plan: list[SftUpdate] = []
    for epoch in range(epochs):
        order = list(packs)
        rng.shuffle(order)
        plan.extend(SftUpdate(epoch, order[i:i + batch_groups]) for i in range(0, len(order), batch_groups))
    return plan


@dataclass
class StepReady:
    """RL step ``step`` (1-based) has all its groups: train ``batch`` (may be empty), then checkpoint if asked."""

    step: int
    batch: list[TreeGroup]
    checkpoint: bool
    last: bool
    stale: list[tuple[str, int]] = field(default_factory=list)  # (group id, lag) of groups left out as too old
    resampled: list[TreeGroup] = field(default_factory=list)  # replaced for want of a reward spread
    # every other group the step counted, in arrival order: dropped by the tree builder, or too stale (the
    # rollouts of a step are reported whether they were trained or not: pipeline.training.health)
    untrained: list[TreeGroup | GroupDropped] = field(default_factory=list)


@dataclass
class Resample:
    """Dynamic sampling: ``group`` had no reward spread; ask for group ``group.resample + 1`` of its slot."""

    group: TreeGroup

    @property
    def next(self) -> int:
        return self.group.resample + 1


@dataclass
class LearnerLoop:
    steps: int
    groups_per_step: int
    checkpoint_every: int = 1  # 0: only after the last step
    steps_done: int = 0  # RL steps finished (set from the checkpoint on resume)
    cold_start_done: bool = False
    received: int = 0  # training groups received in the current run, trained or dropped (not replaced ones)
    dynamic_sampling: int = 0  # replacements per slot of a step ([run].dynamic_sampling)
    _packs: list[TreeGroup] = field(default_factory=list)
    _packs_seen: int = 0
    _batch: list[TreeGroup] = field(default_factory=list)
    _stale: list[tuple[str, int]] = field(default_factory=list)
    _untrained: list[TreeGroup | GroupDropped] = field(default_factory=list)
    _resampled: list[TreeGroup] = field(default_factory=list)

    @classmethod
    def resumed(cls, steps: int, groups_per_step: int, checkpoint_every: int, steps_done: int,
                dynamic_sampling: int = 0) -> LearnerLoop:
        """After a resume: the cold start is behind it, and counting restarts at the first unfinished step."""
        return cls(steps, groups_per_step, checkpoint_every, steps_done=steps_done, cold_start_done=True,
                   received=steps_done * groups_per_step, dynamic_sampling=dynamic_sampling)

    @property
    def finished(self) -> bool:
        # steps = 0 is a cold-start-only run (the config requires demonstrations then): done once SFT is
        return self.steps_done >= self.steps and (self.steps > 0 or self.cold_start_done)

    def receive(self, msg: TreeGroup | GroupDropped, *, version: int, max_staleness: int,
                spread: bool = True) -> ColdStartReady | StepReady | Resample | None:
        """Account for one message; return what to do now, if anything. ``spread``: whether a training group's
        rewards differ (over the rollouts the learner scores), for dynamic sampling."""
        if msg.purpose == "sft":
            return self._demonstration(msg)
        lag = version - msg.issued_version if isinstance(msg, TreeGroup) else 0  # one version per RL step
        if isinstance(msg, TreeGroup) and not spread and lag <= max_staleness and msg.resample < self.dynamic_sampling:
            self._resampled.append(msg)
            return Resample(msg)
        self.received += 1
        if isinstance(msg, TreeGroup):
            if lag > max_staleness:
                self._stale.append((msg.group_id, lag))
                self._untrained.append(msg)
            else:
                self._batch.append(msg)
        else:
            self._untrained.append(msg)
        if self.received % self.groups_per_step:
            return None
        self.steps_done += 1
        every = self.checkpoint_every
        last = self.steps_done >= self.steps
        ready = StepReady(step=self.steps_done, batch=self._batch, stale=self._stale, last=last,
                          checkpoint=last or bool(every and self.steps_done % every == 0), untrained=self._untrained,
                          resampled=self._resampled)
        self._batch, self._stale, self._untrained, self._resampled = [], [], [], []
        return ready

    def _demonstration(self, msg: TreeGroup | GroupDropped) -> ColdStartReady | None:
        if self.cold_start_done:
            raise ValueError(f"demonstration pack {msg.group_id} arrived after the cold start was trained")
        if msg.packs < 1:
            raise ValueError(f"demonstration pack {msg.group_id} does not say how many packs the cold start has "
                             "(TreeGroup.packs); the tree builder sets it from RolloutRequest.demonstrations")
        self._packs_seen += 1
        if isinstance(msg, TreeGroup):
            self._packs.append(msg)
        if self._packs_seen < msg.packs:
            return None
        self.cold_start_done = True
        ready = ColdStartReady(packs=self._packs, dropped=self._packs_seen - len(self._packs))
        self._packs = []
        return ready
