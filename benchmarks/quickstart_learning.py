#!/usr/bin/env python3
"""Does the quickstart learn? Runs it with 3 seeds and prints the mean reward of the first 5 and last 5 RL steps.

Claim checked: on every one of the 3 seeds, the mean reward of the last 5 steps exceeds that of the first 5 by at
least MARGIN = 0.05 (5 points of pass rate). Why that margin is enough: the quickstart trains on a pool of 40
tasks visited once per 5 steps (8 groups of 8 rollouts a step), so both windows hold the same 40 tasks with 8
rollouts each, and their difference carries no task-mix noise, only sampling noise. Its standard error, estimated
from the 40 per-task differences in each run's event log, is ~0.03-0.045 (the "noise SE" column). If the policy
did not learn at all, one seed would clear 0.05 by chance with probability P(Z >= 0.05 / SE) ~= 0.05-0.13 and all
three ~= 0.01-0.2 %: the claim is a test at p < 0.3 %. It says the reward rises, not by how much; the gains and
gain/SE columns say how much. When the two windows do not share their tasks (a config without a pool), the SE
comes from the step-to-step variance instead, which also carries the task mix (~0.04-0.06 with 64 rollouts a
step). Exits 1 if a seed misses.

    python benchmarks/quickstart_learning.py [--seeds 0 1 2] [--set k=v ...]
    python benchmarks/quickstart_learning.py --from /tmp/bridle-qs-learning-XXXX   # re-print a table
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from _quickstart import run_quickstart  # benchmarks/ is sys.path[0] when run as a script

MARGIN = 0.05


def paired_se(run_dir: Path, steps: int) -> tuple[float | None, str]:
    """Standard error of (last-5 mean - first-5 mean) from per-task differences, when both windows trained on the
    same tasks (the quickstart's pool); (None, "") otherwise. From the event log: a group's task and its rollouts'
    rewards; group j belongs to step j // groups_per_step + 1."""
    from pipeline.core.eventlog import EventLogReader
    from pipeline.messages import RolloutFinished, RolloutRequest

    per_step = tomllib.loads((run_dir / "config.toml").read_text())["scheduler"]["groups_per_step"]
    task: dict[str, str] = {}
    reward: dict[str, list[float]] = {}
    for ev in EventLogReader(run_dir / "events.msgpack"):
        m = ev.msg
        if isinstance(m, RolloutRequest) and m.purpose == "train":
            task[m.group_id] = m.task_id
        elif isinstance(m, RolloutFinished) and m.group_id in task:
            reward.setdefault(m.group_id, []).append(m.reward)

    def window(lo: int, hi: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for g, t in task.items():
            slot = int(re.match(r"g(\d+)", g).group(1))  # g00012, or g00012-a1 / -x1 (resumed / replaced)
            if g in reward and lo <= slot // per_step + 1 <= hi:
                out.setdefault(t, []).extend(reward[g])
        return out

    a, b = window(1, 5), window(steps - 4, steps)
    if not a or set(a) != set(b):
        return None, ""
    diffs = [statistics.fmean(b[t]) - statistics.fmean(a[t]) for t in a]
    return statistics.stdev(diffs) / math.sqrt(len(diffs)), f"{len(diffs)} tasks"


def main() -> int:

    from pipeline.monitor.metrics import load_metrics, of_kind

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
            seeds = [f"experiment.seed={seed}"]  # every actor's seed (the task sets keep theirs)
            t0 = time.time()
            r = run_quickstart(run_dir, [*seeds, *args.sets])
            dt = time.time() - t0
            if r.returncode != 0:
                print(f"seed {seed}: run failed ({r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
                return 1
        rewards = [m["reward"] for m in of_kind(load_metrics(run_dir / "metrics.jsonl"), "rl_step")]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        se, how = paired_se(run_dir, len(rewards))
        if se is None:
            se = math.sqrt(statistics.variance(rewards[:5]) / 5 + statistics.variance(rewards[-5:]) / 5)
            how = "steps"
        rows.append((seed, len(rewards), first, last, last - first, se, how, dt))
    print(f"{'seed':>4} {'steps':>5} {'first-5 reward':>15} {'last-5 reward':>14} {'gain':>7} {'noise SE':>8} "
          f"{'SE from':>8} {'gain/SE':>7} {'wall s':>7}")
    ok = True
    for seed, n, first, last, gain, se, how, dt in rows:
        print(f"{seed:>4} {n:>5} {first:>15.3f} {last:>14.3f} {gain:>+7.3f} {se:>8.3f} {how:>8} {gain / se if se else math.nan:>7.1f} "
              f"{dt:>7.0f}")
        ok &= gain >= MARGIN
    print(f"claim: last-5 beats first-5 by >= {MARGIN} on every seed: {'YES' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
