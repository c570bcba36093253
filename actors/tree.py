"""TreeBuilder actor: holds settled rollouts until their group is complete, then builds and packs the group."""

from __future__ import annotations

from typing import Any

from pipeline.config import Section
from pipeline.messages import GroupDropped, Metric, SettledRollout
from pipeline.packing import build_group
from pipeline.runtime import Actor
from pipeline.tree import TreeOptions


class TreeConfig(Section):
    max_leaves: int = 32  # over-branching: rollouts with more trained leaves are discarded
    include_aux: bool = False  # train subagent and compaction calls too
    reloadable = frozenset({"max_leaves", "include_aux"})


class TreeBuilder(Actor[TreeConfig]):
    Config = TreeConfig
    outputs = ("groups", "dropped", "metrics")

    async def run(self) -> None:
        waiting: dict[str, list[SettledRollout]] = {}
        async for msg in self.messages():
            if not isinstance(msg, SettledRollout):
                continue
            gid = msg.request.group_id
            group = waiting.setdefault(gid, [])
            group.append(msg)
            if len(group) < msg.request.group_size:
                continue
            del waiting[gid]
            build = build_group(group, TreeOptions(max_leaves=self.config.max_leaves,
                                                   include_aux=self.config.include_aux))
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
        return Metric(source=self.name, values=v)
