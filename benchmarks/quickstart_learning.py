#!/usr/bin/env python3
"""Does the quickstart learn? Runs it with 3 seeds and prints the mean reward of the first 5 and last 5 RL steps.

Claim checked: on every seed, mean reward over the last 5 steps exceeds the first 5 by at least MARGIN (0.1
absolute, i.e. 10 points of pass rate). Why that margin: each step averages 32 rollouts (4 groups x 8), so a 5-step
mean averages 160 rewards in [0, 1]; its standard error is at most sqrt(0.25/160) ~= 0.04, and the difference of
two such means has a standard error of at most ~0.056, so 0.1 is about two standard errors of pure noise in the
worst case (p = 0.5), and the rise has to hold on 3 of 3 seeds. Prints a table; exits 1 if a seed misses.

    python benchmarks/quickstart_learning.py [--seeds 0 1 2] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 0.1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    rows = []
    base = Path(tempfile.mkdtemp(prefix="bridle-qs-learning-"))
    for seed in args.seeds:
        run_dir = base / f"seed{seed}"
        cmd = [sys.executable, "run.py", "--experiment", "quickstart", "--run-dir", str(run_dir), "--no-watch",
               "--set", f"experiment.seed={seed}", "--set", f"scheduler.seed={seed}",
               "--set", f"learner.train.seed={seed}", "--set", f"learner.sft.seed={seed}",
               "--set", 'monitor.display="off"']
        for s in args.sets:
            cmd += ["--set", s]
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        dt = time.time() - t0
        if r.returncode != 0:
            print(f"seed {seed}: run failed ({r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        rl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rewards = [m["reward"] for m in rl if m.get("source") == "learner.rl"]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        rows.append((seed, len(rewards), first, last, last - first, dt))
    print(f"{'seed':>4} {'steps':>5} {'first-5 reward':>15} {'last-5 reward':>14} {'gain':>7} {'wall s':>7}")
    ok = True
    for seed, n, first, last, gain, dt in rows:
        print(f"{seed:>4} {n:>5} {first:>15.3f} {last:>14.3f} {gain:>+7.3f} {dt:>7.0f}")
        ok &= gain >= MARGIN
    print(f"claim: last-5 beats first-5 by >= {MARGIN} on every seed: {'YES' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
