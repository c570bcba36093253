"""Monitor actor: metrics.jsonl, a live terminal display (rich), and PNG plots at the end (also on Ctrl-C).

Inbox: Metric, dispatched on ``Metric.kind``, and RolloutFinished (each rollout's status and reason; others ignored). The state and the display live in
pipeline.monitor (state, display, view); this actor writes the file, ticks the view and logs one line per RL step.
"""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TextIO

import anyio
import msgspec

from pipeline.core import logs
from pipeline.core.config import ConfigError, Section
from pipeline.core.runtime import Actor
from pipeline.messages import ConfigChanged, Metric, RolloutFinished
from pipeline.monitor.display import step_fields
from pipeline.monitor.metrics import record
from pipeline.monitor.plots import write_plots
from pipeline.monitor.state import MonitorState, absorb
from pipeline.monitor.trackers import TrackerName, Trackers, tracker_problem
from pipeline.monitor.view import Display, LiveView, LogView, open_view

Seconds = Annotated[float, msgspec.Meta(gt=0)]


class MonitorSettings(Section):
    # auto: a live display on a terminal, progress log lines otherwise; log: progress log lines; off: neither
    # (the log line per RL step and metrics.jsonl stay)
    display: Display = "auto"
    refresh_s: Seconds = 1.0  # live display redraws
    progress_s: Seconds = 30.0  # at most one progress log line per this many seconds (and one per phase change)
    plots: bool = True  # write plots.png (and sft.png) at the end
    # every metric also in TensorBoard (<run>/tensorboard) and/or Weights & Biases (pipeline/monitor/trackers.py)
    trackers: list[TrackerName] = msgspec.field(default_factory=list)
    wandb_project: str = "bridle"  # the W&B project
    # offline: files under <run>/wandb, uploaded later with `wandb sync`; online: uploaded as the run goes
    wandb_mode: Literal["offline", "online"] = "offline"
    reloadable = frozenset({"refresh_s", "progress_s"})

    def check(self, name: str, exp: Any) -> None:
        if why := tracker_problem(list(self.trackers)):
            raise ConfigError(f"{exp.source}: [{name}].{why}")


class Monitor(Actor[MonitorSettings]):
    Config = MonitorSettings
    outputs = ()

    view: LiveView | LogView | None = None
    trackers: Trackers | None = None
    _wake: anyio.Event | None = None  # set to redraw now (a changed refresh_s)

    async def run(self) -> None:
        assert self.run_dir is not None
        self.state = MonitorState(run_name=self.run_dir.name, t0=time.time())
        path = self.run_dir / "metrics.jsonl"
        self.view = open_view(self.config.display, logs.console(), self.log, self.config.progress_s)
        trackers = self.trackers = await anyio.to_thread.run_sync(self._trackers) if self.config.trackers else None
        # held open for the whole run (one short line per metric); closed in the finally below
        f: TextIO = open(path, "a", encoding="utf-8")  # noqa: ASYNC230, SIM115
        try:
            async with anyio.create_task_group() as tg:
                if self.view is not None:
                    self.view.start(self.state, time.time())
                    tg.start_soon(self._ticker, self.view)
                async for msg in self.messages():
                    if isinstance(msg, RolloutFinished):
                        self.state.outcomes.add(msg)
                        if trackers is not None:
                            trackers.status(msg.status)
                        continue
                    if not isinstance(msg, Metric):
                        continue
                    now = time.time()
                    row = record(msg, now)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    if trackers is not None:
                        trackers.row(row)
                    absorb(self.state, msg, now)
                    if msg.kind == "rl_step":
                        self.log.info("step", **step_fields(msg.step, msg.values))
                tg.cancel_scope.cancel()
        finally:
            f.close()
            if trackers is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(trackers.close)
            if self.view is not None:
                self.view.close(self.state, time.time())
            if self.state.outcomes.none_succeeded:
                self.log.error("no rollout succeeded", verdict=self.state.outcomes.verdict())
            if self.config.plots:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._plots, path)

    async def on_reload(self, change: ConfigChanged) -> None:
        if self.trackers is not None:
            text = (f"[{change.section}] {change.changes}" if change.accepted
                    else f"refused, nothing applied: {change.reason}")
            self.trackers.note("config/reload", text, self.state.rl_steps_done)

    def _trackers(self) -> Trackers:
        """The trackers, given the run's resolved config (config.toml, written before any actor starts)."""
        assert self.run_dir is not None
        path = self.run_dir / "config.toml"
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        config = tomllib.loads(text) if text else {}
        return Trackers(list(self.config.trackers), self.run_dir, config, text,
                        wandb_project=self.config.wandb_project, wandb_mode=self.config.wandb_mode)

    async def _ticker(self, view: LiveView | LogView) -> None:
        while True:
            # a config change wakes it, so a new refresh_s applies now rather than after the old interval
            self._wake = anyio.Event()
            with anyio.move_on_after(self.config.refresh_s):
                await self._wake.wait()
            view.tick(self.state, time.time())

    async def on_config(self, new: MonitorSettings, changes: dict[str, Any]) -> None:
        self.config = new
        if isinstance(self.view, LogView):
            self.view.every_s = new.progress_s
        if self._wake is not None:
            self._wake.set()

    def _plots(self, path: Path) -> None:
        try:
            out = write_plots(path, path.parent)
            self.log.info("plots written", files=[p.name for p in out])
        except Exception as e:  # noqa: BLE001 — plots are a convenience; never let them hide the run's outcome
            self.log.warning("plots failed", error=repr(e))
