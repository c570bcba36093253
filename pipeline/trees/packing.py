"""Pack a group's filtered trees into one depth-first sequence for the learner (docs/trees.md).

The kept nodes of all valid rollouts of a group go into one forest. Environment tokens above any trained token (the
group's common prompt: system + task, identical across rollouts and segments) are merged and stored once; trained
tokens are never merged, so two rollouts that sampled the same text keep two spans with their own advantages.
The forest is laid out depth-first, which gives every token the contract of :class:`~pipeline.messages.PackedTree`:

- ``positions``: depth in its root-to-leaf path (restarts at 0 at every root);
- ``subtree_end``: end of its node's subtree, so j is visible to i iff ``j <= i < subtree_end[j]``;
- ``pred``: the token whose logits predict it (i-1 inside a node, the parent's last token at a node's first token,
  -1 at a root's first token); a parent's last token predicts the first token of each of its children;
- ``rollout``: the index into ``TreeGroup.rollouts`` (the advantage slot), -1 where several rollouts share it;
- ``segment``: the rollout's chain (segment) number from the tree builder, -1 where several chains share it.

All per-token arrays are built with numpy from per-node arrays; Python only loops over nodes.

:func:`build_group` / :func:`assemble_group` turn a group's ``SettledRollout``s into a ``TreeGroup`` (or a
``GroupDropped`` with the reason when fewer than two rollouts are valid).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.core.logs import get_logger
from pipeline.messages import (
    F32_DTYPE,
    I32_DTYPE,
    GroupDropped,
    LeftOut,
    PackedTree,
    RolloutSummary,
    SettledRollout,
    TreeGroup,
    ids,
)
from pipeline.trees.tree import Node, RolloutTree, TreeOptions, _lcp, build_tree

log = get_logger(component="packing")

MIN_VALID_ROLLOUTS = 2


class _G:
    """A node of the group forest: a run of tokens from one rollout node (or a merged shared prefix)."""

    __slots__ = ("children", "logprobs", "open", "rollout", "segment", "tokens", "trainable")

    def __init__(
        self,
        tokens: np.ndarray,
        logprobs: np.ndarray | None,
        trainable: bool,
        rollout: int,
        segment: int,
        open_: bool,
    ) -> None:
        self.tokens = tokens
        self.logprobs = logprobs
        self.trainable = trainable
        self.rollout = rollout
        self.segment = segment
        self.children: list[_G] = []
        self.open = open_  # environment with only environment above it: may be shared with other rollouts


def _share(g: _G, rollout: int, segment: int) -> None:
    if g.rollout != rollout:
        g.rollout, g.segment = -1, -1
    elif g.segment != segment:
        g.segment = -1


def _merge(groot: _G, tree: RolloutTree, r: int) -> None:
    """Insert rollout r's kept nodes under ``groot``, merging environment prefixes with what is already there."""
    included = [c.included for c in tree.calls]
    stack: list[tuple[_G, Node, int]] = [(groot, n, 0) for n in reversed(tree.root.children) if n.kept]
    while stack:
        gp, node, off = stack.pop()
        trainable = node.trainable and included[node.call]
        tokens = node.tokens[off:]
        if not trainable and gp.open:
            hit, shared = None, 0
            for g in gp.children:
                if g.open and g.tokens[0] == tokens[0]:
                    hit, shared = g, _lcp(g.tokens, tokens)
                    break
            if hit is not None:
                if shared < len(hit.tokens):
                    tail = _G(hit.tokens[shared:], None, False, hit.rollout, hit.segment, True)
                    tail.children, hit.children = hit.children, [tail]
                    hit.tokens = hit.tokens[:shared]
                _share(hit, r, node.seg)
                if shared < len(tokens):
                    stack.append((hit, node, off + shared))
                else:
                    stack.extend((hit, c, 0) for c in reversed(node.children) if c.kept)
                continue
        g = _G(
            tokens,
            node.logprobs[off:] if trainable and node.logprobs is not None else None,
            trainable,
            r,
            node.seg,
            gp.open and not trainable,
        )
        gp.children.append(g)
        stack.extend((g, c, 0) for c in reversed(node.children) if c.kept)


