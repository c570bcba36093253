"""Test helpers for the learner: pack root-to-leaf paths into a PackedTree, random groups, a tiny Qwen3.

Independent of the tree builder on purpose: a token-level trie over (token, rollout, trainable, logprob, segment)
items, laid out depth-first. Paths that share a prefix of identical items share those tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pipeline.messages import PackedTree, RolloutSummary, TreeGroup, pack_f32, pack_i32, pack_u8


class Item(NamedTuple):
    token: int
    rollout: int = -1
    trainable: bool = False
    logprob: float = 0.0
    segment: int = 0


def pack_paths(paths: list[list[Item]]) -> PackedTree:
    trie: dict = {}
    for path in paths:
        node = trie
        for item in path:
            node = node.setdefault(item, {})
    cols: dict[str, list] = {
        k: []
        for k in ("tokens", "positions", "subtree_end", "pred", "trainable", "logprobs", "rollout", "segment")
    }

    def walk(node: dict, parent: int, depth: int) -> None:
        for item, children in node.items():
            i = len(cols["tokens"])
            cols["tokens"].append(item.token)
            cols["positions"].append(depth)
            cols["subtree_end"].append(-1)
            cols["pred"].append(parent)
            cols["trainable"].append(item.trainable)
            cols["logprobs"].append(item.logprob if item.trainable else 0.0)
            cols["rollout"].append(item.rollout)
            cols["segment"].append(item.segment)
            walk(children, i, depth + 1)
            cols["subtree_end"][i] = len(cols["tokens"])

    walk(trie, -1, 0)
    return PackedTree(
        tokens=pack_i32(cols["tokens"]),
        positions=pack_i32(cols["positions"]),
        subtree_end=pack_i32(cols["subtree_end"]),
        pred=pack_i32(cols["pred"]),
        trainable=pack_u8(cols["trainable"]),
        logprobs=pack_f32(cols["logprobs"]),
        rollout=pack_i32(cols["rollout"]),
        segment=pack_i32(cols["segment"]),
    )


def random_paths(rng: np.random.Generator, n_rollouts: int = 3, vocab: int = 200) -> list[list[Item]]:
    """A group: a shared prompt, per rollout several turns (observation then response), retry branches off earlier
    turns, a second segment (compaction restart) for some rollouts, and some trainable tokens masked out."""

    def toks(n: int) -> np.ndarray:
        return rng.integers(1, vocab, size=n)

    prompt = [Item(int(t)) for t in toks(int(rng.integers(2, 8)))]
    paths: list[list[Item]] = []
    for r in range(n_rollouts):
        for seg in range(1 + int(rng.random() < 0.4)):
            hist = (
                list(prompt)
                if seg == 0
                else [Item(int(t), r, segment=seg) for t in toks(int(rng.integers(1, 4)))]
            )
            turns = int(rng.integers(1, 4))
            for turn in range(turns):
                if turn:
                    hist += [Item(int(t), r, segment=seg) for t in toks(int(rng.integers(1, 4)))]
                if rng.random() < 0.35:  # a retry: a dead branch that leaves this point
                    dead = [
                        Item(int(t), r, True, float(-3.5 - rng.random() * 3), seg)
                        for t in toks(int(rng.integers(1, 4)))
                    ]
                    paths.append(hist + dead)
                resp = toks(int(rng.integers(1, 5)))
                hist += [
                    Item(int(t), r, bool(rng.random() > 0.15), float(-3.5 - rng.random() * 3), seg)
                    for t in resp
                ]
            paths.append(hist)
    return paths


def group(paths: list[list[Item]], rewards: list[float], statuses: list[str] | None = None, gid: str = "g0"):
    statuses = statuses or ["ok"] * len(rewards)
    return TreeGroup(
        group_id=gid,
        task_id="t",
        harness="h",
        rollouts=[
            RolloutSummary(rollout_id=f"{gid}-r{i}", reward=float(x), status=s)  # type: ignore[arg-type]
            for i, (x, s) in enumerate(zip(rewards, statuses, strict=True))
        ],
        packed=pack_paths(paths),
    )


def tiny_qwen3(seed: int = 0, vocab: int = 200, tie: bool = True):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    model = Qwen3ForCausalLM(cfg).float()
    # Random init is near-uniform; larger weights make logits (and gradients) differ visibly between tokens.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 0.05)
    return model
