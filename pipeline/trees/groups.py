"""Which settled rollouts make a unit of training data: a (task, harness) group, or a pack of demonstrations.

The tree builder actor (``actors/tree.py``) feeds :class:`Grouper` every SettledRollout and sends what it returns.

- Training (and eval) rollouts wait until their whole group (``RolloutRequest.group_size`` rollouts) has settled;
  the group is then built and packed (:func:`pipeline.trees.packing.build_group`) into a TreeGroup, or dropped.
- Demonstrations (purpose ``sft``) of *different* tasks are packed ``sft_pack`` at a time into one tree, so the
  prompt they share is stored and computed once. ``RolloutRequest.demonstrations`` says how many the cold start
  issues in all: the last pack may be partial, and every pack (trained or dropped) carries the number of packs, so
  the learner knows when the cold start is complete. The pack size is fixed at the first demonstration.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.messages import GroupDropped, SettledRollout, TreeGroup
from pipeline.trees.packing import GroupBuild, build_group, pack_demonstrations
from pipeline.trees.tree import TreeOptions


@dataclass
class Completed:
    """A unit ready to go out; ``build`` (training groups only) holds every tree and summary, for metrics."""

    message: TreeGroup | GroupDropped
    rollouts: list[SettledRollout]
    build: GroupBuild | None = None


@dataclass
class Grouper:
    options: Callable[[], TreeOptions]  # read per group: [tree] max_leaves / include_aux are hot-reloadable
    sft_pack: int
    _waiting: dict[str, list[SettledRollout]] = field(default_factory=dict)
    _demos: list[SettledRollout] = field(default_factory=list)
    _demos_seen: int = 0
    _packs_sent: int = 0
    _pack_size: int = 0  # fixed at the first demonstration
    _packs_total: int = 0

    @property
    def incomplete_groups(self) -> int:
        return len(self._waiting)

    def add(self, s: SettledRollout) -> Completed | None:
        if s.request.purpose == "sft":
            return self._demonstration(s)
        gid = s.request.group_id
        group = self._waiting.setdefault(gid, [])
        group.append(s)
        if len(group) < s.request.group_size:
            return None
        del self._waiting[gid]
        build = build_group(group, self.options())
        msg = build.message
        first = group[0].request
        if isinstance(msg, GroupDropped):
            msg.purpose = first.purpose
        else:
            msg.purpose = first.purpose
            msg.issued_version = min(r.request.policy_version for r in group)
            msg.temperature = first.sampling.temperature
        return Completed(msg, group, build)

    def _demonstration(self, s: SettledRollout) -> Completed | None:
        if not self._pack_size:
            self._pack_size = self.sft_pack
            total = s.request.demonstrations
            # 0: a log from before demonstrations were counted; packs are then only ever full ones.
            self._packs_total = math.ceil(total / self._pack_size) if total else 0
        self._demos.append(s)
        self._demos_seen += 1
        last = bool(self._packs_total) and self._demos_seen >= s.request.demonstrations
        if len(self._demos) < self._pack_size and not last:
            return None
        pack, self._demos = self._demos, []
        msg = pack_demonstrations(pack, f"sftpack{self._packs_sent:04d}", self.options())
        self._packs_sent += 1
        msg.purpose = "sft"
        msg.packs = self._packs_total
        return Completed(msg, pack)
