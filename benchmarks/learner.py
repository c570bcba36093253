#!/usr/bin/env python3
"""Learner step time for one group in three layouts: one prefix tree, one sequence per trajectory, one per call.

The shape (issue 9): 4 rollouts x 12 turns, a 4096-token shared prompt, 200-token responses, 300-token observations
(after every turn but the last). Every layout trains the same response tokens with the same advantages:

- tree:        the prompt once, each rollout's turns hang under it (what the tree builder produces);
- trajectory:  each rollout as its own sequence, the prompt repeated per rollout;
- call:        each model call as its own sample (its whole input, then its response), as a per-call trainer does.

All three go through the same ``Learner.train_step`` (a single update per batch, so pi_old comes from the same
forward pass), packed into micro-batches of ``--micro-batch-tokens``.

GPU (default when CUDA is present): Qwen3-0.6B shape with random weights, bf16, flex attention; prints step time,
ratios to the per-trajectory layout and MFU. ``--small`` (default without CUDA): a tiny Qwen3 on the CPU with the
dense mask at 1/16 of the lengths, plus the token counts of the full shape.

With ``--ranks 1,2`` each layout is also trained by learner ranks (``[learner] processes``: Accelerate's launcher,
DDP; gloo on a CPU), on a batch of ``--groups`` groups (default 4 then: whole groups are what ranks share), each
rank with ``--threads`` torch threads; the step time is the actor's view (the batch sent over the ranks' channel,
every rank's reply back).

    python benchmarks/learner.py                          # GPU
    python benchmarks/learner.py --small                  # CPU
    python benchmarks/learner.py --small --ranks 1,2      # CPU, 1 vs 2 learner ranks
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import torch

from pipeline.core.logs import configure
from pipeline.messages import PackedTree, RolloutSummary, TreeGroup, ids, mask, pack_f32, pack_i32, pack_u8
from pipeline.training.learner import Learner
from pipeline.training.stage import StageSettings, stage_settings

H200_BF16_TFLOPS = 989.0


@dataclass
class Shape:
    rollouts: int
    turns: int
    prompt: int
    response: int
    obs: int

    def scaled(self, f: int) -> Shape:
        return Shape(
            self.rollouts,
            self.turns,
            max(1, self.prompt // f),
            max(1, self.response // f),
            max(1, self.obs // f),
        )


@dataclass
class Node:
    parent: int  # index of the parent node, -1 for a root
    tokens: np.ndarray
    trainable: np.ndarray
    rollout: int


def pack_nodes(nodes: list[Node]) -> PackedTree:
    """Nodes listed in depth-first order -> PackedTree, with numpy (no per-token Python loop)."""
    lens = np.array([len(n.tokens) for n in nodes])
    start = np.concatenate([[0], np.cumsum(lens)[:-1]])
    end = start + lens
    depth = np.zeros(len(nodes), np.int64)
    for k, n in enumerate(nodes):
        depth[k] = 0 if n.parent < 0 else depth[n.parent] + lens[n.parent]
    sub_end = end.copy()
    for k in range(len(nodes) - 1, -1, -1):  # children come after their parent: one reverse sweep
        if nodes[k].parent >= 0:
            sub_end[nodes[k].parent] = max(sub_end[nodes[k].parent], sub_end[k])
    node_of = np.repeat(np.arange(len(nodes)), lens)
    within = np.arange(lens.sum()) - start[node_of]
    parents = np.array([n.parent for n in nodes])
    first_pred = np.where(parents >= 0, end[np.maximum(parents, 0)] - 1, -1)
    idx = np.arange(lens.sum())
    pred = np.where(within == 0, first_pred[node_of], idx - 1)
    trainable = np.concatenate([n.trainable for n in nodes])
    rng = np.random.default_rng(1)
    return PackedTree(
        tokens=pack_i32(np.concatenate([n.tokens for n in nodes])),
        positions=pack_i32(depth[node_of] + within),
        subtree_end=pack_i32(sub_end[node_of]),
        pred=pack_i32(pred),
        trainable=pack_u8(trainable),
        logprobs=pack_f32(np.where(trainable, -rng.random(trainable.shape[0]) * 2, 0.0)),
        rollout=pack_i32(np.repeat([n.rollout for n in nodes], lens)),
        segment=pack_i32(np.zeros(lens.sum(), np.int64)),
    )


def layouts(shape: Shape, vocab: int, seed: int = 0) -> dict[str, TreeGroup]:
    rng = np.random.default_rng(seed)

    def toks(n: int) -> np.ndarray:
        return rng.integers(0, vocab, n)

    prompt = toks(shape.prompt)
    resp = [[toks(shape.response) for _ in range(shape.turns)] for _ in range(shape.rollouts)]
    obs = [[toks(shape.obs) for _ in range(shape.turns - 1)] for _ in range(shape.rollouts)]

    def history(r: int, turns: int) -> tuple[np.ndarray, np.ndarray]:
        """Rollout r's tokens after the prompt, through ``turns`` turns (and the observation after each)."""
        parts, train = [np.zeros(0, np.int64)], [np.zeros(0, bool)]
        for k in range(turns):
            parts.append(resp[r][k])
            train.append(np.ones(shape.response, bool))
            if k < shape.turns - 1:
                parts.append(obs[r][k])
                train.append(np.zeros(shape.obs, bool))
        return np.concatenate(parts), np.concatenate(train)

    no = np.zeros(shape.prompt, bool)
    tree = [Node(-1, prompt, no, -1)]
    traj, call = [], []
    for r in range(shape.rollouts):
        h, m = history(r, shape.turns)
        tree.append(Node(0, h, m, r))
        traj.append(Node(-1, np.concatenate([prompt, h]), np.concatenate([no, m]), r))
        for k in range(shape.turns):
            hk, _ = history(r, k)  # the call's input: everything before response k
            x = np.concatenate([prompt, hk])
            call.append(
                Node(
                    -1,
                    np.concatenate([x, resp[r][k]]),
                    np.concatenate([np.zeros(len(x), bool), np.ones(shape.response, bool)]),
                    r,
                )
            )
    rewards = [float(r % 2 == 0) for r in range(shape.rollouts)]
    summaries = [
        RolloutSummary(rollout_id=f"r{r}", reward=rewards[r], status="ok") for r in range(shape.rollouts)
    ]
    return {
        name: TreeGroup(
            group_id=name, task_id="bench", harness="bench", rollouts=summaries, packed=pack_nodes(nodes)
        )
        for name, nodes in (("tree", tree), ("trajectory", traj), ("call", call))
    }


