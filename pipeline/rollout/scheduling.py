"""What the scheduler decides: which tasks, which harness per group, when to issue them, oracle scripts.

The scheduler actor (``actors/scheduler.py``) only moves messages; every decision is here, in plain objects a test
can drive without the runtime: :class:`Planner` (the seeded stream of (task, harness) groups) and :class:`Issuer`
(which group goes out next, bounded by groups in flight and by staleness; cold-start demonstrations first; resume).

Harness modes (docs/architecture.md, "Scheduling"):
- ``single``: every group uses ``harness``.
- ``mix``: every task is paired with each harness in ``harnesses``; each (task, harness) pair is its own group.
- ``scaling``: white-box configurations of a training set (``space``); each task gets K of them (``assignment``: a
  random anchor + its K-1 nearest, K distinct at random, or one K times) used over K successive steps. The task stream
  does not depend on the space or the assignment (they draw from their own generator), so for one seed every scaling
  variant with the same K, and ``single`` with K = 1, trains on the same tasks in the same order.

Staleness: a group issued while the learner has done s steps must be trained by step s + max_staleness. With B
groups per step, training group j (0-based) is trained in step j // B (the learner counts groups received, trained
or dropped); so it may be issued once the learner has finished ``j // B - max_staleness`` steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from pipeline.core.config import NonNegFloat, NonNegInt, PosFloat, PosInt, Section
from pipeline.core.recordings import Recordings
from pipeline.messages import RolloutRequest, SamplingParams, rollout_token, sampling_seed
from pipeline.rollout import demonstrations
from pipeline.rollout.harness_space import AssignmentRule, Space, assign, design
from pipeline.rollout.harnesses import HARNESSES, harness_for, harness_problem
from pipeline.rollout.tasks import Task, load_task_dir

Purpose = Literal["train", "eval", "sft"]


class TaskSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``builtin:fam1,fam2`` generates ``count`` seeded instances per family; otherwise a folder of task folders."""

    tasks: str = "builtin:create_file"
    count: PosInt = 64
    seed: int = 0  # builtin: the first instance seed (a task set keeps its own, whatever [experiment].seed)

    def problem(self) -> str:
        """Why this source cannot produce tasks, or "" (checked when the experiment is read)."""
        if self.tasks.startswith("builtin:"):
            from pipeline.rollout.taskgen import family_names

            fams = [f for f in self.tasks.removeprefix("builtin:").split(",") if f]
            unknown = [f for f in fams if f not in family_names()]
            if not fams or unknown:
                return (f"unknown built-in task families {unknown or fams}; known: {', '.join(family_names())}")
            return ""
        if not Path(self.tasks).is_dir():
            return f"task folder {self.tasks!r} does not exist (give a folder of Harbor task folders, or builtin:FAMILY)"
        return ""


GREEDY_TEMPERATURE = 1e-6  # below it engines decode greedily (SGLang's rule, kept by the embedded engine)


