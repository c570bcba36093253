"""``run.py --replay LOG``: per-harness numbers under the summary (with ``--json``, its ``harnesses`` list).

For each harness a run used (``RolloutRequest.harness``): rollouts (demonstrations among them), their statuses,
how many settled, model calls per rollout, input and output tokens per call, how long the harness ran (the
sandbox's ``timings``: started to exited, so container start-up counts, the verifier does not), demonstration packs
holding its rollouts, its training groups trained, dropped by the tree builder, or left out as too stale, and the
mean reward of its scored rollouts (status ok or timeout; not the demonstrations) with each named part
(``RolloutFinished.rewards``: ``rule``, and ``judge`` with a rubric judge), "n/a" when none was scored.
A group counts as trained when an RL step's ``PolicyUpdated`` lists it (``groups``; logs written before that field
show ``?``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import msgspec

from pipeline.core.eventlog import EventLogReader
from pipeline.messages import (
    GroupDropped,
    ModelCall,
    PolicyUpdated,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
    TreeGroup,
    ids,
)


class HarnessStats(msgspec.Struct, kw_only=True):
    harness: str
    rollouts: int = 0
    demonstrations: int = 0
    statuses: dict[str, int] = msgspec.field(default_factory=dict)
    settled: int = 0
    calls: int = 0
    calls_per_rollout: float = 0.0
    input_tokens_per_call: float = 0.0
    max_input_tokens: int = 0
    output_tokens_per_call: float = 0.0
    harness_s_mean: float = 0.0  # started to exited, per rollout
    harness_s_max: float = 0.0
    sft_packs: int = 0  # demonstration packs holding at least one of its rollouts
    groups_trained: int | None = None  # its groups an RL step trained on (None: the log does not say)
    groups_dropped: int = 0  # GroupDropped by the tree builder (too few valid rollouts)
    scored: int = 0  # rollouts with a reward: status ok or timeout, demonstrations not counted
    reward_mean: float | None = None  # over the scored rollouts (None: none)
    reward_parts: dict[str, float] = msgspec.field(default_factory=dict)  # part -> its mean where present


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 2) if xs else 0.0


def report(log_path: Path) -> list[HarnessStats]:
    """Per-harness numbers of the run in ``log_path`` (see the module docstring), in order of first use."""
    harness_of: dict[str, str] = {}  # rollout id -> harness
    group_harness: dict[str, str] = {}
    purpose_of: dict[str, str] = {}
    finished: dict[str, RolloutFinished] = {}
    settled: set[str] = set()
    calls: dict[str, list[ModelCall]] = defaultdict(list)
    packs: list[TreeGroup] = []
    dropped: list[str] = []  # training groups the tree builder dropped
    updates: list[PolicyUpdated] = []
    for ev in EventLogReader(log_path):
        m = ev.msg
        if isinstance(m, RolloutRequest):
            harness_of.setdefault(m.rollout_id, m.harness)
            group_harness.setdefault(m.group_id, m.harness)
            purpose_of[m.rollout_id] = m.purpose
        elif isinstance(m, RolloutFinished):
            finished[m.rollout_id] = m
        elif isinstance(m, SettledRollout):
            settled.add(m.request.rollout_id)
        elif isinstance(m, ModelCall):
            calls[m.rollout_id].append(m)
        elif isinstance(m, TreeGroup) and m.purpose == "sft" and ev.src.startswith("tree."):
            packs.append(m)
        elif isinstance(m, GroupDropped) and m.purpose != "sft" and ev.src.startswith("tree."):
            dropped.append(m.group_id)
        elif isinstance(m, PolicyUpdated) and ev.src.startswith("learner."):
            updates.append(m)
    # logs written before PolicyUpdated.groups cannot say which groups a step trained
    listed = any(u.groups for u in updates)
    trained = [g for u in updates if u.step > 0 for g in u.groups]
    stats: dict[str, HarnessStats] = {}
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rid, h in harness_of.items():
        s = stats.setdefault(h, HarnessStats(harness=h))
        s.rollouts += 1
        s.demonstrations += purpose_of.get(rid) == "sft"
        s.settled += rid in settled
        fin = finished.get(rid)
        if fin is not None:
            _add_finished(s, per[h], fin, demonstration=purpose_of.get(rid) == "sft")
        cs = calls.get(rid, [])
        per[h]["calls"].append(len(cs))
        for c in cs:
            per[h]["in"].append(len(ids(c.input_ids)))
            per[h]["out"].append(len(ids(c.output_ids)))
    for h, s in stats.items():
        p = per[h]
        s.calls = int(sum(p["calls"]))
        s.calls_per_rollout = _mean(p["calls"])
        s.input_tokens_per_call = _mean(p["in"])
        s.max_input_tokens = int(max(p["in"], default=0))
        s.output_tokens_per_call = _mean(p["out"])
        s.harness_s_mean = _mean(p["harness_s"])
        s.harness_s_max = round(max(p["harness_s"], default=0.0), 2)
        s.sft_packs = sum(any(harness_of.get(r.rollout_id) == h for r in g.rollouts) for g in packs)
        s.groups_dropped = sum(group_harness.get(g) == h for g in dropped)
        s.groups_trained = sum(group_harness.get(g) == h for g in trained) if listed else None
        s.scored = len(p["reward"])
        s.reward_mean = _mean(p["reward"]) if p["reward"] else None
        s.reward_parts = {k[5:]: _mean(v) for k, v in p.items() if k.startswith("part:")}
    return list(stats.values())


def _add_finished(s: HarnessStats, per: dict[str, list[float]], fin: RolloutFinished, *, demonstration: bool) -> None:
    s.statuses[fin.status] = s.statuses.get(fin.status, 0) + 1
    if fin.status in ("ok", "timeout") and not demonstration:
        per["reward"].append(fin.reward)
        for part, v in fin.rewards.items():
            per["part:" + part].append(v)
    t = fin.timings
    if t.sandbox_ready and t.harness_done:
        per["harness_s"].append(t.harness_done - t.sandbox_ready)


def text(stats: list[HarnessStats]) -> str:
    head = (f"{'harness':<22}{'rollouts':>9}{'demos':>6}{'settled':>8}{'calls/r':>8}{'in tok/call':>12}"
            f"{'max in':>8}{'out tok/call':>13}{'run s':>7}{'max s':>7}{'sft packs':>10}{'trained':>8}{'dropped':>8}"
            "  statuses; reward")
    lines = [head]
    for s in stats:
        st = ", ".join(f"{k} {v}" for k, v in sorted(s.statuses.items(), key=lambda kv: -kv[1]))
        lines.append(f"{s.harness:<22}{s.rollouts:>9}{s.demonstrations:>6}{s.settled:>8}{s.calls_per_rollout:>8.1f}"
                     f"{s.input_tokens_per_call:>12.0f}{s.max_input_tokens:>8}{s.output_tokens_per_call:>13.1f}"
                     f"{s.harness_s_mean:>7.1f}{s.harness_s_max:>7.1f}{s.sft_packs:>10}"
                     f"{'?' if s.groups_trained is None else s.groups_trained:>8}"
                     f"{s.groups_dropped:>8}  {st}; {_reward_text(s)}")
    return "\n".join(lines)


def _reward_text(s: HarnessStats) -> str:
    if s.reward_mean is None:
        return "reward n/a (0 scored)"
    parts = ", ".join(f"{k} {v:.2f}" for k, v in s.reward_parts.items())
    return f"reward {s.reward_mean:.2f}" + (f" ({parts})" if parts else "") + f" over {s.scored} scored"
