"""Learner actor: receives TreeGroups, runs the optimizer off the event loop, publishes weights.

Inbox: TreeGroup and GroupDropped (demonstration packs for the cold start, training groups for RL steps);
EngineReady (the engine servers, for ``weight_sync = "distributed"``). Outputs: ``updates`` (PolicyUpdated: to the
proxy, which loads the weights into the engine unless they were pushed over the weight update group, and to the
scheduler), ``metrics``. When to train and what is a step: :mod:`pipeline.training.loop`; the optimizer:
:mod:`pipeline.training.learner`; whether a step could learn (its counts, and the warning it logs and sends with its
metrics when not): :mod:`pipeline.training.health`. ``PolicyUpdated.step`` is the number of RL steps done (0 for
the push after the cold start).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec
import numpy as np

from pipeline.core.config import NonNegInt, Port, PosFloat, PosInt, RunSection, Section
from pipeline.core.runfiles import SFT_CHECKPOINT, run_tag, safe_name
from pipeline.core.runtime import Actor
from pipeline.messages import (
    EngineReady,
    GroupDropped,
    GroupResample,
    Metric,
    PolicyUpdated,
    TreeGroup,
    ids,
    pack_i32,
    packed_hash,
)
from pipeline.models.small import VOCAB_FILE, load_vocab_table
from pipeline.serving.engine import EngineError
from pipeline.serving.weight_sync import WeightPusher
from pipeline.training import advantages as adv
from pipeline.training.health import assess
from pipeline.training.loop import ColdStartReady, LearnerLoop, Resample, StepReady, sft_plan
from pipeline.training.policy import load_policy
from pipeline.training.ranks import InProcess, Ranks, start_ranks
from pipeline.training.stage import OptimizerSettings, StageSettings


class Announcement(msgspec.Struct):
    """What an RL step announces (its metrics row and update record), kept in its checkpoint."""

    metrics: dict[str, float]
    warnings: list[str]
    batch_hash: str
    groups: list[str]


def _floats(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


class LearnerSettings(Section):
    """``[learner]``. The policy's folder, steps and groups per step are in ``[run]``."""

    # Cold-start SFT on the demonstration packs: passes over all packs, and packs per update.
    sft_epochs: PosInt = 10
    sft_batch_groups: PosInt = 1  # packs per SFT update
    # SFT updates between cold-start checkpoints (checkpoints/sft00040, the latest only; 0: none): a run killed in
    # its cold start resumes from there instead of starting over. Removed once the first RL step is checkpointed.
    sft_checkpoint_every: NonNegInt = 25
    checkpoint_every: NonNegInt = 1  # RL steps between checkpoints (0: only at the end); resume starts from the last
    keep_weights: PosInt = 2  # weight folders kept in runs/<run>/weights
    # CPU threads for the learner's torch ops (0: torch's default, one per core). On a CPU that also runs the
    # engine and the harnesses, idle OpenMP workers spin and take cores from the rollouts: the quickstart uses 1.
    threads: NonNegInt = 0
    # How new weights reach the engine (docs/serving.md, "Weight sync"). "disk": written to runs/<run>/weights, the
    # proxy has the engine load the folder. "distributed": broadcast to the engine servers over a torch.distributed
    # group (nccl on GPUs, gloo on CPUs), nothing written; needs the edge "<proxy>.engines -> <learner>". Whatever
    # fails there (the group's set-up, an update) falls back to "disk" for the rest of the run; checkpoints and the
    # cold start's weights are written in any case.
    weight_sync: Literal["disk", "distributed"] = "disk"
    sync_host: str = "127.0.0.1"  # the address the engine servers reach the learner's rank 0 at
    sync_port: Port = 0  # its rendezvous port (0: a free one)
    sync_backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl when this process has a GPU, else gloo
    # the group's rendezvous, and each broadcast, fail after this; an SGLang server applies an update only once its
    # running requests are done (unless paused), so it must cover the longest generation, as [proxy].update_timeout_s
    sync_timeout_s: PosFloat = 600.0
    # Learner processes. 1: a thread of this process. N > 1: N ranks under Accelerate's launcher, each training its
    # share of a step's groups (whole trees, balanced by tokens), gradients all-reduced (docs/learner.md, "Ranks").
    processes: PosInt = 1
    gpus: str = ""  # CUDA device ids of the ranks ("0,1"); empty: every visible one. Without CUDA: the CPU
    fsdp: bool = False  # shard parameters, gradients and optimizer state over the ranks (Accelerate's FSDP plugin)
    rank_timeout_s: PosFloat = 1800.0  # longest a rank may take for one command (a step, a save) before the run fails
    train: StageSettings = msgspec.field(default_factory=StageSettings)  # the RL stage
    # The SFT stage has its own optimizer (and usually a larger learning rate); RL then starts from the SFT
    # weights with a fresh optimizer, so no SFT momentum leaks into the policy-gradient updates.
    sft: StageSettings = msgspec.field(default_factory=lambda: StageSettings(optimizer=OptimizerSettings(lr=1e-3)))
    reloadable = frozenset({"checkpoint_every", "keep_weights"})

    def check(self, name: str, exp: Any) -> None:
        from pipeline.core.config import ConfigError

        if not exp.run.model:
            raise ConfigError(f"{exp.source}: [run].model: the learner ([{name}]) needs the policy's HF folder")
        if self.weight_sync == "distributed" and not any(
                out == "engines" and dst == name for _, out, dst in exp.graph.parsed_edges()):
            raise ConfigError(f'{exp.source}: [{name}].weight_sync = "distributed" needs the engine servers: add '
                              f'"<proxy>.engines -> {name}" to [graph].edges (docs/serving.md, "Weight sync")')
        if self.processes == 1 and (self.fsdp or self.gpus):
            what = "fsdp = true" if self.fsdp else f'gpus = "{self.gpus}"'
            raise ConfigError(f"{exp.source}: [{name}].{what} applies to learner ranks, and processes = 1 runs the "
                              f"learner in this process: set [{name}].processes to the number of ranks")
        if self.gpus and not re.fullmatch(r"\d+(,\d+)*", self.gpus):
            raise ConfigError(f'{exp.source}: [{name}].gpus = "{self.gpus}": expected CUDA device ids separated by '
                              'commas, e.g. "0,1"')
        if self.gpus and len(self.gpus.split(",")) < self.processes:
            raise ConfigError(f'{exp.source}: [{name}].gpus = "{self.gpus}" names {len(self.gpus.split(","))} '
                              f"device(s) for processes = {self.processes}: one per rank")
        if exp.run.dynamic_sampling:
            if self.train.objective.advantage != "grpo":
                raise ConfigError(f"{exp.source}: [run].dynamic_sampling replaces groups without a reward spread, "
                                  f"which only GRPO leaves without a gradient; [{name}.train.objective].advantage is "
                                  f'"{self.train.objective.advantage}": set dynamic_sampling = 0')
            if not any(src == name and out == "resample" for src, out, _ in exp.graph.parsed_edges()):
                raise ConfigError(f"{exp.source}: [run].dynamic_sampling = {exp.run.dynamic_sampling} asks the "
                                  f'scheduler for replacement groups: add "{name}.resample -> <scheduler>" to '
                                  "[graph].edges")
        if self.weight_sync == "distributed" and self.processes > 1:
            raise ConfigError(f'{exp.source}: [{name}].weight_sync = "distributed" with processes = '
                              f'{self.processes}: the broadcast is sent from this process, which holds no weights '
                              'when the learner runs as ranks; use weight_sync = "disk" with ranks for now')

    def rl_stage(self, run: RunSection) -> StageSettings:
        """``[learner.train]`` with what it leaves to ``[run]``: the decay of a linear/cosine schedule spans every
        optimizer step of the run unless ``total_steps`` is set."""
        t = self.train
        if t.schedule.kind != "constant" and not t.schedule.total_steps:
            t = msgspec.structs.replace(t, schedule=msgspec.structs.replace(
                t.schedule, total_steps=max(1, run.steps * t.epochs * t.minibatches)))
        return t


