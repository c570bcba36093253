"""TreeBuilder actor: holds settled rollouts until their group is complete, then builds and packs the group."""

from __future__ import annotations

from typing import Any

from pipeline.core.config import Section
from pipeline.core.runtime import Actor
from pipeline.messages import GroupDropped, Metric, SettledRollout, TreeGroup
from pipeline.trees.packing import build_group, pack_demonstrations
from pipeline.trees.tree import TreeOptions


class TreeConfig(Section):
    max_leaves: int = 32  # over-branching: rollouts with more trained leaves are discarded
    include_aux: bool = False  # train subagent and compaction calls too
    sft_pack: int = 8  # demonstrations (purpose "sft") packed into one tree across tasks; shared prompt once
    reloadable = frozenset({"max_leaves", "include_aux", "sft_pack"})


class TreeBuilder(Actor[TreeConfig]):
    Config = TreeConfig
    outputs = ("groups", "dropped", "metrics")

    async def run(self) -> None:
        waiting: dict[str, list[SettledRollout]] = {}
        demos: list[SettledRollout] = []
        packs = 0
        async for msg in self.messages():
            if not isinstance(msg, SettledRollout):
                continue
            if msg.request.purpose == "sft":
                demos.append(msg)
                if len(demos) >= self.config.sft_pack:
                    out = pack_demonstrations(demos, f"sftpack{packs:04d}", self._options())
                    packs += 1
                    demos = []
                    await self.send("groups" if isinstance(out, TreeGroup) else "dropped", out)
                continue
            gid = msg.request.group_id
            group = waiting.setdefault(gid, [])
            group.append(msg)
            if len(group) < msg.request.group_size:
                continue
            del waiting[gid]
            build = build_group(group, self._options())
            out = build.message
            if isinstance(out, GroupDropped):
                self.log.info("group dropped", group=gid, reason=out.reason)
                if self.out["dropped"].connected:
                    await self.send("dropped", out)
            else:
                out.purpose = group[0].request.purpose
                out.issued_version = min(r.request.policy_version for r in group)
                await self.send("groups", out)
            if self.out["metrics"].connected:
                await self.send("metrics", self._metric(build, group))
        if waiting:
            self.log.warning("inputs ended with incomplete groups", groups=len(waiting))

    def _options(self) -> TreeOptions:
        return TreeOptions(max_leaves=self.config.max_leaves, include_aux=self.config.include_aux)

    def _metric(self, build: Any, group: list[SettledRollout]) -> Metric:
        v: dict[str, float] = {"group_rollouts": len(group)}
        sums: dict[str, float] = {}
        for s in build.summaries:
            st = s.stats
            for k in ("calls", "leaves", "kept_leaves", "segments", "depth", "tokens_total", "tokens_packed",
                      "tokens_trainable"):
                sums[k] = sums.get(k, 0) + getattr(st, k)
            sums["attach_rate"] = sums.get("attach_rate", 0) + st.exact_prefix_attach_rate
            for reason, n in st.dropped.items():
                sums[f"dropped_{reason}"] = sums.get(f"dropped_{reason}", 0) + n
        n = max(1, len(build.summaries))
        v.update({f"tree_{k}": val / n if k == "attach_rate" else val for k, val in sums.items()})
        v["group_dropped"] = float(isinstance(build.message, GroupDropped))
        return Metric(source=self.name, kind="tree", values=v)
