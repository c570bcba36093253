#!/usr/bin/env python3
"""Tree build + group packing throughput (pipeline/tree.py, pipeline/packing.py).

A group of G rollouts shares a prompt; each rollout is a conversation of C calls whose input is the previous call's
input + output + a tool result (the shape token-in splicing produces), with some turns retried (dead leaves).
"Total tokens" is what the harness sent and received, summed over all calls of the group (TreeStats.tokens_total),
the work a builder without a tree would face. The goal: linear in total tokens, >= 20M tokens/s at the high end.

    python benchmarks/tree.py            # the full table (up to 10M tokens)
    python benchmarks/tree.py --quick    # small sizes only
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pipeline.messages import (
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
    pack_f32,
    pack_i32,
)
from pipeline.trees.packing import build_group
from pipeline.trees.tree import TreeOptions

GROUP = 4
VOCAB = 150_000


def make_group(
    total: int, calls: int, rng: np.random.Generator, p_retry: float = 0.1
) -> list[SettledRollout]:
    """A group whose calls add up to about ``total`` tokens, ``calls`` calls in all (split over the rollouts)."""
    per = max(1, calls // GROUP)
    budget = total / GROUP  # tokens per rollout, summed over its calls
    # Call i sends prompt + i * step tokens and gets step // 3 back; half the budget goes to re-sent prompts
    # unless the turns need more than half.
    turns = per * (per - 1) / 2 + per / 3
    step = max(3, int(budget / 2 / turns))
    prompt_len = int((budget - step * turns) / per)
    if prompt_len < 1:
        raise ValueError(f"{calls} calls cannot add up to only {total} tokens")
    prompt = rng.integers(0, VOCAB, prompt_len, dtype=np.int32)
    out_len = max(1, step // 3)
    group = []
    for r in range(GROUP):
        hist = prompt
        records = []
        seq = 0
        for turn in range(per):
            if turn:
                hist = np.concatenate([hist, rng.integers(0, VOCAB, step - out_len, dtype=np.int32)])
            attempts = 2 if rng.random() < p_retry else 1
            for _ in range(attempts):
                y = rng.integers(0, VOCAB, out_len, dtype=np.int32)
                records.append(
                    ModelCall(
                        rollout_id=f"r{r}",
                        call_id=f"r{r}-{seq}",
                        seq=seq,
                        protocol="chat",
                        input_ids=pack_i32(hist),
                        output_ids=pack_i32(y),
                        logprobs=pack_f32(np.full(out_len, -0.5, dtype=np.float32)),
                    )
                )
                seq += 1
            hist = np.concatenate([hist, y])
        group.append(
            SettledRollout(
                request=RolloutRequest(
                    rollout_id=f"r{r}",
                    group_id="g",
                    index=r,
                    group_size=GROUP,
                    task_id="t",
                    harness="bench",
                    token="x",
                    policy_version=0,
                ),
                finished=RolloutFinished(rollout_id=f"r{r}", group_id="g", status="ok", reward=float(r)),
                calls=records,
            )
        )
    return group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only sizes up to 1M tokens")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sizes = [1_000, 10_000, 100_000, 1_000_000] + ([] if args.quick else [10_000_000])
    options = TreeOptions(max_leaves=10_000)
    rows = []
    for total in sizes:
        for calls in (10, 100, 1000):
            try:
                group = make_group(total, calls, rng)
            except ValueError:
                continue
            n_calls = sum(len(r.calls) for r in group)
            reps = 5 if total <= 100_000 else (3 if total <= 1_000_000 else 2)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                build = build_group(group, options)
                best = min(best, time.perf_counter() - t0)
            stats = [s.stats for s in build.summaries]
            tok = sum(s.tokens_total for s in stats)
            packed = len(build.message.packed.tokens) // 4  # type: ignore[union-attr]
            dead = sum(s.dropped.get("dead_leaf", 0) for s in stats)
            rows.append((n_calls, tok, packed, dead, best, tok / best / 1e6, best / tok * 1e9))
    print(
        f"{'calls':>6} {'total tokens':>13} {'packed':>10} {'dead':>5} {'build+pack s':>13} "
        f"{'Mtok/s':>8} {'ns/token':>9}"
    )
    for n_calls, tok, packed, dead, t, rate, ns in rows:
        print(f"{n_calls:>6} {tok:>13,} {packed:>10,} {dead:>5} {t:>13.4f} {rate:>8.1f} {ns:>9.2f}")


if __name__ == "__main__":
    main()