class SchedulerSettings(Section):
    """``[scheduler]``: what to roll out. Steps, groups per step and the staleness bound are in ``[run]``."""

    tasks: TaskSource = msgspec.field(default_factory=TaskSource)  # the training tasks
    # Tasks of the demonstrations. Unset: they are the first sft_groups of the training stream. Set: a separate
    # set, so training can cycle over a small fixed pool the demonstrations never showed (quickstart).
    sft_tasks: TaskSource | None = None
    mode: Literal["single", "mix", "scaling"] = "single"  # how groups get harnesses (docs/rollout.md)
    harness: str = "whitebox:S0T0O0C0W0"  # single mode: every group's harness
    harnesses: list[str] = msgspec.field(default_factory=list)  # mix mode
    k: PosInt = 2  # scaling mode: harnesses per task, over K successive steps
    # scaling mode: the white-box training set: the paper's published 18, the generated orthogonal array, Random-18
    # (drawn outside the published held-out set) or all 243 (harness_space.design; docs/rollout.md)
    space: Space = "published"
    space_seed: int = 0  # scaling mode: the draw of space = "random18" (and the generated space's held-out translate)
    # scaling mode: a task's K configurations: an anchor and its K-1 nearest ("locality"), K distinct drawn at random
    # ("random"), or one drawn at random K times ("repeat": Repeat-K, the control for K passes per task)
    assignment: AssignmentRule = "locality"
    group_size: PosInt = 4  # rollouts per (task, harness) group
    max_groups_in_flight: PosInt = 4  # groups issued and not finished, at most
    sft_groups: NonNegInt = 0  # oracle demonstration groups before training (cold-start SFT)
    # earlier runs' rollouts as demonstrations too: an --eval of a teacher, a --serve session (rejection-sampled)
    sft_recordings: Recordings | None = None
    sft_group_size: PosInt = 2  # rollouts per demonstration group
    # Through which harnesses the demonstrations go: what the run trains on ("training": a mix's harnesses, each
    # task through every one in turn; a scaling space's configurations, each task through the next of a seeded
    # cycle over them), or ``harness`` alone ("harness": one format demonstrated, however many are trained on).
    sft_harnesses: Literal["training", "harness"] = "training"
    temperature: NonNegFloat = 1.0  # the policy's sampling temperature
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0  # nucleus sampling (1: off)
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: off
    max_new_tokens: PosInt = 256  # per model call
    # A demonstration's responses are the script's, whatever their length (a file's whole content in one tool
    # call): their own, larger cap, so a small max_new_tokens for sampled rollouts never cuts one.
    sft_max_new_tokens: PosInt = 1024
    timeout_s: PosFloat = 300.0  # a rollout's wall-clock limit (the task's own when shorter)
    seed: int = 0  # task order and sampling; [experiment].seed by default
    reloadable = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "timeout_s", "max_groups_in_flight"})

    def check(self, name: str, exp: Any) -> None:
        from pipeline.core.config import ConfigError

        for label, src in (("tasks", self.tasks), ("sft_tasks", self.sft_tasks)):
            if src is not None and (why := src.problem()):
                raise ConfigError(f"{exp.source}: [{name}].{label}: {why}")
        if self.sft_recordings is not None and (why := self.sft_recordings.problem()):
            raise ConfigError(f"{exp.source}: [{name}].sft_recordings: {why}")
        if self.top_k == 0:
            raise ConfigError(f"{exp.source}: [{name}].top_k: 0 samples nothing; use -1 (off) or >= 1")
        if self.mode == "mix" and not self.harnesses:
            raise ConfigError(f'{exp.source}: [{name}].harnesses: mode = "mix" needs the list of harnesses')
        self._check_scaling(name, exp)
        for label, value in [("harness", self.harness), *(("harnesses", h) for h in self.harnesses)]:
            if why := harness_problem(value):
                raise ConfigError(f"{exp.source}: [{name}].{label}: {why}")
        proxy = exp.kind_section("proxy")
        for field_name in ("max_new_tokens", "sft_max_new_tokens") if self.sft_groups else ("max_new_tokens",):
            value = getattr(self, field_name)
            if proxy is not None and value >= proxy[1].context_len:
                raise ConfigError(
                    f"{exp.source}: [{name}].{field_name} = {value} leaves no room for a prompt within "
                    f"[{proxy[0]}].context_len = {proxy[1].context_len}; lower the first or raise the second")
        learner = exp.kind_section("learner")
        if learner is not None and exp.run.steps == 0 and self.sft_groups == 0 and self.sft_recordings is None:
            raise ConfigError(f"{exp.source}: [run].steps = 0 and [{name}].sft_groups = 0: nothing to train; a run "
                              "with no RL steps is a cold start only and needs demonstrations (sft_groups, or "
                              "recorded runs in sft_recordings)")
        if learner is not None and exp.run.steps > 0 and self.temperature < GREEDY_TEMPERATURE:
            raise ConfigError(
                f"{exp.source}: [{name}].temperature = {self.temperature:g} is greedy decoding: the engine's "
                f"log-probabilities then describe no sampling distribution, so [{learner[0]}] cannot score them "
                "(the loss would be NaN); train at a temperature > 0, and decode greedily only where nothing is "
                "trained (--serve)")
        if (learner is not None and self.group_size < 2 and learner[1].train.objective.advantage == "grpo"
                and exp.run.steps > 0):
            raise ConfigError(
                f"{exp.source}: [{name}].group_size = {self.group_size} gives every rollout a zero GRPO advantage "
                f'([{learner[0]}.train].advantage = "grpo"): nothing would be learned; use group_size >= 2 or '
                'advantage = "ppo"')

    def _check_scaling(self, name: str, exp: Any) -> None:
        from pipeline.core.config import ConfigError

        if self.mode != "scaling":
            default = type(self)()
            set_here = [f"{f} = {getattr(self, f)!r}" for f in ("space", "space_seed", "assignment")
                        if getattr(self, f) != getattr(default, f)]
            if set_here:
                raise ConfigError(f"{exp.source}: [{name}]: {', '.join(set_here)}: only mode = \"scaling\" reads "
                                  f'it (how it picks white-box configurations), and mode = "{self.mode}"; set '
                                  'mode = "scaling" or remove it')
            return
        n = len(design(self.space, self.space_seed)[0])
        if self.assignment != "repeat" and self.k > n:
            raise ConfigError(
                f'{exp.source}: [{name}].k = {self.k}: assignment = "{self.assignment}" gives each task {self.k} '
                f'distinct configurations and space = "{self.space}" has {n}; lower k, or use assignment = "repeat"')


