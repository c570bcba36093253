"""``run.py --eval``: evaluate a policy through an experiment's own proxy, sandboxes and verifiers, with no learner;
``run.py --replay LOG --eval``: every evaluation round of a recorded run, recomputed from its event log alone; and
``run.py --compare A B``: two evaluations of the same tasks, per (task, harness) pair (docs/evaluation.md)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from pipeline.core import config as cfg
from pipeline.core import graphs
from pipeline.core.eventlog import EventLogReader
from pipeline.core.logs import get_logger
from pipeline.core.runtime import Resolver
from pipeline.eval.behaviour import Behaviour
from pipeline.eval.estimators import paired_difference, pass_at_k
from pipeline.eval.report import Report
from pipeline.eval.run import (
    RoundResult,
    behaviour_by_harness,
    behaviour_table,
    finish,
    metric_values,
    rounds_from_log,
    text,
)
from pipeline.messages import PolicyUpdated, SettledRollout

# What an evaluation runs of an experiment's graph: everything else (scheduler, tree builder, learner) is left out.


def latest_weights(run_dir: Path) -> Path:
    """The newest complete weights folder a training run published (its final policy)."""
    from pipeline.training.learner import WEIGHTS_INFO_FILE

    done = [d for d in (run_dir / "weights").glob("v*") if (d / WEIGHTS_INFO_FILE).is_file()]
    if not done:
        raise cfg.ConfigError(f"--checkpoint {run_dir}: no complete weights folder in {run_dir / 'weights'} (a run "
                              "publishes one after its cold start and after every RL step)")
    newest = max(done, key=lambda d: _version(d / WEIGHTS_INFO_FILE))
    _warn_if_newer_policy_in_log(run_dir, _version(newest / WEIGHTS_INFO_FILE), newest)
    return newest


def _version(info: Path) -> int:
    return int(json.loads(info.read_text())["version"])


def _pushed_without_disk(config: Path) -> bool:
    """Whether the run's resolved config (its run folder's config.toml) has a learner with weight_sync =
    "distributed"; True when it cannot be read (then the log decides)."""
    try:
        raw = tomllib.loads(config.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return True
    return any(isinstance(v, dict) and v.get("weight_sync") == "distributed" for v in raw.values())


def _warn_if_newer_policy_in_log(run_dir: Path, on_disk: int, folder: Path) -> None:
    """A run that pushed weights without the disk (weight_sync = "distributed") and was killed before its final
    policy was written has a newer policy in its log than in any folder: say so rather than evaluate silently."""
    log = run_dir / "events.msgpack"
    if not log.is_file() or not _pushed_without_disk(run_dir / "config.toml"):
        return  # every policy got a folder: the log need not be read (it can be gigabytes)
    last: PolicyUpdated | None = None
    for ev in EventLogReader(log):
        if isinstance(ev.msg, PolicyUpdated):
            last = ev.msg
    if last is not None and last.version > on_disk:
        get_logger(actor="eval").warning(
            "the run's last policy has no weights folder; evaluating an older one", logged_version=last.version,
            logged_step=last.step, evaluated_version=on_disk, evaluated=str(folder),
            why="pushed to the engines without the disk; the run stopped before writing its final policy (a "
                "resumed run writes it when it ends)")


def eval_experiment(exp: cfg.Experiment, resolve: Resolver, *, model: str | None = None,
                    checkpoint: str | None = None) -> tuple[cfg.Experiment, str]:
    """The experiment's evaluation graph and what it evaluates: its evaluator, proxy, sandboxes and collector
    (and monitor), run until the evaluator's one round is done (``[eval].standalone``)."""
    ev = exp.kind_section("evaluator")
    if ev is None:
        raise cfg.ConfigError(f"{exp.source}: --eval needs an actor of kind \"evaluator\" in [graph].actors and its "
                              "section (configs/quickstart.toml has one: [eval])")
    raw: dict[str, Any] = exp.to_dict()
    keep = {n for n, k in exp.graph.actors.items() if k in graphs.EVAL_KINDS}
    graph = raw["graph"]
    graph["actors"] = {n: k for n, k in graph["actors"].items() if n in keep}
    graph["edges"] = graphs.keep_edges(graph["edges"], keep)
    graph["stop_after"] = [ev[0]]
    graph["inbox_sizes"] = {n: v for n, v in graph.get("inbox_sizes", {}).items() if n in keep}
    for name in list(raw):
        if name in exp.graph.actors and name not in keep:
            del raw[name]
    raw["run"]["steps"] = 0
    raw[ev[0]]["standalone"] = True
    if checkpoint:
        run_dir = Path(checkpoint)
        raw["run"]["model"] = str(latest_weights(run_dir))
        raw[ev[0]]["exclude"] = [*raw[ev[0]].get("exclude", []),
                                 *(str(run_dir / d) for d in ("tasks", "sft_tasks") if (run_dir / d).is_dir())]
    elif model:
        if not (Path(model) / "config.json").is_file():
            raise cfg.ConfigError(f"--model {model}: not a Hugging Face model folder (no config.json)")
        raw["run"]["model"] = model
    if checkpoint or model:
        raw["experiment"].pop("build_model", None)  # evaluate the policy given, never build one in its place
    raw["experiment"]["name"] = f"{exp.name}-eval"
    out = cfg.load_experiment(raw, resolve)
    out.source = f"{exp.source} (--eval)"
    out.preset = "eval" if exp.preset == "train" else None
    _require_edges(out, ev[0])
    proxy = out.kind_section("proxy")
    if proxy is not None and proxy[1].engine.kind == "openai":  # a teacher answers, whatever [run].model says
        return out, f"the teacher {proxy[1].engine.served_model!r} at {proxy[1].engine.url}"
    return out, out.run.model


