"""Attention over a packed prefix tree (docs/learner.md, "Tree attention"), three ways.

A :class:`~pipeline.messages.PackedTree` lays a group's tree out depth-first; token j is visible to token i iff
``j <= i < subtree_end[j]``, and token i is predicted by the hidden state at ``pred[i]`` — the previous token inside
a node, the parent's last token for a node's first token. The paths:

- GPU (:func:`flex_block_mask`): a flex-attention ``BlockMask`` from ``subtree_end``; memory linear in tokens and
  blocks that no token can see are skipped, so shared prefixes cost once.
- CPU (:class:`ChunkedTreeMask`, the default there): attention one block of queries at a time, each block
  against only the keys it can see, with that block's slice of the tree mask; memory is linear in tokens for a
  fixed block size, so a 20k-token tree (a group of Claude Code rollouts) trains in well under a GB.
- CPU, dense (:func:`dense_mask`): an explicit (1, 1, N, N) mask for the ``sdpa``/``eager`` kernels; N^2 memory.
- Reference (:func:`expand_paths`): every kept root-to-leaf path as its own causal sequence; used by the tests to
  check the two paths above.

The model runs on the tree with ``position_ids = positions`` (depth), so every token gets the RoPE position it has
in its own path.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from pipeline.messages import PackedTree, floats, ids, mask

FLEX_BLOCK = 128


class TreeError(ValueError):
    """A PackedTree that breaks the layout contract; the message names the field and the first bad index."""


@dataclass(frozen=True)
class TreeArrays:
    """A PackedTree as numpy arrays (int64 indices, bool masks, float32 logprobs)."""

    tokens: np.ndarray
    positions: np.ndarray
    subtree_end: np.ndarray
    pred: np.ndarray
    trainable: np.ndarray
    logprobs: np.ndarray
    rollout: np.ndarray
    segment: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def unpack(packed: PackedTree, where: str = "PackedTree") -> TreeArrays:
    """Decode and validate a PackedTree; raises :class:`TreeError` naming ``where`` and the broken field."""
    tree = TreeArrays(
        tokens=ids(packed.tokens).astype(np.int64),
        positions=ids(packed.positions).astype(np.int64),
        subtree_end=ids(packed.subtree_end).astype(np.int64),
        pred=ids(packed.pred).astype(np.int64),
        trainable=mask(packed.trainable),
        logprobs=floats(packed.logprobs).astype(np.float32),
        rollout=ids(packed.rollout).astype(np.int64),
        segment=ids(packed.segment).astype(np.int64),
    )
    validate(tree, where)
    return tree


def validate(tree: TreeArrays, where: str = "PackedTree") -> None:
    """Check the layout invariants in O(N) with numpy (no quadratic check; the reference path does that)."""
    n = len(tree)
    if n == 0:
        raise TreeError(f"{where}: empty tree (tokens has length 0)")
    for f in fields(tree):
        arr = getattr(tree, f.name)
        if arr.shape != (n,):
            raise TreeError(f"{where}.{f.name}: length {arr.shape[0]} but tokens has length {n}")
    idx = np.arange(n)

    def fail(field: str, bad: np.ndarray, rule: str) -> None:
        i = int(np.flatnonzero(bad)[0])
        raise TreeError(
            f"{where}.{field}[{i}]: {rule} (tokens={n}); the tree builder produced a broken layout"
        )

    se, pred, pos = tree.subtree_end, tree.pred, tree.positions
    if (bad := (se <= idx) | (se > n)).any():
        fail("subtree_end", bad, "must satisfy i < subtree_end[i] <= len(tokens)")
    if (bad := (pred >= idx) | (pred < -1)).any():
        fail("pred", bad, "must satisfy -1 <= pred[i] < i")
    has_pred = pred >= 0
    safe_pred = np.where(has_pred, pred, 0)
    if (bad := has_pred & (se[safe_pred] <= idx)).any():
        fail("pred", bad, "pred[i] must be visible to i (i < subtree_end[pred[i]])")
    want_pos = np.where(has_pred, pos[safe_pred] + 1, 0)
    if (bad := pos != want_pos).any():
        fail("positions", bad, "must be positions[pred[i]] + 1, or 0 where pred[i] == -1")
    # Subtrees nest: the subtree of anything visible to i must cover i's own subtree.
    if (bad := has_pred & (se[safe_pred] < se)).any():
        fail("subtree_end", bad, "a token's subtree must end no later than its predecessor's")
    roots = np.flatnonzero(~has_pred)
    if roots[0] != 0:
        raise TreeError(f"{where}.pred[0]: the first token must start a root (pred -1), got {int(pred[0])}")
    if (bad_roots := se[roots] != np.append(roots[1:], n)).any():
        i = int(roots[np.flatnonzero(bad_roots)[0]])
        raise TreeError(f"{where}.subtree_end[{i}]: a root's subtree must end where the next root starts")
    if (bad := tree.trainable & ~has_pred).any():
        fail("trainable", bad, "a token with pred == -1 (a root's first token) cannot be trainable")
    if (bad := tree.trainable & (tree.rollout < 0)).any():
        fail("trainable", bad, "a shared-prefix token (rollout == -1) cannot be trainable")


def concat(trees: list[TreeArrays]) -> tuple[TreeArrays, np.ndarray]:
    """Lay several trees end to end as one forest (block-diagonal attention); returns it and the start offsets."""
    lengths = np.array([len(t) for t in trees], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if len(trees) == 1:
        return trees[0], offsets

    def cat(name: str, shift: bool = False, keep_neg: bool = False) -> np.ndarray:
        parts = []
        for t, off in zip(trees, offsets, strict=True):
            a = getattr(t, name)
            if shift:
                a = np.where(a >= 0, a + off, a) if keep_neg else a + off
            parts.append(a)
        return np.concatenate(parts)

    forest = TreeArrays(
        tokens=cat("tokens"),
        positions=cat("positions"),
        subtree_end=cat("subtree_end", shift=True),
        pred=cat("pred", shift=True, keep_neg=True),
        trainable=cat("trainable"),
        logprobs=cat("logprobs"),
        rollout=cat("rollout"),
        segment=cat("segment"),
    )
    return forest, offsets


def root_ranges(tree: TreeArrays) -> list[tuple[int, int]]:
    """[start, end) of each root's subtree: independent pieces a micro-batch may take separately."""
    roots = np.flatnonzero(tree.pred < 0)
    return list(zip(roots.tolist(), tree.subtree_end[roots].tolist(), strict=True))


