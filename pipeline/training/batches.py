"""From TreeGroups to what the model sees: each group's tree with a score (GRPO advantage, or the reward as
PPO's return) and a loss weight per trainable token of a valid rollout (:func:`prepare`), whole root subtrees
packed into micro-batches (:func:`micro_batches`), and a micro-batch as model inputs in the configured
attention layout (:func:`model_inputs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from pipeline.messages import TreeGroup
from pipeline.training import advantages as adv
from pipeline.training import tree_attention as ta


class ScoreRules(Protocol):
    """The StageSettings fields that decide targets, scores and weights."""

    advantage: str  # "grpo": group-normalized advantages; "ppo": the reward as the return
    grpo_eps: float
    grpo_scale_by_std: bool
    train_statuses: list[str]  # rollouts with another status are left out
    loss_agg: str  # "token_mean" or "seq_mean_token_mean"


@dataclass
class Tree:
    """One group's tree with its per-target arrays (targets: trainable tokens of valid rollouts)."""

    arrays: ta.TreeArrays
    targets: np.ndarray  # indices into the tree
    score: np.ndarray  # per target: GRPO advantage, or the reward (the PPO return)
    weight: np.ndarray  # per target: its share in the loss aggregation (1 for a token mean)
    logp_rollout: np.ndarray
    n_rollouts: int
    reward_mean: float
    temperature: float  # the group's sampling temperature (1 for SFT: plain NLL)


@dataclass
class MicroBatch:
    """Root subtrees of one or more trees laid end to end (one forest), with their targets' arrays."""

    forest: ta.TreeArrays
    targets: np.ndarray
    score: np.ndarray
    weight: np.ndarray
    logp_rollout: np.ndarray
    temperature: np.ndarray  # per target
    old: dict[str, torch.Tensor] = field(default_factory=dict)  # logp / value under pi_old, logp under pi_ref
    pad: bool = False  # see :func:`padding`


def prepare(group: TreeGroup, index: int, cfg: ScoreRules, sft: bool = False) -> Tree:
    """Group ``index``'s tree, unpacked and checked, with each target's score (advantage or reward) and loss
    weight; ``sft``: every trainable token, score 0, token-mean weights."""
    arrays = ta.unpack(group.packed, where=f"TreeGroup[{index}]({group.group_id}).packed")
    if arrays.rollout.max(initial=-1) >= len(group.rollouts):
        raise ValueError(
            f"TreeGroup[{index}]({group.group_id}): packed.rollout refers to slot "
            f"{int(arrays.rollout.max())} but rollouts has {len(group.rollouts)} entries"
        )
    rewards = np.array([r.reward for r in group.rollouts], dtype=np.float64)
    if sft:
        targets = np.flatnonzero(arrays.trainable)
        score = np.zeros(targets.shape[0])
    else:
        valid = adv.rollout_valid(group.rollouts, cfg.objective.train_statuses)
        targets = np.flatnonzero(arrays.trainable & adv.per_token(valid, arrays.rollout))
        slot = (
            adv.grpo_advantages(rewards, valid, cfg.objective.grpo_eps, cfg.objective.grpo_scale_by_std)
            if cfg.objective.advantage == "grpo"
            else rewards
        )
        score = adv.per_token(slot, arrays.rollout)[targets]
    weight = np.ones(targets.shape[0], dtype=np.float32)
    if not sft and cfg.objective.loss_agg == "seq_mean_token_mean" and targets.size:
        slots = arrays.rollout[targets]
        weight = (1.0 / np.bincount(slots)[slots]).astype(np.float32)
    return Tree(
        arrays=arrays,
        targets=targets,
        score=score.astype(np.float32),
        weight=weight,
        logp_rollout=arrays.logprobs[targets],
        n_rollouts=len(group.rollouts),
        reward_mean=float(rewards.mean()) if rewards.size else 0.0,
        temperature=1.0 if sft else float(group.temperature),
    )


def micro_batches(trees: list[Tree], budget: int) -> list[MicroBatch]:
    """Greedy packing of root subtrees (a group's tree is usually one root; compaction segments and per-sample
    layouts add more) into micro-batches of at most ``budget`` tokens; a larger subtree goes alone."""
    bins: list[list[tuple[Tree, int, int]]] = []
    used = 0
    for t in trees:
        for start, end in ta.root_ranges(t.arrays):
            if bins and used + (end - start) <= budget:
                bins[-1].append((t, start, end))
                used += end - start
            else:
                bins.append([(t, start, end)])
                used = end - start
    micros = []
    for b in bins:
        forest, offsets = ta.concat([ta.slice_tree(t.arrays, s, e) for t, s, e in b])
        keep = [(t.targets >= s) & (t.targets < e) for t, s, e in b]
        picked = [(t, k) for (t, _, _), k in zip(b, keep, strict=True)]  # each tree, its targets' mask
        micros.append(
            MicroBatch(
                forest=forest,
                targets=np.concatenate(
                    [t.targets[k] - s + off for (t, s, _), k, off in zip(b, keep, offsets, strict=True)]
                ),
                score=np.concatenate([t.score[k] for t, k in picked]),
                weight=np.concatenate([t.weight[k] for t, k in picked]),
                logp_rollout=np.concatenate([t.logp_rollout[k] for t, k in picked]),
                temperature=np.concatenate([np.full(int(k.sum()), t.temperature, np.float32)
                                            for t, k in picked]),
            )
        )
    return micros