def _edges(exp: cfg.Experiment) -> list[tuple[str, str, str]]:
    return exp.graph.parsed_edges()


def _require_edges(exp: cfg.Experiment, ev: str) -> None:
    have = {(s, o, d) for s, o, d in _edges(exp)}
    proxy = next(n for n, k in exp.graph.actors.items() if k == "proxy")
    collector = next((n for n, k in exp.graph.actors.items() if k == "collector"), None)
    need = [(ev, "requests", proxy)] + ([(collector, "settled", ev)] if collector else [])
    missing = [f"{s}.{o} -> {d}" for s, o, d in need if (s, o, d) not in have]
    if missing:
        raise cfg.ConfigError(f"{exp.source}: the evaluation graph needs the edges {missing} in [graph].edges")


# ------------------------------------------------------------------------------------------------ replay
class Replayed(msgspec.Struct, kw_only=True):
    rounds: list[RoundResult]
    training: dict[str, Behaviour]  # the behavioural metrics of the run's training rollouts, per harness


def replay_rounds(log_path: Path) -> Replayed:
    """Every evaluation round of a recorded run, recomputed from the log (its recorded [eval] ks and threshold),
    and the behaviour of its training rollouts."""
    reader = EventLogReader(log_path)
    conf = msgspec.to_builtins(reader.header.config)
    ev = next((n for n, k in conf.get("graph", {}).get("actors", {}).items() if k == "evaluator"), None)
    sec = conf.get(ev, {}) if ev else {}
    ks, threshold = sec.get("ks", [1]), float(sec.get("threshold", 1.0))
    settled = [e.msg for e in reader if isinstance(e.msg, SettledRollout)]
    rounds = [finish(rs, ks, threshold, step=step) for step, rs in rounds_from_log(settled).items()]
    training = behaviour_by_harness([r for r in settled if r.request.purpose == "train"], threshold)
    return Replayed(rounds=rounds, training=training)


def replay_text(res: Replayed) -> str:
    parts = [text(r) + "\n" + behaviour_table({"all": r.behaviour, **r.by_harness}) for r in res.rounds]
    parts = parts or ["no evaluation rollouts in this log"]
    if res.training:
        parts.append("# Training rollouts: behaviour per harness\n\n" + behaviour_table(res.training))
    return "\n".join(parts)


def replay_json(res: Replayed) -> str:
    return msgspec.json.encode({
        "rounds": [{"step": r.report.step, "values": metric_values(r), "report": r.report, "behaviour": r.behaviour,
                    "by_harness": r.by_harness} for r in res.rounds],
        "training": res.training}).decode()


# ------------------------------------------------------------------------------------------------ compare
def load_report(where: Path) -> Report:
    path = next((p for p in (where / "eval" / "report.json", where / "report.json", where) if p.is_file()), None)
    if path is None:
        raise cfg.ConfigError(f"--compare: no report.json in {where} (give an evaluation's run folder or its eval/)")
    return msgspec.json.decode(path.read_bytes(), type=Report)


def compare(a: Path, b: Path) -> str:
    """pass@k of two evaluations and their difference, paired over the (task, harness) pairs both measured."""
    ra, rb = load_report(a), load_report(b)
    lines = [f"A = {a}", f"B = {b}", "", "| metric | A | B | A - B over common pairs |", "| --- | --- | --- | --- |"]
    for k in sorted(set(ra.ks) & set(rb.ks)):
        per = [{f"{p.task_id}|{p.harness}": pass_at_k(p.n, p.successes, k) for p in r.pairs if p.n >= k}
               for r in (ra, rb)]
        d = paired_difference(per[0], per[1])
        ea, eb = (r.row("overall", "all").pass_at[k] for r in (ra, rb))
        lines.append(f"| pass@{k} | {ea.text()} | {eb.text()} | {d.text()} (n={d.n}) |")
    rewards = [p.mean_reward for p in [*ra.pairs, *rb.pairs]]
    mr = paired_difference({f"{p.task_id}|{p.harness}": p.mean_reward for p in ra.pairs},
                           {f"{p.task_id}|{p.harness}": p.mean_reward for p in rb.pairs},
                           rates=all(0.0 <= r <= 1.0 for r in rewards))
    lines.append(f"| mean reward | {ra.row('overall', 'all').mean_reward.text()} | "
                 f"{rb.row('overall', 'all').mean_reward.text()} | {mr.text()} (n={mr.n}) |")
    return "\n".join(lines)
