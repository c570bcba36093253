"""``python -m pipeline.rollout.taskgen --family NAME --n 100 --seed 0 --out DIR [--check]``."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio

from pipeline.rollout.taskgen import FAMILIES, generate_to, resolve_families
from pipeline.rollout.tasks import Task, seed_workspace
from pipeline.rollout.verify import replay_actions_local, run_solution_local, run_verifier_local


async def _self_check(task: Task) -> list[str]:
    """Untouched workspace must score 0; solve.sh and the replayed oracle actions must score 1."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("untouched", "solve.sh", "actions"):
            ws = seed_workspace(task, Path(tmp) / mode)
            if mode == "solve.sh":
                res = await run_solution_local(task, ws)
                if res.exit_code != 0:
                    problems.append(
                        f"{task.id}: solve.sh exited with {res.exit_code}: {res.output_tail[-300:]}"
                    )
            elif mode == "actions":
                try:
                    await replay_actions_local(task.oracle_actions or [], ws)
                except ValueError as e:
                    problems.append(f"{task.id}: oracle actions failed: {e}")
            r = await run_verifier_local(task, ws)
            want = 0.0 if mode == "untouched" else 1.0
            if r.status != "ok" or r.reward != want:
                problems.append(f"{task.id}: {mode} scored {r.reward} ({r.status} {r.error}), want {want}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.rollout.taskgen", description="Generate bridle task folders."
    )
    ap.add_argument("--family", default="all", help=f"'all' or comma-separated: {', '.join(FAMILIES)}")
    ap.add_argument("--n", type=int, default=10, help="instances per family")
    ap.add_argument("--seed", type=int, default=0, help="first seed; instances use seed..seed+n-1")
    ap.add_argument("--out", type=Path, help="output directory (task folders go to OUT/<family>-<seed>/)")
    ap.add_argument("--check", action="store_true", help="verify oracle=1 and untouched=0 for each task")
    ap.add_argument("--list", action="store_true", help="list the families and exit")
    a = ap.parse_args(argv)
    if a.list:
        for name, mod in FAMILIES.items():
            sys.stdout.write(f"{name:16} {mod.DIFFICULTY:8} {mod.DESCRIPTION}\n")
        return 0
    if a.out is None:
        ap.error("--out is required")
    try:
        families = resolve_families(a.family)
    except ValueError as e:
        ap.error(str(e))
    tasks = generate_to(a.out, families, a.n, a.seed)
    sys.stdout.write(f"wrote {len(tasks)} tasks to {a.out}\n")
    if a.check:
        problems: list[str] = []
        for t in tasks:
            problems += anyio.run(_self_check, t)
        for p in problems:
            sys.stdout.write(p + "\n")
        sys.stdout.write(f"checked {len(tasks)} tasks: {len(problems)} problems\n")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
