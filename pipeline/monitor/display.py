"""What a person sees: pure functions from a MonitorState (and the time) to text, log fields and a rich renderable.

Numbers mean what they say: a value that was not measured yet reads "-" or "n/a (why)", never 0; progress is
counted from finished items; an ETA comes from measured pace (the mean of the last few intervals between items)
and counts down between items. The policy version counts optimizer updates, cold-start SFT included (one version
per SFT update and per RL update), so after a cold start of 160 SFT updates the first RL rollouts sample from v160;
the display says so instead of leaving "160" next to "learner step 0". An RL step that could not learn says so: the
learner's warning line under the table, and the KL line says why the policy does not move ("no policy gradient in
steps 2-5: no reward spread"); "no RL step yet" only before the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from pipeline.messages import RolloutStatus
from pipeline.monitor.state import MonitorState

Phase = Literal["starting", "demonstrations", "sft", "rl", "done"]

PHASE_TEXT: dict[Phase, str] = {
    "starting": "starting",
    "demonstrations": "cold start: recording demonstrations",
    "sft": "cold start: SFT on the demonstrations",
    "rl": "RL",
    "done": "done",
}

PANEL_WIDTH = 100
ETA_WINDOW = 5  # intervals averaged for the pace of SFT updates and RL steps (RL: the first one fills the pipeline)


def phase(s: MonitorState) -> Phase:
    if s.steps_total and s.rl_steps_done >= s.steps_total:
        return "done"
    if s.rl_times or s.rl_rollouts:
        return "rl"
    if s.sft_times:
        finished = s.sft_updates_total is not None and s.sft_updates_done >= s.sft_updates_total
        return "rl" if finished else "sft"
    if s.demos_total:
        return "sft" if s.demos_done >= s.demos_total else "demonstrations"
    if s.demo_times:
        return "demonstrations"
    if s.scheduler:
        return "rl"  # no cold start planned: the first rollouts are on their way
    return "starting"


def eta_s(times: Sequence[float], total: int | None, now: float, *, start: float | None = None,
          window: int | None = ETA_WINDOW, done: int | None = None) -> float | None:
    """Seconds until ``total`` items are done at the measured pace; None when there is nothing to measure.

    ``times`` are the arrival times of this run's items; ``done`` (default ``len(times)``) may be larger when
    earlier items came from before (a resumed run). The pace is the mean interval over the last ``window``
    intervals (all of them when None), the first measured from ``start`` when given. The estimate counts down
    from the last item's time and stops at 0.
    """
    done = len(times) if done is None else done
    if total is None or not times:
        return None
    if done >= total:
        return 0.0
    pts = ([start] if start is not None else []) + list(times)
    if window is not None:
        pts = pts[-(window + 1):]
    if len(pts) < 2:
        return None
    per_item = (pts[-1] - pts[0]) / (len(pts) - 1)
    return max(0.0, per_item * (total - done) - (now - times[-1]))


def duration(seconds: float) -> str:
    """12 s, 3:05, 1:02:03."""
    sec = max(0, round(seconds))
    if sec < 60:
        return f"{sec} s"
    h, rest = divmod(sec, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


@dataclass(frozen=True)
class Progress:
    label: str
    done: int
    total: int | None  # None: not announced yet
    eta_s: float | None  # None: not measured yet
    took_s: float | None = None  # set once the phase is finished
    note: str = ""  # what is happening right now, e.g. "step 4 running 6 s"

    @property
    def count(self) -> str:
        return f"{self.done} / {'?' if self.total is None else self.total}"

    @property
    def when(self) -> str:
        if self.took_s is not None:
            return f"done in {duration(self.took_s)}"
        return "ETA -" if self.eta_s is None else f"ETA {duration(self.eta_s)}"


def progresses(s: MonitorState, now: float) -> list[Progress]:
    """One bar per phase of the run's plan: demonstrations and SFT updates (when a cold start is planned or seen),
    then RL steps."""
    out = []
    cold = bool(s.demos_total) or bool(s.demo_times) or bool(s.sft_times)
    if cold:
        total = s.demos_total
        finished = total is not None and s.demos_done >= total
        # paced from the first finished one, over all: the engine's start-up is not demonstration time
        out.append(Progress("demonstrations", s.demos_done, total, eta_s(s.demo_times, total, now, window=None),
                            took_s=s.demo_times[-1] - s.t0 if finished and s.demo_times else None))
        total = s.sft_updates_total
        finished = total is not None and s.sft_updates_done >= total
        took = s.sft_times[-1] - (s.demo_times[-1] if s.demo_times else s.t0) if finished else None
        out.append(Progress("SFT updates", s.sft_updates_done, total, eta_s(s.sft_times, total, now), took_s=took))
    start = s.sft_times[-1] if s.sft_times else s.t0
    total = s.steps_total
    finished = total is not None and 0 < total <= s.rl_steps_done
    note = ""
    if phase(s) == "rl":
        since = s.rl_times[-1] if s.rl_times else start
        note = f"step {s.rl_steps_done + 1} running {duration(now - since)}"
    out.append(Progress("RL steps", s.rl_steps_done, total,
                        eta_s(s.rl_times, total, now, start=start, done=s.rl_steps_done),
                        took_s=s.rl_times[-1] - start if finished and s.rl_times else None, note=note))
    return out


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def policy_text(s: MonitorState) -> str:
    """The version rollouts are sampled with, what it is made of, and the learner's when that is ahead."""
    v = s.policy_version
    if v is None:
        return "-"
    if v == 0:
        why = {"demonstrations": " (the demonstrations are scripted, not sampled)",
               "sft": " (the SFT weights go to the engine when SFT ends)"}
        return f"v0: the initial weights{why.get(phase(s), '')}"
    n_sft = s.sft_updates_done
    if n_sft and v >= n_sft:
        text = f"v{v}: {_plural(n_sft, 'SFT update')} + {_plural(v - n_sft, 'RL update')}"
    else:
        text = f"v{v} (one version per optimizer update, SFT included)"
    ahead = s.last_rl.get("version", s.last_sft.get("version"))
    if ahead is not None and int(ahead) > v and phase(s) not in ("demonstrations", "sft"):
        text += f"; the learner is at v{int(ahead)}"
    return text


