#!/usr/bin/env python3
"""Weight update time, disk vs process group, for embedded engines on the CPU (docs/serving.md, "Weight sync").

    python benchmarks/weight_sync.py                                 # three model sizes, 1 engine, 5 updates each
    python benchmarks/weight_sync.py --engines 2 --sizes 512x8 --updates 3

For each size one engine (or several) serves a small reduced-vocabulary model. The disk path is what the learner and
the proxy do with `weight_sync = "disk"`: write the folder (safetensors, the config and vocabulary files copied
along), then `/update_weights_from_disk` on every engine, which reads it and applies it. The distributed path is
`WeightPusher.push`: `/begin_weight_update`, the broadcast over gloo with `/update_weights_from_distributed`,
`/end_weight_update`, the version check. Both end when every engine reports the new version. Prints the median of
``--updates`` updates per path.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import torch
from safetensors.torch import load_file, save_file

from pipeline.models.small import VOCAB_FILE, VocabTable, create_small_model
from pipeline.serving.launch import launch_embedded
from pipeline.serving.sglang_client import HttpEngine
from pipeline.serving.weight_sync import WeightPusher


def write_folder(tensors: dict[str, torch.Tensor], model: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    for name in ("config.json", VOCAB_FILE):
        if (model / name).is_file():
            shutil.copy2(model / name, out / name)


async def one_size(hidden: int, layers: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    heads = max(1, hidden // 64)
    model = create_small_model(tmp / f"m{hidden}x{layers}", vocab=VocabTable.from_sequences([range(1000, 1000 + 512)]),
                               hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads)
    tensors = load_file(str(Path(model) / "model.safetensors"))
    params = sum(t.numel() for t in tensors.values())
    async with AsyncExitStack() as stack:
        urls = [(await stack.enter_async_context(
            launch_embedded(model, threads=args.threads, timeout_s=300))).base_url for _ in range(args.engines)]
        fleet = await stack.enter_async_context(HttpEngine(urls[0], control_urls=urls))
        disk, write = [], []
        for i in range(args.updates):
            t0 = time.perf_counter()
            folder = tmp / f"w{hidden}x{layers}" / f"v{i:05d}"
            await anyio.to_thread.run_sync(write_folder, tensors, Path(model), folder)
            t1 = time.perf_counter()
            await fleet.update_weights(str(folder), 100 + i)
            disk.append(time.perf_counter() - t0)
            write.append(t1 - t0)
        pusher = WeightPusher(urls, timeout_s=120)
        try:
            await pusher.join()
            pushed = []
            for i in range(args.updates):
                t0 = time.perf_counter()
                await pusher.push(tensors, 200 + i)
                pushed.append(time.perf_counter() - t0)
        finally:
            await pusher.close()
    return {"params_m": params / 1e6, "mb": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20,
            "disk_s": statistics.median(disk), "write_s": statistics.median(write),
            "distributed_s": statistics.median(pushed)}


async def main(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            hidden, layers = (int(x) for x in size.split("x"))
            rows.append((size, await one_size(hidden, layers, args, Path(tmp))))
    print(f"engines: {args.engines}, torch threads per engine: {args.threads}, median of {args.updates} updates")
    print("| model (hidden x layers) | params | float32 MB | disk: write + load (s) | of which write (s) "
          "| distributed (s) | disk / distributed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for size, r in rows:
        print(f"| {size} | {r['params_m']:.1f} M | {r['mb']:.0f} | {r['disk_s']:.3f} | {r['write_s']:.3f} "
              f"| {r['distributed_s']:.3f} | {r['disk_s'] / r['distributed_s']:.2f}x |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["64x2", "512x8", "1024x12"], help="hidden x layers")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    anyio.run(main, p.parse_args())
