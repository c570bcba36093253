"""One line per rollout and one per call, for ``run.py --replay --trees``."""

from __future__ import annotations

from pipeline.messages import RolloutSummary
from pipeline.trees.filters import how_attached
from pipeline.trees.nodes import RolloutTree


def format_stats(summary: RolloutSummary, relabelled: dict[str, int] | None = None) -> str:
    """One line per rollout for ``run.py --replay --trees``."""
    s = summary.stats
    ratio = s.tokens_total / s.tokens_packed if s.tokens_packed else 0.0
    parts = [
        f"{summary.rollout_id} {summary.status} reward={summary.reward:.3f}",
        f"calls={s.calls} leaves={s.leaves} kept={s.kept_leaves} segments={s.segments} depth={s.depth}",
        (f"tokens total={s.tokens_total:,} packed={s.tokens_packed:,} "
         f"trainable={s.tokens_trainable:,}/{s.tokens_output:,} output"),
        f"shared={ratio:.1f}x",
        f"exact-attach={100 * s.exact_prefix_attach_rate:.1f}%",
        "attach " + " ".join(f"{k}={v}" for k, v in s.attach.items()),
        "calls " + " ".join(f"{k}={v}" for k, v in s.calls_by_fate.items()),
    ]
    if s.unjoined_segments:
        parts.append(f"NOT JOINED: {s.unjoined_segments} segment(s) no compaction explains")
    if s.unconfirmed_compactions:
        parts.append(f"UNCONFIRMED: {s.unconfirmed_compactions} compaction(s) no next segment starts from")
    if s.dropped:
        parts.append("dropped " + " ".join(f"{k}={v}" for k, v in s.dropped.items()))
    if relabelled:
        parts.append("relabelled " + " ".join(f"{k}={v}" for k, v in sorted(relabelled.items())))
    return "  ".join(parts)


def format_calls(tree: RolloutTree) -> str:
    """Call-by-call view of one rollout's tree for ``run.py --replay``: one line per call, in seq order."""
    lines = []
    for n, c in enumerate(tree.calls):
        how = how_attached(tree.calls, tree.chains, n)
        state = "kept-leaf" if c.kept else ("leaf" if c.leaf else "")
        label = c.label if c.label == c.proxy_label else f"{c.label}(proxy {c.proxy_label})"
        if c.label == "compaction" and c.summary_for < 0:
            label += "?"  # unconfirmed: no next segment starts from its output
        lines.append(
            f"  seq={c.seq:<4} {c.call_id:<16} chain={c.chain:<2} {label:<10} {how:<28} "
            f"in={c.input_len:<7} out={c.output_len:<6} on-path={c.n_calls:<4} "
            f"{'trained' if c.kept_tokens else 'context'} {state}".rstrip()
        )
    return "\n".join(lines)
