"""What is trained: the filters over a built tree (auxiliary calls, dead leaves, over-branching), the kept paths,
and the statistics that account for every call (docs/trees.md)."""

from __future__ import annotations

from collections import Counter

from pipeline.messages import SettledRollout, TreeStats
from pipeline.trees.nodes import CallInfo, Chain, Node, TreeOptions


def filter_tree(
    settled: SettledRollout,
    infos: list[CallInfo],
    chains: list[Chain],
    options: TreeOptions,
    dropped: Counter[str],
    tokens_total: int,
) -> tuple[TreeStats, str]:
    for info in infos:
        info.included = info.label == "main" or options.include_aux
        if not info.included:
            dropped[f"{info.label}_excluded"] += 1

    extended_by_any = {info.extends for info in infos if info.extends >= 0}
    extended_by_included = {info.extends for info in infos if info.extends >= 0 and info.included}
    # Continued after a rewrite: the next call carries its output, but on a path of its own (the rewritten
    # history), so its leaf is kept beside the chain's longest one instead of counting as a dead branch.
    continued = {info.parent_call for info in infos if info.rewrite and info.included}
    leaves = 0
    trained_leaves = 0
    for n, info in enumerate(infos):
        info.leaf = n not in extended_by_any
        leaves += info.leaf
        if info.included and n not in extended_by_included and n not in continued:
            trained_leaves += 1

    kept: list[int] = []
    for chain in chains:
        cands = [n for n in chain.calls if infos[n].included and n not in extended_by_included
                 and n not in continued]
        if not cands:
            continue
        best = max(cands, key=lambda n: (infos[n].n_calls, infos[n].seq))
        kept.append(best)
        if len(cands) > 1:
            dropped["dead_leaf"] += len(cands) - 1
    kept += sorted(n for n in continued if n not in extended_by_included)

    invalid = ""
    if settled.finished.status != "ok":
        invalid = f"status {settled.finished.status}"
    elif not infos:
        invalid = "no usable calls"
    elif trained_leaves > options.max_leaves:
        invalid = f"over_branching ({trained_leaves} leaves > max_leaves {options.max_leaves})"
        dropped["over_branching"] += 1

    packed = trainable = 0
    if not invalid:
        packed, trainable = _mark_kept(infos, kept)
        if trainable == 0:
            invalid = "no trainable tokens kept"
    return _stats(infos, chains, kept, invalid, dropped, tokens_total, packed, trainable), invalid


def _mark_kept(infos: list[CallInfo], kept: list[int]) -> tuple[int, int]:
    """Mark every kept leaf's root path; (tokens packed, tokens trainable). A node shared by paths of several
    chains gets seg -1 (a prefix shared by segments, e.g. the system prompt)."""
    packed = trainable = 0
    for n in kept:
        infos[n].kept = True
        k = infos[n].chain
        node: Node | None = infos[n].out_end
        while node is not None and node.parent is not None:
            if node.kept and node.seg in (k, -1):
                break
            if not node.kept:
                node.kept = True
                node.seg = k
                packed += len(node.tokens)
                if node.trainable and infos[node.call].included:
                    trainable += len(node.tokens)
                    infos[node.call].kept_tokens = True
            else:
                node.seg = -1
            node = node.parent
    return packed, trainable


def how_attached(infos: list[CallInfo], chains: list[Chain], n: int) -> str:
    """How call n joined the tree: ``first`` (the rollout's first call), ``exact`` (its input extends an earlier
    call's whole history), ``retry`` (its input is an earlier call's input: another sample of the same turn),
    ``rewrite:<name>`` (it continues an earlier call after a known rewrite, REWRITES), ``branch`` (it continues an
    earlier call from inside its history: a truncated answer, an edit), ``root`` (a new chain: a subagent, a
    segment after compaction, or a call the builder could not join)."""
    info = infos[n]
    if n == 0:
        return "first"
    if info.rewrite:
        return f"rewrite:{info.rewrite}"
    if info.parent_call < 0:
        return "root" if chains[info.chain].calls[0] == n else "retry"
    if info.extends >= 0 and info.exact:
        return "exact"
    return "branch"


def _stats(infos: list[CallInfo], chains: list[Chain], kept: list[int], invalid: str, dropped: Counter[str],
           tokens_total: int, packed: int, trainable: int) -> TreeStats:
    attach = Counter(how_attached(infos, chains, n) for n in range(len(infos)))
    fate: Counter[str] = Counter()
    for info in infos:
        if not info.included:
            fate["auxiliary"] += 1
        elif info.kept_tokens and not invalid:
            fate["trained"] += 1
        else:
            fate["not_trained"] += 1
    segments = [ch for ch in chains if any(infos[n].label == "main" for n in ch.calls)]
    # Every call but the rollout's first could have extended an earlier one: a rollout of new roots reads 0 %.
    attachable = len(infos) - 1
    return TreeStats(
        calls=len(infos),
        leaves=sum(info.leaf for info in infos),
        kept_leaves=0 if invalid else len(kept),
        segments=len(segments),
        depth=max((info.n_calls for info in infos), default=0),
        tokens_total=tokens_total,
        tokens_packed=packed if not invalid else 0,
        tokens_trainable=trainable if not invalid else 0,
        tokens_output=sum(info.output_len for info in infos),
        exact_prefix_attach_rate=(attach["exact"] + attach["retry"]) / attachable if attachable > 0 else 1.0,
        attach={k: v for k, v in sorted(attach.items())},
        calls_by_fate={k: v for k, v in sorted(fate.items())},
        unjoined_segments=sum(1 for ch in segments[1:] if ch.joined_by < 0),
        unconfirmed_compactions=sum(1 for info in infos if info.label == "compaction" and info.summary_for < 0),
        dropped={k: v for k, v in sorted(dropped.items()) if v},
    )
