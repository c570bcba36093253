#!/usr/bin/env python3
"""Does the quickstart learn? Runs it with 3 seeds and prints the mean reward of the first 5 and last 5 RL steps.

Claim checked: on every one of the 3 seeds, the mean reward of the last 5 steps exceeds that of the first 5 by at
least MARGIN = 0.05 (5 points of pass rate). Why that margin is enough: a step averages 64 rollouts, but they come
in 8 groups of one task each and tasks differ in difficulty (".md" and extension-less names are much harder for
the tiny policy than ".txt"), so the step mean moves by ~0.05-0.1 from step to step even when the policy stands
still. The difference of two 5-step means then has a standard error of ~0.04-0.06 (the table prints it, estimated
from each run's own step rewards). If the policy did not learn at all, one seed would clear 0.05 by chance with
probability P(Z >= 0.05 / SE) ~= 0.14-0.20, and all three seeds ~= 0.3-0.8 %: the claim is a test at p < 1 %. It
says the reward rises, not by how much; the gains and gain/SE columns say how much. Exits 1 if a seed misses.

    python benchmarks/quickstart_learning.py [--seeds 0 1 2] [--set k=v ...]
    python benchmarks/quickstart_learning.py --from /tmp/bridle-qs-learning-XXXX   # re-print a table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--from", dest="from_dir", type=Path,
                    help="print the table from the seed<N> run folders of an earlier invocation; run nothing")
    args = ap.parse_args()
    rows = []
    base = args.from_dir or Path(tempfile.mkdtemp(prefix="bridle-qs-learning-"))
    print(f"run folders: {base}", flush=True)
    for seed in args.seeds:
        run_dir = base / f"seed{seed}"
        dt = float("nan")
        if args.from_dir is None:
            cmd = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch",
                   "--set", f"experiment.seed={seed}", "--set", f"scheduler.seed={seed}",
                   "--set", f"learner.train.seed={seed}", "--set", f"learner.sft.seed={seed}",
                   "--set", 'monitor.display="off"']
            for s in args.sets:
                cmd += ["--set", s]
            t0 = time.time()
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
            dt = time.time() - t0
            if r.returncode != 0:
                print(f"seed {seed}: run failed ({r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
                return 1
        rl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rewards = [m["reward"] for m in rl if m.get("source") == "learner.rl"]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        se = math.sqrt(statistics.variance(rewards[:5]) / 5 + statistics.variance(rewards[-5:]) / 5)
        rows.append((seed, len(rewards), first, last, last - first, se, dt))
    print(f"{'seed':>4} {'steps':>5} {'first-5 reward':>15} {'last-5 reward':>14} {'gain':>7} {'noise SE':>8} "
          f"{'gain/SE':>7} {'wall s':>7}")
    ok = True
    for seed, n, first, last, gain, se, dt in rows:
        print(f"{seed:>4} {n:>5} {first:>15.3f} {last:>14.3f} {gain:>+7.3f} {se:>8.3f} {gain / se:>7.1f} {dt:>7.0f}")
        ok &= gain >= MARGIN
    print(f"claim: last-5 beats first-5 by >= {MARGIN} on every seed: {'YES' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
