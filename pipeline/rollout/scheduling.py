"""What the scheduler decides: which tasks, which harness per group, oracle scripts, and the staleness bound.

Harness modes (DESIGN.md §2, §7):
- ``single``: every group uses ``harness``.
- ``mix``: every task is paired with each harness in ``harnesses``; each (task, harness) pair is its own group.
- ``scaling``: white-box configurations from the strength-2 orthogonal array; each task gets K harnesses (a random
  anchor + its K-1 nearest training configurations) used over K successive steps.

Staleness: a group issued while the learner has done s steps must be trained by step s + max_staleness. With B
groups per step, training group j (0-based) is trained in step j // B (the learner counts groups received, trained
or dropped); so it may be issued once the learner has finished ``j // B - max_staleness`` steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from pipeline.rollout.harness_space import HarnessConfig, locality_assignment, tool_name_for, training_configs
from pipeline.rollout.tasks import Task, load_task_dir


class TaskSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``builtin:fam1,fam2`` generates ``count`` seeded instances per family; otherwise a folder of task folders."""

    tasks: str = "builtin:create_file"
    count: int = 64
    seed: int = 0


def load_tasks(src: TaskSource, run_dir: Path, folder: str = "tasks") -> list[Task]:
    """Built-in families are generated into ``run_dir/folder``; a folder source is read in place."""
    if src.tasks.startswith("builtin:"):
        from pipeline.rollout.taskgen import generate_to

        fams = src.tasks.removeprefix("builtin:")
        out = run_dir / folder
        if out.exists():  # a resumed run keeps its tasks
            return load_task_dir(out)
        return generate_to(out, fams, src.count, seed=src.seed)
    return load_task_dir(src.tasks)


@dataclass
class Assignment:
    task: Task
    harness: str
    step: int  # the training step this group is meant for (-1: warm-up)


class Planner:
    """An endless, seeded stream of (task, harness) groups for training steps."""

    def __init__(self, tasks: list[Task], mode: Literal["single", "mix", "scaling"], harness: str,
                 harnesses: list[str], k: int, groups_per_step: int, seed: int) -> None:
        if not tasks:
            raise ValueError("[scheduler]: the task source produced no tasks")
        self.tasks = tasks
        self.mode = mode
        self.harness = harness
        self.harnesses = harnesses or [harness]
        self.k = k
        self.B = groups_per_step
        self.rng = random.Random(seed)
        self._order: list[Task] = []
        self.training = training_configs() if mode == "scaling" else []
        self._blocks: list[list[tuple[Task, list[str]]]] = []

    def next_task(self) -> Task:
        if not self._order:
            self._order = list(self.tasks)
            self.rng.shuffle(self._order)
        return self._order.pop()

    def step(self, step: int) -> list[Assignment]:
        """The B groups of training step ``step``."""
        if self.mode == "single":
            return [Assignment(self.next_task(), self.harness, step) for _ in range(self.B)]
        if self.mode == "mix":
            out: list[Assignment] = []
            while len(out) < self.B:
                t = self.next_task()
                out += [Assignment(t, h, step) for h in self.harnesses]
            return out[: self.B]
        # scaling: a block of K steps shares its tasks; step j of the block uses each task's j-th harness
        block, j = divmod(step, self.k)
        while len(self._blocks) <= block:
            self._blocks.append([
                (t, ["whitebox:" + c.name for c in locality_assignment(self.training, self.k, self.rng)])
                for t in (self.next_task() for _ in range(self.B))
            ])
        return [Assignment(t, hs[j], step) for t, hs in self._blocks[block]]


def oracle_script(task: Task, harness: str, final_text: str = "Done.") -> list[dict[str, Any]]:
    """The task's oracle as scripted responses for ``harness`` (white-box only: tool names follow its T level)."""
    if not task.oracle_actions:
        raise ValueError(f"task {task.id}: no oracle actions (solution/actions.json); cannot script a demonstration")
    name, _, variant = harness.partition(":")
    if name != "whitebox":
        raise ValueError(f"oracle demonstrations are scripted for the white-box harness only, not {harness!r}")
    cfg = HarnessConfig.parse(variant or "S0T0O0C0W0")
    out: list[dict[str, Any]] = [
        {"tool_calls": [{"name": tool_name_for(cfg, a.tool), "arguments": dict(a.args)}]} for a in task.oracle_actions
    ]
    out.append({"text": final_text})
    return out


def may_issue(j: int, steps_done: int, groups_per_step: int, max_staleness: int) -> bool:
    """Whether training group ``j`` may be issued once the learner finished ``steps_done`` steps (module docstring)."""
    return steps_done >= j // groups_per_step - max_staleness
