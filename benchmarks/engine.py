#!/usr/bin/env python3
"""Embedded-engine throughput: aggregate output tokens/s at several concurrency levels, over real HTTP.

    python benchmarks/engine.py                       # quickstart-sized model, reduced vocabulary, 1 and 16
    python benchmarks/engine.py --hidden 256 --layers 4 --concurrency 1 4 16 32 --full-vocab

Goal: >= 4x the single-request aggregate throughput at 16 concurrent requests (batched decoding).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio

from pipeline.models.small import IM_END, IM_START, VocabTable, create_small_model
from pipeline.serving.engine import EngineSampling
from pipeline.serving.launch import launch_embedded


async def measure(client, concurrency: int, prompt_len: int, tokens: int, rounds: int) -> tuple[float, float]:
    """(aggregate tokens/s, mean seconds per request) over ``rounds`` waves of ``concurrency`` requests."""
    s = EngineSampling(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    total, latencies = 0, []
    t0 = time.perf_counter()
    for r in range(rounds):

        async def one(i: int, r: int = r) -> None:
            nonlocal total
            start = time.perf_counter()
            prompt = [IM_START] + [1000 + (i * 31 + j * 7 + r) % 500 for j in range(prompt_len)] + [IM_END]
            res = await client.generate(
                prompt, EngineSampling(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "seed": i})
            )
            total += len(res.output_ids)
            latencies.append(time.perf_counter() - start)

        async with anyio.create_task_group() as tg:
            for i in range(concurrency):
                tg.start_soon(one, i)
    wall = time.perf_counter() - t0
    return total / wall, sum(latencies) / len(latencies)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        vocab = None if args.full_vocab else VocabTable.from_sequences([range(1000, 1000 + args.vocab)])
        path = create_small_model(
            Path(tmp) / "model",
            vocab=vocab,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
        )
        async with launch_embedded(
            path, threads=args.threads, max_running_requests=max(args.concurrency)
        ) as client:
            await measure(client, 2, args.prompt, 8, 1)  # warm-up
            rows = []
            threads = (await client.server_info())["torch_threads"]
            info = await client.model_info()
            for c in args.concurrency:
                before = await client.server_info()
                tps, lat = await measure(client, c, args.prompt, args.tokens, args.rounds)
                after = await client.server_info()
                steps = after["decode_steps"] - before["decode_steps"]
                occ = (after["decoded_tokens"] - before["decoded_tokens"]) / steps if steps else 0.0
                rows.append((c, tps, lat, occ))
    base = rows[0][1]
    vocab_desc = f"{info['vocab']} ({info['model_vocab_size']} rows)"
    print(
        f"\nembedded engine, Qwen3 hidden={args.hidden} layers={args.layers} heads={args.heads}/"
        f"{args.kv_heads} vocab={vocab_desc}, prompt={args.prompt + 2} tokens, {args.tokens} new tokens/request, "
        f"engine torch threads={threads}"
    )
    print(
        f"{'concurrency':>11} | {'agg tok/s':>10} | {'vs c=' + str(rows[0][0]):>8} | {'s/request':>9} | "
        f"{'mean batch':>10}"
    )
    print("-" * 61)
    for c, tps, lat, occ in rows:
        print(f"{c:>11} | {tps:>10.1f} | {tps / base:>7.2f}x | {lat:>9.2f} | {occ:>10.1f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2000, help="distinct Qwen ids in the reduced table")
    p.add_argument("--full-vocab", action="store_true", help="full 151,936-row vocabulary instead")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=0, help="engine torch threads (0 = the engine's default)")
    anyio.run(main, p.parse_args())
