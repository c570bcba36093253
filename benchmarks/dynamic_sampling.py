#!/usr/bin/env python3
"""What dynamic sampling ([run].dynamic_sampling, docs/learner.md) costs and buys: the quickstart trained with it off
and on, per seed, then each final policy evaluated on the same held-out tasks, paired.

    python benchmarks/dynamic_sampling.py [--resample 2] [--seeds 0 1] [--out DIR] [--set k=v ...]
    python benchmarks/dynamic_sampling.py --from DIR      # re-print the table of an earlier invocation

One row per (setting, seed): the RL steps, the trained groups that had a reward spread (all steps pooled), the
groups replaced, the training rollouts sampled (what the replacements cost), wall minutes, the mean reward of the
first and last 5 steps, and held-out pass@1 [95 %] (`run.py --eval --checkpoint`). Then per seed the paired
difference on - off over the held-out (task, harness) pairs, as `run.py --compare` computes it. Run folders:
DIR/{off,on}-seed<N>/{train,eval}. No claim is asserted: the table is the measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _quickstart import run_child, run_quickstart  # benchmarks/ is sys.path[0] when run as a script

from pipeline.core.eventlog import EventLogReader
from pipeline.eval.estimators import Estimate, paired_difference, pass_at_k
from pipeline.messages import RolloutRequest
from pipeline.monitor.metrics import load_metrics, of_kind


@dataclass
class Row:
    setting: str
    seed: int
    steps: int = 0
    groups: int = 0
    spread: int = 0
    resampled: int = 0
    rollouts: int = 0
    wall_min: float | None = None
    first5: float | None = None
    last5: float | None = None
    heldout: Estimate | None = None
    pairs: dict[str, float] | None = None
    error: str = ""


def _seeds(seed: int) -> list[str]:
    return [f"experiment.seed={seed}"]  # every actor's seed (the task sets keep theirs)


def run_one(where: Path, resample: int, seed: int, sets: list[str]) -> None:
    train, ev = where / "train", where / "eval"
    t0 = time.monotonic()
    r = run_quickstart(train, [*_seeds(seed), f"run.dynamic_sampling={resample}", *sets])
    if r.returncode:
        raise RuntimeError(f"training run {train} exited {r.returncode}:\n{r.stderr[-3000:]}")
    (where / "wall_min.json").write_text(json.dumps((time.monotonic() - t0) / 60))
    cmd = [sys.executable, "run.py", "--eval", "--experiment", "quickstart", "--checkpoint", str(train),
           "--run-dir", str(ev), "--set", 'monitor.display="off"', *(x for s in sets for x in ("--set", s))]
    r = run_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")


def facts(where: Path, row: Row) -> None:
    from pipeline.cli.evaluate import load_report

    train = where / "train"
    steps = of_kind(load_metrics(train / "metrics.jsonl"), "rl_step")
    row.steps = len(steps)
    rewards = [m["reward"] for m in steps if "reward" in m]
    if rewards:
        row.first5, row.last5 = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
    for m in steps:
        row.groups += int(m.get("groups", 0))
        row.spread += int(m.get("groups", 0) - m.get("zero_var_groups", 0))
        row.resampled += int(m.get("groups_resampled", 0))
    row.rollouts = sum(1 for e in EventLogReader(train / "events.msgpack")
                       if isinstance(e.msg, RolloutRequest) and e.msg.purpose == "train" and e.src.startswith("sched"))
    if (where / "wall_min.json").is_file():
        row.wall_min = json.loads((where / "wall_min.json").read_text())
    rep = load_report(where / "eval")
    row.heldout = rep.row("overall", "all").pass_at[1]
    row.pairs = {f"{p.task_id}|{p.harness}": pass_at_k(p.n, p.successes, 1) for p in rep.pairs if p.n >= 1}


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(rows: list[Row]) -> str:
    head = ("| dynamic sampling | seed | RL steps | trained groups with a reward spread | groups replaced | training "
            "rollouts sampled | wall min | reward first 5 | reward last 5 | held-out pass@1 [95 %] |")
    out = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        if r.error:
            out.append(f"| {r.setting} | {r.seed} | failed: {r.error.splitlines()[0][:200]} |")
            continue
        share = f"{r.spread} / {r.groups}" + (f" ({100 * r.spread / r.groups:.0f} %)" if r.groups else " (n/a)")
        out.append(f"| {r.setting} | {r.seed} | {r.steps} | {share} | {r.resampled} | {r.rollouts} | "
                   f"{_num(r.wall_min, '.1f')} | {_num(r.first5, '.3f')} | {_num(r.last5, '.3f')} | "
                   f"{'n/a' if r.heldout is None else r.heldout.text()} |")
    out += ["", "| seed | held-out pass@1, on - off, paired [95 %] |", "| --- | --- |"]
    for seed in sorted({r.seed for r in rows}):
        by = {r.setting.split()[0]: r for r in rows if r.seed == seed}
        off, on = by.get("off"), by.get("on")
        if off is None or on is None or off.pairs is None or on.pairs is None:
            out.append(f"| {seed} | n/a (a run is missing or failed) |")
            continue
        d = paired_difference(on.pairs, off.pairs)
        out.append(f"| {seed} | {'n/a' if d is None else f'{d.text()} (n={d.n})'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resample", type=int, default=2, help="[run].dynamic_sampling of the 'on' runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, help="where the runs go (default: a new temporary folder)")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="a config override for every training run and evaluation (run.py --set)")
    ap.add_argument("--from", dest="from_dir", type=Path, help="print the table of an earlier invocation; run nothing")
    args = ap.parse_args()
    base = args.from_dir or args.out or Path(tempfile.mkdtemp(prefix="bridle-dynamic-sampling-"))
    print(f"run folders: {base}", flush=True)
    rows = []
    for seed in args.seeds:
        for name, resample in (("off", 0), ("on", args.resample)):
            where = base / f"{name}-seed{seed}"
            row = Row(f"{name} ({resample})", seed)
            try:
                if args.from_dir is None:
                    print(f"{name}, seed {seed} ...", flush=True)
                    run_one(where, resample, seed, args.sets)
                facts(where, row)
            except (RuntimeError, OSError, ValueError) as e:
                row.error = str(e)
                print(row.error, file=sys.stderr, flush=True)
            rows.append(row)
    print(table(rows))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
