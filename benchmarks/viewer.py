#!/usr/bin/env python3
"""The trajectory viewer (``run.py --view``) on large logs: seconds to write the site, its size, and the run page's
size, for logs of N rollouts synthesised from a real recording (tests/data/codex.events.msgpack.gz: Codex rollouts
of 1-2 calls over an 8.6k-token prompt, copied under new ids). The goal: a 2,000-rollout log's site within 120 s on
a 2-core machine, and a run page small enough to open at once (at most 2 MB: the table's rows are data in the page,
each rollout's page a separate file).

    python benchmarks/viewer.py                 # 200, 2,000 rollouts
    python benchmarks/viewer.py --sizes 50      # a quick look
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
import time
from pathlib import Path

import msgspec

from pipeline.cli.view import write_site
from pipeline.core.eventlog import EventLogReader, EventLogWriter
from pipeline.core.logs import configure
from pipeline.core.recordings import recorded_rollouts

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "data" / "codex.events.msgpack.gz"
GOAL_S, GOAL_INDEX_MB = 120.0, 2.0


def synthesise(n: int, folder: Path) -> Path:
    """An event log of ``n`` rollouts: the fixture's, round-robin, each under its own id."""
    plain = folder / "fixture.msgpack"
    plain.write_bytes(gzip.decompress(FIXTURE.read_bytes()))
    base = [r.rollout for r in recorded_rollouts(plain)]
    log = folder / "events.msgpack"
    r = msgspec.structs.replace
    with EventLogWriter(log, EventLogReader(plain).header) as w:
        for i in range(n):
            s = base[i % len(base)]
            rid = f"{s.request.group_id}-n{i:05d}"
            w.append("collector.settled", r(s, request=r(s.request, rollout_id=rid),
                                            finished=r(s.finished, rollout_id=rid),
                                            calls=[r(c, rollout_id=rid) for c in s.calls]), t=float(i))
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 2000])
    args = ap.parse_args()
    configure(level="warning")
    print("| rollouts | write s | site MB | run page MB | per rollout ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    ok = True
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bridle-viewer-bench-") as tmp:
            log = synthesise(n, Path(tmp))
            t0 = time.perf_counter()
            index = write_site(log, Path(tmp) / "site")
            dt = time.perf_counter() - t0
            site = sum(p.stat().st_size for p in (Path(tmp) / "site").rglob("*") if p.is_file()) / 1e6
            page = index.stat().st_size / 1e6
            print(f"| {n:,} | {dt:.1f} | {site:.0f} | {page:.2f} | {1000 * dt / n:.1f} |", flush=True)
            if n >= 2000:
                ok = ok and dt <= GOAL_S and page <= GOAL_INDEX_MB
    print(f"goal (2,000 rollouts: <= {GOAL_S:.0f} s, run page <= {GOAL_INDEX_MB} MB): "
          f"{'YES' if ok else 'NO'}" if any(n >= 2000 for n in args.sizes) else "goal: n/a (no size >= 2,000)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