def _num(d: dict[str, float], key: str, fmt: str, missing: str = "-") -> str:
    return format(d[key], fmt) if key in d else missing


def rl_missing(s: MonitorState) -> str:
    """What a value the last RL step did not report means: no step yet, a step that trained nothing, or (a value
    an older learner did not write) not measured."""
    if not s.last_rl:
        return "n/a (no RL step yet)"
    if s.last_rl.get("groups") == 0:
        return f"n/a (nothing trained in step {s.rl_steps_done})"
    return "n/a (not measured in the last RL step)"


def kl_text(s: MonitorState) -> str:
    """The last RL step's KL to the reference, and why the policy is not moving when it is not."""
    rl = s.last_rl
    if not rl:
        return "n/a (no RL step yet)"
    if "kl" in rl:
        return f"{rl['kl']:.4f} per token (k3)" + ("" if s.quiet is None else f"; {s.quiet.text()}")
    if s.quiet is not None:
        return f"n/a ({s.quiet.text()})"
    if rl.get("value_phase"):
        return "n/a (PPO value warm-up: the policy does not move)"
    if "loss" in rl:
        return "n/a (no KL term: [learner.train].kl_coef = 0)"
    return rl_missing(s)


def spread_text(s: MonitorState) -> str:
    """How many of the last RL step's trained groups had a reward spread (the others add no policy gradient)."""
    rl = s.last_rl
    if "zero_var_groups" not in rl or not rl.get("groups"):
        return rl_missing(s)
    groups, flat = int(rl["groups"]), int(rl["zero_var_groups"])
    return f"{groups - flat} / {groups} groups last step" + (f" ({flat} scored alike: no signal)" if flat else "")


def statuses_text(s: MonitorState) -> str:
    """The last RL step's rollouts by status, and how many were left out of the loss."""
    rl = s.last_rl
    if "rollouts" not in rl:
        return rl_missing(s)
    known = get_args(RolloutStatus)
    extra = sorted(k[len("rollouts_"):] for k in rl if k.startswith("rollouts_") and k[len("rollouts_"):] not in
                   (*known, "trained", "left_out"))
    parts = [f"{int(rl[f'rollouts_{st}'])} {st}" for st in (*known, *extra) if rl.get(f"rollouts_{st}")]
    left = int(rl.get("rollouts_left_out", 0))
    return ", ".join(parts) + (f" · {left} left out of the loss" if left else "")


