"""Learner actor: batches TreeGroups, runs the optimizer off the event loop, publishes weights.

Inbox: TreeGroup (purpose "sft" fills the cold-start buffer, "train" the RL batch), GroupDropped (counts toward
the step it was issued for, so a dropped group never stalls the run). Outputs: ``updates`` (PolicyUpdated: to the
proxy, which loads the weights into the engine, and to the scheduler), ``metrics``.

Steps are counted in groups *received* (trained or dropped): every ``groups_per_step`` of them make one step, so
the scheduler's staleness bound (which counts issued groups) and the learner always agree on step numbers.
``PolicyUpdated.step`` is the number of RL steps done (0 for the push after cold-start SFT).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np

from pipeline.core.config import Section
from pipeline.core.runtime import Actor
from pipeline.messages import GroupDropped, Metric, PolicyUpdated, TreeGroup, ids, pack_i32, packed_hash
from pipeline.models.small import VOCAB_FILE, load_vocab_table
from pipeline.training.learner import Learner, LearnerConfig


class LearnerActorConfig(Section):
    model: str = ""  # HF folder of the initial policy (the same the engine serves)
    groups_per_step: int = 2  # must equal [scheduler].groups_per_step
    steps: int = 10  # RL steps; the actor returns after the last one (use [graph].stop_after = ["learner"])
    max_staleness: int = 1  # groups older than this many steps are dropped (a backstop: the scheduler bounds it)
    # Cold-start SFT: wait for this many demonstration packs (TreeGroups or drops named "sftpack…", each
    # [tree].sft_pack rollouts: [scheduler].sft_groups x sft_group_size = sft_packs x [tree].sft_pack), then train.
    sft_packs: int = 0
    sft_epochs: int = 10
    sft_batch_groups: int = 1  # demonstration packs ([tree].sft_pack rollouts each) per SFT update
    checkpoint_every: int = 1  # RL steps between checkpoints (0: only at the end); resume starts from the last
    keep_weights: int = 2  # weight folders kept in runs/<run>/weights
    # CPU threads for the learner's torch ops (0: torch's default, one per core). On a CPU that also runs the
    # engine and the harnesses, idle OpenMP workers spin and take cores from the rollouts: the quickstart uses 1.
    threads: int = 0
    train: LearnerConfig = msgspec.field(default_factory=LearnerConfig)  # the RL stage
    # The SFT stage has its own optimizer (and usually a larger learning rate); RL then starts from the SFT
    # weights with a fresh optimizer, so no SFT momentum leaks into the policy-gradient updates.
    sft: LearnerConfig = msgspec.field(default_factory=lambda: LearnerConfig(lr=1e-3))
    reloadable = frozenset({"checkpoint_every", "keep_weights", "max_staleness"})


class LearnerActor(Actor[LearnerActorConfig]):
    Config = LearnerActorConfig
    outputs = ("updates", "metrics")

    async def run(self) -> None:
        c = self.config
        if not c.model:
            raise ValueError("[learner].model: give the HF folder of the initial policy")
        assert self.run_dir is not None
        self.model_dir = Path(c.model)
        if c.threads:
            import torch  # process-wide; the learner is this process's only torch user

            torch.set_num_threads(c.threads)
        self.vocab = load_vocab_table(self.model_dir)
        self.steps_done = 0
        received = 0
        batch: list[TreeGroup] = []
        sft: list[TreeGroup] = []
        sft_done = c.sft_packs == 0
        packs_seen = 0
        if self.resume is not None:
            # Model, optimizer, schedule, RNG, step and version from the checkpoint; the engine gets the weights
            # at once (an update that trains nothing: empty batch hash). Groups of unfinished steps are re-issued.
            self.learner = await anyio.to_thread.run_sync(Learner, str(self.model_dir), c.train)
            await anyio.to_thread.run_sync(self.learner.load_checkpoint, self.resume.checkpoint)
            self.steps_done = self.resume.steps_done
            received = self.steps_done * c.groups_per_step
            sft_done = True
            self.log.info("resumed", checkpoint=str(self.resume.checkpoint), steps_done=self.steps_done)
            await self._publish({}, "")
            if self.steps_done >= c.steps:
                return
        else:
            first = c.sft if c.sft_packs else c.train
            self.learner = await anyio.to_thread.run_sync(Learner, str(self.model_dir), first)
        self.log.info("learner ready", model=str(self.model_dir), reduced_vocab=self.vocab is not None)
        async for msg in self.messages():
            is_pack = msg.group_id.startswith("sftpack") if isinstance(msg, (TreeGroup, GroupDropped)) else False
            if is_pack:
                packs_seen += 1
                if isinstance(msg, TreeGroup):
                    sft.append(self._compact(msg))
                else:
                    self.log.warning("demonstration pack dropped", group=msg.group_id, reason=msg.reason)
                if packs_seen >= c.sft_packs and not sft_done:
                    await self._cold_start(sft)
                    sft_done = True
                continue
            if not isinstance(msg, (TreeGroup, GroupDropped)):
                continue
            received += 1
            if isinstance(msg, TreeGroup):
                lag = self.learner.version - msg.issued_version  # one version per RL step
                if lag > c.max_staleness:
                    self.log.warning("stale group dropped", group=msg.group_id, lag=lag)
                else:
                    batch.append(self._compact(msg))
            if received % c.groups_per_step == 0:
                await self._rl_step(batch)
                batch = []
                if self.steps_done >= c.steps:
                    return
        self.log.warning("inputs ended before the last step", steps_done=self.steps_done, steps=c.steps)

    def _compact(self, g: TreeGroup) -> TreeGroup:
        """Reduced-vocabulary models train on compact ids (the same rows the engine sampled from)."""
        if self.vocab is None:
            return g
        packed = msgspec.structs.replace(g.packed, tokens=pack_i32(self.vocab.to_compact(ids(g.packed.tokens))))
        return msgspec.structs.replace(g, packed=packed)

    async def _cold_start(self, groups: list[TreeGroup]) -> None:
        c = self.config
        rng = random.Random(c.train.seed)
        self.log.info("cold-start SFT", packs=len(groups), demos=sum(len(g.rollouts) for g in groups),
                      epochs=c.sft_epochs)
        updates = c.sft_epochs * -(-len(groups) // c.sft_batch_groups)  # ceil: the plan, for the monitor's progress
        for epoch in range(c.sft_epochs):
            order = list(groups)
            rng.shuffle(order)
            for i in range(0, len(order), c.sft_batch_groups):
                m = await anyio.to_thread.run_sync(self.learner.sft_step, order[i:i + c.sft_batch_groups],
                                                abandon_on_cancel=True)
                await self._metric({**m, "sft_epoch": epoch, "sft_updates": updates}, phase="sft")
        path = await self._publish({"sft_demos": sum(len(g.rollouts) for g in groups)}, packed_hash(groups))
        version = self.learner.version
        cfg = msgspec.structs.replace(self.config.train, initial_version=version)
        self.learner = await anyio.to_thread.run_sync(Learner, str(path), cfg)

    async def _rl_step(self, batch: list[TreeGroup]) -> None:
        self.steps_done += 1
        every = self.config.checkpoint_every
        # Checkpoint before the update is announced: a step the log shows as done is always in a checkpoint, so
        # --resume after kill -9 neither repeats nor skips one.
        checkpoint = self.steps_done >= self.config.steps or (every and self.steps_done % every == 0)
        if not batch:
            self.log.warning("no trainable group in this step; the policy is unchanged", step=self.steps_done)
            if checkpoint:
                await self._checkpoint()
            await self.send("updates", PolicyUpdated(version=self.learner.version, step=self.steps_done,
                                                     batch_hash=packed_hash([])))
            return
        rewards = [r.reward for g in batch for r in g.rollouts]
        # abandon_on_cancel: Ctrl-C must not wait for a long step; the step's result is simply never published
        m = await anyio.to_thread.run_sync(self.learner.train_step, batch, abandon_on_cancel=True)
        m.update({"reward": float(np.mean(rewards)), "pass_rate": float(np.mean([r >= 1.0 for r in rewards])),
                  "groups": len(batch)})
        if checkpoint:
            await self._checkpoint()
        await self._metric(m, phase="rl")
        await self._publish(m, packed_hash(batch))

    async def _publish(self, metrics: dict[str, Any], batch_hash: str) -> Path:
        assert self.run_dir is not None
        version = self.learner.version
        path = self.run_dir / "weights" / f"v{version:05d}"
        await anyio.to_thread.run_sync(self.learner.save_weights, path, version)
        if self.vocab is not None:
            shutil.copy2(self.model_dir / VOCAB_FILE, path / VOCAB_FILE)
        self._prune()
        await self.send("updates", PolicyUpdated(
            version=version, step=self.steps_done, weights_path=str(path), batch_hash=batch_hash,
            metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}))
        return path

    def _prune(self) -> None:
        assert self.run_dir is not None
        dirs = sorted((self.run_dir / "weights").glob("v*"))
        for d in dirs[: max(0, len(dirs) - self.config.keep_weights)]:
            shutil.rmtree(d, ignore_errors=True)

    async def _checkpoint(self) -> None:
        assert self.run_dir is not None
        path = self.run_dir / "checkpoints" / f"step{self.steps_done:05d}"
        await anyio.to_thread.run_sync(self.learner.save_checkpoint, path, {"steps_done": self.steps_done})
        self.log.info("checkpoint saved", path=str(path))

    async def _metric(self, values: dict[str, Any], phase: str) -> None:
        if self.out["metrics"].connected:
            v = {k: float(x) for k, x in values.items() if isinstance(x, (int, float))}
            kind = "rl_step" if phase == "rl" else "sft_update"
            await self.send("metrics", Metric(source=f"{self.name}.{phase}", kind=kind, step=self.steps_done,
                                              values=v))
