#!/usr/bin/env python3
"""Overlap of rollouts and updates: RL step wall time with overlap (max_staleness = 1) vs synchronous
(max_staleness = 0), in one run each of the quickstart graph (same seed, same sizes).

From the event log of each run: per RL step, the wall time between consecutive PolicyUpdated events; the rollout
time of a step's groups (first RolloutRequest to last RolloutFinished of the groups it trained on); the learner's
own step time (metrics). Goal (issue #10): overlapped step time <= 1.15 x max(rollout, train). Prints a table.

    python benchmarks/overlap.py [--steps 8] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

from _quickstart import run_quickstart  # benchmarks/ is sys.path[0] when run as a script

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import PolicyUpdated, RolloutFinished, RolloutRequest, TreeGroup


def measure(run_dir: Path) -> dict[str, float]:
    from pipeline.monitor.metrics import load_metrics, of_kind

    issued: dict[str, float] = {}
    finished: dict[str, float] = {}
    updates: list[tuple[float, int]] = []
    batches: dict[int, list[str]] = {}
    pending: list[str] = []
    for ev in EventLogReader(run_dir / "events.msgpack"):
        m = ev.msg
        if isinstance(m, RolloutRequest) and m.purpose == "train" and ev.src.startswith("scheduler"):
            issued.setdefault(m.group_id, ev.t)
        elif isinstance(m, RolloutFinished):
            finished[m.group_id] = max(finished.get(m.group_id, 0.0), ev.t)
        elif isinstance(m, TreeGroup) and m.purpose == "train":
            pending.append(m.group_id)
        elif isinstance(m, PolicyUpdated) and m.step > 0:
            updates.append((ev.t, m.step))
            batches[m.step] = pending
            pending = []
    steps = [b - a for (a, _), (b, _) in itertools.pairwise(updates)]
    rollout = [max(finished[g] for g in gs) - min(issued[g] for g in gs) for s, gs in batches.items() if gs and s > 1]
    train = [m["step_s"] for m in of_kind(load_metrics(run_dir / "metrics.jsonl"), "rl_step")]
    return {"step": statistics.median(steps), "rollout": statistics.median(rollout), "train": statistics.median(train)}


def main() -> int:

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bridle-overlap-"))
    results = {}
    for name, staleness in (("synchronous", 0), ("overlapped", 1)):
        run_dir = base / name
        r = run_quickstart(run_dir, [f"run.steps={args.steps}",
                                     f"run.max_staleness={staleness}",
                                     *args.sets])
        if r.returncode != 0:
            print(f"{name}: run failed:\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        results[name] = measure(run_dir)
    o, s = results["overlapped"], results["synchronous"]
    # The bound: a step can take no less than producing its rollouts alone or training on them alone; both are
    # measured in the synchronous run, where neither competes with the other (in the overlapped run a batch's
    # rollouts also wait in the sandbox queue behind the next batch's, so their span is not the cost of a step).
    bound = max(s["rollout"], s["train"])
    print(f"{'mode':12s} {'step s (median)':>16s} {'rollout s':>10s} {'train s':>8s} {'step / bound':>13s}")
    for name, m in results.items():
        print(f"{name:12s} {m['step']:>16.2f} {m['rollout']:>10.2f} {m['train']:>8.2f} {m['step'] / bound:>13.2f}")
    print(f"bound = max(rollout, train) of the synchronous run = {bound:.2f} s; overlapped / synchronous step time: "
          f"{o['step'] / s['step']:.2f}")
    ok = o["step"] <= 1.15 * bound
    print(f"goal: overlapped step <= 1.15 x bound: {'met' if ok else 'MISSED'} ({o['step'] / bound:.2f} x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