def rows(s: MonitorState, now: float) -> list[tuple[str, str]]:
    """The table under the progress bars, as (label, text); the last RL step's warnings, if any, last."""
    no_rl = rl_missing(s)
    rl = s.last_rl
    reward = no_rl
    if s.rl_rewards and "reward" in rl:
        recent = s.rl_rewards[-ETA_WINDOW:]
        reward = (f"{s.rl_rewards[-1]:.3f} last step · {sum(recent) / len(recent):.3f} mean of the last "
                  f"{len(recent)}")
    sft = "-"
    if s.last_sft:
        epoch = s.last_sft.get("sft_epoch")
        where = f"update {s.sft_updates_done}" + ("" if epoch is None else f", epoch {int(epoch) + 1}")
        sft = f"{s.last_sft.get('loss', float('nan')):.3f} ({where})"
    last_update = rl if rl else s.last_sft
    which = "last RL step" if rl else "last SFT update"
    throughput = f"{last_update['tokens_per_s']:,.0f} tokens/s ({which})" if "tokens_per_s" in last_update else "-"
    # counts as of the last report; once the last step is done the remaining rollouts are stopped, not running
    over = phase(s) == "done"
    running = "-" if s.rollouts_running is None or over else str(s.rollouts_running)
    return [
        ("elapsed", duration(now - s.t0)),
        ("policy version", policy_text(s)),
        ("SFT loss", sft),
        ("reward", reward),
        ("pass rate", _num(rl, "pass_rate", ".3f", no_rl) + (" last step" if "pass_rate" in rl else "")),
        ("entropy", _num(rl, "entropy", ".3f", no_rl) + (" nats/token" if "entropy" in rl else "")),
        ("KL to the reference", kl_text(s)),
        ("reward spread", spread_text(s)),
        ("learner throughput", throughput),
        ("rollouts", f"{running} running · {s.demos_done} demonstrations + {s.rl_rollouts} policy rollouts done"),
        ("last step's rollouts", statuses_text(s)),
        ("groups in flight", "-" if over else _num(s.scheduler, "groups_in_flight", ".0f")),
        ("weight sync", "-" if s.weight_sync_s is None else f"{s.weight_sync_s:.2f} s (the engine's last load)"),
        *(("failed", line) for line in s.outcomes.reasons()[:3]),
        *(("warning", w) for w in s.rl_warnings),
    ]


def render(s: MonitorState, now: float) -> RenderableType:
    """The live view: a panel with the phase in its title, one progress bar per phase, then the table."""
    bars = Table.grid(padding=(0, 2))
    for p in progresses(s, now):
        # an unknown total draws an empty bar: rich's pulsing one looks like a full bar on a still screen
        bar = ProgressBar(total=float(p.total or 1), completed=p.done if p.total else 0, width=32)
        bars.add_row(p.label, bar, p.count, p.when, p.note)
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    for k, v in rows(s, now):
        table.add_row(k, Text(v, style="bold yellow") if k in ("warning", "failed") else v)
    # a fixed width (rich narrows it on a smaller terminal): a panel fitted to its text would change size as
    # numbers change
    state = PHASE_TEXT[phase(s)] + (" · no rollout succeeded" if s.outcomes.none_succeeded else "")
    return Panel(Group(bars, "", table), title=f"bridle · {s.run_name} · {state}",
                 title_align="left", width=PANEL_WIDTH)


def progress_fields(s: MonitorState, now: float) -> dict[str, Any]:
    """Fields of an off-terminal progress log line: the phase and ``done/total (ETA)`` per bar."""
    out: dict[str, Any] = {"phase": PHASE_TEXT[phase(s)]}
    for p in progresses(s, now):
        out[p.label.replace(" ", "_")] = f"{p.count.replace(' ', '')} ({p.when})"
    if s.outcomes.first:
        out["rollouts"] = s.outcomes.counts_text()
        out["failed"] = s.outcomes.reasons()[0]
    return out


def step_fields(step: int, values: dict[str, float]) -> dict[str, Any]:
    """Fields of the log line per RL step (what the plots show, rounded)."""
    out: dict[str, Any] = {"step": step}
    for key, digits in (("reward", 3), ("pass_rate", 3), ("loss", 4), ("entropy", 3)):
        if key in values:
            out[key] = round(values[key], digits)
    return out
