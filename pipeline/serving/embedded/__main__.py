"""``python -m pipeline.serving.embedded --model DIR --port N``: the embedded engine's command line."""

from __future__ import annotations

import argparse
import os

import torch

import pipeline.serving.embedded as package
from pipeline.core.logs import configure
from pipeline.core.runtime import run_main
from pipeline.serving.embedded.server import serve
from pipeline.serving.launch import DEFAULT_PREFIX_CACHE_MB


def _mebibytes(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: the prefix cache's size in MiB must be >= 0 (0 turns it off)")
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.serving.embedded", description=(package.__doc__ or "").split("\n")[0]
    )
    p.add_argument("--model", required=True, help="HF model folder (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default="", help="write the bound port here once serving")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help='"cpu", "cuda" or "cuda:N": where the model runs')
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = half the cores: oversubscribed OpenMP threads are much slower)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=_mebibytes,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="MiB of KV the prefix cache may hold (0 = off): prompts reuse the KV of the longest prefix computed before",
    )
    p.add_argument("--parent-pid", type=int, default=0,
                   help="stop once this process (the launcher) is gone; 0: its parent when it starts")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    configure(level=args.log_level)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    run_main(serve, args)


if __name__ == "__main__":
    main()