def slice_tree(tree: TreeArrays, start: int, end: int) -> TreeArrays:
    """Tokens [start, end) as a tree of their own; the range must be whole root subtrees (see root_ranges)."""
    if start == 0 and end == len(tree):
        return tree
    sub = {f.name: getattr(tree, f.name)[start:end] for f in fields(tree)}
    sub["subtree_end"] = sub["subtree_end"] - start
    sub["pred"] = np.where(sub["pred"] >= 0, sub["pred"] - start, -1)
    return TreeArrays(**sub)


def pad_to(tree: TreeArrays, multiple: int) -> TreeArrays:
    """Append self-only, untrainable tokens so the length is a multiple of ``multiple`` (flex kernel blocks)."""
    n = len(tree)
    extra = (-n) % multiple
    if extra == 0:
        return tree
    tail = np.arange(n, n + extra, dtype=np.int64)
    return replace(
        tree,
        tokens=np.concatenate([tree.tokens, np.zeros(extra, np.int64)]),
        positions=np.concatenate([tree.positions, np.zeros(extra, np.int64)]),
        subtree_end=np.concatenate([tree.subtree_end, tail + 1]),
        pred=np.concatenate([tree.pred, np.full(extra, -1, np.int64)]),
        trainable=np.concatenate([tree.trainable, np.zeros(extra, bool)]),
        logprobs=np.concatenate([tree.logprobs, np.zeros(extra, np.float32)]),
        rollout=np.concatenate([tree.rollout, np.full(extra, -1, np.int64)]),
        segment=np.concatenate([tree.segment, np.zeros(extra, np.int64)]),
    )


def visibility(subtree_end: torch.Tensor) -> torch.Tensor:
    """Boolean (N, N) matrix, [i, j] = token i may attend to token j."""
    n = subtree_end.shape[0]
    q = torch.arange(n, device=subtree_end.device)
    return (q[None, :] <= q[:, None]) & (q[:, None] < subtree_end[None, :])