def training_harnesses(s: SchedulerSettings) -> list[str]:
    """What a run with these settings trains on, in a stable order: ``harness`` (single mode), ``harnesses``
    (mix), the space's training configurations (scaling)."""
    if s.mode == "single":
        return [s.harness]
    if s.mode == "mix":
        return list(dict.fromkeys(s.harnesses))
    return ["whitebox:" + c.name for c in design(s.space, s.space_seed)[0]]


# The training-set variants of the harness-scaling experiment (docs/rollout.md, "Training-set variants"), as the
# [scheduler] settings each one sets over configs/scaling.toml. Steps, groups per step, group size, tasks, seeds and
# the number of demonstrations are the file's for all of them, so each trains on as many rollouts; the
# demonstrations go through the variant's own training set (sft_harnesses = "training").
SCALING_VARIANTS: dict[str, dict[str, Any]] = {
    "single": {"mode": "single", "harness": "whitebox:S0T0O0C0W0"},
    "published-k1": {"mode": "scaling", "space": "published", "k": 1, "assignment": "locality"},
    "published-k2": {"mode": "scaling", "space": "published", "k": 2, "assignment": "locality"},
    "published-k2-random": {"mode": "scaling", "space": "published", "k": 2, "assignment": "random"},
    "repeat-2": {"mode": "scaling", "space": "published", "k": 2, "assignment": "repeat"},
    "random-18": {"mode": "scaling", "space": "random18", "k": 2, "assignment": "locality"},
    "all-243": {"mode": "scaling", "space": "all", "k": 2, "assignment": "locality"},
}


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
                 harnesses: list[str], k: int, groups_per_step: int, seed: int, space: Space = "published", *,
                 assignment: AssignmentRule = "locality", space_seed: int = 0) -> None:
        if not tasks:
            raise ValueError("[scheduler]: the task source produced no tasks")
        self.tasks = tasks
        self.mode = mode
        self.harness = harness
        self.harnesses = harnesses or [harness]
        self.k = k
        self.B = groups_per_step
        self.seed = seed
        self.rng = random.Random(seed)  # the task order, alone: it is the same whatever the harnesses
        self.harness_rng = random.Random(f"{seed}/harnesses")
        self.assignment: AssignmentRule = assignment
        self._order: list[Task] = []
        self.training = design(space, space_seed)[0] if mode == "scaling" else []
        self._blocks: list[list[tuple[Task, list[str]]]] = []

    def next_task(self) -> Task:
        if not self._order:
            self._order = list(self.tasks)
            self.rng.shuffle(self._order)
        return self._order.pop()

    def replacement(self, a: Assignment, slot: int, resample: int) -> Assignment:
        """Dynamic sampling: the task of group ``resample`` of training slot ``slot`` (``a``: the slot's group it
        replaces), another task than ``a``'s where there is one, with ``a``'s harness. Drawn from its own generator
        seeded by (seed, slot, resample), so the step stream's order does not depend on how many were replaced, and
        a resumed run draws the same ones."""
        rng = random.Random(f"{self.seed}/{slot}/{resample}")
        others = [t for t in self.tasks if t.id != a.task.id] or self.tasks
        return Assignment(rng.choice(others), a.harness, a.step)

    def demonstrations(self, n: int, harnesses: list[str], *, every: bool) -> list[Assignment]:
        """The ``n`` cold-start demonstration groups through ``harnesses``. ``every``: each task paired with every
        harness in turn, one group per (task, harness) pair (a mix's few harnesses, each with its own SFT groups);
        otherwise each task through the next harness of a cycle over a seeded shuffle of them (a scaling space's
        18-243 configurations: as many distinct tasks as groups, the configurations spread evenly)."""
        out: list[Assignment] = []
        if every:
            while len(out) < n:
                t = self.next_task()
                out += [Assignment(t, h, -1) for h in harnesses]
            return out[:n]
        order = list(harnesses)
        random.Random(f"{self.seed}/demonstrations").shuffle(order)  # its own draw: the training stream's is kept
        return [Assignment(self.next_task(), order[i % len(order)], -1) for i in range(n)]

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
                (t, ["whitebox:" + c.name for c in assign(self.training, self.k, self.harness_rng, self.assignment)])
                for t in (self.next_task() for _ in range(self.B))
            ])
        return [Assignment(t, hs[j], step) for t, hs in self._blocks[block]]


