"""An evaluation's results as tables: pass@k, pass^k and mean reward with 95 % intervals, overall and per column
(in-space / held-out / out-of-space), harness and task family; written as report.json, report.md and a chart.

The unit of every estimate is one (task, harness) pair sampled n times (docs/evaluation.md). A rollout that failed
for a reason that is not the policy's (``sandbox_error``, ``verifier_error``) is left out of its pair's n and counted
as excluded; a timeout or a crashed harness is the policy's failure and counts as a miss. A pair with fewer valid
samples than k is left out of that k's estimate, and the row says how many pairs each estimate used.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import msgspec

from pipeline.eval.estimators import Estimate, mean_ci, pass_at_k, pass_hat_k

Column = Literal["in-space", "held-out", "out-of-space", "custom"]
INFRASTRUCTURE = frozenset({"sandbox_error", "verifier_error"})


class Sample(msgspec.Struct, kw_only=True, frozen=True):
    """One evaluated rollout."""

    task_id: str
    family: str
    harness: str
    column: Column
    status: str
    reward: float
    rollout_id: str = ""


class Row(msgspec.Struct, kw_only=True):
    scope: Literal["overall", "column", "harness", "family"]
    key: str
    pairs: int  # (task, harness) pairs with at least one valid sample
    rollouts: int  # valid samples
    excluded: int  # infrastructure failures, not counted as the policy's
    mean_reward: Estimate
    pass_at: dict[int, Estimate]
    pass_hat: dict[int, Estimate]


class Pair(msgspec.Struct, kw_only=True, frozen=True):
    """One (task, harness) pair's valid samples, so two evaluations can be compared pair by pair."""

    task_id: str
    harness: str
    n: int
    successes: int
    mean_reward: float


class Report(msgspec.Struct, kw_only=True):
    ks: list[int]
    threshold: float  # a sample succeeds when its reward is at least this
    rows: list[Row]
    pairs: list[Pair] = msgspec.field(default_factory=list)
    policy: str = ""  # what was evaluated: a model folder or a run's checkpoint
    step: int = -1  # the training step, for evaluations during training

    def row(self, scope: str, key: str) -> Row | None:
        return next((r for r in self.rows if r.scope == scope and r.key == key), None)


def build_report(samples: Iterable[Sample], ks: list[int], *, threshold: float = 1.0, policy: str = "",
                 step: int = -1) -> Report:
    samples = list(samples)
    scopes: list[tuple[Literal["overall", "column", "harness", "family"], str, list[Sample]]] = [
        ("overall", "all", samples)]
    for scope, attr in (("column", "column"), ("harness", "harness"), ("family", "family")):
        by: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            by[getattr(s, attr)].append(s)
        scopes += [(scope, key, by[key]) for key in sorted(by)]  # type: ignore[misc]
    return Report(ks=sorted(set(ks)), threshold=threshold, policy=policy, step=step,
                  rows=[_row(scope, key, group, ks, threshold) for scope, key, group in scopes],
                  pairs=_pairs(samples, threshold))


def _valid_by_pair(group: Iterable[Sample]) -> tuple[dict[tuple[str, str], list[Sample]], int]:
    pairs: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    excluded = 0
    for s in group:
        if s.status in INFRASTRUCTURE:
            excluded += 1
        else:
            pairs[(s.task_id, s.harness)].append(s)
    return pairs, excluded


def _success(s: Sample, threshold: float) -> bool:
    return s.status == "ok" and s.reward >= threshold


def _pairs(samples: list[Sample], threshold: float) -> list[Pair]:
    pairs, _ = _valid_by_pair(samples)
    return [Pair(task_id=t, harness=h, n=len(ps), successes=sum(_success(s, threshold) for s in ps),
                 mean_reward=sum(s.reward for s in ps) / len(ps)) for (t, h), ps in sorted(pairs.items())]


def _row(scope: Literal["overall", "column", "harness", "family"], key: str, group: list[Sample], ks: list[int],
         threshold: float) -> Row:
    pairs, excluded = _valid_by_pair(group)
    rewards = [sum(s.reward for s in ps) / len(ps) for ps in pairs.values()]
    counts = [(len(ps), sum(_success(s, threshold) for s in ps)) for ps in pairs.values()]
    return Row(
        scope=scope, key=key, pairs=len(pairs), rollouts=sum(n for n, _ in counts), excluded=excluded,
        mean_reward=mean_ci(rewards) if all(0.0 <= r <= 1.0 for r in rewards) else mean_ci(rewards, lo=None, hi=None),
        pass_at={k: mean_ci([pass_at_k(n, c, k) for n, c in counts if n >= k]) for k in sorted(set(ks))},
        pass_hat={k: mean_ci([pass_hat_k(n, c, k) for n, c in counts if n >= k]) for k in sorted(set(ks))},
    )


# ------------------------------------------------------------------------------------------------ writing
def markdown(report: Report) -> str:
    ks = report.ks
    head = ["scope", "key", "pairs", "rollouts", "excluded", "mean reward"]
    head += [f"pass@{k}" for k in ks] + [f"pass^{k}" for k in ks if k > 1]
    lines = [f"# Evaluation{f' at step {report.step}' if report.step >= 0 else ''}", ""]
    if report.policy:
        lines += [f"Policy: `{report.policy}`", ""]
    rule = (f"A sample succeeds when its status is ok and its reward is at least {report.threshold:g}. Each cell "
            "is the mean over (task, harness) pairs with its 95 % interval; n/a means nothing was measured.")
    lines += [rule, ""]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report.rows:
        cells = [r.scope, r.key, str(r.pairs), str(r.rollouts), str(r.excluded), r.mean_reward.text()]
        cells += [r.pass_at[k].text() for k in ks] + [r.pass_hat[k].text() for k in ks if k > 1]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(report: Report, path: Path) -> None:
    """pass@k per column and per harness, with the intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [r for r in report.rows if r.scope in ("column", "harness")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) * len(report.ks)), 4.0))
    width = 0.8 / max(1, len(report.ks))
    for j, k in enumerate(report.ks):
        xs, ys, errs = [], [], [[], []]
        for i, r in enumerate(groups):
            e = r.pass_at[k]
            if e.mean is None:
                continue
            xs.append(i + j * width)
            ys.append(e.mean)
            errs[0].append(e.mean - (e.low if e.low is not None else e.mean))
            errs[1].append((e.high if e.high is not None else e.mean) - e.mean)
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=f"pass@{k}")
    ax.set_xticks([i + width * (len(report.ks) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{r.key}\n({r.scope})" for r in groups], fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("pass rate")
    ax.legend(fontsize=8)
    ax.set_title("Evaluation" + (f" at step {report.step}" if report.step >= 0 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: Report, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md", out_dir / "pass_at_k.png"]
    paths[0].write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    paths[1].write_text(markdown(report))
    chart(report, paths[2])
    return paths
