"""Monitor actor: metrics.jsonl, a live terminal display (rich), and PNG plots at the end (also on Ctrl-C)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import anyio

from pipeline.core.config import Section
from pipeline.core.runtime import Actor
from pipeline.messages import Metric
from pipeline.monitor.plots import write_plots


class MonitorConfig(Section):
    display: str = "auto"  # auto: a live table on a terminal, a log line per learner step otherwise; "off"
    refresh_s: float = 1.0
    plots: bool = True
    reloadable = frozenset({"refresh_s"})


class Monitor(Actor[MonitorConfig]):
    Config = MonitorConfig
    outputs = ()

    async def run(self) -> None:
        assert self.run_dir is not None
        self.latest: dict[str, dict[str, float]] = {}
        self.t0 = time.time()
        self.rollouts_done = 0
        self.rewards: list[float] = []
        path = self.run_dir / "metrics.jsonl"
        live = None
        # held open for the whole run (one short line per metric); closed in the finally below
        f: TextIO = open(path, "a", encoding="utf-8")  # noqa: ASYNC230, SIM115
        try:
            if self.config.display == "auto" and sys.stderr.isatty():
                from rich.live import Live

                live = Live(self._table(), refresh_per_second=max(0.2, 1 / self.config.refresh_s),
                            console=None, transient=False)
                live.start()
            async for msg in self.messages():
                if not isinstance(msg, Metric):
                    continue
                rec = {"t": msg.t or time.time(), "source": msg.source, "step": msg.step, **msg.values}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                self._absorb(msg)
                if live is not None:
                    live.update(self._table())
        finally:
            f.close()
            if live is not None:
                live.stop()
            if self.config.plots:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._plots, path)

    def _absorb(self, msg: Metric) -> None:
        self.latest.setdefault(msg.source, {}).update(msg.values)
        if msg.source.startswith("sandbox") and "reward" in msg.values:
            self.rollouts_done += 1
        if msg.source.endswith(".rl"):
            v = msg.values
            self.log.info("step", step=msg.step, reward=round(v.get("reward", 0.0), 3),
                          pass_rate=round(v.get("pass_rate", 0.0), 3), loss=round(v.get("loss", 0.0), 4),
                          entropy=round(v.get("entropy", 0.0), 3))
        elif msg.source.endswith(".sft") and msg.values.get("sft_epoch") is not None:
            self.latest["sft"] = {"epoch": msg.values["sft_epoch"], "loss": msg.values.get("loss", 0.0)}

    def _table(self) -> Any:
        from rich.table import Table

        rl = self.latest.get("learner.rl", {})
        sched = self.latest.get("scheduler", {})
        sb = self.latest.get("sandbox", {})
        sft = self.latest.get("sft", {})
        t = Table(title=f"bridle  {self.run_dir.name if self.run_dir else ''}", show_header=False)
        rows = [
            ("elapsed", f"{time.time() - self.t0:,.0f} s"),
            ("learner step", f"{int(sched.get('learner_steps', 0))}"),
            ("policy version", f"{int(sched.get('policy_version', 0))}"),
            ("cold-start SFT", f"epoch {int(sft.get('epoch', 0))}  loss {sft.get('loss', 0.0):.3f}" if sft else "-"),
            ("reward (last step)", f"{rl.get('reward', 0.0):.3f}"),
            ("pass rate (last step)", f"{rl.get('pass_rate', 0.0):.3f}"),
            ("entropy", f"{rl.get('entropy', 0.0):.3f}"),
            ("groups in flight", f"{int(sched.get('groups_in_flight', 0))}"),
            ("rollouts running", f"{int(sb.get('rollouts_running', 0))}"),
            ("rollouts done", f"{self.rollouts_done}"),
            ("tokens/s (learner)", f"{rl.get('tokens_per_s', 0.0):,.0f}"),
        ]
        for k, v in rows:
            t.add_row(k, v)
        return t

    def _plots(self, path: Path) -> None:
        try:
            out = write_plots(path, path.parent)
            self.log.info("plots written", files=[p.name for p in out])
        except Exception as e:  # noqa: BLE001 — plots are a convenience; never let them hide the run's outcome
            self.log.warning("plots failed", error=repr(e))
