#!/usr/bin/env python3
"""The CPU learner's tree attention with a sliding window: keys pruned to the window vs all ancestors read.

    python benchmarks/window_attention.py [--repeats 3] [--chunk 1024]

An SFT pack through a black-box harness is one long shared prompt and many short branches (one per
demonstration). The learner's CPU attention (``ChunkedTreeMask``) takes one block of queries at a time; a block
reads every key that some query of it may see. With the model's sliding window, only keys fewer than ``window``
positions before the block's shallowest query can be seen, so the pruned arm reads those alone; the unpruned arm
reads every ancestor and lets the mask drop the rest (what the learner did before). Both give the same loss and
gradients (checked here, and against transformers' own sliding-window model in tests/training).

Packs are synthetic ids in the shapes recorded through the harnesses (``configs/blackbox.toml``'s 64 demonstrations
a pack): Codex, an 8.6k-token prompt then ~30 tokens per demonstration; Claude Code, 17.4k tokens to the instruction,
then ~1.47k per demonstration (its reminders and agent list come after the task: benchmarks/results/
2026-12-07-window-attention.md). The policy is the blackbox experiment's (2 layers, hidden 128, window 512, 160-row
vocabulary). One forward and backward per arm per repeat, interleaved; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from pipeline.training import tree_attention as ta

PACKS = {"codex": (8_600, 64, 30), "claude-code": (17_400, 64, 1_470)}  # trunk, demonstrations, tokens each
WINDOW = 512


class Unpruned(ta.ChunkedTreeMask):
    """Every ancestor key read, the window applied by the mask alone."""

    def blocks(self) -> list[tuple[int, int, torch.Tensor]]:
        return ta.ChunkedTreeMask(self.subtree_end, self.chunk).blocks()


def pack(trunk: int, branches: int, each: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = trunk + branches * each
    tokens = torch.randint(0, 160, (n,))
    positions = torch.cat([torch.arange(trunk), *(torch.arange(trunk, trunk + each) for _ in range(branches))])
    ends = [torch.full((trunk,), n)] + [torch.full((each,), trunk + (b + 1) * each) for b in range(branches)]
    return tokens, positions, torch.cat(ends)


def step(model: Qwen3ForCausalLM, tokens: torch.Tensor, positions: torch.Tensor, mask: dict) -> tuple[float, float]:
    model.zero_grad()
    t0 = time.perf_counter()
    logits = model(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits.float(), tokens[1:])
    loss.backward()
    return time.perf_counter() - t0, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1024, help="queries per block ([learner.*.compute] attention_chunk)")
    ap.add_argument("--branches", type=int, default=64, help="demonstrations per pack (the unpruned arm of a 64-"
                    "demonstration Claude Code pack takes minutes a step)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # as [learner] threads = 1
    cfg = Qwen3Config(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=160, use_sliding_window=True,
                      sliding_window=WINDOW, max_window_layers=0, max_position_embeddings=32768)
    model = Qwen3ForCausalLM(cfg)
    model.set_attn_implementation(ta.register_chunked())
    print(f"{args.branches} demonstrations a pack, {args.repeats} steps per arm\n")
    print(f"| pack | tokens | keys read per layer: unpruned | pruned | step s: unpruned | pruned | speed-up |"
          f" loss equal |\n|{' --- |' * 8}")
    for name, shape in PACKS.items():
        tokens, positions, ends = pack(shape[0], args.branches, shape[2])
        arms = {"unpruned": {"full_attention": ta.ChunkedTreeMask(ends, args.chunk),
                             "sliding_attention": Unpruned(ends, args.chunk, positions, WINDOW)},
                "pruned": ta.chunked_mask(ends, args.chunk, positions, WINDOW)}
        keys = {a: sum(len(k) for *_, k in m["sliding_attention"].blocks()) for a, m in arms.items()}
        times: dict[str, list[float]] = {a: [] for a in arms}
        losses: dict[str, float] = {}
        grads: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for arm, mask in arms.items():
                dt, losses[arm] = step(model, tokens, positions, mask)
                times[arm].append(dt)
                grads[arm] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        same = abs(losses["pruned"] - losses["unpruned"]) < 1e-5 and torch.allclose(grads["pruned"],
                                                                                    grads["unpruned"], atol=1e-6)
        med = {a: statistics.median(t) for a, t in times.items()}
        print(f"| {name} | {len(tokens):,} | {keys['unpruned']:,} | {keys['pruned']:,} | {med['unpruned']:.2f} | "
              f"{med['pruned']:.2f} | {med['unpruned'] / med['pruned']:.1f}x | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
