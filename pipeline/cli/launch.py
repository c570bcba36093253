"""Starting runs and replays: run directories, logging, the event log, the supervisor.

``run.py`` is a thin command line over these functions; tests call them directly too.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec

from pipeline.core import config as cfg
from pipeline.core import logs
from pipeline.core.eventlog import AsyncEventLog, EventLogReader, EventLogWriter, LogHeader
from pipeline.core.runfiles import SFT_CHECKPOINT, run_tag
from pipeline.core.runtime import Graph, Interrupted, Resolver, Resume, Supervisor, event_loop_name
from pipeline.messages import SCHEMA_VERSION, ConfigChanged, GroupDropped, Metric, PolicyUpdated, TreeGroup


@dataclass
class RunDir:
    path: Path

    @property
    def events(self) -> Path:
        return self.path / "events.msgpack"

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def log_file(self) -> Path:
        return self.path / "log.jsonl"


def make_run_dir(exp: cfg.Experiment, run_dir: str | Path | None, suffix: str = "") -> RunDir:
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(exp.experiment.runs_dir) / f"{stamp}-{exp.name}{suffix}"
        path, i = base, 1
        while path.exists():
            i += 1
            path = base.with_name(f"{base.name}-{i}")
    else:
        path = Path(run_dir)
        if (path / "events.msgpack").exists():
            raise cfg.ConfigError(f"--run-dir {path}: already holds a run (events.msgpack); continue it with "
                                  f"`python run.py --resume {path}`, or pick a new directory")
    path.mkdir(parents=True, exist_ok=True)
    return RunDir(path)


def open_event_log(rd: RunDir, exp: cfg.Experiment, replay_of: str = "") -> AsyncEventLog:
    header = LogHeader(
        schema_version=SCHEMA_VERSION,
        run_id=run_tag(rd.path),  # what the run's files, processes and containers outside its folder carry
        created=time.time(),
        experiment=exp.name,
        config=exp.to_dict(),
        replay_of=replay_of,
    )
    return AsyncEventLog(EventLogWriter(rd.events, header))


def prepare(exp: cfg.Experiment, run_dir: str | Path | None, *, suffix: str = "", console: bool = True) -> RunDir:
    rd = make_run_dir(exp, run_dir, suffix)
    rd.config.write_text(exp.to_toml(), encoding="utf-8")
    logs.configure(rd.log_file, level=exp.experiment.log_level, console=console)
    return rd


async def run_experiment(
    exp: cfg.Experiment,
    resolve: Resolver,
    rd: RunDir,
    *,
    config_path: Path | None = None,
    handle_signals: bool = True,
) -> Supervisor:
    """Run the graph of ``exp`` to its end. Raises ActorCrashed / Interrupted like Supervisor.run."""
    await build_model(exp)
    log = open_event_log(rd, exp)
    sup = Supervisor(exp, resolve, log, config_path=config_path, handle_signals=handle_signals, run_dir=rd.path)
    logs.get_logger(actor="run").info("run started", run_dir=str(rd.path), experiment=exp.name,
                                      event_loop=event_loop_name())
    try:
        await sup.run()
    finally:
        log.close()
    return sup


async def build_model(exp: cfg.Experiment) -> None:
    if not exp.experiment.build_model:
        return
    from pipeline.models.quickstart import ModelSpec, ensure_model

    if not exp.run.model:
        raise cfg.ConfigError(f"{exp.source}: [experiment.build_model] builds the policy at [run].model; set it")
    try:
        spec = msgspec.convert({**exp.experiment.build_model, "path": exp.run.model}, ModelSpec)
    except msgspec.ValidationError as e:
        raise cfg.ConfigError(f"{exp.source}: [experiment.build_model]: {e}") from None
    logs.get_logger(actor="run").info("preparing the model", path=spec.path)
    # Ctrl-C must stop a long build: the thread is abandoned (run.py then exits without joining it).
    interrupted: list[Interrupted] = []
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def interrupt() -> None:
                async for signum in signals:
                    interrupted.append(Interrupted(signum))
                    tg.cancel_scope.cancel()

            tg.start_soon(interrupt)
            try:
                await anyio.to_thread.run_sync(ensure_model, spec, abandon_on_cancel=True)
            except ValueError as e:  # a model built there before with another shape
                raise cfg.ConfigError(f"{exp.source}: {e}") from None
            tg.cancel_scope.cancel()
    if interrupted:
        raise interrupted[0]


RESUMES_FILE = "resumes.json"  # how often the run was resumed: re-issued groups get ids of their own


def find_resume(run_dir: Path) -> Resume:
    # A checkpoint is renamed into place whole (Learner.save_checkpoint); one cut by a crash is a ``.tmp`` folder.
    ckpts = sorted(c for c in (run_dir / "checkpoints").glob("step*")
                   if re.fullmatch(r"step\d{5}", c.name) and (c / "learner_state.json").is_file())
    for cut in (run_dir / "checkpoints").glob("step*.tmp"):
        shutil.rmtree(cut, ignore_errors=True)
    sft = sorted(c for c in (run_dir / "checkpoints").glob(f"{SFT_CHECKPOINT}*")
                 if re.fullmatch(SFT_CHECKPOINT + r"\d{5}", c.name) and (c / "learner_state.json").is_file())
    for cut in (run_dir / "checkpoints").glob(f"{SFT_CHECKPOINT}*.tmp"):
        shutil.rmtree(cut, ignore_errors=True)
    if not ckpts and not sft:
        raise NoCheckpoint(f"--resume {run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}")
    count = run_dir / RESUMES_FILE
    attempt = json.loads(count.read_text())["resumes"] + 1 if count.is_file() else 1
    count.write_text(json.dumps({"resumes": attempt}))
    if not ckpts:  # killed inside the cold start, after one of its checkpoints
        last = sft[-1]
        return Resume(checkpoint=last, steps_done=0, attempt=attempt,
                      sft_updates=int(last.name.removeprefix(SFT_CHECKPOINT)))
    last = ckpts[-1]
    return Resume(checkpoint=last, steps_done=int(last.name.removeprefix("step")), attempt=attempt)


def recorded_packs(log_path: Path) -> list[TreeGroup | GroupDropped]:
    """The demonstration packs the event log recorded (what the learner's cold start trains on), in order."""
    return [ev.msg for ev in EventLogReader(log_path)
            if isinstance(ev.msg, (TreeGroup, GroupDropped)) and ev.msg.purpose == "sft"]


class NoCheckpoint(cfg.ConfigError):
    """The run folder holds no complete learner checkpoint."""


STARTS_DIR = "killed-starts"  # what a start killed before its first checkpoint wrote, set aside by --resume


async def resume_experiment(exp: cfg.Experiment, resolve: Resolver, rd: RunDir, *, config_path: Path | None = None,
                            handle_signals: bool = True) -> Supervisor:
    """Continue a run from its last checkpoint, appending to its event log. A run killed before its first
    checkpoint (during the cold start) starts over in its folder: what the killed start wrote is set aside, its
    tasks are kept, and each actor removes what it left outside the folder (the run's tag is the same)."""
    if not rd.events.is_file():
        raise cfg.ConfigError(f"--resume {rd.path}: no run there (no events.msgpack)")
    try:
        res = find_resume(rd.path)
    except NoCheckpoint:
        aside = rd.path / STARTS_DIR / time.strftime("%Y%m%d-%H%M%S")
        aside.mkdir(parents=True)
        for name in ("events.msgpack", "metrics.jsonl", "plots.png"):
            if (rd.path / name).exists():
                (rd.path / name).replace(aside / name)
        logs.get_logger(actor="run").warning(
            "no checkpoint: the run was killed before its first RL step was saved; it starts over in its folder",
            set_aside=str(aside))
        return await run_experiment(exp, resolve, rd, config_path=config_path, handle_signals=handle_signals)
    await build_model(exp)
    writer = EventLogWriter.reopen(rd.events)
    res.announced, res.metrics_recorded = await anyio.to_thread.run_sync(step_recorded, rd.events, res.steps_done)
    if res.sft_updates is not None:
        res.sft_packs = await anyio.to_thread.run_sync(recorded_packs, rd.events)
    log = AsyncEventLog(writer)
    logs.get_logger(actor="run").info("resuming", run_dir=str(rd.path), checkpoint=str(res.checkpoint),
                                      steps_done=res.steps_done, sft_updates=res.sft_updates,
                                      truncated_bytes=writer.truncated_bytes)
    sup = Supervisor(exp, resolve, log, config_path=config_path, handle_signals=handle_signals, run_dir=rd.path,
                     resume=res)
    try:
        await sup.run()
    finally:
        log.close()
    return sup


def step_recorded(log_path: Path, step: int) -> tuple[bool, bool]:
    """Whether the log holds RL step ``step``'s update record (PolicyUpdated) and its metrics row."""
    update = row = False
    for ev in EventLogReader(log_path):
        m = ev.msg
        if isinstance(m, PolicyUpdated) and m.step == step:
            update = True
        elif isinstance(m, Metric) and m.kind == "rl_step" and m.step == step:
            row = True
    return update, row


def recorded_experiment(log_path: Path, resolve: Resolver, overrides: list[str] | None = None) -> cfg.Experiment:
    reader = EventLogReader(log_path)
    data = msgspec.to_builtins(reader.header.config)
    exp = cfg.load_experiment(data, resolve, overrides)
    exp.source = f"{log_path} (recorded config)"
    return exp


STAGE_ALIASES = {"trees": "tree"}


def resolve_stage(exp: cfg.Experiment, names: list[str]) -> set[str]:
    """Actor names for ``--stage``: an actor's name, its kind, or an alias ("trees" = the actor of kind "tree").
    Raises ConfigError naming what is none of these (before anything, the replay's run folder included, exists)."""
    out, unknown = set(), set()
    for n in names:
        n = STAGE_ALIASES.get(n, n)
        if n in exp.graph.actors:
            out.add(n)
            continue
        by_kind = [a for a, kind in exp.graph.actors.items() if kind == n]
        out.update(by_kind)
        if not by_kind:
            unknown.add(n)
    if unknown:
        raise cfg.ConfigError(
            f"--stage {','.join(sorted(unknown))}: not an actor of the recorded graph "
            f"({', '.join(exp.graph.actors)})"
        )
    return out


def compare_replay(original: Path, replayed: Path) -> dict[str, Any]:
    """Do the replay's trees / batches equal the recorded ones? (hashes of packed arrays, in order)"""
    from pipeline.messages import TreeGroup, packed_hash

    def collect(path: Path) -> tuple[dict[str, str], list[tuple[int, str]]]:
        trees, updates = {}, []
        for ev in EventLogReader(path):
            if isinstance(ev.msg, TreeGroup):
                trees[ev.msg.group_id] = packed_hash([ev.msg])
            elif isinstance(ev.msg, PolicyUpdated) and ev.msg.batch_hash:
                updates.append((ev.msg.step, ev.msg.batch_hash))
        return trees, updates

    t0, u0 = collect(original)
    t1, u1 = collect(replayed)
    out: dict[str, Any] = {}
    if t1:
        same = sum(1 for g, h in t1.items() if t0.get(g) == h)
        out["trees"] = {"replayed": len(t1), "recorded": len(t0), "identical": same}
    if u1:
        # strict=False: a replay may stop before (or run past) the recorded steps; compare the common ones
        same = sum(1 for a, b in zip(u0, u1, strict=False) if a == b)
        out["batches"] = {"replayed": len(u1), "recorded": len(u0), "identical": same}
    return out


def replay_plan(exp: cfg.Experiment, stage: set[str]) -> dict[str, list[str]]:
    """Which recorded outputs ("actor.output") feed which replayed actors (``stage``, from :func:`resolve_stage`):
    every edge from outside the stage in."""
    plan: dict[str, list[str]] = {}
    for src, out, dst in exp.graph.parsed_edges():
        if dst in stage and src not in stage:
            plan.setdefault(f"{src}.{out}", []).append(dst)
    return plan


async def replay_stage(
    log_path: Path,
    exp: cfg.Experiment,
    resolve: Resolver,
    stage: set[str],
    rd: RunDir,
) -> Supervisor:
    """Re-feed the recorded inputs of ``stage`` into fresh instances of its actors and run them live.

    Edges among the stage's actors are live; outputs to actors outside the stage only go to the new event log.
    Recorded config changes of the stage's actors are applied at their place in the stream (after the target's
    inbox has drained), so a replay sees what the live run saw.
    """
    plan = replay_plan(exp, stage)
    reader = EventLogReader(log_path)
    log = open_event_log(rd, exp, replay_of=str(log_path))
    sup = Supervisor(exp, resolve, log, handle_signals=True, only=stage, external_inputs=set(), run_dir=rd.path)
    missing = {d for dsts in plan.values() for d in dsts} - set(sup.graph.feeds)
    assert not missing, missing

    async def feeder(graph: Graph) -> None:
        for ev in reader:
            targets = plan.get(ev.src)
            if targets:
                for dst in targets:
                    await graph.feeds[dst].send(ev.msg)
            elif isinstance(ev.msg, ConfigChanged) and ev.msg.accepted and (
                    ev.msg.section in graph.actors or ev.msg.section == "run"):
                await _apply_recorded_change(graph, exp, ev.msg)
        if reader.report.truncated_at is not None:
            logs.get_logger(actor="replay").warning("replayed a truncated log", detail=reader.report.problem)

    try:
        await sup.run(feeder)
    finally:
        log.close()
    return sup


async def _apply_recorded_change(graph: Graph, exp: cfg.Experiment, change: ConfigChanged) -> None:
    if change.section == "run":
        current = msgspec.to_builtins(exp.run)
        current.update(change.changes)
        exp.run = msgspec.convert(current, cfg.RunSection)
        for a in graph.actors.values():
            a.ctx.run = exp.run
            await a.on_run_config(exp.run, dict(change.changes))
        return
    actor = graph.actors[change.section]
    if actor.inbox is not None:
        # the change applies after the messages recorded before it are taken; a memory stream signals nothing
        # when its buffer empties, so poll it (a replay, not a hot path)
        while actor.inbox.statistics().current_buffer_used:  # noqa: ASYNC110, RUF100 — no signal to wait on (above)
            await anyio.sleep(0.001)
    current = msgspec.to_builtins(actor.config)
    current.update(change.changes)
    new = msgspec.convert(current, type(actor.config))
    exp.sections[change.section] = new
    await actor.on_config(new, dict(change.changes))


async def serve(
    exp: cfg.Experiment, resolve: Resolver, rd: RunDir, announce: Callable[[dict[str, Any]], None]
) -> Supervisor:
    """Engine + proxy only, for recording any harness by hand: ``announce`` gets the endpoints and a token."""
    names = [n for n, kind in exp.graph.actors.items() if kind == "proxy"]
    if len(names) != 1:
        raise cfg.ConfigError(f"--serve: the experiment needs exactly one actor of kind \"proxy\" (found {names})")
    name = names[0]
    if getattr(exp.sections[name], "workers", 1) > 1:
        raise cfg.ConfigError(f"--serve: [{name}].workers = {exp.sections[name].workers}: recording by hand goes "
                              "through one proxy; set it to 1")
    log = open_event_log(rd, exp)
    sup = Supervisor(exp, resolve, log, only={name}, external_inputs={name}, run_dir=rd.path)
    actor: Any = sup.actors[name]

    async def hold_open(graph: Graph) -> None:
        await actor.ready.wait()
        token = actor.proxy.open_rollout(f"serve-{rd.path.name}")
        base = actor.proxy.base_url
        announce({"openai_base_url": f"{base}/v1", "anthropic_base_url": base, "token": token,
                  "unix_socket": actor.proxy.unix_socket, "run_dir": str(rd.path), "events": str(rd.events)})
        await anyio.sleep_forever()

    try:
        await sup.run(hold_open)
    finally:
        log.close()
    return sup


def call_lines(log_path: Path) -> list[str]:
    """One line per recorded model call (``--replay LOG --calls``)."""
    from pipeline.messages import CallFailed, ModelCall, ids

    out = []
    for ev in EventLogReader(log_path):
        m = ev.msg
        if isinstance(m, ModelCall):
            out.append(
                f"{m.rollout_id:>20s} #{m.seq:<3d} {m.protocol:9s} {m.label:10s} in {len(ids(m.input_ids)):>6d} "
                f"out {len(ids(m.output_ids)):>5d}  {m.finish_reason:10s} spliced {m.spliced_turns} "
                f"rendered {m.rendered_turns}  v{m.versions[0].version if m.versions else '?'}"
            )
        elif isinstance(m, CallFailed):
            out.append(f"{m.rollout_id:>20s} #{m.seq:<3d} FAILED: {m.reason}")
    return out


def summary_text(s: Any) -> str:
    lines = [
        f"event log  {s.path}",
        f"run        {s.run_id}  (experiment {s.experiment}, schema v{s.schema_version})",
        f"events     {s.events}  over {s.span_s:.2f} s",
        f"rollouts   {s.rollouts}   groups {s.groups}   steps {s.steps}"
        + (" after the cold-start SFT" if s.cold_start else "")
        + (f"   policy version {s.last_policy_version}" if s.last_policy_version is not None else ""),
        "statuses   " + (", ".join(f"{k} {v}" for k, v in s.statuses.items()) or "no rollout finished"),
        *(f"  {k:<9}first: {why}" for k, why in s.first_reasons.items()),
        "by type    " + ", ".join(f"{k} {v}" for k, v in s.by_type.items()),
        "by source  " + ", ".join(f"{k} {v}" for k, v in s.by_source.items()),
    ]
    if s.truncated_at is not None:
        lines.append(f"TRUNCATED  {s.problem}")
    return "\n".join(lines)
