"""Finishing an evaluation round: the report (pass@k, pass^k, mean reward, behavioural metrics) from its settled
rollouts, the files it writes and the numbers that go to metrics.jsonl. Also used by ``run.py --replay LOG --eval``,
which rebuilds every round of a recorded run from its event log alone."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from pipeline.eval.behaviour import METRICS, Behaviour, behaviour
from pipeline.eval.report import Report, Sample, build_report, markdown, write
from pipeline.messages import SettledRollout


class RoundResult(msgspec.Struct, kw_only=True):
    report: Report
    behaviour: Behaviour
    versions: list[int]  # the policy versions that sampled the round's tokens (weights can land mid-round)
    by_harness: dict[str, Behaviour] = msgspec.field(default_factory=dict)


def behaviour_by_harness(rollouts: list[SettledRollout], threshold: float) -> dict[str, Behaviour]:
    """The behavioural metrics of each harness's rollouts (training or evaluation alike)."""
    by: dict[str, list[SettledRollout]] = defaultdict(list)
    for r in rollouts:
        by[r.request.harness].append(r)
    return {h: behaviour(rs, succeeded=_succeeded(threshold), oracle_steps=_oracle_steps(rs))
            for h, rs in sorted(by.items())}


def _succeeded(threshold: float) -> Callable[[SettledRollout], bool]:
    return lambda r: r.finished.status == "ok" and r.finished.reward >= threshold


def samples(rollouts: Iterable[SettledRollout]) -> list[Sample]:
    return [Sample(task_id=r.request.task_id, family=r.request.eval.family if r.request.eval else "",
                   harness=r.request.harness, column=r.request.eval.column if r.request.eval else "custom",
                   status=r.finished.status, reward=r.finished.reward, rollout_id=r.request.rollout_id)
            for r in rollouts]


def finish(rollouts: list[SettledRollout], ks: list[int], threshold: float, *, step: int = -1,
           policy: str = "") -> RoundResult:
    report = build_report(samples(rollouts), ks, threshold=threshold, policy=policy, step=step)
    beh = behaviour(rollouts, succeeded=_succeeded(threshold), oracle_steps=_oracle_steps(rollouts))
    versions = sorted({s.version for r in rollouts for c in r.calls for s in c.versions})
    return RoundResult(report=report, behaviour=beh, versions=versions,
                       by_harness=behaviour_by_harness(rollouts, threshold))


def _oracle_steps(rollouts: list[SettledRollout]) -> Callable[[str], int | None]:
    """The oracle length by task, from the rollouts' evaluation tags (training rollouts carry none: None)."""
    steps = {r.request.task_id: r.request.eval.oracle_steps for r in rollouts if r.request.eval}
    return lambda task_id: steps.get(task_id) or None


def metric_values(res: RoundResult) -> dict[str, float]:
    """Flat numbers for metrics.jsonl and the plots: overall and per-column pass@k / pass^k, mean reward, counts,
    behavioural metrics. Nothing measured means the key is absent, never a 0."""
    out: dict[str, float] = {}
    for row in res.report.rows:
        if row.scope not in ("overall", "column"):
            continue
        prefix = "" if row.scope == "overall" else f"{row.key}/"
        out[f"{prefix}pairs"] = row.pairs
        if row.mean_reward.mean is not None:
            out[f"{prefix}mean_reward"] = row.mean_reward.mean
        for k, e in row.pass_at.items():
            if e.mean is not None:
                out[f"{prefix}pass@{k}"] = e.mean
        for k, e in row.pass_hat.items():
            if e.mean is not None and k > 1:
                out[f"{prefix}pass^{k}"] = e.mean
    out["excluded"] = res.report.row("overall", "all").excluded if res.report.rows else 0
    out.update(res.behaviour.values())
    return out


def behaviour_table(rows: dict[str, Behaviour]) -> str:
    """One row per harness (or "all"), one column per metric: the value with its interval and its n."""
    head = "| harness | rollouts | " + " | ".join(m.replace("_", " ") for m in METRICS) + " |"
    lines = [head, "|" + " --- |" * (len(METRICS) + 2)]
    for key, b in rows.items():
        cells = [f"{getattr(b, m).text()} (n={getattr(b, m).n})" for m in METRICS]
        lines.append(f"| {key} | {b.rollouts} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_round(res: RoundResult, out_dir: Path) -> list[Path]:
    paths = write(res.report, out_dir)
    beh = out_dir / "behaviour.json"
    beh.write_bytes(msgspec.json.format(msgspec.json.encode(res.behaviour)))
    with (out_dir / "report.md").open("a") as f:
        f.write("\n## Behaviour (main-agent calls; docs/evaluation.md)\n\n")
        f.write(behaviour_table({"all": res.behaviour, **res.by_harness}))
        f.write(f"\nEngine weight versions that sampled this round (0: the folder the engine started from): "
                f"{res.versions or 'n/a'}\n")
    return [*paths, beh]


def rounds_from_log(rollouts: Iterable[SettledRollout]) -> dict[int, list[SettledRollout]]:
    """The evaluation rollouts of a recorded run, by the step they evaluated."""
    by: dict[int, list[SettledRollout]] = defaultdict(list)
    for r in rollouts:
        if r.request.purpose == "eval" and r.request.eval is not None:
            by[r.request.eval.step].append(r)
    return dict(sorted(by.items()))


def text(res: RoundResult) -> str:
    return markdown(res.report)
