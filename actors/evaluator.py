"""Evaluator actor (``[eval]``): issues evaluation rounds through the same proxy, sandboxes and verifiers as
training, collects their settled rollouts and reports pass@k, pass^k and behavioural metrics (pipeline.eval).

Standalone (``run.py --eval``, ``[eval].standalone``): one round of the served policy, then it returns. During
training (``every_steps = N``): a round after the cold start, after every N-th RL step and after the last one;
with ``every_steps = 0`` none, until a hot reload sets it (pipeline.eval.plan.Rounds decides)."""

from __future__ import annotations

from pathlib import Path

import anyio

from pipeline.core.runtime import Actor
from pipeline.eval.plan import EvalSettings, Round, Rounds, held_out
from pipeline.eval.run import finish, metric_values, write_round
from pipeline.messages import Metric, PolicyUpdated, SettledRollout
from pipeline.rollout.scheduling import load_tasks
from pipeline.rollout.tasks import Task, load_task_dir


class Evaluator(Actor[EvalSettings]):
    Config = EvalSettings
    outputs = ("requests", "metrics")

    async def run(self) -> None:
        assert self.run_dir is not None, "the evaluator needs a run directory for its tasks and reports"
        self.rounds = Rounds(self.config, self.ctx.run.steps)
        self.tasks: list[Task] | None = None
        await self._start()
        if self.rounds.complete:
            return
        async for msg in self.messages():
            if isinstance(msg, PolicyUpdated):
                if self.rounds.updated(msg.step, msg.version):
                    await self._start()
                elif self.rounds.complete:
                    return
            elif isinstance(msg, SettledRollout):
                done = self.rounds.settled(msg)
                if done is not None:
                    await self._finish(done)
                    if self.rounds.complete:
                        return
                    await self._start()
                elif self.rounds.current is not None:
                    await self._send(self.rounds.current)

    async def _start(self) -> None:
        if self.rounds.current is not None or self.rounds.complete:
            return
        if self.tasks is None and (self.config.standalone or self.rounds.waiting):
            # read only now: the scheduler has written this run's training tasks by the first policy update
            self.tasks = await anyio.to_thread.run_sync(self._held_out)
        if self.tasks is not None and (rnd := self.rounds.start(self.tasks)) is not None:
            self.log.info("evaluation round", step=rnd.step, pairs=len(rnd.groups), rollouts=rnd.expected)
            await self._send(rnd)

    def _held_out(self) -> list[Task]:
        assert self.run_dir is not None
        tasks = load_tasks(self.config.tasks, self.run_dir, "eval_tasks")
        training: list[Task] = []
        for folder in [self.run_dir / "tasks", self.run_dir / "sft_tasks", *map(Path, self.config.exclude)]:
            if folder.is_dir():
                training += load_task_dir(folder)
        kept, dropped = held_out(tasks, training)
        if dropped:
            self.log.warning("evaluation tasks dropped: same content as a training task", dropped=len(dropped),
                             tasks=dropped[:10])
        if not kept:
            raise RuntimeError(f"[{self.name}].tasks: every evaluation task is also a training task; give another "
                               "folder or seed")
        return kept

    async def _send(self, rnd: Round) -> None:
        for req in rnd.next():
            await self.send("requests", req)

    async def _finish(self, rnd: Round) -> None:
        assert self.run_dir is not None
        c = self.config
        res = await anyio.to_thread.run_sync(
            lambda: finish(rnd.settled, c.ks, c.threshold, step=rnd.step, policy=str(self.ctx.run.model)))
        out = self.run_dir / "eval" / (f"step{rnd.step:05d}" if rnd.step >= 0 else "")
        paths = await anyio.to_thread.run_sync(write_round, res, out)
        values = metric_values(res)
        self.log.info("evaluation done", step=rnd.step, report=str(paths[1]),
                      **{k: round(v, 4) for k, v in values.items() if "/" not in k})
        if self.out["metrics"].connected:
            await self.send("metrics", Metric(source=self.name, kind="eval", step=rnd.step, values=values))

    async def on_config(self, new: EvalSettings, changes: dict[str, object]) -> None:
        self.config = new
        self.rounds.settings = new
        if self.rounds.current is not None:
            self.rounds.current.settings = new
            await self._send(self.rounds.current)