def counts(g: TreeGroup) -> dict[str, int]:
    pos = ids(g.packed.positions)
    return {
        "sequences": int((ids(g.packed.pred) == -1).sum()),
        "tokens": int(pos.shape[0]),
        "trainable": int(mask(g.packed.trainable).sum()),
        "attn_pairs": int(
            (pos.astype(np.int64) + 1).sum()
        ),  # (query, key) pairs each attention layer computes
    }


def model_flops(cfg, c: dict[str, int]) -> float:
    """Forward + backward FLOPs (3x forward) of one step: matmuls over all tokens, attention over the visible
    pairs, the LM head over trainable rows only (that is all the learner computes it for)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = layers * 2 * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    attn = layers * 4 * q * c["attn_pairs"]
    head = 2 * h * cfg.vocab_size * c["trainable"]
    return 3.0 * (per_token * c["tokens"] + attn + head)


def make_model(small: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if small:
        cfg = Qwen3Config(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        )
    else:  # Qwen3-0.6B
        cfg = Qwen3Config(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
        )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg), cfg


def parse_args(cuda: bool) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--small", action="store_true", default=not cuda, help="tiny model on CPU (default w/o CUDA)"
    )
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--response", type=int, default=200)
    ap.add_argument("--obs", type=int, default=300)
    ap.add_argument("--scale", type=int, default=None, help="divide lengths for the timed run (--small: 16)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="default 32768 on GPU, 2048 small")
    ap.add_argument("--layouts", default="tree,trajectory,call")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing in the transformer")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    ap.add_argument("--ranks", default="1", help="learner processes to compare, e.g. 1,2")
    ap.add_argument("--groups", type=int, default=None, help="groups per step (default 1; 4 with --ranks)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=1, help="timing rounds (median), rank counts interleaved")
    return ap.parse_args()


def print_counts(full_groups: dict[str, TreeGroup]) -> None:
    """Sequences, tokens and attention pairs of each layout, and their ratio to the trajectory layout's."""
    full_counts = {k: counts(g) for k, g in full_groups.items()}
    print("\ntoken counts, full shape")
    print(
        f"{'layout':<11} {'seqs':>5} {'tokens':>9} {'trainable':>9} {'attn pairs':>13} {'tokens x':>9} "
        f"{'pairs x':>8}"
    )
    base = full_counts["trajectory"]
    for name, c in full_counts.items():
        print(
            f"{name:<11} {c['sequences']:>5} {c['tokens']:>9} {c['trainable']:>9} {c['attn_pairs']:>13} "
            f"{c['tokens'] / base['tokens']:>9.2f} {c['attn_pairs'] / base['attn_pairs']:>8.2f}"
        )


