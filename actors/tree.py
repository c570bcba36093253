"""TreeBuilder actor: holds settled rollouts until their group (or demonstration pack) is complete, then sends it
built and packed (pipeline.trees.groups)."""

from __future__ import annotations

from pipeline.core.config import PosInt, Section
from pipeline.core.runtime import Actor
from pipeline.messages import GroupDropped, Metric, SettledRollout
from pipeline.trees.groups import Completed, Grouper
from pipeline.trees.tree import TreeOptions


class TreeSettings(Section):
    max_leaves: PosInt = 32  # over-branching: rollouts with more trained leaves are discarded
    include_aux: bool = False  # train subagent and compaction calls too
    sft_pack: PosInt = 8  # demonstrations (purpose "sft") packed into one tree across tasks; shared prompt once
    reloadable = frozenset({"max_leaves", "include_aux"})


class TreeBuilder(Actor[TreeSettings]):
    Config = TreeSettings
    outputs = ("groups", "dropped", "metrics")

    async def run(self) -> None:
        grouper = Grouper(self._options, self.config.sft_pack)
        async for msg in self.messages():
            if not isinstance(msg, SettledRollout) or msg.request.purpose == "eval":
                continue  # evaluation rollouts are measured (the evaluator), never trained
            done = grouper.add(msg)
            if done is None:
                continue
            out = done.message
            if isinstance(out, GroupDropped):
                self.log.info("group dropped", group=out.group_id, reason=out.reason, purpose=out.purpose)
                if self.out["dropped"].connected:
                    await self.send("dropped", out)
            else:
                await self.send("groups", out)
            if done.build is not None and self.out["metrics"].connected:
                await self.send("metrics", self._metric(done))
        if grouper.incomplete_groups:
            self.log.warning("inputs ended with incomplete groups", groups=grouper.incomplete_groups)

    def _options(self) -> TreeOptions:
        return TreeOptions(max_leaves=self.config.max_leaves, include_aux=self.config.include_aux)

    def _metric(self, done: Completed) -> Metric:
        assert done.build is not None
        v: dict[str, float] = {"group_rollouts": len(done.rollouts)}
        sums: dict[str, float] = {}
        for s in done.build.summaries:
            st = s.stats
            for k in ("calls", "leaves", "kept_leaves", "segments", "depth", "tokens_total", "tokens_packed",
                      "tokens_trainable"):
                sums[k] = sums.get(k, 0) + getattr(st, k)
            sums["attach_rate"] = sums.get("attach_rate", 0) + st.exact_prefix_attach_rate
            for reason, n in st.dropped.items():
                sums[f"dropped_{reason}"] = sums.get(f"dropped_{reason}", 0) + n
        n = max(1, len(done.build.summaries))
        v.update({f"tree_{k}": val / n if k == "attach_rate" else val for k, val in sums.items()})
        v["group_dropped"] = float(isinstance(done.message, GroupDropped))
        return Metric(source=self.name, kind="tree", values=v, harness=done.rollouts[0].request.harness)
