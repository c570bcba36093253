"""What the monitor knows about a run, folded from its Metrics by kind (never by actor name).

Everything that was not measured yet stays ``None`` (or empty), so the display can say "n/a" instead of showing a
zero that looks like a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.outcomes import Outcomes
from pipeline.messages import Metric


@dataclass
class Quiet:
    first: int
    last: int
    why: list[str]  # in order of first appearance: "nothing trained", "no reward spread"

    def text(self) -> str:
        steps = f"step {self.last}" if self.first == self.last else f"steps {self.first}-{self.last}"
        return f"no policy gradient in {steps}: {', '.join(self.why)}"


def quiet_reason(v: dict[str, float]) -> str | None:
    """Why an RL step's policy gradient was zero, from its values (pipeline.training.health's counts); None when
    it had one, or when the values do not say (written before the counts existed)."""
    groups = v.get("groups")
    if groups is None:
        return None
    if not groups:
        return "nothing trained"
    if v.get("zero_var_groups") == groups:
        return "no reward spread"
    return None


@dataclass
class MonitorState:
    run_name: str
    t0: float  # when the monitor started (the graph's start, within milliseconds)
    # the plan, as the scheduler and the learner announce it (None: not announced yet, or no such actor)
    demos_total: int | None = None
    sft_updates_total: int | None = None
    steps_total: int | None = None
    # arrival times of each finished item, for progress and pace
    demo_times: list[float] = field(default_factory=list)
    sft_times: list[float] = field(default_factory=list)
    rl_times: list[float] = field(default_factory=list)
    rl_steps_done: int = 0  # from the learner's step numbers: includes the steps of a resumed run's checkpoint
    rl_rollouts: int = 0
    rl_rewards: list[float] = field(default_factory=list)
    last_rl: dict[str, float] = field(default_factory=dict)
    last_sft: dict[str, float] = field(default_factory=dict)
    scheduler: dict[str, float] = field(default_factory=dict)
    rollouts_running: int | None = None
    engine_version: int | None = None  # the version the engine serves (after its last weight load)
    weight_sync_s: float | None = None
    rl_warnings: list[str] = field(default_factory=list)  # the last RL step's (the learner's words)
    # The latest RL steps in a row without a policy gradient (nothing trained, or no group with a reward spread):
    # the first and last of them and why, for the display's "no policy gradient in steps 2-5" (None: the last step
    # had one).
    quiet: Quiet | None = None
    outcomes: Outcomes = field(default_factory=Outcomes)  # every rollout's status (sandbox.finished -> monitor)

    @property
    def demos_done(self) -> int:
        return len(self.demo_times)

    @property
    def sft_updates_done(self) -> int:
        return len(self.sft_times)

    @property
    def policy_version(self) -> int | None:
        """The engine's version when it reported one; else the version the scheduler issues rollouts with."""
        if self.engine_version is not None:
            return self.engine_version
        v = self.scheduler.get("policy_version")
        return None if v is None else int(v)


def _plan(value: float | None) -> int | None:
    return None if value is None else int(value)


def absorb(s: MonitorState, msg: Metric, now: float) -> None:
    """Fold one Metric into the state; ``now`` is its arrival time (``msg.t`` wins when the sender set it)."""
    t = msg.t or now
    v = msg.values
    match msg.kind:
        case "rl_step":
            s.rl_times.append(t)
            s.rl_steps_done = max(s.rl_steps_done, msg.step)
            s.last_rl = dict(v)
            if "reward" in v:
                s.rl_rewards.append(v["reward"])
            s.rl_warnings = list(msg.warnings)
            why = quiet_reason(v)
            if why is None:
                s.quiet = None
            elif s.quiet is None or msg.step != s.quiet.last + 1:
                s.quiet = Quiet(msg.step, msg.step, [why])
            else:
                s.quiet.last = msg.step
                if why not in s.quiet.why:
                    s.quiet.why.append(why)
        case "sft_update":
            s.sft_times.append(t)
            s.last_sft = dict(v)
            s.sft_updates_total = _plan(v.get("sft_updates")) or s.sft_updates_total
        case "demonstration" | "rollout":
            if msg.kind == "demonstration":
                s.demo_times.append(t)
            else:
                s.rl_rollouts += 1
            if "rollouts_running" in v:
                s.rollouts_running = int(v["rollouts_running"])
        case "scheduler":
            s.scheduler.update(v)
            if "demonstrations_total" in v:
                s.demos_total = _plan(v["demonstrations_total"])
            if "steps_total" in v:
                s.steps_total = _plan(v["steps_total"])
        case "weight_sync":
            if "policy_version" in v:
                s.engine_version = int(v["policy_version"])
            s.weight_sync_s = v.get("weight_update_s", s.weight_sync_s)
        case _:
            pass  # tree, settle, other: in metrics.jsonl and the plots, not in the live view