def pack_trees(trees: Sequence[RolloutTree]) -> PackedTree:
    """Lay out the kept nodes of ``trees`` (rollout r = position in ``trees``) as one PackedTree."""
    groot = _G(np.zeros(0, dtype=np.int32), None, False, -1, -1, True)
    for r, tree in enumerate(trees):
        _merge(groot, tree, r)

    order: list[_G] = []
    parent: list[int] = []
    stack = [(g, -1) for g in reversed(groot.children)]
    while stack:
        g, p = stack.pop()
        k = len(order)
        order.append(g)
        parent.append(p)
        stack.extend((c, k) for c in reversed(g.children))
    if not order:
        raise ValueError("pack_trees: no kept nodes to pack (every rollout was filtered out)")

    n_nodes = len(order)
    lengths = np.fromiter((len(g.tokens) for g in order), dtype=np.int64, count=n_nodes)
    starts = np.zeros(n_nodes, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    size = lengths.copy()
    for k in range(n_nodes - 1, 0, -1):  # children come after their parent in pre-order
        if parent[k] >= 0:
            size[parent[k]] += size[k]
    total = int(lengths.sum())
    if total >= 2**31:
        raise ValueError(
            f"pack_trees: {total} tokens do not fit int32 indices; pack fewer rollouts per group"
        )

    # One pass per output array, filled node by node (a few thousand slices) rather than with temporaries; each
    # array is in its wire dtype, so tobytes() below is the PackedTree field.
    tokens = np.empty(total, dtype=I32_DTYPE)
    positions = np.empty(total, dtype=I32_DTYPE)
    subtree_end = np.empty(total, dtype=I32_DTYPE)
    pred = np.empty(total, dtype=I32_DTYPE)
    trainable = np.zeros(total, dtype=np.uint8)
    logprobs = np.zeros(total, dtype=F32_DTYPE)
    rollout = np.empty(total, dtype=I32_DTYPE)
    segment = np.empty(total, dtype=I32_DTYPE)
    ramp = np.arange(int(lengths.max()), dtype=np.int32)
    depth0 = [0] * n_nodes  # position of each node's first token
    for k, g in enumerate(order):
        s, n, p = int(starts[k]), int(lengths[k]), parent[k]
        e = s + n
        tokens[s:e] = g.tokens
        if p >= 0:
            depth0[k] = depth0[p] + int(lengths[p])
            pred[s] = int(starts[p] + lengths[p]) - 1
        else:
            pred[s] = -1
        np.add(ramp[:n], depth0[k], out=positions[s:e])
        np.add(ramp[: n - 1], s, out=pred[s + 1 : e])
        subtree_end[s:e] = s + int(size[k])
        if g.trainable:
            trainable[s:e] = 1
            if g.logprobs is not None:
                logprobs[s:e] = g.logprobs
        rollout[s:e] = g.rollout
        segment[s:e] = g.segment
    return PackedTree(
        tokens=tokens.tobytes(),
        positions=positions.tobytes(),
        subtree_end=subtree_end.tobytes(),
        pred=pred.tobytes(),
        trainable=trainable.tobytes(),
        logprobs=logprobs.tobytes(),
        rollout=rollout.tobytes(),
        segment=segment.tobytes(),
    )


# ------------------------------------------------------------------------------------------- group assembly
@dataclass
class GroupBuild:
    """Everything :func:`build_group` decided: the message to send, and every rollout's tree and summary (the
    discarded ones too, for metrics and ``--replay``)."""

    message: TreeGroup | GroupDropped
    trees: list[RolloutTree]
    summaries: list[RolloutSummary]
    discarded: dict[str, str]  # rollout_id -> reason


def build_group(rollouts: Sequence[SettledRollout], options: TreeOptions | None = None) -> GroupBuild:
    """Build every rollout's tree and pack the valid ones; fewer than two valid rollouts drops the group.

    ``TreeGroup.rollouts`` lists the valid rollouts in request-index order, and ``packed.rollout`` indexes that
    list (it is the advantage slot); invalid rollouts are left out of the group entirely.
    """
    options = options or TreeOptions()
    if not rollouts:
        raise ValueError("build_group: no SettledRollout given; the collector must pass a whole group")
    group_ids = {r.request.group_id for r in rollouts}
    if len(group_ids) != 1:
        raise ValueError(f"build_group: rollouts from several groups {sorted(group_ids)}; pass one group")
    group_id = group_ids.pop()
    ordered: list[SettledRollout] = []
    seen: set[str] = set()
    dupes = 0
    for r in sorted(rollouts, key=lambda r: (r.request.index, r.request.rollout_id)):
        if r.request.rollout_id in seen:
            dupes += 1
            continue
        seen.add(r.request.rollout_id)
        ordered.append(r)
    if dupes:
        log.warning("duplicate_rollouts", group=group_id, count=dupes)

    trees = [build_tree(r, options) for r in ordered]
    valid = [t for t in trees if t.valid]
    discarded = {t.rollout_id: t.invalid for t in trees if not t.valid}
    expected = ordered[0].request.group_size
    for k in range(len(ordered), expected):
        discarded[f"<missing {k}>"] = "never settled"
    summaries = [t.summary() for t in trees]
    first = ordered[0].request
    if len(valid) < MIN_VALID_ROLLOUTS:
        reasons = Counter(discarded.values())
        why = ", ".join(f"{n}x {reason}" for reason, n in sorted(reasons.items()))
        message: TreeGroup | GroupDropped = GroupDropped(
            group_id=group_id,
            reason=f"{len(valid)} valid rollouts of {max(expected, len(ordered))}, need {MIN_VALID_ROLLOUTS}"
            + (f" ({why})" if why else ""),
            valid_rollouts=len(valid),
            task_id=first.task_id,
            harness=first.harness,
            left_out=[_left_out(t) for t in trees],
        )
    else:
        message = TreeGroup(
            group_id=group_id,
            task_id=first.task_id,
            harness=first.harness,
            rollouts=[t.summary() for t in valid],
            packed=pack_trees(valid),
            issued_version=min(r.request.policy_version for r in ordered),
            left_out=[_left_out(t) for t in trees if not t.valid],
            resample=first.resample,
        )
    return GroupBuild(message=message, trees=trees, summaries=summaries, discarded=discarded)


def _left_out(t: RolloutTree) -> LeftOut:
    """Why ``t`` is not trained, from what bridle decided (status, exit code, the filter's reason); the sandbox's
    ``details`` stay out, as they may quote the harness."""
    fin = t.settled.finished
    return LeftOut(rollout_id=t.rollout_id, status=fin.status, reason=t.invalid or "group dropped",
                   exit_code=fin.exit_code)


def assemble_group(
    rollouts: Sequence[SettledRollout], options: TreeOptions | None = None
) -> TreeGroup | GroupDropped:
    """The TreeBuilder's pure function: a settled group in, the message to send out."""
    return build_group(rollouts, options).message


# ------------------------------------------------------------------------------------------------- helpers
def path_ends(packed: PackedTree) -> np.ndarray:
    """Index of the last token of every leaf (tokens whose subtree is only themselves)."""
    se = ids(packed.subtree_end)
    return np.flatnonzero(se == np.arange(se.shape[0]) + 1)


def expand_paths(packed: PackedTree) -> list[np.ndarray]:
    """Every root-to-leaf path as the token indices along it, following ``pred`` node by node (the reference
    layout: gather any PackedTree field with these indices to get that path as a plain causal sequence)."""
    pred = ids(packed.pred)
    n = pred.shape[0]
    is_start = pred != np.arange(n) - 1
    node_start = np.maximum.accumulate(np.where(is_start, np.arange(n), 0))
    paths = []
    for end in path_ends(packed):
        pieces = []
        i = int(end)
        while i >= 0:
            s = int(node_start[i])
            pieces.append(np.arange(s, i + 1))
            i = int(pred[s])
        paths.append(np.concatenate(pieces[::-1]))
    return paths


def visible(packed: PackedTree) -> np.ndarray:
    """Dense (N, N) boolean mask, True where token i (row) may attend to token j (column). For small cases."""
    se = ids(packed.subtree_end).astype(np.int64)
    i = np.arange(se.shape[0])[:, None]
    j = np.arange(se.shape[0])[None, :]
    return (j <= i) & (i < se[None, :])


def pack_demonstrations(
    rollouts: Sequence[SettledRollout], group_id: str, options: TreeOptions | None = None
) -> TreeGroup | GroupDropped:
    """Cold-start SFT data: demonstrations of *different* tasks packed into one tree.

    There are no advantages to compute, so group boundaries do not matter, and the prompt every demonstration
    shares (system prompt + tool definitions, often most of the tokens) is stored and computed once.
    """
    trees = [build_tree(r, options or TreeOptions()) for r in rollouts]
    valid = [t for t in trees if t.valid]
    if not valid:
        return GroupDropped(group_id=group_id, reason=f"none of {len(trees)} demonstrations is usable")
    return TreeGroup(
        group_id=group_id,
        task_id="*",
        harness=rollouts[0].request.harness,
        rollouts=[t.summary() for t in valid],
        packed=pack_trees(valid),
        issued_version=min(r.request.policy_version for r in rollouts),
        purpose="sft",
    )
