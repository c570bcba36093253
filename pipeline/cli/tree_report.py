"""``run.py --replay LOG --trees [--calls] [--json]``: every rollout's prefix tree, rebuilt from any event log.

A training run's log holds each rollout's ``SettledRollout``. A log recorded with ``--serve`` (a harness pointed at
the proxy by hand) or cut by a crash has only the call records: their rollouts are rebuilt from the ``ModelCall``
and ``CallFailed`` records alone (``settled: false`` in the report), so a user who records a harness sees its tree.

Per rollout and per harness the report counts every call by how it joined the tree (``first``, ``exact``,
``retry``, ``rewrite:<name>``, ``branch``, ``root``) and by what became of it (``trained``, ``auxiliary``,
``not_trained``), output tokens against trainable ones, the rewrites seen and the segments no compaction explains.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgspec

from pipeline.core.recordings import recorded_rollouts
from pipeline.trees.tree import RolloutTree, TreeOptions, build_tree, format_calls, format_stats


class RolloutReport(msgspec.Struct, kw_only=True):
    rollout_id: str
    harness: str
    settled: bool
    status: str
    invalid: str
    stats: dict[str, Any]
    relabelled: dict[str, int]


class HarnessReport(msgspec.Struct, kw_only=True):
    rollouts: int = 0
    calls: int = 0
    attach: dict[str, int] = msgspec.field(default_factory=dict)
    calls_by_fate: dict[str, int] = msgspec.field(default_factory=dict)
    rewrites: dict[str, int] = msgspec.field(default_factory=dict)
    tokens_output: int = 0
    tokens_trainable: int = 0
    unjoined_segments: int = 0
    unconfirmed_compactions: int = 0
    relabelled: dict[str, int] = msgspec.field(default_factory=dict)


class TreeReport(msgspec.Struct, kw_only=True):
    log: str
    rollouts: list[RolloutReport]
    harnesses: dict[str, HarnessReport]


def _harness_name(harness: str) -> str:
    return harness.split(":", 1)[0]


def report(log_path: Path, options: TreeOptions | None = None) -> tuple[TreeReport, list[RolloutTree]]:
    trees: list[RolloutTree] = []
    rows: list[RolloutReport] = []
    per: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for rec in recorded_rollouts(log_path):
        s, was_settled = rec.rollout, rec.settled
        tree = build_tree(s, options or TreeOptions())
        trees.append(tree)
        st = tree.stats
        name = _harness_name(s.request.harness)
        rows.append(RolloutReport(rollout_id=s.request.rollout_id, harness=s.request.harness, settled=was_settled,
                                  status=s.finished.status, invalid=tree.invalid,
                                  stats=msgspec.to_builtins(st), relabelled=tree.relabelled))
        agg = per[name]
        agg["n"].update(rollouts=1, calls=st.calls, tokens_output=st.tokens_output,
                        tokens_trainable=st.tokens_trainable, unjoined_segments=st.unjoined_segments,
                        unconfirmed_compactions=st.unconfirmed_compactions)
        agg["attach"].update(st.attach)
        agg["fate"].update(st.calls_by_fate)
        agg["rewrites"].update({k.removeprefix("rewrite:"): v for k, v in st.attach.items()
                                if k.startswith("rewrite:")})
        agg["relabelled"].update(tree.relabelled)
    harnesses = {
        name: HarnessReport(rollouts=a["n"]["rollouts"], calls=a["n"]["calls"], attach=dict(sorted(a["attach"].items())),
                            calls_by_fate=dict(sorted(a["fate"].items())), rewrites=dict(sorted(a["rewrites"].items())),
                            tokens_output=a["n"]["tokens_output"], tokens_trainable=a["n"]["tokens_trainable"],
                            unjoined_segments=a["n"]["unjoined_segments"],
                            unconfirmed_compactions=a["n"]["unconfirmed_compactions"],
                            relabelled=dict(sorted(a["relabelled"].items())))
        for name, a in sorted(per.items())
    }
    return TreeReport(log=str(log_path), rollouts=rows, harnesses=harnesses), trees


def text(rep: TreeReport, trees: list[RolloutTree], calls: bool = False) -> str:
    lines: list[str] = []
    for row, tree in zip(rep.rollouts, trees, strict=True):
        lines.append(format_stats(tree.summary(), tree.relabelled) + ("" if row.settled else "  (from call records)"))
        if calls:
            lines.append(format_calls(tree))
    if rep.rollouts:
        lines.append("")
    for name, h in rep.harnesses.items():
        share = f"{100 * h.tokens_trainable / h.tokens_output:.1f}%" if h.tokens_output else "n/a"
        lines.append(
            f"harness {name}: rollouts={h.rollouts} calls={h.calls}  "
            + "attach " + " ".join(f"{k}={v}" for k, v in h.attach.items()) + "  "
            + "calls " + " ".join(f"{k}={v}" for k, v in h.calls_by_fate.items())
            + f"  trainable {h.tokens_trainable:,}/{h.tokens_output:,} output tokens ({share})"
            + (f"  NOT JOINED: {h.unjoined_segments} segment(s)" if h.unjoined_segments else "")
            + (f"  UNCONFIRMED: {h.unconfirmed_compactions} compaction(s)" if h.unconfirmed_compactions else ""))
    if not rep.rollouts:
        lines.append(f"no model calls in {rep.log}")
    return "\n".join(lines)
