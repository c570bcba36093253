"""Scheduler actor: turns tasks and the harness assignment into RolloutRequests (decisions: pipeline.rollout.scheduling).

Inbox: RolloutFinished (frees in-flight slots), PolicyUpdated (the learner's version), GroupResample (dynamic
sampling: a group to replace). Outputs: ``requests`` (to the proxy, which registers the token and forwards them to
the sandbox pool), ``recorded`` (the demonstrations ``sft_recordings`` keeps, to the tree builder: they were rolled
out and verified before, in the run that recorded them), ``metrics``. With ``[run].dynamic_sampling`` it keeps listening after its last group: the learner
may still ask for replacements until the run stops.
"""

from __future__ import annotations

import anyio

from pipeline.core.config import RunSection
from pipeline.core.recordings import select_demonstrations, with_total
from pipeline.core.runtime import Actor
from pipeline.messages import GroupResample, Metric, PolicyUpdated, RolloutFinished
from pipeline.rollout.scheduling import Issuer, Planner, SchedulerSettings, load_tasks, rollout_requests


class Scheduler(Actor[SchedulerSettings]):
    Config = SchedulerSettings
    outputs = ("requests", "recorded", "metrics")
    issuer: Issuer | None = None  # built in run(), once the tasks are generated

    async def run(self) -> None:
        c, run = self.config, self.ctx.run
        assert self.run_dir is not None, "the scheduler needs a run directory for its tasks"
        tasks = load_tasks(c.tasks, self.run_dir)
        planner = Planner(tasks, c.mode, c.harness, c.harnesses, c.k, run.groups_per_step, c.seed, c.space,
                          assignment=c.assignment, space_seed=c.space_seed)
        sft_planner = planner
        if c.sft_tasks is not None and c.sft_groups:
            sft_tasks = load_tasks(c.sft_tasks, self.run_dir, "sft_tasks")
            sft_planner = Planner(sft_tasks, "mix" if c.mode == "mix" else "single", c.harness, c.harnesses, c.k,
                                  run.groups_per_step, c.seed)
        recorded = []
        if c.sft_recordings is not None and self.resume is None:  # a resumed run's cold start has its demonstrations
            sel = await anyio.to_thread.run_sync(select_demonstrations, c.sft_recordings)
            recorded = sel.rollouts
            self.log.info("recorded demonstrations", logs=c.sft_recordings.logs, rollouts=sel.seen,
                          kept=len(recorded), left_out=dict(sel.left_out))
            if not recorded:
                raise ValueError(f"[{self.name}].sft_recordings: none of the {sel.seen} recorded rollouts is kept "
                                 f"({', '.join(f'{k}: {v}' for k, v in sel.left_out.items()) or 'no rollouts'}); "
                                 "lower min_reward, set unverified = true for a --serve recording, or name other logs")
        issuer = self.issuer = Issuer(planner, sft_planner, c, steps=run.steps, groups_per_step=run.groups_per_step,
                                      recorded=len(recorded))
        if self.resume is not None:
            issuer.resume(self.resume.steps_done, self.resume.attempt)
            self.log.info("resumed", steps_done=self.resume.steps_done, next_group=issuer.train_issued,
                          attempt=self.resume.attempt)
        self.log.info("scheduler ready", tasks=len(tasks), sft_tasks=len(sft_planner.tasks), mode=c.mode,
                      groups=issuer.total, sft_groups=c.sft_groups)
        await self._issue()
        for demo in with_total(recorded, issuer.demonstrations):
            await self.send("recorded", demo)
        if issuer.done and not run.dynamic_sampling:
            return
        async for msg in self.messages():
            if isinstance(msg, RolloutFinished):
                issuer.finished(msg.group_id)
            elif isinstance(msg, PolicyUpdated):
                issuer.updated(msg.version, msg.step)
            elif isinstance(msg, GroupResample) and not issuer.resample(msg.group_id, msg.resample):
                self.log.warning("resample of a group this run did not issue; ignored", group=msg.group_id)
            await self._issue()
            if issuer.done and not self.ctx.run.dynamic_sampling:
                return

    async def _issue(self) -> None:
        assert self.issuer is not None
        for issue in self.issuer.next(self.ctx.run.max_staleness):
            for req in rollout_requests(issue, self.config, self.issuer.version):
                await self.send("requests", req)
        if self.out["metrics"].connected:
            await self.send("metrics", Metric(source=self.name, kind="scheduler", values={
                **self.issuer.metrics(), "steps_total": self.issuer.steps,
                # the display counts the demonstrations the sandboxes play; recorded ones are sent at once
                "demonstrations_total": 0 if self.resume else self.issuer.demonstrations - self.issuer.recorded,
                "demonstrations_recorded": self.issuer.recorded}))

    async def on_config(self, new: SchedulerSettings, changes: dict[str, object]) -> None:
        self.config = new
        if self.issuer is not None:
            self.issuer.settings = new  # sampling, timeout and the in-flight bound apply from the next issue on
            await self._issue()  # a raised bound lets more groups out at once, not at the next message

    async def on_run_config(self, new: RunSection, changes: dict[str, object]) -> None:
        if self.issuer is not None:
            await self._issue()  # a raised max_staleness lets waiting groups out at once