class LearnerActor(Actor[LearnerSettings]):
    Config = LearnerSettings
    outputs = ("updates", "metrics", "resample")
    learner: InProcess | Ranks | None = None
    loop: LearnerLoop | None = None
    pusher: WeightPusher | None = None  # set while weight sync without the disk works

    async def run(self) -> None:
        try:
            async with self._learner() as learner:
                await self._run(learner)
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_pushing()

    @contextlib.asynccontextmanager
    async def _learner(self) -> AsyncIterator[InProcess | Ranks]:
        """This process (``processes = 1``) or N ranks, started now so they are up by the first batch."""
        c = self.config
        assert self.run_dir is not None
        if c.processes == 1:
            yield InProcess()
            return
        # The socket's folder is named by run and actor, like the proxy's: a restart removes what a crash left.
        prefix = f"bridle.sock-{run_tag(self.run_dir)}_{safe_name(self.name, 16)}_"
        async with start_ranks(c.processes, log_path=self.run_dir / "learner_ranks.log", gpus=c.gpus, fsdp=c.fsdp,
                               threads=c.threads, timeout_s=c.rank_timeout_s, socket_prefix=prefix,
                               run=run_tag(self.run_dir)) as ranks:
            yield ranks

    async def _run(self, learner: InProcess | Ranks) -> None:
        c, run = self.config, self.ctx.run
        self.model_dir = Path(run.model)
        self.learner = learner
        if c.threads and c.processes == 1:
            import torch  # process-wide; the learner is this process's only torch user

            torch.set_num_threads(c.threads)
        self.vocab = load_vocab_table(self.model_dir)
        if self.resume is not None:
            loop = self.loop = await self._resumed(learner)
        else:
            loop = LearnerLoop(run.steps, run.groups_per_step, c.checkpoint_every,
                               dynamic_sampling=run.dynamic_sampling)
            # Weights load now, while the first rollouts run (ranks load their own); the optimizer is chosen by
            # the first message: a demonstration pack (they all come before any training group) starts SFT.
            policy = (await anyio.to_thread.run_sync(load_policy, self.model_dir, c.train) if c.processes == 1
                      else str(self.model_dir))
        self.loop = loop
        self.log.info("learner ready", model=str(self.model_dir), reduced_vocab=self.vocab is not None,
                      processes=c.processes)
        if loop.finished:
            return
        started = self.resume is not None
        async for msg in self.messages():
            if isinstance(msg, EngineReady):
                await self._join(msg)
            if not isinstance(msg, (TreeGroup, GroupDropped)):
                continue
            if not started:
                started = True
                stage = c.sft if msg.purpose == "sft" else c.rl_stage(run)
                await learner.init(policy, stage, model_path=self.model_dir)
                del policy  # the Learner holds it now
            if isinstance(msg, GroupDropped) and msg.purpose == "sft":
                self.log.warning("demonstration pack dropped", group=msg.group_id, reason=msg.reason)
            todo = loop.receive(self._compact(msg), version=learner.version,
                                max_staleness=self.ctx.run.max_staleness, spread=self._spread(msg))
            if isinstance(todo, Resample):
                self.log.info("no reward spread: group replaced", group=todo.group.group_id, resample=todo.next)
                await self.send("resample", GroupResample(group_id=todo.group.group_id, resample=todo.next))
            elif isinstance(todo, ColdStartReady):
                await self._cold_start(todo)
                if loop.finished:
                    return  # a cold-start-only run ([run].steps = 0)
            elif isinstance(todo, StepReady):
                await self._rl_step(todo)
                if todo.last:
                    return
        self.log.warning("inputs ended before the last step", steps_done=loop.steps_done, steps=run.steps)

    async def _resumed(self, learner: InProcess | Ranks) -> LearnerLoop:
        """Continue from the resume's checkpoint: an RL step's, or (killed in the cold start) an SFT checkpoint's."""
        c, run, res = self.config, self.ctx.run, self.resume
        assert res is not None
        loop = LearnerLoop.resumed(run.steps, run.groups_per_step, c.checkpoint_every, res.steps_done,
                                   run.dynamic_sampling)
        if res.sft_updates is not None:
            # The model and optimizer from the SFT checkpoint, the packs from the event log; the rest of the plan
            # runs now (the scheduler sends no demonstrations again) and publishes the SFT weights, then RL as usual.
            self.loop = loop
            await learner.init(str(self.model_dir), c.sft)
            await learner.load_checkpoint(res.checkpoint)
            packs = [self._compact(g) for g in res.sft_packs if isinstance(g, TreeGroup)]
            self.log.info("resumed in the cold start", checkpoint=str(res.checkpoint), sft_updates_done=res.sft_updates,
                          packs=len(packs))
            await self._cold_start(ColdStartReady(packs, len(res.sft_packs) - len(packs)), done=res.sft_updates)
            return loop
        # Model, optimizer, schedule, RNG, step and version from the checkpoint; the engine gets the weights at
        # once (an update that trains nothing: empty batch hash). Groups of unfinished steps are re-issued.
        await learner.init(str(self.model_dir), c.rl_stage(run))
        extra = await learner.load_checkpoint(res.checkpoint)
        self.log.info("resumed", checkpoint=str(res.checkpoint), steps_done=loop.steps_done)
        await self._announce_resumed(loop.steps_done, extra.get("announce"))
        return loop

    def _spread(self, g: TreeGroup | GroupDropped) -> bool:
        """Whether a training group's rewards differ over the rollouts the RL stage scores (dynamic sampling)."""
        if not isinstance(g, TreeGroup) or g.purpose != "train":
            return True
        statuses = self.config.rl_stage(self.ctx.run).objective.train_statuses
        return adv.reward_spread(np.array([r.reward for r in g.rollouts]), adv.rollout_valid(g.rollouts, statuses))

    def _compact(self, g: TreeGroup | GroupDropped) -> TreeGroup | GroupDropped:
        """Reduced-vocabulary models train on compact ids (the same rows the engine sampled from)."""
        if self.vocab is None or isinstance(g, GroupDropped):
            return g
        packed = msgspec.structs.replace(g.packed, tokens=pack_i32(self.vocab.to_compact(ids(g.packed.tokens))))
        return msgspec.structs.replace(g, packed=packed)

    async def _cold_start(self, ready: ColdStartReady, done: int = 0) -> None:
        """SFT on the demonstration packs, then the SFT weights published; ``done``: updates an SFT checkpoint
        already holds (a resumed cold start continues the same plan after them)."""
        c = self.config
        groups = ready.packs
        demos = sum(len(g.rollouts) for g in groups)
        self.log.info("cold-start SFT", packs=len(groups), dropped_packs=ready.dropped, demos=demos,
                      epochs=c.sft_epochs)
        plan = sft_plan(groups, epochs=c.sft_epochs, batch_groups=c.sft_batch_groups, seed=c.train.seed)
        if c.processes > 1 and max((len(u.packs) for u in plan), default=0) < c.processes:
            # each pack goes whole to one rank: with fewer packs per update than ranks, some ranks wait
            self.log.warning("SFT updates hold fewer packs than learner ranks; some ranks idle in the cold start",
                             packs_per_update=c.sft_batch_groups, ranks=c.processes,
                             fix=f"[{self.name}].sft_batch_groups >= {c.processes}")
        if done > len(plan):
            raise ValueError(f"{self.resume and self.resume.checkpoint}: the checkpoint holds {done} SFT updates, but "
                             f"the cold start's plan has {len(plan)} ([{self.name}].sft_epochs or sft_batch_groups "
                             "changed since); resume with the run's own settings")
        for i, update in enumerate(plan[done:], start=done + 1):
            m = await self.learner.sft_step(update.packs)
            # sft_update: this update's number (after a resume, the updates past the checkpoint are done again and
            # their rows written again: the later row counts); sft_updates: the plan's length, for the monitor
            await self._metric(0, {**m, "sft_epoch": update.epoch, "sft_update": i, "sft_updates": len(plan)},
                               phase="sft")
            if c.sft_checkpoint_every and i % c.sft_checkpoint_every == 0 and i < len(plan):
                await self._sft_checkpoint(i)
        path = await self._publish(0, {"sft_demos": demos}, groups, save=True)  # RL starts from this folder
        assert path is not None
        cfg = msgspec.structs.replace(c.rl_stage(self.ctx.run), initial_version=self.learner.version)
        await self.learner.init(str(path), cfg)

    async def _rl_step(self, ready: StepReady) -> None:
        for gid, lag in ready.stale:
            self.log.warning("stale group dropped", group=gid, lag=lag)
        stage = self.config.rl_stage(self.ctx.run)
        health = assess(ready.step, ready.batch, ready.untrained, stage.objective.train_statuses,
                        resampled=ready.resampled if self.ctx.run.dynamic_sampling else None)
        warning = health.warning(stage.objective.advantage)
        if warning is not None:
            self.log.warning(warning, step=ready.step, cause=health.cause)
        warnings = [warning] if warning is not None else []
        if not ready.batch:
            if ready.checkpoint:
                await self._checkpoint(ready.step, Announcement(_floats(health.values()), warnings, packed_hash([]),
                                                                []))
            # the step happened: it is in metrics.jsonl with its counts, and nothing trained (no reward, no loss)
            await self._metric(ready.step, health.values(), phase="rl", warnings=warnings)
            await self.send("updates", PolicyUpdated(version=self.learner.version, step=ready.step,
                                                     batch_hash=packed_hash([])))
            await self._keep_final(ready.step)
            return
        rewards = [r.reward for g in ready.batch for r in g.rollouts]
        m = await self.learner.train_step(ready.batch)
        m.update({"reward": float(np.mean(rewards)), "pass_rate": float(np.mean([r >= 1.0 for r in rewards])),
                  **health.values()})
        if ready.checkpoint:
            await self._checkpoint(ready.step, Announcement(_floats(m), warnings, packed_hash(ready.batch),
                                                            [g.group_id for g in ready.batch]))
        await self._metric(ready.step, m, phase="rl", warnings=warnings)
        await self._publish(ready.step, m, ready.batch)
        await self._keep_final(ready.step)

    async def _keep_final(self, step: int) -> None:
        """After the last step the final policy is a folder of ``weights/`` (what ``--eval --checkpoint`` reads),
        also when its update was pushed without the disk."""
        assert self.run_dir is not None
        path = self.run_dir / "weights" / f"v{self.learner.version:05d}"
        if step < self.ctx.run.steps or path.is_dir():
            return
        await self._write_weights(path)
        self.log.info("final policy written", path=str(path), version=self.learner.version)

    async def _announce_resumed(self, step: int, saved: dict[str, Any] | None) -> None:
        """After a resume: the engine gets the checkpoint's weights. When a kill came between the checkpoint of
        ``step`` and its announcement, the event log lacks the step's metrics row and update record; they are
        written now from what the checkpoint saved (its ``announce``), so the log, ``metrics.jsonl`` and the
        checkpoints agree. Otherwise the weights are announced as an update that trained nothing."""
        assert self.resume is not None
        if saved is None or self.resume.announced or step == 0:
            await self._publish(step, {}, None)
            return
        a = msgspec.convert(saved, Announcement)
        self.log.warning("the last checkpoint's step was never announced (killed in between): its metrics row and "
                         "update record are written now", step=step)
        if not self.resume.metrics_recorded:
            await self._metric(step, a.metrics, phase="rl", warnings=a.warnings)
        await self._publish(step, a.metrics, None, recorded=(a.batch_hash, a.groups))

    async def _publish(self, step: int, metrics: dict[str, Any], batch: list[TreeGroup] | None, *,
                       save: bool = False, recorded: tuple[str, list[str]] | None = None) -> Path | None:
        """Push the weights to the engine servers (weight sync without the disk), or save them, and announce them;
        ``batch``: what this update trained on (None: no update, a resume); ``save``: write them in any case.
        Returns the folder written, None when pushed."""
        assert self.run_dir is not None
        version = self.learner.version
        batch_hash, groups = recorded or ("" if batch is None else packed_hash(batch), [g.group_id for g in batch or []])
        announce = partial(
            PolicyUpdated, version=version, step=step, batch_hash=batch_hash, groups=groups,
            metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        if self.pusher is not None and not save and await self._push(version, step):
            await self.send("updates", announce(pushed=True))
            return None
        path = self.run_dir / "weights" / f"v{version:05d}"
        await self._write_weights(path)
        await self.send("updates", announce(weights_path=str(path)))
        return path

    async def _write_weights(self, path: Path) -> None:
        await self.learner.save_weights(path, self.learner.version)
        if self.vocab is not None:
            shutil.copy2(self.model_dir / VOCAB_FILE, path / VOCAB_FILE)
        self._prune()

    async def _join(self, msg: EngineReady) -> None:
        """Set up the weight update group with the workers ``msg`` names; on failure, stay on the disk path."""
        c = self.config
        if c.weight_sync != "distributed" or self.pusher is not None:
            return
        if not msg.servers:
            self.log.warning("weight sync: the engine takes weights only from disk; using the disk path")
            return
        backend = c.sync_backend
        if backend == "auto":
            import torch

            backend = "nccl" if torch.cuda.is_available() else "gloo"
        pusher = WeightPusher(msg.servers, host=c.sync_host, port=c.sync_port, backend=backend,
                              timeout_s=c.sync_timeout_s)
        try:
            with anyio.fail_after(c.sync_timeout_s + 60):
                await pusher.join()
        except (EngineError, TimeoutError) as e:
            self.log.error("weight sync: the weight update group could not be set up; using the disk path",
                           servers=msg.servers, backend=backend, error=str(e) or type(e).__name__)
            with anyio.CancelScope(shield=True):
                await pusher.close()
            return
        self.pusher = pusher
        self.log.info("weight sync: updates go to the engine servers over the weight update group",
                      servers=msg.servers, backend=backend)

    async def _push(self, version: int, step: int) -> bool:
        """Broadcast the weights to every worker; False (logged, and the group given up) when that failed."""
        assert self.pusher is not None
        t0 = anyio.current_time()
        try:
            tensors = await self.learner.policy_state()
            # Shielded, as the proxy's disk update is: a stop mid-push must not leave the workers on different
            # versions. Bounded: the broadcast's own timeout, plus the HTTP calls around it.
            with anyio.CancelScope(shield=True), anyio.fail_after(self.config.sync_timeout_s + 60):
                await self.pusher.push(tensors, version)
        except (EngineError, TimeoutError) as e:
            self.log.error("weight sync: the update over the weight update group failed; it goes through the disk "
                           "now, and so do the later ones", version=version, error=str(e) or type(e).__name__)
            with anyio.CancelScope(shield=True):
                await self._stop_pushing()
            return False
        dt = anyio.current_time() - t0
        self.log.info("engine weights pushed", version=version, seconds=round(dt, 3))
        if self.out["metrics"].connected:
            await self.send("metrics", Metric(source=self.name, kind="weight_sync", step=step,
                                              values={"weight_update_s": dt, "policy_version": version}))
        return True

    async def _stop_pushing(self) -> None:
        pusher, self.pusher = self.pusher, None
        if pusher is not None:
            with anyio.move_on_after(60):
                await pusher.close()

    def _prune(self) -> None:
        assert self.run_dir is not None
        dirs = sorted((self.run_dir / "weights").glob("v*"))
        for d in dirs[: max(0, len(dirs) - self.config.keep_weights)]:
            shutil.rmtree(d, ignore_errors=True)

    async def _checkpoint(self, step: int, announce: Announcement | None = None) -> None:
        """Save the learner; ``announce``: what the step is about to announce, so a resume after a kill before the
        announcement can still write it (:meth:`_announce_resumed`)."""
        assert self.run_dir is not None
        path = self.run_dir / "checkpoints" / f"step{step:05d}"
        extra: dict[str, Any] = {"steps_done": step}
        if announce is not None:
            extra["announce"] = msgspec.to_builtins(announce)
        await self.learner.save_checkpoint(path, extra)
        self.log.info("checkpoint saved", path=str(path))
        self._remove_sft_checkpoints()  # a resume now starts from an RL step

    async def _sft_checkpoint(self, updates: int) -> None:
        """The cold start after ``updates`` SFT updates (the latest one only is kept)."""
        assert self.run_dir is not None
        path = self.run_dir / "checkpoints" / f"{SFT_CHECKPOINT}{updates:05d}"
        await self.learner.save_checkpoint(path, {"steps_done": 0, "sft_updates": updates})
        self._remove_sft_checkpoints(keep=path)
        self.log.info("cold-start checkpoint saved", path=str(path), sft_updates=updates)

    def _remove_sft_checkpoints(self, keep: Path | None = None) -> None:
        assert self.run_dir is not None
        for old in (self.run_dir / "checkpoints").glob(f"{SFT_CHECKPOINT}*"):
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    async def _metric(self, step: int, values: dict[str, Any], phase: str,
                      warnings: list[str] | None = None) -> None:
        if self.out["metrics"].connected:
            v = {k: float(x) for k, x in values.items() if isinstance(x, (int, float))}
            kind = "rl_step" if phase == "rl" else "sft_update"
            await self.send("metrics", Metric(source=f"{self.name}.{phase}", kind=kind, step=step, values=v,
                                              warnings=warnings or []))

    async def on_config(self, new: LearnerSettings, changes: dict[str, Any]) -> None:
        self.config = new
        if self.loop is not None and "checkpoint_every" in changes:
            self.loop.checkpoint_every = new.checkpoint_every
