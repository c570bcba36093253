"""Scheduler actor: turns tasks and the harness assignment into RolloutRequests, bounded by staleness.

Inbox: RolloutFinished (frees in-flight slots), PolicyUpdated (the learner's version). Outputs: ``requests``
(to the proxy, which registers the token and forwards them to the sandbox pool), ``metrics``.
Optional warm-up: ``sft_groups`` groups of oracle demonstrations (scripted through the same harness, proxy and
trees) are issued first; training groups wait for the learner's first update after them.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec

from pipeline.core.config import Section
from pipeline.core.runtime import Actor
from pipeline.messages import Metric, PolicyUpdated, RolloutFinished, RolloutRequest, SamplingParams
from pipeline.rollout.scheduling import Assignment, Planner, TaskSource, load_tasks, may_issue, oracle_script


class SchedulerConfig(Section):
    tasks: TaskSource = msgspec.field(default_factory=TaskSource)
    # Tasks of the demonstrations. Unset: they are the first sft_groups of the training stream. Set: a separate
    # set, so training can cycle over a small fixed pool the demonstrations never showed (quickstart).
    sft_tasks: TaskSource | None = None
    mode: Literal["single", "mix", "scaling"] = "single"
    harness: str = "whitebox:S0T0O0C0W0"
    harnesses: list[str] = msgspec.field(default_factory=list)  # mix mode
    k: int = 2  # scaling mode: harnesses per task, over K successive steps
    group_size: int = 4
    groups_per_step: int = 2  # must equal [learner].groups_per_step
    steps: int = 10
    max_staleness: int = 1
    max_groups_in_flight: int = 4
    sft_groups: int = 0  # oracle demonstration groups before training (cold-start SFT)
    sft_group_size: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    timeout_s: float = 300.0
    seed: int = 0
    reloadable = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "timeout_s", "max_staleness",
                            "max_groups_in_flight"})


class Scheduler(Actor[SchedulerConfig]):
    Config = SchedulerConfig
    outputs = ("requests", "metrics")

    async def run(self) -> None:
        c = self.config
        assert self.run_dir is not None, "the scheduler needs a run directory for its tasks"
        tasks = load_tasks(c.tasks, self.run_dir)
        self.planner = Planner(tasks, c.mode, c.harness, c.harnesses, c.k, c.groups_per_step, c.seed)
        self.sft_planner = self.planner
        if c.sft_tasks is not None and c.sft_groups:
            sft_tasks = load_tasks(c.sft_tasks, self.run_dir, "sft_tasks")
            self.sft_planner = Planner(sft_tasks, "single", c.harness, [], c.k, c.groups_per_step, c.seed)
        self.version = 0
        self.steps_done = 0  # RL steps the learner finished (PolicyUpdated.step)
        self.warm = c.sft_groups == 0  # training waits for the update after the demonstrations
        self.sft_issued = 0
        self.train_issued = 0
        self.total = c.steps * c.groups_per_step
        self.in_flight: dict[str, int] = {}  # group -> rollouts not finished
        self.issued_at: dict[str, int] = {}
        self._pending: list[Assignment] = []
        if self.resume is not None:
            # Continue with the groups of the first unfinished step; replaying the planner keeps its task order.
            self.steps_done = self.resume.steps_done
            self.train_issued = min(self.total, self.steps_done * c.groups_per_step)
            self.sft_issued = c.sft_groups
            self.warm = False  # wait for the learner's resumed weights to reach the engine
            if self.sft_planner is self.planner:
                for _ in range(c.sft_groups):
                    self.planner.next_task()
            for s in range(self.steps_done):
                self.planner.step(s)
            self.log.info("resumed", steps_done=self.steps_done, next_group=self.train_issued)
        self.log.info("scheduler ready", tasks=len(tasks), sft_tasks=len(self.sft_planner.tasks), mode=c.mode,
                      groups=self.total, sft_groups=c.sft_groups)
        await self._issue()
        if self._done():
            return
        async for msg in self.messages():
            if isinstance(msg, RolloutFinished):
                left = self.in_flight.get(msg.group_id)
                if left is not None:
                    if left <= 1:
                        del self.in_flight[msg.group_id]
                    else:
                        self.in_flight[msg.group_id] = left - 1
            elif isinstance(msg, PolicyUpdated):
                self.version = max(self.version, msg.version)
                self.steps_done = max(self.steps_done, msg.step)
                self.warm = True
            await self._issue()
            if self._done():
                return

    def _done(self) -> bool:
        return self.train_issued >= self.total and self.sft_issued >= self.config.sft_groups

    def _sampling(self) -> SamplingParams:
        c = self.config
        return SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=c.max_new_tokens, seed=None)

    async def _issue(self) -> None:
        c = self.config
        while len(self.in_flight) < c.max_groups_in_flight:
            if self.sft_issued < c.sft_groups:
                a = Assignment(self.sft_planner.next_task(), c.harness, -1)
                await self._send_group(f"sft{self.sft_issued:04d}", a, "sft", c.sft_group_size)
                self.sft_issued += 1
                continue
            if self.train_issued >= self.total or not self.warm:
                break
            j = self.train_issued
            if not may_issue(j, self.steps_done, c.groups_per_step, c.max_staleness):
                break
            if not self._pending:
                self._pending = self.planner.step(j // c.groups_per_step)
            await self._send_group(f"g{j:05d}", self._pending.pop(0), "train", c.group_size)
            self.train_issued += 1
        if self.out["metrics"].connected:
            await self.send("metrics", Metric(source=self.name, kind="scheduler", values={
                "groups_in_flight": len(self.in_flight), "groups_issued": self.train_issued,
                "sft_groups_issued": self.sft_issued, "policy_version": self.version,
                "learner_steps": self.steps_done, "steps_total": c.steps,
                "demonstrations_total": 0 if self.resume else c.sft_groups * c.sft_group_size}))

    async def _send_group(self, gid: str, a: Assignment, purpose: Any, size: int) -> None:
        script = oracle_script(a.task, a.harness) if purpose == "sft" else []
        self.in_flight[gid] = size
        self.issued_at[gid] = self.version
        for i in range(size):
            await self.send("requests", RolloutRequest(
                rollout_id=f"{gid}-r{i}", group_id=gid, index=i, group_size=size, task_id=a.task.id,
                harness=a.harness, token="bridle-" + secrets.token_urlsafe(24), policy_version=self.version,
                sampling=self._sampling(), timeout_s=self.config.timeout_s, purpose=purpose,
                task_path=a.task.path, script=script,
            ))