def dense_mask(subtree_end: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """CPU path: an explicit (1, 1, N, N) mask for transformers' ``sdpa`` kernel (boolean, True = visible), or
    additive (0 visible, the dtype's minimum elsewhere) when ``dtype`` is given, as the ``eager`` kernel needs.
    Every row sees at least its own token, so no row is fully masked.
    """
    vis = visibility(subtree_end)
    if dtype is None:
        return vis[None, None]
    out = torch.zeros(vis.shape, dtype=dtype, device=subtree_end.device)
    out.masked_fill_(~vis, torch.finfo(dtype).min)
    return out[None, None]


@lru_cache(maxsize=1)
def _compiled_create_block_mask() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def flex_block_mask(subtree_end: torch.Tensor) -> Any:
    """GPU path: a flex-attention BlockMask for ``kv <= q < subtree_end[kv]``.

    ``subtree_end`` lives on the device the model runs on (CUDA normally; CPU works through inductor's C++
    backend) and has a length that is a multiple of :data:`FLEX_BLOCK` (see :func:`pad_to`). Compiled mask creation evaluates the rule block-wise, so no N x N tensor is materialized.
    """
    n = int(subtree_end.shape[0])
    se = subtree_end.to(torch.int32)

    def tree_rule(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (q_idx < se[kv_idx])

    return _compiled_create_block_mask()(tree_rule, None, None, n, n, device=se.device, BLOCK_SIZE=FLEX_BLOCK)


def path_ends(subtree_end: np.ndarray) -> np.ndarray:
    """Indices of the last token of each leaf: tokens whose subtree is only themselves."""
    return np.flatnonzero(subtree_end == np.arange(subtree_end.shape[0]) + 1)


def expand_paths(tree: TreeArrays) -> list[np.ndarray]:
    """Reference path: the token indices of every root-to-leaf path, in order (the ancestors of each leaf end).

    Quadratic in the tree size and meant for tests; raises :class:`TreeError` if a path's positions are not
    0..L-1, which would mean ``positions`` disagrees with ``subtree_end``.
    """
    idx = np.arange(len(tree))
    paths = []
    for end in path_ends(tree.subtree_end):
        path = idx[(idx <= end) & (end < tree.subtree_end)]
        if not np.array_equal(tree.positions[path], np.arange(path.shape[0])):
            raise TreeError(
                f"PackedTree.positions: path ending at token {end} is not numbered 0..{len(path) - 1}"
            )
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------- chunked (CPU)
CHUNKED_IMPL = "bridle_tree_chunked"  # the transformers attention implementation registered below


@dataclass(frozen=True)
class ChunkedTreeMask:
    """The tree's visibility rule for :func:`chunked_tree_attention`, never materialized as N x N."""

    subtree_end: torch.Tensor  # (N,) int64
    chunk: int  # queries per block
    # A sliding-window layer's rule on top: a key is seen only from fewer than ``window`` positions (depths on the
    # path, ``positions``) further on, as transformers' own sliding-window mask has it. 0: no window.
    positions: torch.Tensor | None = None
    window: int = 0

    def blocks(self) -> list[tuple[int, int, torch.Tensor]]:
        """(start, end, keys) per block of queries [start, end): the keys some query of the block can see
        (``j < end`` and ``subtree_end[j] > start``; the others, earlier finished branches, are skipped). With a
        window, also only keys fewer than ``window`` positions before the block's shallowest query: a harness's
        18k-token prompt then costs each block ``window`` keys, not 18k (exact: no query sees the others)."""
        se = self.subtree_end
        n = int(se.shape[0])
        out = []
        for start in range(0, n, self.chunk):
            end = min(n, start + self.chunk)
            keys = torch.nonzero(se[:end] > start).squeeze(1)
            if self.window:
                assert self.positions is not None
                keys = keys[self.positions[keys] > self.positions[start:end].min() - self.window]
            out.append((start, end, keys))
        return out

    def block_mask(self, start: int, end: int, keys: torch.Tensor) -> torch.Tensor:
        """The (end - start, len(keys)) boolean mask of queries [start, end) over ``keys``."""
        q = torch.arange(start, end, device=keys.device)
        mask = (keys[None, :] <= q[:, None]) & (q[:, None] < self.subtree_end[keys][None, :])
        if self.window:
            assert self.positions is not None
            mask &= (self.positions[q][:, None] - self.positions[keys][None, :]) < self.window
        return mask


def chunked_mask(subtree_end: torch.Tensor, chunk: int, positions: torch.Tensor | None = None,
                 window: int = 0) -> dict[str, ChunkedTreeMask]:
    """CPU path: the model's ``attention_mask`` argument for :data:`CHUNKED_IMPL`. transformers takes a dict as
    masks already prepared per layer type and hands each layer its entry unchanged; ``window`` > 0 adds the entry
    of sliding-window layers (``positions``: each token's depth on its path)."""
    se = subtree_end.to(torch.int64)
    masks = {"full_attention": ChunkedTreeMask(se, chunk)}
    if window:
        if positions is None:
            raise ValueError("chunked_mask: a sliding window needs the tokens' positions")
        masks["sliding_attention"] = ChunkedTreeMask(se, chunk, positions.to(torch.int64), window)
    return masks


def sliding_window(config: Any) -> int:
    """The sliding window of a transformers model config when any of its layers uses one; 0 otherwise."""
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in layer_types else 0


def chunked_tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ``sdpa`` over one block of queries at a time (see ChunkedTreeMask).
    Any other mask (an ordinary causal sequence: none) goes to ``sdpa`` as it is.

    With gradients, each block is recomputed in the backward pass instead of kept: torch's CPU flash kernel saves
    its mask in float for the backward, which over all blocks is N^2 / 2 floats per layer again."""
    from torch.utils.checkpoint import checkpoint
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, ChunkedTreeMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    tree = attention_mask

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
              keys: torch.Tensor) -> torch.Tensor:
        mask = tree.block_mask(start, end, keys)[None, None]
        out, _ = sdpa_attention_forward(module, q[:, :, start:end], k.index_select(2, keys), v.index_select(2, keys),
                                        mask, dropout=dropout, scaling=scaling, is_causal=False)
        return out  # (batch, queries, heads, head_dim)

    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    outs = [checkpoint(block, query, key, value, start, end, keys, use_reentrant=False) if recompute
            else block(query, key, value, start, end, keys) for start, end, keys in tree.blocks()]
    return torch.cat(outs, dim=1), None


def register_chunked() -> str:
    """Register :func:`chunked_tree_attention` with transformers (idempotent); returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(CHUNKED_IMPL, chunked_tree_attention)
    return CHUNKED_IMPL
