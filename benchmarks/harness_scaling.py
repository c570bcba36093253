#!/usr/bin/env python3
"""Does training across more harness configurations generalize better? (the Harness Scaling paper's claim.) Every
training-set variant of `configs/scaling.toml` trained with the same model, tasks, seed and compute, then its final
policy evaluated on the same held-out tasks in three columns, paired against the single-configuration variant.

    python benchmarks/harness_scaling.py                              # every variant, seeds 0 and 1
    python benchmarks/harness_scaling.py --variants single published-k2 --seeds 0 --no-out-of-space --out DIR
    python benchmarks/harness_scaling.py --from DIR                   # re-print the table of an earlier invocation
    python benchmarks/harness_scaling.py --out DIR --eval-set eval.tasks.count=60   # evaluate DIR's policies again

Variants (`pipeline.rollout.scheduling.SCALING_VARIANTS`; docs/rollout.md, "Training-set variants"): `single`
(S0T0O0C0W0 only), `published-k1` / `published-k2` (the paper's 18, K = 1 / 2, locality-aware),
`published-k2-random` (K = 2 drawn at random), `repeat-2` (one configuration twice: the control for two passes),
`random-18` (18 drawn at random outside the published held-out set), `all-243`. Compute is equal: every run has
the file's steps, groups per step and group size (so as many RL rollouts), a cold start of as many demonstrations
and SFT updates (128 demonstrations, 10 SFT epochs), each through the variant's own training set (one
configuration for `single`; `--set scheduler.sft_harnesses='"harness"'`: all through S0T0O0C0W0) and, for one
seed, the same task stream (K = 2 variants see half as many distinct tasks, twice each, as in the paper); the
`RL rollouts` column shows it. Each stage of a row (training, each evaluation) is kept when an earlier invocation
finished it with the same overrides, and a stage cut part-way runs again whole: the same command goes on where a
killed one stopped, and another evaluation plan (`--configs`, `--eval-set`, the real harnesses) evaluates the
policies already trained.

Per (variant, seed): `run.py --experiment scaling` with the variant's settings (no evaluation during training),
then `run.py --eval --checkpoint` of its final policy, twice side by side on `[eval]`'s held-out tasks:
- white-box, local sandboxes: `--configs` of the 18 published held-out configurations (the same for every
  variant) and `--configs` of the configurations the variant trained on, each spread evenly over its set. The
  default, 18, takes every held-out configuration: the published set has each level of each component 6 times,
  and a subset is not balanced (6 of them spread by index hold 4 W2 and one W1, which favours a training set rich
  in W2);
- out-of-space (unless `--no-out-of-space`): Claude Code, Codex, Qwen Code, OpenClaw in Docker sandboxes, one sample
  per pair (`python run.py --build-images` first).
The table: per variant, pass@1 [95 %] of each column over both seeds' (task, harness) pairs, then the paired
difference against `single` (over the pairs both measured; the trained column's configurations differ between
variants, so its difference pairs each task's mean over them). A variant any of whose runs or evaluations did not
finish prints `failed: why` instead of numbers, and the script exits 1. No claim is asserted: the table is the
measurement. Run folders: DIR/<variant>-seed<N>/{train,eval-space,eval-oos}.

The policy: the quickstart's shape (2 layers, hidden 128, a reduced vocabulary) with the black-box experiment's
context (32,768 positions, a 512-position sliding window; configs/blackbox.toml says why), its vocabulary covering
the white-box harness and the four real harnesses' answers, so the out-of-space column measures the policy, not a
context-length error. The quickstart's RL recipe (30 steps x 8 groups x 8 rollouts, lr 5e-4, k3 KL 0.05), 20
evaluation tasks (13 held out), 2 samples.

Cost on the 2-core, 24 GB machine (no GPU), measured on 2026-12-07 with the white-box columns: 15-19 minutes of
training per (variant, seed) (~5 of them the cold start: building the policy once, 128 demonstrations, 160 SFT
updates; then ~25 s per RL step of 64 rollouts: the learner's update on one thread, 20-27 s, with the next step's
rollouts beside it) and 3-4 minutes of white-box evaluation at the default `--configs 18` (13 tasks x up to 36
configurations x 2 samples, up to 936 rollouts; `--configs 6`: ~1 minute): ~2.5 hours per seed for the 7 variants with
`--no-out-of-space`. The real harnesses' 52 rollouts per policy (Claude Code and Codex 2.6-5.6 s each, Qwen Code 16 s,
OpenClaw 26-78 s: benchmarks/README.md, "Harnesses") add an estimated 8-10 minutes per row beside the white-box
evaluation. `--configs 0` would evaluate all-243 on every one of its 243.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from _quickstart import run_logged  # benchmarks/ is sys.path[0] when run as a script

from pipeline.cli.evaluate import load_report
from pipeline.core.runfiles import remove_tree
from pipeline.eval.estimators import Estimate, mean_ci, paired_difference, pass_at_k
from pipeline.eval.plan import spread
from pipeline.monitor.metrics import load_metrics, of_kind
from pipeline.rollout.harness_space import PUBLISHED_HELD_OUT
from pipeline.rollout.scheduling import SCALING_VARIANTS, SchedulerSettings, training_harnesses

BASELINE = "single"
BLACK_BOX = ("claude-code", "codex", "qwen-code", "openclaw")
COLUMNS = ("held-out", "trained", "out-of-space")
# Every run's policy (see the module docstring); its own path, since a model built with another spec is refused.
MODEL = [
    'run.model="runs/cache/scaling-bench-model-v1"',
    f'experiment.build_model.harness={json.dumps(["whitebox:S0T0O0C0W0", *BLACK_BOX])}',
    "experiment.build_model.max_position_embeddings=32768",
    "experiment.build_model.sliding_window=512",
]
EVAL = ["eval.columns=[]", "eval.tasks.count=20"]
# The real harnesses run in Docker as configs/blackbox.toml runs them: their prompts are 8-19k tokens.
OUT_OF_SPACE = [
    'sandbox.backend="docker"', 'sandbox.docker.network="none"', 'sandbox.docker.verifier_network="none"',
    "sandbox.docker.cpus=1.0", 'sandbox.docker.memory="2g"', "sandbox.max_turns=6", "proxy.context_len=32768",
    "eval.samples=1", "eval.ks=[1]", "eval.max_new_tokens=96", "eval.timeout_s=240.0",
]


@dataclass
class Run:
    """One (variant, seed): pass@1 of each evaluated pair by column, keyed ``seed|task|harness``."""

    variant: str
    seed: int
    values: dict[str, dict[str, float]] = field(default_factory=dict)
    steps: int = 0
    rollouts: int = 0
    rewards: list[float] = field(default_factory=list)  # each RL step's mean training reward
    train_min: float | None = None
    eval_min: float | None = None
    error: str = ""


def variant_sets(name: str) -> list[str]:
    """The variant's ``[scheduler]`` settings, and ``[eval]``'s space with them (a scaling run's must match)."""
    v = SCALING_VARIANTS[name]
    out = [f"scheduler.{k}={json.dumps(x)}" for k, x in v.items()]
    return out + ([f"eval.space={json.dumps(v['space'])}"] if v["mode"] == "scaling" else [])


def plan(name: str, configs: int, out_of_space: bool) -> dict[str, list[str]]:
    """The harnesses of each column: held-out and trained configurations spread evenly, the real harnesses."""
    return {"held-out": spread(["whitebox:" + n for n in PUBLISHED_HELD_OUT], configs),
            "trained": spread(training_harnesses(SchedulerSettings(**SCALING_VARIANTS[name])), configs),
            "out-of-space": list(BLACK_BOX) if out_of_space else []}


def _seeds(seed: int) -> list[str]:
    return [f"experiment.seed={seed}"]  # every actor's seed (the task sets keep theirs)


def train_sets(name: str, seed: int, sets: list[str]) -> list[str]:
    """The training run's overrides: the variant, the policy, the seed, no evaluation during training, the user's
    (last, so they win)."""
    return [*variant_sets(name), *MODEL, *_seeds(seed), "eval.every_steps=0", *sets]


def eval_jobs(name: str, cols: dict[str, list[str]], sets: list[str],
              eval_sets: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """(folder, overrides) of each evaluation: the white-box columns, and the real harnesses when planned;
    ``eval_sets`` last (the evaluations' own overrides)."""
    common = [*variant_sets(name), *MODEL, *EVAL]
    space = list(dict.fromkeys(cols["held-out"] + cols["trained"]))
    jobs = [("eval-space", [*common, f"eval.harnesses={json.dumps(space)}", *sets, *eval_sets])]
    if cols["out-of-space"]:
        jobs.append(("eval-oos", [*common, *OUT_OF_SPACE, f"eval.harnesses={json.dumps(cols['out-of-space'])}",
                                  *sets, *eval_sets]))
    return jobs


def stages(where: Path, name: str, seed: int, cols: dict[str, list[str]], sets: list[str],
           eval_sets: Sequence[str]) -> list[tuple[str, list[str], list[str]]]:
    """(folder, run.py arguments, overrides) of the row's runs: training, then its evaluations."""
    train = ("train", ["--experiment", "scaling", "--run-dir", str(where / "train"), "--no-watch"],
             train_sets(name, seed, sets))
    return [train, *((folder, ["--eval", "--experiment", "scaling", "--checkpoint", str(where / "train"),
                               "--run-dir", str(where / folder)], overrides)
                     for folder, overrides in eval_jobs(name, cols, sets, eval_sets))]


def _done(where: Path, stage: tuple[str, list[str], list[str]]) -> bool:
    """Whether an earlier invocation finished this stage with the same overrides (``FOLDER.done.json``)."""
    marker = where / f"{stage[0]}.done.json"
    try:
        return json.loads(marker.read_text()) == stage[2]
    except (OSError, ValueError):
        return False


def finished(where: Path, name: str, seed: int, cols: dict[str, list[str]], sets: list[str],
             eval_sets: Sequence[str]) -> bool:
    return all(_done(where, st) for st in stages(where, name, seed, cols, sets, eval_sets))


def run_one(where: Path, name: str, seed: int, cols: dict[str, list[str]], sets: list[str],
            eval_sets: Sequence[str]) -> None:
    """Train, then the evaluations side by side (each mostly waits on its sandboxes); wall minutes to wall.json.
    A stage an earlier invocation finished with the same overrides is kept (a killed invocation goes on where it
    stopped; a column added later evaluates the policy already trained); one cut part-way runs again whole, and
    new training makes every evaluation stale."""
    wall = json.loads((where / "wall.json").read_text()) if (where / "wall.json").is_file() else {}
    train, *evals = stages(where, name, seed, cols, sets, eval_sets)

    def run(stage: tuple[str, list[str], list[str]]) -> None:
        folder, argv, overrides = stage
        (where / f"{folder}.done.json").unlink(missing_ok=True)
        remove_tree(where / folder)  # whatever an earlier, killed stage left, at any depth
        run_logged(argv, overrides, where / f"{folder}.log")
        (where / f"{folder}.done.json").write_text(json.dumps(overrides))

    if not _done(where, train):
        for folder, _, _ in evals:
            (where / f"{folder}.done.json").unlink(missing_ok=True)
        t0 = time.monotonic()
        run(train)
        wall = {"train_min": (time.monotonic() - t0) / 60}
        (where / "wall.json").write_text(json.dumps(wall))
    if todo := [st for st in evals if not _done(where, st)]:
        t1 = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(run, todo))
        wall["eval_min"] = wall.get("eval_min", 0.0) + (time.monotonic() - t1) / 60
        (where / "wall.json").write_text(json.dumps(wall))


def read(where: Path, run: Run) -> None:
    """The finished run's facts and each column's pairs; raises ValueError where a column measured nothing."""
    cols = json.loads((where / "plan.json").read_text())
    steps = of_kind(load_metrics(where / "train" / "metrics.jsonl"), "rl_step")
    run.steps = len(steps)
    run.rollouts = sum(int(m.get("rollouts", 0)) for m in steps)
    run.rewards = [float(m["reward_mean"]) for m in steps if "reward_mean" in m]
    if (where / "wall.json").is_file():
        wall = json.loads((where / "wall.json").read_text())
        run.train_min, run.eval_min = wall["train_min"], wall["eval_min"]
    for col, hs in cols.items():
        if not hs:
            continue
        folder = where / ("eval-oos" if col == "out-of-space" else "eval-space")
        if not (folder / "eval" / "report.json").is_file():
            raise ValueError(f"{col}: the evaluation did not finish (no {folder / 'eval' / 'report.json'})")
        rep = load_report(folder)
        run.values[col] = {f"{run.seed}|{p.task_id}|{p.harness}": pass_at_k(p.n, p.successes, 1)
                           for p in rep.pairs if p.harness in hs and p.n >= 1}
        # a harness whose every rollout failed for the infrastructure would silently narrow the column
        if missing := [h for h in hs if not any(k.endswith("|" + h) for k in run.values[col])]:
            row = rep.row("harness", missing[0])
            raise ValueError(f"{col}: no valid rollout through {', '.join(missing)} ({row.excluded if row else 0} "
                             f"excluded as infrastructure failures); see {folder.name}.log")


def measure(base: Path, name: str, seed: int, cols: dict[str, list[str]] | None, sets: list[str],
            eval_sets: Sequence[str] = ()) -> Run:
    """Run (unless ``cols`` is None: re-read an earlier invocation) and read one (variant, seed)."""
    run, where = Run(name, seed), base / f"{name}-seed{seed}"
    try:
        if cols is not None:
            where.mkdir(parents=True, exist_ok=True)
            (where / "plan.json").write_text(json.dumps(cols))
            run_one(where, name, seed, cols, sets, eval_sets)
        read(where, run)
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        run.error = str(e) or type(e).__name__
    return run


# ------------------------------------------------------------------------------------------------ the table
def _pooled(runs: list[Run], col: str) -> dict[str, float]:
    return {k: v for r in runs for k, v in r.values.get(col, {}).items()}


def _by_task(values: dict[str, float]) -> dict[str, float]:
    """Each ``seed|task``'s mean over its harnesses."""
    by: dict[str, list[float]] = defaultdict(list)
    for key, v in values.items():
        by[key.rpartition("|")[0]].append(v)
    return {k: sum(vs) / len(vs) for k, vs in by.items()}


def _diff(a: dict[str, float], b: dict[str, float], col: str) -> Estimate:
    return paired_difference(_by_task(a), _by_task(b)) if col == "trained" else paired_difference(a, b)


def _window(rewards: list[float], first: bool) -> str:
    """The mean training reward of the first or last 5 RL steps ("n/a" with fewer than 5: nothing to compare)."""
    if len(rewards) < 5:
        return f"n/a ({len(rewards)} steps)"
    w = rewards[:5] if first else rewards[-5:]
    return f"{sum(w) / 5:.3f}"


def describe(name: str) -> str:
    s = SchedulerSettings(**SCALING_VARIANTS[name])
    if s.mode == "single":
        return f"{s.harness.removeprefix('whitebox:')}, K = 1"
    size = len(training_harnesses(s))
    what = {"published": "published 18", "generated": "generated 18", "random18": f"random 18 (seed {s.space_seed})",
            "all": f"all {size}"}[s.space]
    return f"{what}, K = {s.k}" + (f", {s.assignment}" if s.k > 1 else "")


def table(rows: dict[str, list[Run]]) -> str:
    head = ("| variant | training set, K, assignment | seeds | RL steps | RL rollouts | train min | eval min | "
            "reward first 5 | reward last 5 | "
            + " | ".join(f"{c} pass@1 [95 %]" for c in COLUMNS) + " | "
            + " | ".join(f"{c} - {BASELINE}, paired [95 %]" for c in COLUMNS) + " |")
    out = [head, "|" + " --- |" * (head.count("|") - 1)]
    base = rows.get(BASELINE, [])
    base_ok = bool(base) and not any(r.error for r in base)
    for name, runs in rows.items():
        failed = [r for r in runs if r.error]
        if failed:
            why = "; ".join(f"seed {r.seed}: {r.error.splitlines()[0][:160]}" for r in failed)
            out.append(f"| {name} | failed: {why} |")
            continue
        cells = [name, describe(name), ", ".join(str(r.seed) for r in runs), "/".join(str(r.steps) for r in runs),
                 "/".join(str(r.rollouts) for r in runs),
                 "/".join("n/a" if r.train_min is None else f"{r.train_min:.1f}" for r in runs),
                 "/".join("n/a" if r.eval_min is None else f"{r.eval_min:.1f}" for r in runs),
                 *("/".join(_window(r.rewards, first) for r in runs) for first in (True, False))]
        for col in COLUMNS:
            vals = _pooled(runs, col)
            cells.append(mean_ci(list(vals.values())).text() if vals else "not run")
        for col in COLUMNS:
            vals, ref = _pooled(runs, col), _pooled(base, col)
            if name == BASELINE:
                cells.append("—")
            elif not vals or not base_ok or not ref:
                cells.append("n/a (no baseline)" if vals else "not run")
            else:
                d = _diff(vals, ref, col)
                cells.append(f"{d.text()} (n={d.n})")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def harness_table(rows: dict[str, list[Run]]) -> str:
    """Out-of-space pass@1 per real harness, the variants that measured it."""
    measured = {n: rs for n, rs in rows.items() if not any(r.error for r in rs) and _pooled(rs, "out-of-space")}
    if not measured:
        return ""
    out = ["| variant | " + " | ".join(BLACK_BOX) + " |", "|" + " --- |" * (len(BLACK_BOX) + 1)]
    for name, runs in measured.items():
        vals = _pooled(runs, "out-of-space")
        cells = [mean_ci([v for k, v in vals.items() if k.rpartition("|")[2] == h]).text() for h in BLACK_BOX]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(SCALING_VARIANTS), choices=list(SCALING_VARIANTS),
                    metavar="NAME", help=f"default: all ({', '.join(SCALING_VARIANTS)})")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--configs", type=int, default=18,
                    help="white-box configurations per column, spread evenly over the set (0: all of it; the "
                         "default, 18, is the whole published held-out set, balanced by level)")
    ap.add_argument("--no-out-of-space", action="store_true",
                    help="skip the real harnesses (no Docker needed): the white-box columns only")
    ap.add_argument("--out", type=Path, help="where the runs go (default: a new temporary folder)")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="a config override for every training run and evaluation (run.py --set)")
    ap.add_argument("--eval-set", dest="eval_sets", action="append", default=[],
                    help="a config override for the evaluations only (e.g. eval.tasks.count=60): the trained "
                         "policies of an earlier invocation are evaluated again, not retrained")
    ap.add_argument("--from", dest="from_dir", type=Path, help="print the table of an earlier invocation; run nothing")
    args = ap.parse_args()
    base = args.from_dir or args.out or Path(tempfile.mkdtemp(prefix="bridle-harness-scaling-"))
    print(f"run folders: {base}", flush=True)
    if args.from_dir:
        found = sorted(p.name.rpartition("-seed") for p in base.iterdir() if (p / "plan.json").is_file())
        todo = [(n, int(s)) for n, _, s in found if n in SCALING_VARIANTS]
    else:
        todo = [(n, s) for n in dict.fromkeys(args.variants) for s in args.seeds]
    rows: dict[str, list[Run]] = {n: [] for n in SCALING_VARIANTS if any(n == v for v, _ in todo)}
    for name, seed in todo:
        cols = None if args.from_dir else plan(name, args.configs, not args.no_out_of_space)
        if cols is not None:
            again = finished(base / f"{name}-seed{seed}", name, seed, cols, args.sets, args.eval_sets)
            print(f"{name}, seed {seed}" + (": finished earlier, re-read" if again else " ..."), flush=True)
        rows[name].append(measure(base, name, seed, cols, args.sets, args.eval_sets))
        if rows[name][-1].error:
            print(rows[name][-1].error, file=sys.stderr, flush=True)
    print(table(rows))
    if "all-243" in rows:
        print("\nall-243 trains on the published held-out configurations too: its held-out column measures "
              "configurations it was trained on.")
    if extra := harness_table(rows):
        print("\nOut-of-space pass@1 [95 %] per real harness:\n\n" + extra)
    return 1 if not todo or any(r.error for rs in rows.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
