"""Toy actors for tests and the foundation demo: a counter source, a scaler, a file sink."""

from __future__ import annotations

import json
from typing import Any

import anyio

from pipeline.core.config import Section
from pipeline.core.runtime import Actor
from pipeline.messages import Metric, Note


class SourceSettings(Section):
    count: int = 10  # -1: run until stopped
    interval_s: float = 0.0  # pause between notes
    reloadable = frozenset({"interval_s"})


class Source(Actor[SourceSettings]):
    """Emits Note(seq=i, value=i) for i in 0..count-1, then ends."""

    Config = SourceSettings
    outputs = ("out",)

    async def run(self) -> None:
        i = 0
        while self.config.count < 0 or i < self.config.count:
            await self.send("out", Note(seq=i, value=i))
            i += 1
            await anyio.sleep(self.config.interval_s)


class ScaleSettings(Section):
    factor: float = 2.0  # what each value is multiplied by (hot-reloadable)
    mode: str = "mul"  # fixed: changing it needs a restart
    reloadable = frozenset({"factor"})


class Scale(Actor[ScaleSettings]):
    """Multiplies each note's value by ``factor`` (hot-reloadable) and reports the factor it used."""

    Config = ScaleSettings
    outputs = ("out", "metrics")

    async def run(self) -> None:
        async for msg in self.messages():
            assert isinstance(msg, Note)
            value = msg.value * self.config.factor if self.config.mode == "mul" else msg.value + self.config.factor
            await self.send("out", Note(seq=msg.seq, value=value))
            if self.out["metrics"].connected:
                await self.send("metrics", Metric(source=self.name, step=msg.seq, values={"factor": self.config.factor}))

    async def on_config(self, new: ScaleSettings, changes: dict[str, Any]) -> None:
        self.log.info("factor changed", old=self.config.factor, new=new.factor)
        self.config = new


class SinkSettings(Section):
    path: str = ""  # JSON lines of every note received; empty: keep nothing
    fail_at: int = -1  # raise at this seq (to test crash handling)
    delay_s: float = 0.0  # per message, to test back-pressure
    reloadable = frozenset({"delay_s"})


class Sink(Actor[SinkSettings]):
    Config = SinkSettings
    outputs = ()

    async def run(self) -> None:
        f = open(self.config.path, "a", encoding="utf-8") if self.config.path else None  # noqa: ASYNC230, SIM115
        try:
            async for msg in self.messages():
                if isinstance(msg, Note) and msg.seq == self.config.fail_at:
                    raise RuntimeError(f"sink told to fail at seq {msg.seq}")
                if f is not None and isinstance(msg, Note):
                    f.write(json.dumps({"seq": msg.seq, "value": msg.value}) + "\n")
                    f.flush()
                if self.config.delay_s:
                    await anyio.sleep(self.config.delay_s)
        finally:
            if f is not None:
                f.close()