def model_inputs(forest: ta.TreeArrays, targets: np.ndarray, attention: str, dev: torch.device,
                 chunk: int = 1024, window: int = 0) -> dict[str, Any]:
    """Model inputs for one micro-batch in an attention layout ("flex", "chunked" with ``chunk`` queries per
    block, "dense" or "reference"). ``window``: the model's sliding window (``chunked`` only, for now)."""
    if window and attention != "chunked":
        raise ValueError(f"a model with a sliding window ({window}) trains with [learner] attention = \"chunked\" "
                         f"only, not {attention!r}")
    tgt_tokens = torch.as_tensor(forest.tokens[targets], device=dev)
    if attention == "reference":
        return _reference_inputs(forest, targets, tgt_tokens, dev)
    if attention == "flex":
        forest = ta.pad_to(forest, ta.FLEX_BLOCK)
    se = torch.as_tensor(forest.subtree_end, device=dev)
    if attention == "flex":
        attn: Any = ta.flex_block_mask(se)
    elif attention == "chunked":
        attn = ta.chunked_mask(se, chunk, torch.as_tensor(forest.positions, device=dev), window)
    else:
        attn = ta.dense_mask(se)
    return {
        "input_ids": torch.as_tensor(forest.tokens, device=dev)[None],
        "position_ids": torch.as_tensor(forest.positions, device=dev)[None],
        "attention_mask": attn,
        "rows": torch.as_tensor(forest.pred[targets], device=dev),
        "targets": tgt_tokens,
    }


def _reference_inputs(
    forest: ta.TreeArrays, targets: np.ndarray, tgt_tokens: torch.Tensor, dev: torch.device
) -> dict[str, Any]:
    """Every root-to-leaf path as its own causal row; each target read from the first path that holds it."""
    paths = ta.expand_paths(forest)
    width = max(len(p) for p in paths)
    tokens = np.zeros((len(paths), width), np.int64)
    positions = np.zeros((len(paths), width), np.int64)
    row_of = np.full(len(forest), -1, np.int64)
    for b, p in enumerate(paths):
        tokens[b, : len(p)] = forest.tokens[p]
        positions[b, : len(p)] = np.arange(len(p))
        first = row_of[p[1:]] < 0
        # Token p[k] is predicted from the hidden state at row position k - 1 of this path.
        row_of[p[1:][first]] = b * width + np.arange(len(p) - 1)[first]
    return {
        "input_ids": torch.as_tensor(tokens, device=dev),
        "position_ids": torch.as_tensor(positions, device=dev),
        "attention_mask": None,
        "rows": torch.as_tensor(row_of[targets], device=dev),
        "targets": tgt_tokens,
    }


def shares(sizes: list[int], ranks: int) -> list[list[int]]:
    """Indices of ``sizes`` per rank: whole trees, balanced by tokens. Greedy largest-first (ties: the lower index
    first, the lower rank); each share keeps the batch's order, so every rank, given the same batch, computes the
    same split without talking to the others."""
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += sizes[i]
    return [sorted(s) for s in out]


def padding() -> MicroBatch:
    """A two-token micro-batch with one target of weight 0: a rank with fewer micro-batches in an update than the
    others runs these, so every rank makes the same number of forward and backward calls (DDP all-reduces on the
    last backward; FSDP gathers parameters in every forward) while adding nothing to the loss or its gradient."""
    forest = ta.TreeArrays(
        tokens=np.zeros(2, np.int64),
        positions=np.arange(2, dtype=np.int64),
        subtree_end=np.full(2, 2, np.int64),
        pred=np.array([-1, 0], np.int64),
        trainable=np.array([False, True]),
        logprobs=np.zeros(2, np.float32),
        rollout=np.zeros(2, np.int64),
        segment=np.zeros(2, np.int64),
    )
    one = np.ones(1, np.float32)
    return MicroBatch(forest=forest, targets=np.array([1], np.int64), score=0 * one, weight=0 * one,
                      logp_rollout=0 * one, temperature=one, pad=True)