def oracle_script(task: Task, harness: str, final_text: str = "Done.") -> list[dict[str, Any]]:
    """The task's oracle as scripted responses for ``harness``: its neutral actions in the harness's own tools
    (the adapter's ``demo_tools``; pipeline/rollout/demonstrations.py), then ``final_text``."""
    if not task.oracle_actions:
        raise ValueError(f"task {task.id}: no oracle actions (solution/actions.json); cannot script a demonstration")
    adapter, variant = harness_for(harness)
    if adapter.demo_tools is None:
        playable = [h.name for h in HARNESSES.values() if h.demo_tools is not None]
        raise ValueError(f"harness {harness!r} cannot play oracle demonstrations; these can: {', '.join(playable)}")
    actions = [(a.tool, a.args) for a in task.oracle_actions]
    return demonstrations.script(adapter.demo_tools(variant), actions, final_text)


def may_issue(j: int, steps_done: int, groups_per_step: int, max_staleness: int) -> bool:
    """Whether training group ``j`` may be issued once the learner finished ``steps_done`` steps (module docstring)."""
    return steps_done >= j // groups_per_step - max_staleness


@dataclass
class Issue:
    """One group to send: its id, (task, harness), purpose and size."""

    group_id: str
    assignment: Assignment
    purpose: Purpose
    size: int
    demonstrations: int = 0  # purpose "sft": the cold start's demonstration rollouts in all
    resample: int = 0  # dynamic sampling: RolloutRequest.resample