Timing = tuple[dict[str, int], float, float, float]  # counts, step seconds, model TFLOP/s, peak GiB


def print_timings(rows: dict[tuple[str, int], Timing], cuda: bool, peak_tflops: float) -> None:
    print(
        f"\n{'layout':<11} {'ranks':>5} {'tokens':>8} {'step s':>8} {'x traj':>7} {'x 1 rank':>8} {'tok/s':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}"
    )
    first = next(iter(rows))[1]
    ref = rows.get(("trajectory", first), next(iter(rows.values())))[1]
    for (name, n), (c, dt, tflops, mem) in rows.items():
        mfu = f"{100 * tflops / peak_tflops:.1f}%" if cuda else "-"
        tf, gib = (f"{tflops:.1f}", f"{mem:.1f}") if cuda else ("-", "-")
        one = rows.get((name, 1))
        speedup = f"{one[1] / dt:.2f}" if one else "-"
        print(
            f"{name:<11} {n:>5} {c['tokens']:>8} {dt:>8.3f} {dt / ref:>7.2f} {speedup:>8} {c['tokens'] / dt:>9.0f} "
            f"{tf:>8} {mfu:>6} {gib:>8}"
        )
    if cuda:
        print(
            f"\nMFU: model FLOPs of each layout (matmuls + visible attention pairs + LM head on trainable rows, "
            f"x3 for backward) / step time / {peak_tflops:.0f} TFLOP/s"
        )


