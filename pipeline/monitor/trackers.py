"""Experiment trackers (``[monitor] trackers``): every metrics.jsonl row, the rollouts' statuses and the resolved
config, also in TensorBoard and/or Weights & Biases, so a bridle run sits next to a researcher's other runs.

- Each row of kind K becomes scalars ``K/<value>`` against ``K``'s own step: the RL step for ``rl_step``, the SFT
  update for ``sft_update``, the evaluation round's step for ``eval`` (pass@k per column, harness and family, as
  the evaluator sends them), and a running count for per-event kinds (``rollout``, ``scheduler``, ...); the tree
  builder's rows are per harness: ``tree/<harness>/<value>`` (trainable and sampled tokens, attach rate, drops).
- Rollout statuses: ``rollouts/<status>`` (counted since the start) at every RL step.
- The resolved config: W&B's run config; TensorBoard's ``config`` text.
- Notes (``note``): the learner's step warnings, and every hot reload of the experiment file (``config/reload``:
  the changed fields, or why the change was refused), written as text at the RL step they came at.

TensorBoard writes ``<run>/tensorboard``. W&B runs offline by default (``wandb_mode``): files under ``<run>/wandb``,
uploaded later with ``wandb sync <run>/wandb/offline-run-*``; its run id is the run folder's (``wandb-id``), so a
resumed run continues the same W&B run. Both are optional extras (``pip install -e '.[trackers]'``); a tracker
whose package is missing is refused when the experiment is read (:func:`tracker_problem`).
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Literal, Protocol

TrackerName = Literal["tensorboard", "wandb"]
PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
INSTALL = "pip install -e '.[trackers]'"
# Kinds whose Metric.step is their own step; every other kind is counted per row (its own x axis).
STEPPED = {"rl_step", "sft_update", "eval", "weight_sync"}


def tracker_problem(names: list[str]) -> str:
    """The trackers named whose package is not installed ("" when all are)."""
    missing = [n for n in names if importlib.util.find_spec(PACKAGES[n]) is None]
    if not missing:
        return ""
    return f"trackers {missing}: the package{'s are' if len(missing) > 1 else ' is'} not installed; {INSTALL}"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl row, named ``<kind>/<value>``, or ``<kind>/<harness>/<value>`` for a row about
    one harness (the tree builder's groups); its bookkeeping fields left out."""
    prefix = "/".join(x for x in (row["kind"], row.get("harness", "")) if x)
    return {f"{prefix}/{k}": float(v) for k, v in row.items()
            if k not in ("t", "source", "kind", "step", "warnings", "harness") and isinstance(v, (int, float))
            and not isinstance(v, bool)}


class Tracker(Protocol):
    def log(self, values: dict[str, float], axis: str, step: int) -> None: ...

    def note(self, tag: str, text: str, step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config_text: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```toml\n" + config_text + "\n```", 0)

    def log(self, values: dict[str, float], axis: str, step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def note(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], *, project: str, mode: str):
        import wandb

        id_file = run_dir / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir),
                              mode=mode, config=config, settings=wandb.Settings(silent=True, console="off"))
        self._axes: set[str] = set()

    def log(self, values: dict[str, float], axis: str, step: int) -> None:
        if axis not in self._axes:  # each kind against its own step (W&B's step must only grow)
            self.run.define_metric(f"{axis}/*", step_metric=f"{axis}/_step")
            self._axes.add(axis)
        self.run.log({**values, f"{axis}/_step": step})

    def note(self, tag: str, text: str, step: int) -> None:
        self.run.log({f"{tag}/_step": step, tag: text})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for W&B's service to have written everything (a loaded machine lost the last row)


class Trackers:
    """The trackers a run writes to, fed by the monitor actor."""

    def __init__(self, names: list[str], run_dir: Path, config: dict[str, Any], config_text: str, *,
                 wandb_project: str = "bridle", wandb_mode: str = "offline"):
        self.trackers: list[Tracker] = []
        for n in names:
            if n == "tensorboard":
                self.trackers.append(TensorBoardTracker(run_dir, config_text))
            elif n == "wandb":
                os.environ.setdefault("WANDB_SILENT", "true")
                self.trackers.append(WandbTracker(run_dir, run_dir.name, config, project=wandb_project,
                                                  mode=wandb_mode))
        self.rows: Counter[str] = Counter()  # rows seen per per-event kind: their x axis
        self.statuses: Counter[str] = Counter()

    def row(self, row: dict[str, Any]) -> None:
        kind = row["kind"]
        axis = "/".join(x for x in (kind, row.get("harness", "")) if x)
        if kind in STEPPED:
            step = int(row.get("sft_update", row["step"])) if kind == "sft_update" else int(row["step"])
        else:
            self.rows[axis] += 1
            step = self.rows[axis]
        values = scalars(row)
        if kind == "rl_step":
            values |= {f"rollouts/{s}": float(n) for s, n in self.statuses.items()}
        for t in self.trackers:
            if values:
                t.log(values, axis, step)
            for w in row.get("warnings", []):
                t.note(f"{kind}/warnings", w, step)

    def note(self, tag: str, text: str, step: int) -> None:
        """A line of text at ``step`` (a hot reload: ``config/reload``)."""
        for t in self.trackers:
            t.note(tag, text, step)

    def status(self, status: str) -> None:
        self.statuses[status] += 1

    def close(self) -> None:
        for t in self.trackers:
            t.close()
