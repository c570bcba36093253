"""Collector actor: gathers every record of a rollout and emits it once it has settled (pipeline.trees.collector)."""

from __future__ import annotations

from typing import Any

import anyio

from pipeline.core.runtime import Actor
from pipeline.messages import Metric, ServiceReady, SettledRollout
from pipeline.trees.collector import Settler, SettleSettings


class Collector(Actor[SettleSettings]):
    Config = SettleSettings
    outputs = ("settled", "metrics")


    async def run(self) -> None:
        self.settler = Settler(self.config)
        self._inputs_closed = False
        self._drained = anyio.Event()  # set by the ticker once the inputs have closed and nothing can still settle
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._ticker)
            async for msg in self.messages():
                if not isinstance(msg, ServiceReady):
                    self.settler.add(msg, anyio.current_time())
            # Inputs closed: everything that can still settle does so by its own clock; then stop ticking.
            self._inputs_closed = True
            if self._settling():
                await self._drained.wait()
            tg.cancel_scope.cancel()

    def _settling(self) -> bool:
        """Whether a finished rollout is still waiting to settle (an unfinished one never will once inputs close)."""
        return any(r.finished for r in self.settler.rollouts.values())

    async def _ticker(self) -> None:
        while True:
            await anyio.sleep(min(self.config.settle_interval_s / 2, 0.25))
            await self._emit(self.settler.tick(anyio.current_time()))
            if self._inputs_closed and not self._settling():
                self._drained.set()

    async def _emit(self, settled_now: list[SettledRollout]) -> None:
        for settled in settled_now:
            if settled.settle == "timeout":
                self.log.warning("rollout settled by timeout", rollout=settled.request.rollout_id,
                                 stragglers=settled.aborted_calls)
            await self.send("settled", settled)
            if self.out["metrics"].connected:
                st = self.settler.stats
                await self.send("metrics", Metric(source=self.name, kind="settle", values={
                    "settled": st.settled, "settle_timeouts": st.timed_out, "late_records": st.late_records,
                    "duplicate_records": st.duplicates}))

    async def on_config(self, new: SettleSettings, changes: dict[str, Any]) -> None:
        self.config = new
        self.settler.settings = new