def main() -> None:
    args = parse_args(torch.cuda.is_available())
    configure(level="warning")  # the learner's per-step info lines would drown the table
    small = args.small
    full = Shape(args.rollouts, args.turns, args.prompt, args.response, args.obs)
    run_shape = full.scaled(args.scale or (16 if small else 1))
    model, mcfg = make_model(small)
    budget = args.micro_batch_tokens or (2048 if small else 32768)

    print(
        f"shape: {full.rollouts} rollouts x {full.turns} turns, prompt {full.prompt}, response {full.response}, "
        f"observation {full.obs}"
    )
    full_groups = layouts(full, mcfg.vocab_size)
    print_counts(full_groups)

    rank_counts = [int(x) for x in args.ranks.split(",")]
    n_groups = args.groups or (4 if rank_counts != [1] else 1)
    names = args.layouts.split(",")
    # n_groups groups per step: the layout's group and copies of it with other tokens (ranks share whole groups)
    variants = [full_groups if run_shape == full and k == 0 else layouts(run_shape, mcfg.vocab_size, seed=k)
                for k in range(n_groups)]
    batches = {name: [msgspec.structs.replace(v[name], group_id=f"{name}-{k}") for k, v in enumerate(variants)]
               for name in names}
    gpu = torch.cuda.is_available() and not small
    cfg = stage_settings(
        lr=1e-6,
        micro_batch_tokens=budget,
        attention="flex" if gpu else "dense",
        mixed_precision="bf16" if gpu else "no",
        param_dtype="bfloat16" if gpu else "float32",
        gradient_checkpointing=args.grad_ckpt,
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"\ntimed run: {'small Qwen3 on CPU, dense mask' if small else 'Qwen3-0.6B shape, bf16, flex attention'}"
        f", lengths / {args.scale or (16 if small else 1)}, micro-batch {budget} tokens, {n_groups} group(s) per "
        f"step, {args.rounds} x {args.iters} steps after a warm-up step, ranks {args.ranks}, torch threads per rank "
        f"{args.threads or torch.get_num_threads()}, {os.cpu_count()} CPUs"
    )
    c_of = {name: {k: sum(counts(g)[k] for g in batches[name]) for k in counts(batches[name][0])} for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        times, mems = anyio.run(measure, args, Path(tmp), model, cfg, batches, rank_counts, gpu)
    rows: dict[tuple[str, int], Timing] = {}
    for (name, n), dts in times.items():
        dt = float(np.median(dts))
        rows[(name, n)] = (c_of[name], dt, model_flops(mcfg, c_of[name]) / dt / 1e12, mems.get((name, n), NAN))
    print_timings(rows, gpu, args.peak_tflops)
    if args.rounds > 1:
        print(f"\nstep s: median of {args.rounds} rounds; each round times every rank count in turn, so a change in "
              "the machine's load falls on all of them. Per round (s):")
        for (name, n), dts in times.items():
            print(f"  {name:<11} {n} rank(s): " + " ".join(f"{x:.3f}" for x in dts))


NAN = float("nan")


async def measure(args: argparse.Namespace, model_dir: Path, model, cfg: StageSettings,
                  batches: dict[str, list[TreeGroup]], rank_counts: list[int], gpu: bool
                  ) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], float]]:
    """Seconds per step of each (layout, rank count), ``--rounds`` times: 1 rank in this process (what
    ``processes = 1`` runs), N ranks through :func:`start_ranks` (all started once, idle while another is timed)."""
    from accelerate import Accelerator

    from pipeline.training.ranks import start_ranks

    times: dict[tuple[str, int], list[float]] = {}
    mems: dict[tuple[str, int], float] = {}
    async with contextlib.AsyncExitStack() as stack:
        steppers: dict[int, Any] = {}
        for n in rank_counts:
            if n == 1:
                learner = Learner(model, cfg, accelerator=Accelerator(mixed_precision=cfg.compute.mixed_precision,
                                                                      cpu=not gpu))

                async def one(batch: list[TreeGroup], learner: Learner = learner) -> None:
                    learner.train_step(batch)

                steppers[1] = one
            else:
                log = Path(tempfile.gettempdir()) / f"bridle-bench-ranks-{os.getpid()}-{n}.log"
                ranks = await stack.enter_async_context(
                    start_ranks(n, log_path=log, threads=args.threads, timeout_s=3600))
                await ranks.init(str(model_dir), cfg)
                steppers[n] = ranks.train_step
        for name, batch in batches.items():
            for step in steppers.values():
                await step(batch)  # warm-up: compilation, allocator
            for _ in range(args.rounds):
                for n, step in steppers.items():
                    if gpu:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        await step(batch)
                    if gpu:
                        torch.cuda.synchronize()
                        if n == 1:
                            mems[(name, n)] = torch.cuda.max_memory_allocated() / 2**30
                    times.setdefault((name, n), []).append((time.perf_counter() - t0) / args.iters)
    return times, mems

if __name__ == "__main__":
    main()