@dataclass
class Issuer:
    """Which group goes out next. Pure bookkeeping: the actor feeds it what it receives and sends what it returns.

    Demonstrations (``sft_groups``) go out first; training groups wait for the learner's first update after them
    (its weights must reach the engine), then go out in order, at most ``max_groups_in_flight`` unfinished groups
    at a time and never more than ``max_staleness`` steps ahead of the learner (:func:`may_issue`).
    A resumed run continues with the groups of the first unfinished step; their ids carry the resume attempt
    (``g00016-a1``), so a group id names one issue of one group in the event log. With dynamic sampling, a group
    the learner asks to replace (:meth:`resample`) goes out before any new group, as ``g00016-x1``, ``-x2``, ...
    """

    planner: Planner
    sft_planner: Planner
    settings: SchedulerSettings
    steps: int
    groups_per_step: int
    version: int = 0  # the newest policy version the learner announced
    steps_done: int = 0  # RL steps the learner finished (PolicyUpdated.step)
    attempt: int = 0  # resume attempt (0: the first run)
    recorded: int = 0  # demonstrations from recorded runs ([scheduler].sft_recordings), sent by the actor itself
    sft_issued: int = 0
    train_issued: int = 0
    warm: bool = False
    in_flight: dict[str, int] = field(default_factory=dict)  # group -> rollouts not finished
    resampled: int = 0  # replacement groups asked for (dynamic sampling)
    # training groups issued in this run: group id -> (slot, assignment of the slot's first group, its id)
    _slots: dict[str, tuple[int, Assignment, str]] = field(default_factory=dict, repr=False)
    _replacements: list[Issue] = field(default_factory=list, repr=False)  # asked for, not yet issued
    # The current step's assignments: the planner is asked once per step, in order (its RNG depends on it).
    _step_cache: dict[int, list[Assignment]] = field(default_factory=dict, repr=False)
    _sft: list[Assignment] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.warm = self.settings.sft_groups == 0 and not self.recorded

    @property
    def total(self) -> int:
        return self.steps * self.groups_per_step

    @property
    def demonstrations(self) -> int:
        return self.settings.sft_groups * self.settings.sft_group_size + self.recorded

    def resume(self, steps_done: int, attempt: int) -> None:
        """Continue after ``steps_done`` finished steps; replaying the planners keeps their task order."""
        self.steps_done = steps_done
        self.attempt = attempt
        self.train_issued = min(self.total, steps_done * self.groups_per_step)
        self.sft_issued = self.settings.sft_groups
        self.warm = False  # wait for the learner's resumed weights to reach the engine
        self._demonstrations()  # drawn from the training planner's stream when they share it
        for s in range(steps_done):
            self.planner.step(s)

    def finished(self, group_id: str) -> None:
        """One rollout of ``group_id`` ended (RolloutFinished)."""
        left = self.in_flight.get(group_id)
        if left is not None:
            if left <= 1:
                del self.in_flight[group_id]
            else:
                self.in_flight[group_id] = left - 1

    def updated(self, version: int, step: int) -> None:
        """The learner published a policy (PolicyUpdated)."""
        self.version = max(self.version, version)
        self.steps_done = max(self.steps_done, step)
        self.warm = True

    def resample(self, group_id: str, resample: int) -> bool:
        """The learner asks for group ``resample`` of ``group_id``'s slot (GroupResample); False when
        ``group_id`` is not a training group of this run (one issued before a resume)."""
        slot = self._slots.get(group_id)
        if slot is None:
            return False
        j, first, base = slot
        gid = f"{base}-x{resample}"
        self._slots[gid] = slot
        self._replacements.append(Issue(gid, self.planner.replacement(first, j, resample), "train",
                                        self.settings.group_size, resample=resample))
        self.resampled += 1
        return True

    @property
    def done(self) -> bool:
        return (self.train_issued >= self.total and self.sft_issued >= self.settings.sft_groups
                and not self._replacements)

    def next(self, max_staleness: int) -> list[Issue]:
        """The groups that may go out now, in order (each is counted as in flight from here on)."""
        s = self.settings
        out: list[Issue] = []
        pending: list[Assignment] = []
        while len(self.in_flight) < s.max_groups_in_flight:
            if self._replacements:  # its slot was issued already: no staleness wait
                issue = self._replacements.pop(0)
                self.in_flight[issue.group_id] = issue.size
                out.append(issue)
                continue
            if self.sft_issued < s.sft_groups:
                a = self._demonstrations()[self.sft_issued]
                out.append(self._take(f"sft{self.sft_issued:04d}", a, "sft", s.sft_group_size))
                self.sft_issued += 1
                continue
            j = self.train_issued
            if j >= self.total or not self.warm or not may_issue(j, self.steps_done, self.groups_per_step,
                                                                 max_staleness):
                break
            if not pending:
                pending = self._step_assignments(j // self.groups_per_step)[j % self.groups_per_step:]
            suffix = f"-a{self.attempt}" if self.attempt else ""
            gid, a = f"g{j:05d}{suffix}", pending.pop(0)
            out.append(self._take(gid, a, "train", s.group_size))
            self._slots[gid] = (j, a, gid)
            self.train_issued += 1
        return out

    def _demonstrations(self) -> list[Assignment]:
        """Every demonstration group, drawn at once on first use (before any training group, as they are issued)."""
        if self._sft is None:
            s = self.settings
            harnesses = training_harnesses(s) if s.sft_harnesses == "training" else [s.harness]
            self._sft = self.sft_planner.demonstrations(s.sft_groups, harnesses, every=s.mode == "mix")
        return self._sft

    def _step_assignments(self, step: int) -> list[Assignment]:
        if step not in self._step_cache:
            self._step_cache.clear()
            self._step_cache[step] = self.planner.step(step)
        return self._step_cache[step]

    def _take(self, gid: str, a: Assignment, purpose: Purpose, size: int) -> Issue:
        self.in_flight[gid] = size
        return Issue(gid, a, purpose, size, self.demonstrations if purpose == "sft" else 0)

    def metrics(self) -> dict[str, float]:
        return {"groups_in_flight": len(self.in_flight), "groups_issued": self.train_issued,
                "sft_groups_issued": self.sft_issued, "groups_resampled": self.resampled,
                "policy_version": self.version,
                "learner_steps": self.steps_done}


def rollout_requests(issue: Issue, settings: SchedulerSettings, version: int) -> list[RolloutRequest]:
    """The group's RolloutRequests, each with its own fresh rollout token; demonstrations carry the oracle script."""
    script = oracle_script(issue.assignment.task, issue.assignment.harness) if issue.purpose == "sft" else []
    cap = settings.sft_max_new_tokens if issue.purpose == "sft" else settings.max_new_tokens
    sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                              max_new_tokens=cap)
    a = issue.assignment
    return [RolloutRequest(
        rollout_id=f"{issue.group_id}-r{i}", group_id=issue.group_id, index=i, group_size=issue.size,
        task_id=a.task.id, harness=a.harness, token=rollout_token(), policy_version=version,
        sampling=msgspec.structs.replace(sampling, seed=sampling_seed(settings.seed, f"{issue.group_id}-r{i}")),
        timeout_s=settings.timeout_s, purpose=issue.purpose, task_path=a.task.path,
        script=script, demonstrations=issue.demonstrations, resample=issue.resample,
    ) for i in range(issue.size)]
