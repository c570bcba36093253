#!/usr/bin/env python3
"""Does a policy learn through a real black-box harness? `configs/blackbox.toml` per harness and seed, then a
held-out evaluation of its SFT and RL policies through the same harness, paired.

    python benchmarks/blackbox_learning.py --harness codex [--seed 0 1] [--out DIR] [--set k=v ...]
    python benchmarks/blackbox_learning.py --harness claude-code:lean codex qwen-code openclaw --seed 0 1 --out DIR
    python benchmarks/blackbox_learning.py --from DIR          # re-print the table of an earlier invocation
    python benchmarks/blackbox_learning.py --harness codex --flawed-demos 0.5 --out DIR   # RL has a choice to fix

Per (harness, seed): one training run (`run.py --experiment blackbox`: demonstrations played through the harness,
SFT on them, then GRPO through it; every policy folder kept), then `run.py --eval` of the cold start's policy (SFT)
and of the final policy (RL) on `[eval]`'s held-out tasks through the same harness, and the paired difference over
the (task, harness) pairs both measured, as `run.py --compare` computes it. The row also says what the run did:
the mean reward of the first and last 5 RL steps, wall minutes, the RL rollouts' trainable tokens against the
tokens they sampled, their statuses, the output tokens and calls of solved and unsolved rollouts, and what the first
call of each unsolved rollout produced (a tool call the harness ran, a malformed call, a plain answer): where a
harness does not learn, the evidence starts there.

`--flawed-demos F`: a share F of the demonstrations (drawn with the demonstration tasks' seed) prints the answer
instead of writing it (each `write_file` of the oracle becomes the shell command `printf %s CONTENT`, which scores 0),
as a careless teacher would. SFT then learns both behaviours, and RL's first job is to choose between them: the
signal is the same for every task (which command to start with), where the slips of a policy SFT trained on correct
demonstrations only are each task's own. The demonstration tasks are written to DIR/<harness>-seed<N>/demos.

Goal (issue "learns through each real harness"): the paired RL - SFT pass@1 interval lies above 0 for every row.
Exits 1 when a row misses it (or a run fails). Harnesses and seeds run one after another: each run uses the whole
machine. Run folders: DIR/<harness>-seed<N>/{train,eval-sft,eval-rl}. The same command again with the same --out
goes on where a killed invocation stopped: its training run resumes from its last checkpoint (`run.py --resume`, wall
minutes summed over the attempts), an evaluation cut part-way runs again whole, finished rows are only re-read.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
import tempfile
import time
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from _quickstart import run_logged  # benchmarks/ is sys.path[0] when run as a script

from pipeline.cli.evaluate import latest_weights, load_report
from pipeline.core.config import ConfigError, apply_overrides, resolve_experiment_path
from pipeline.core.eventlog import EventLogReader
from pipeline.core.logs import configure
from pipeline.eval.estimators import Estimate, paired_difference, pass_at_k
from pipeline.messages import PolicyUpdated, ids
from pipeline.monitor.metrics import load_metrics, of_kind
from pipeline.rollout.scheduling import TaskSource, load_tasks
from pipeline.tokens.tokenizer import QwenTokenizer
from pipeline.training.tree_attention import sliding_window

ROOT = Path(__file__).resolve().parent.parent

EXPERIMENT = "blackbox"


@dataclass
class Row:
    harness: str
    seed: int
    sft: Estimate | None = None
    rl: Estimate | None = None
    diff: Estimate | None = None
    first5: float | None = None
    last5: float | None = None
    steps: int = 0
    wall_min: float | None = None
    trainable: int = 0
    sampled: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    # output tokens and model calls per RL rollout, by outcome: with a token-mean loss, failures that run longer
    # weigh more than the successes they are compared with
    per_outcome: dict[bool, list[tuple[int, int]]] = field(default_factory=lambda: {True: [], False: []})
    # what the first model call of each unsolved RL rollout produced, as the proxy parsed it (CallTrace.output): a
    # tool call the harness ran (so the arguments were wrong), a malformed call, a plain answer, nothing
    unsolved_first: Counter[str] = field(default_factory=Counter)
    # tokens from the end of the task's instruction to the end of each RL rollout's first prompt, against how far
    # back the policy's first output can see at all (None: full attention): a harness that puts its own text after
    # the instruction can put the task out of the policy's sight, and then nothing is learned
    distances: list[int] = field(default_factory=list)
    reach: int | None = None
    error: str = ""


# What a harness needs of the policy beyond configs/blackbox.toml. Claude Code 2.1.197 follows the task's instruction
# with a system message of its own (its agent types and skills): the instruction ends ~1,384 tokens before the first
# output, beyond what the config's 2 layers with a 512-token window can see (2 x 511; perturbing the instruction leaves
# the first output's logits bit-identical), so its policy gets a 2,048-token window, in a model folder of its own.
# The table's last column shows each row's distance and reach. "claude-code:lean" (Claude Code's own flags drop that
# message) needs none of this: its prompt ends with the task, and its policy is the config's.
POLICY_SETS = {"claude-code": ["experiment.build_model.sliding_window=2048",
                               'run.model="runs/cache/blackbox-model-v2-w2048"']}


def _harness_sets(harness: str) -> list[str]:
    return [f'scheduler.harness="{harness}"', f'eval.harnesses=["{harness}"]']


def _run(*args: str, sets: list[str], log: Path) -> None:
    run_logged(["--experiment", EXPERIMENT, "--no-watch", *args], sets, log)


SIGHT_SAMPLE = 64  # RL rollouts whose instruction distance is measured (a harness lays out every task alike)
ATTEMPTS = "train-attempts.json"  # {"start", "end", "done"} per attempt, epoch seconds; a killed one has no end


def train(run_dir: Path, harness: str, seed: int, sets: list[str]) -> float:
    """The training run, or the rest of one an earlier invocation started (``run.py --resume``: a run of an hour or
    more can outlive its session); returns the wall seconds of all its attempts. Every policy folder is kept (the
    SFT one is evaluated)."""
    book = run_dir.with_name(ATTEMPTS)
    attempts = json.loads(book.read_text()) if book.is_file() else []
    if attempts and attempts[-1]["done"]:
        return sum(a["end"] - a["start"] for a in attempts)
    log = run_dir / "log.jsonl"
    for a in attempts:  # a killed attempt ran until the last line its run wrote
        if a["end"] is None:
            a["end"] = max(a["start"], log.stat().st_mtime if log.is_file() else a["start"])
    attempts.append({"start": time.time(), "end": None, "done": False})
    book.parent.mkdir(parents=True, exist_ok=True)
    book.write_text(json.dumps(attempts))
    if (run_dir / "config.toml").is_file():
        run_logged(["--resume", str(run_dir), "--no-watch"], [],
                   run_dir.with_name(f"{run_dir.name}-resume{len(attempts) - 1}.log"))
    else:
        seeds = [f"experiment.seed={seed}"]  # every actor's seed (the task sets keep theirs)
        _run("--run-dir", str(run_dir), sets=[*_harness_sets(harness), *POLICY_SETS.get(harness, []), *seeds,
                                              "learner.keep_weights=1000", *sets],
             log=run_dir.with_name(run_dir.name + ".log"))
    attempts[-1].update(end=time.time(), done=True)
    book.write_text(json.dumps(attempts))
    return sum(a["end"] - a["start"] for a in attempts)


def flawed_demonstrations(folder: Path, share: float, sets: list[str]) -> str:
    """Write the experiment's demonstration tasks (``[scheduler].sft_tasks``) to ``folder``, a ``share`` of them with
    the oracle's ``write_file`` actions turned into ``printf %s CONTENT`` (printed, not written); return the --set
    that makes the run demonstrate them."""
    raw = apply_overrides(tomllib.loads(resolve_experiment_path(EXPERIMENT).read_text(encoding="utf-8")), sets)
    src = TaskSource(**raw["scheduler"]["sft_tasks"])
    if not folder.is_dir():
        tasks = load_tasks(src, folder.parent, folder.name)
        for i in random.Random(src.seed).sample(range(len(tasks)), round(share * len(tasks))):
            path = tasks[i].root / "solution" / "actions.json"
            actions = json.loads(path.read_text(encoding="utf-8"))
            flawed = [{"tool": "bash", "args": {"command": "printf %s " + shlex.quote(a["args"]["content"])}}
                      if a["tool"] == "write_file" else a for a in actions]
            path.write_text(json.dumps(flawed, indent=1), encoding="utf-8")
    return f'scheduler.sft_tasks={{tasks="{folder}"}}'


def sft_policy(run_dir: Path) -> Path:
    """The cold start's policy: the weights of the run's step-0 update (the SFT weights)."""
    for ev in EventLogReader(run_dir / "events.msgpack"):
        if isinstance(ev.msg, PolicyUpdated) and ev.msg.step == 0 and ev.msg.weights_path:
            path = Path(ev.msg.weights_path)
            return path if path.is_absolute() else ROOT / path
    raise RuntimeError(f"{run_dir}: no policy update with a weights folder in its event log (did the cold start run?)")


def evaluate(eval_dir: Path, harness: str, policy: Path, sets: list[str]) -> None:
    _run("--eval", "--model", str(policy), "--run-dir", str(eval_dir), sets=[*_harness_sets(harness), *sets],
         log=eval_dir.with_name(eval_dir.name + ".log"))


def pass1(eval_dir: Path) -> tuple[Estimate, dict[str, float]]:
    rep = load_report(eval_dir)
    pairs = {f"{p.task_id}|{p.harness}": pass_at_k(p.n, p.successes, 1) for p in rep.pairs if p.n >= 1}
    return rep.row("overall", "all").pass_at[1], pairs


def training_facts(run_dir: Path, row: Row) -> None:
    """Rewards of the RL steps (metrics.jsonl), the RL rollouts' statuses and tokens (the event log's trees)."""
    from pipeline.core.recordings import recorded_rollouts
    from pipeline.trees.tree import TreeOptions, build_tree

    rewards = [m["reward"] for m in of_kind(load_metrics(run_dir / "metrics.jsonl"), "rl_step") if "reward" in m]
    row.steps = len(rewards)
    if rewards:
        head, tail = rewards[:5], rewards[-5:]
        row.first5, row.last5 = sum(head) / len(head), sum(tail) / len(tail)
    tok = QwenTokenizer()
    for s in (r.rollout for r in recorded_rollouts(run_dir / "events.msgpack")):
        if s.request.purpose != "train":
            continue
        if len(row.distances) < SIGHT_SAMPLE and (d := instruction_distance(s, tok)) is not None:
            row.distances.append(d)
        row.statuses[s.finished.status] += 1
        st = build_tree(s, TreeOptions()).stats
        row.trainable += st.tokens_trainable
        row.sampled += st.tokens_output
        if s.finished.status == "ok":
            row.per_outcome[s.finished.reward > 0].append((st.tokens_output, len(s.calls)))
            if s.finished.reward <= 0:
                row.unsolved_first[_first_output(s)] += 1


def policy_reach(policy: Path) -> int | None:
    """How far back a policy's output can be influenced by its prompt: each sliding-window layer looks window - 1
    positions further back, so layers x (window - 1); None when any layer attends to the whole prompt."""
    c = json.loads((policy / "config.json").read_text(encoding="utf-8"))
    window = sliding_window(SimpleNamespace(**c))  # the learner's own reading of the config
    if not window or "full_attention" in (c.get("layer_types") or []):
        return None
    return c["num_hidden_layers"] * (window - 1)


def _main_calls(s) -> list:
    return sorted((c for c in s.calls if c.label == "main"), key=lambda c: c.seq)


def instruction_distance(s, tok) -> int | None:
    """About how many tokens lie between the end of the task's instruction (its last line) and the end of the
    rollout's first prompt; None when the prompt does not contain that line. Found by decoding: the shortest tail of
    the prompt whose text holds the line (a longer tail holds it too, so a binary search finds it)."""
    main = _main_calls(s)
    instruction = Path(s.request.task_path) / "instruction.md"
    if not main or not instruction.is_file():
        return None
    lines = instruction.read_text(encoding="utf-8").strip().splitlines()
    prompt = ids(main[0].input_ids).tolist()
    if not lines or lines[-1].strip() not in tok.decode(prompt):
        return None
    line = lines[-1].strip()
    lo, hi = 1, len(prompt)  # the shortest tail holding it lies in (lo - 1, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if line in tok.decode(prompt[-mid:]):
            hi = mid
        else:
            lo = mid + 1
    return max(0, hi - len(tok.encode(line)))


def _first_output(s) -> str:
    main = _main_calls(s)
    if not main:
        return "no call"
    trace = main[0].trace
    return "untraced" if trace is None else {"tool_calls": "tool call"}.get(trace.output, trace.output)


def measure(base: Path, harness: str, seed: int, sets: list[str], run: bool, flawed: float = 0.0) -> Row:
    row = Row(harness=harness, seed=seed)
    where = base / f"{harness.replace(':', '-')}-seed{seed}"  # "claude-code:lean" -> claude-code-lean-seed0
    run_dir, eval_sft, eval_rl = where / "train", where / "eval-sft", where / "eval-rl"
    try:
        if run and not (where / "wall_min.json").is_file():
            demos = [flawed_demonstrations(where / "demos", flawed, sets)] if flawed else []
            row.wall_min = train(run_dir, harness, seed, [*sets, *demos]) / 60
            policies = [(eval_sft, sft_policy(run_dir)), (eval_rl, latest_weights(run_dir))]
            for eval_dir, _ in policies:  # one an earlier, killed invocation left part-way: evaluated again whole
                shutil.rmtree(eval_dir, ignore_errors=True)
            # side by side: each is mostly waiting on its sandboxes
            with ThreadPoolExecutor(max_workers=2) as pool:
                list(pool.map(lambda job: evaluate(job[0], harness, job[1], sets), policies))
            (where / "wall_min.json").write_text(json.dumps(row.wall_min))
        elif (where / "wall_min.json").is_file():
            row.wall_min = json.loads((where / "wall_min.json").read_text())
        row.reach = policy_reach(sft_policy(run_dir))
        training_facts(run_dir, row)
        row.sft, sft_pairs = pass1(eval_sft)
        row.rl, rl_pairs = pass1(eval_rl)
        row.diff = paired_difference(rl_pairs, sft_pairs)
    except (RuntimeError, OSError, ValueError, ConfigError) as e:  # ConfigError: an evaluation without its report
        row.error = str(e)
    return row


def _est(e: Estimate | None) -> str:
    return "n/a" if e is None else e.text()


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _lengths(xs: list[tuple[int, int]]) -> str:
    """Mean output tokens and calls of a set of rollouts, and how many; "n/a (0)" for none."""
    if not xs:
        return "n/a (0)"
    return f"{sum(t for t, _ in xs) / len(xs):.0f}, {sum(c for _, c in xs) / len(xs):.1f} ({len(xs)})"


def _shares(counts: Counter[str]) -> str:
    """How many rollouts of each kind, most first, and of all; "n/a (0)" for none."""
    n = sum(counts.values())
    if not n:
        return "n/a (0)"
    return ", ".join(f"{k} {v}" for k, v in counts.most_common()) + f" ({n})"


def table(rows: list[Row]) -> str:
    head = ("| harness | seed | SFT pass@1 [95 %] | RL pass@1 [95 %] | RL - SFT, paired [95 %] | reward first 5 | "
            "reward last 5 | RL steps | wall min | trainable / sampled tokens | RL rollouts by status | "
            "tokens, calls per rollout: solved / unsolved | unsolved: first call | instruction → end of prompt, median "
            "(max) / policy reach, tokens |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        if r.error and r.diff is None:
            sight = f" (instruction → end of prompt / policy reach: {_sight(r)})" if r.distances else ""
            lines.append(f"| {r.harness} | {r.seed} | failed: {r.error.splitlines()[0][:200]}{sight} |")
            continue
        diff = "n/a" if r.diff is None else f"{r.diff.text()} (n={r.diff.n})"
        share = f"{r.trainable:,} / {r.sampled:,}" + (f" ({100 * r.trainable / r.sampled:.0f} %)" if r.sampled else "")
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(r.statuses.items())) or "none"
        lines.append(f"| {r.harness} | {r.seed} | {_est(r.sft)} | {_est(r.rl)} | {diff} | {_num(r.first5, '.3f')} | "
                     f"{_num(r.last5, '.3f')} | {r.steps} | {_num(r.wall_min, '.0f')} | {share} | {statuses} | "
                     f"{_lengths(r.per_outcome[True])} / {_lengths(r.per_outcome[False])} | "
                     f"{_shares(r.unsolved_first)} | {_sight(r)} |")
    return "\n".join(lines)


def _sight(r: Row) -> str:
    """The instruction's distance from the first output against the policy's reach; "out of sight" when the policy
    cannot read the task in most rollouts (then no amount of training helps)."""
    reach = "all" if r.reach is None else f"{r.reach:,}"
    if not r.distances:
        return f"n/a (0) / {reach}"
    d = sorted(r.distances)
    out = r.reach is not None and d[len(d) // 2] > r.reach
    return f"{d[len(d) // 2]:,} ({d[-1]:,}) / {reach}" + (" **out of sight**" if out else "")


def learned(r: Row) -> bool:
    return r.diff is not None and r.diff.low is not None and r.diff.low > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", nargs="+", default=["codex"],
                    help="black-box harnesses: claude-code, claude-code:lean, codex, qwen-code, openclaw")
    ap.add_argument("--seed", type=int, nargs="+", default=[0])
    ap.add_argument("--out", type=Path, help="where the runs go (default: a new temporary folder)")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="a config override for the training run and both evaluations (run.py --set)")
    ap.add_argument("--flawed-demos", type=float, default=0.0, metavar="SHARE",
                    help="this share of the demonstrations prints the answer instead of writing it (see above)")
    ap.add_argument("--from", dest="from_dir", type=Path,
                    help="print the table from the runs of an earlier invocation; run nothing")
    args = ap.parse_args()
    if not 0.0 <= args.flawed_demos < 1.0:
        ap.error(f"--flawed-demos {args.flawed_demos}: give a share from 0 (none, the default) to below 1")
    configure(level="warning")  # the tree rebuild's per-rollout debug lines would bury the table
    base = args.from_dir or args.out or Path(tempfile.mkdtemp(prefix="bridle-blackbox-"))
    print(f"run folders: {base}", flush=True)
    if args.from_dir:
        found = sorted(p.name.rpartition("-seed") for p in base.iterdir() if (p / "train").is_dir())
        todo = [(h, int(s)) for h, _, s in found]
    else:
        todo = [(h, s) for h in args.harness for s in args.seed]
    rows = []
    for harness, seed in todo:
        print(f"{harness}, seed {seed} ...", flush=True)
        rows.append(measure(base, harness, seed, args.sets, run=args.from_dir is None, flawed=args.flawed_demos))
        if rows[-1].error:
            print(rows[-1].error, file=sys.stderr, flush=True)
    print(table(rows))
    ok = bool(rows) and all(learned(r) for r in rows)
    print(f"goal: the paired RL - SFT pass@1 interval lies above 0 in every row: {'YES' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
