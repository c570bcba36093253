"""Rollouts read back from event logs: for reports (``run.py --replay --trees``) and as demonstrations for the cold
start (``[scheduler].sft_recordings``: runs recorded earlier, e.g. an ``--eval`` of a teacher model or a ``--serve``
session driven by hand, filtered by their verifier's reward: rejection sampling).

A training or evaluation run's log holds each rollout's ``SettledRollout``. A log recorded with ``--serve`` or cut by
a crash has only the call records: such rollouts are rebuilt from the ``ModelCall`` and ``CallFailed`` records alone,
and have no verdict.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from pipeline.core.eventlog import MAGIC, EventLogReader
from pipeline.messages import CallFailed, ModelCall, RolloutFinished, RolloutRequest, SettledRollout


@dataclass
class _Seen:
    request: RolloutRequest | None = None
    finished: RolloutFinished | None = None
    calls: list[ModelCall] = field(default_factory=list)
    failed: list[CallFailed] = field(default_factory=list)


@dataclass
class Recorded:
    rollout: SettledRollout
    settled: bool  # the log held its SettledRollout (else it was rebuilt from the call records)
    verified: bool  # the log held its verdict (else it is built as if it had ended "ok")


def recorded_rollouts(log_path: Path) -> list[Recorded]:
    """Every rollout with a model call, in the order rollouts first appear in the log. One without a verdict (a
    ``--serve`` recording, or a run cut before its verifier ran) is built as if it had ended ``ok``."""
    settled: dict[str, SettledRollout] = {}
    seen: dict[str, _Seen] = defaultdict(_Seen)
    order: list[str] = []
    for ev in EventLogReader(log_path):
        m = ev.msg
        rid = getattr(m, "rollout_id", None) or (m.request.rollout_id if isinstance(m, SettledRollout) else None)
        if rid is None:
            continue
        if rid not in seen:
            order.append(rid)
        s = seen[rid]
        if isinstance(m, SettledRollout):
            settled[rid] = m
        elif isinstance(m, RolloutRequest):
            s.request = m
        elif isinstance(m, RolloutFinished):
            s.finished = m
        elif isinstance(m, ModelCall):
            s.calls.append(m)
        elif isinstance(m, CallFailed):
            s.failed.append(m)
    out: list[Recorded] = []
    for rid in order:
        if rid in settled:
            out.append(Recorded(settled[rid], settled=True, verified=True))
            continue
        s = seen[rid]
        if not s.calls:
            continue
        request = s.request or RolloutRequest(rollout_id=rid, group_id=rid, index=0, group_size=1, task_id="",
                                              harness="unknown", token="", policy_version=0)
        finished = s.finished or RolloutFinished(rollout_id=rid, group_id=request.group_id, status="ok")
        out.append(Recorded(SettledRollout(request=request, finished=finished, calls=s.calls, failed_calls=s.failed),
                            settled=False, verified=s.finished is not None))
    return out


class Recordings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[scheduler].sft_recordings``: earlier runs' rollouts as cold-start demonstrations."""

    logs: list[str]  # event logs (a run folder's events.msgpack; a --serve recording)
    # rejection sampling: a rollout is kept when it ended "ok" and its verifier gave at least this reward
    min_reward: float = 1.0
    # also keep rollouts no verifier scored (a --serve session driven by hand: the person is the judge)
    unverified: bool = False

    def problem(self) -> str:
        if not self.logs:
            return "logs is empty: name the event logs to learn from (a run folder's events.msgpack)"
        missing = [p for p in self.logs if not Path(p).is_file()]
        if missing:
            return (f"logs: no such file {', '.join(map(repr, missing))} (give a run folder's events.msgpack, or the "
                    "log a --serve session wrote)")
        for p in self.logs:
            with open(p, "rb") as f:
                head = f.read(len(MAGIC))
            if head != MAGIC:
                return f"logs: {p!r} is not a bridle event log (it does not start with {MAGIC!r})"
        return ""


@dataclass
class Selected:
    """The demonstrations kept, and how many rollouts each log offered, by why they were left out."""

    rollouts: list[SettledRollout]
    seen: int = 0
    left_out: Counter[str] = field(default_factory=Counter)


def select_demonstrations(rec: Recordings) -> Selected:
    """The rollouts of ``rec.logs`` to train on, as demonstrations: every call kept, each rollout its own group.

    Their ids are renamed ``recNNNNN`` (``rollout_id`` in the request, the verdict and every call) so that logs of
    different runs, or one log named twice, never share an id with each other or with this run's rollouts."""
    out = Selected(rollouts=[])
    for log in rec.logs:
        for r in recorded_rollouts(Path(log)):
            out.seen += 1
            reason = _left_out(r, rec)
            if reason:
                out.left_out[reason] += 1
                continue
            out.rollouts.append(_renamed(r.rollout, f"rec{len(out.rollouts):05d}"))
    return out


def _left_out(r: Recorded, rec: Recordings) -> str:
    s = r.rollout
    if not any(c.label == "main" for c in s.calls):
        return "no model call"
    if not r.verified:
        return "" if rec.unverified else "no verdict (unverified = false)"
    if s.finished.status != "ok":
        return f"status {s.finished.status}"
    if s.finished.reward < rec.min_reward:
        return f"reward below {rec.min_reward:g}"
    return ""


def _renamed(s: SettledRollout, rid: str) -> SettledRollout:
    r = msgspec.structs.replace
    return r(s, request=r(s.request, rollout_id=rid, group_id=rid, index=0, group_size=1, purpose="sft"),
             finished=r(s.finished, rollout_id=rid, group_id=rid),
             calls=[r(c, rollout_id=rid) for c in s.calls],
             failed_calls=[r(c, rollout_id=rid) for c in s.failed_calls])


def with_total(rollouts: Sequence[SettledRollout], total: int) -> list[SettledRollout]:
    """The rollouts as demonstrations of a cold start of ``total`` in all (``RolloutRequest.demonstrations``)."""
    return [msgspec.structs.replace(s, request=msgspec.structs.replace(s.request, demonstrations=total))
            for s in rollouts]
