#!/usr/bin/env python3
"""Event-log throughput: small messages and ModelCall-sized messages, against the disk's raw write speed.

Goals (issue #2): >= 200k small messages/s appended; ModelCall-sized appends >= 50 % of the raw sequential write
speed of the same disk, measured in the same run. Prints a table; asserts nothing.

    python benchmarks/eventlog.py [--dir DIR] [--small N] [--large N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

from pipeline.core.eventlog import AsyncEventLog, EventLogReader, EventLogWriter, LogHeader
from pipeline.messages import ModelCall, Note, pack_f32, pack_i32


def header() -> LogHeader:
    return LogHeader(schema_version=1, run_id="bench", created=time.time())


def bench_append(path: Path, msgs: list) -> float:
    t0 = time.perf_counter()
    w = EventLogWriter(path, header())
    for m in msgs:
        w.append("bench.out", m)
    w.close(fsync=True)
    return time.perf_counter() - t0


def bench_async(path: Path, msgs: list) -> float:
    async def main() -> float:
        log = AsyncEventLog(EventLogWriter(path, header()))
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(log.run_flusher)
            for m in msgs:
                await log.record("bench.out", m)
            tg.cancel_scope.cancel()
        log.close()
        return time.perf_counter() - t0

    return anyio.run(main)


def bench_read(path: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = sum(1 for _ in EventLogReader(path))
    return time.perf_counter() - t0, n


def bench_raw(path: Path, nbytes: int, chunk: int = 1 << 20) -> float:
    block = os.urandom(chunk)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, block[: min(chunk, left)])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--small", type=int, default=300_000)
    ap.add_argument("--large", type=int, default=1_500)
    args = ap.parse_args()
    d = Path(args.dir or tempfile.mkdtemp(prefix="bridle-bench-"))
    d.mkdir(parents=True, exist_ok=True)

    small = [Note(seq=i, value=i) for i in range(args.small)]
    rng = np.random.default_rng(0)
    inp = pack_i32(rng.integers(0, 151_000, 8192))
    out = pack_i32(rng.integers(0, 151_000, 500))
    lps = pack_f32(-rng.random(500))
    large = [
        ModelCall(rollout_id=f"r{i % 64}", call_id=f"c{i}", seq=i, protocol="chat", input_ids=inp, output_ids=out,
                  logprobs=lps)
        for i in range(args.large)
    ]

    rows = []
    t = bench_append(d / "small.msgpack", small)
    rows.append(("small: append (sync writer)", args.small / t, "msg/s", "goal >= 200k msg/s"))
    t = bench_async(d / "small-async.msgpack", small)
    rows.append(("small: record (async tap)", args.small / t, "msg/s", ""))
    t, n = bench_read(d / "small.msgpack")
    assert n == args.small
    rows.append(("small: read", n / t, "msg/s", ""))

    t = bench_append(d / "large.msgpack", large)
    size = (d / "large.msgpack").stat().st_size
    log_mb_s = size / t / 1e6
    t_raw = bench_raw(d / "raw.bin", size)
    raw_mb_s = size / t_raw / 1e6
    rows.append(("ModelCall (8k in, 500 out): append", args.large / t, "msg/s", f"{log_mb_s:,.0f} MB/s"))
    t, n = bench_read(d / "large.msgpack")
    assert n == args.large
    rows.append(("ModelCall: read", n / t, "msg/s", f"{size / t / 1e6:,.0f} MB/s"))
    rows.append(("raw sequential write, same bytes", raw_mb_s, "MB/s", ""))
    rows.append(("ModelCall append / raw write", log_mb_s / raw_mb_s * 100, "%", "goal >= 50 %"))

    print(f"event log benchmark in {d}  ({size / 1e6:.0f} MB of ModelCalls)")
    print(f"{'measurement':40s} {'value':>14s} {'unit':6s} note")
    print("-" * 80)
    for name, v, unit, note in rows:
        print(f"{name:40s} {v:>14,.0f} {unit:6s} {note}")
    for f in d.glob("*"):
        f.unlink()


if __name__ == "__main__":
    main()
