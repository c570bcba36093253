#!/usr/bin/env python3
"""The quickstart's cold start, evaluated: its SFT policy against the random initial model on the same held-out
tasks, with the difference and its 95 % interval (`run.py --compare`).

    python benchmarks/eval_sft.py [--tasks 40] [--samples 4] [--out DIR]

Runs the quickstart with no RL step (the cold start only: demonstrations, SFT, the SFT weights published), then
`run.py --eval` of that run's policy and of the initial model on `[eval]`'s held-out tasks, and prints the table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from _quickstart import ROOT, run_child, run_quickstart


def evaluate(out: Path, name: str, policy: list[str], tasks: int, samples: int) -> Path:
    run_dir = out / name
    cmd = [sys.executable, "run.py", "--eval", "--experiment", "quickstart", "--run-dir", str(run_dir), *policy,
           "--set", 'monitor.display="off"', "--set", f"eval.tasks.count={tasks}", "--set", f"eval.samples={samples}",
           "--set", f"eval.ks=[1, {min(samples, 2)}]"]
    r = run_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=40, help="held-out tasks drawn ([eval].tasks.count)")
    ap.add_argument("--samples", type=int, default=4, help="samples per (task, harness) pair")
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bridle-eval-sft-"))
    sft = out / "sft"
    r = run_quickstart(sft, ["run.steps=0"])
    if r.returncode:
        sys.exit(f"the cold start failed:\n{r.stderr[-3000:]}")
    a = evaluate(out, "eval-sft", ["--checkpoint", str(sft)], args.tasks, args.samples)
    b = evaluate(out, "eval-init", ["--model", str(ROOT / "runs/cache/quickstart-model-v3")], args.tasks,
                 args.samples)
    table = subprocess.run([sys.executable, "run.py", "--compare", str(a), str(b)], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    print(f"A: the quickstart's SFT policy; B: its random initial model; runs in {out}\n")
    print(table)


if __name__ == "__main__":
    main()
