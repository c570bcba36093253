"""metrics.jsonl: one JSON object per Metric, and the reader every consumer (plots, benchmarks, tests) shares.

A line is ``{"t", "source", "kind", "step", **values}``, with ``"warnings"`` (a list of lines) when the sender gave
any: ``kind`` (pipeline.messages.MetricKind) says what the numbers are and is what readers select on; ``source``
names the actor that sent them, for people.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.messages import Metric, MetricKind

# Files written before Metric.kind existed: the learner's phase was the suffix of its source ("learner.rl").
_LEGACY_SUFFIX: dict[str, MetricKind] = {".rl": "rl_step", ".sft": "sft_update"}


def record(msg: Metric, now: float) -> dict[str, Any]:
    """The metrics.jsonl object of one Metric (``t`` is when it arrived unless the sender stamped it).

    The Metric's own fields keep their names; a value of the same name is written as ``value_<name>``. The
    learner's values carry its optimizer's ``step`` counter (it restarts after SFT and skips RL steps that trained
    nothing): that is ``value_step``, and ``step`` is the Metric's (for rl_step, the RL step).
    """
    head: dict[str, Any] = {"t": msg.t or now, "source": msg.source, "kind": msg.kind, "step": msg.step}
    if msg.warnings:
        head["warnings"] = list(msg.warnings)
    if msg.harness:
        head["harness"] = msg.harness
    own = {*head, "warnings", "harness"}
    return head | {(f"value_{k}" if k in own else k): v for k, v in msg.values.items()}


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """Every well-formed line of a metrics.jsonl; each row has a ``kind`` (inferred for files older than it)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if "kind" not in row:
            src = str(row.get("source", ""))
            row["kind"] = next((k for sfx, k in _LEGACY_SUFFIX.items() if src.endswith(sfx)), "other")
        rows.append(row)
    return rows


def of_kind(rows: list[dict[str, Any]], kind: MetricKind) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("kind") == kind]
