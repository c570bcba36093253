"""Settling: deciding when a rollout's records are complete (docs/trees.md, "Settling").

Harnesses retry and clean up in the background, so the end of the harness process is not the end of its records.
A rollout is *settled* when its RolloutFinished has arrived, no call is pending (started but neither recorded nor
failed), and the number of records has not changed over ``checks`` consecutive checks ``interval_s`` apart. A
fixed ``timeout_s`` (from RolloutFinished) bounds the wait: the rollout is then settled as "timeout" and its
stragglers are reported so the proxy can abort them.

:class:`Settler` is pure bookkeeping driven by explicit times, so tests check it step by step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.config import PosFloat, PosInt, Section
from pipeline.messages import (
    CallFailed,
    CallStarted,
    ModelCall,
    RolloutFinished,
    RolloutRequest,
    SettledRollout,
)


class SettleSettings(Section):
    """``[collector]``: a finished rollout settles after ``settle_checks`` quiet checks ``settle_interval_s``
    apart, or at ``settle_timeout_s`` after it finished (its stragglers are then aborted)."""

    settle_checks: PosInt = 3  # N consecutive quiet checks
    settle_interval_s: PosFloat = 0.5  # Δ between checks
    settle_timeout_s: PosFloat = 60.0  # from RolloutFinished; then stragglers are cut
    reloadable = frozenset({"settle_checks", "settle_interval_s", "settle_timeout_s"})


@dataclass
class _Rollout:
    request: RolloutRequest | None = None
    finished: RolloutFinished | None = None
    finished_at: float = 0.0
    calls: dict[str, ModelCall] = field(default_factory=dict)
    failed: dict[str, CallFailed] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    last_count: int = -1
    quiet: int = 0
    last_check: float = 0.0

    @property
    def count(self) -> int:
        return len(self.calls) + len(self.failed) + len(self.started)

    @property
    def pending(self) -> set[str]:
        return self.started - self.calls.keys() - self.failed.keys()


@dataclass
class SettleStats:
    settled: int = 0
    timed_out: int = 0
    late_records: int = 0  # records for rollouts already settled (dropped, counted)
    duplicates: int = 0
    orphans: int = 0  # RolloutFinished for a rollout never requested


class Settler:
    def __init__(self, settings: SettleSettings | None = None) -> None:
        self.settings = settings or SettleSettings()
        self.rollouts: dict[str, _Rollout] = {}
        self.done: set[str] = set()
        self.stats = SettleStats()

    def _get(self, rollout_id: str) -> _Rollout | None:
        if rollout_id in self.done:
            self.stats.late_records += 1
            return None
        return self.rollouts.setdefault(rollout_id, _Rollout())

    def add(self, msg: object, now: float) -> None:
        if isinstance(msg, RolloutRequest):
            r = self._get(msg.rollout_id)
            if r is not None:
                r.request = msg
        elif isinstance(msg, CallStarted):
            r = self._get(msg.rollout_id)
            if r is not None:
                r.started.add(msg.call_id)
        elif isinstance(msg, ModelCall):
            r = self._get(msg.rollout_id)
            if r is not None:
                if msg.call_id in r.calls:
                    self.stats.duplicates += 1
                r.calls[msg.call_id] = msg
                r.started.add(msg.call_id)
        elif isinstance(msg, CallFailed):
            r = self._get(msg.rollout_id)
            if r is not None:
                r.failed[msg.call_id] = msg
                r.started.add(msg.call_id)
        elif isinstance(msg, RolloutFinished):
            r = self._get(msg.rollout_id)
            if r is not None:
                r.finished = msg
                r.finished_at = now
                r.last_check = now
                r.last_count = r.count  # the quiet streak counts from here

    def pending_calls(self, rollout_id: str) -> set[str]:
        r = self.rollouts.get(rollout_id)
        return set(r.pending) if r else set()

    def tick(self, now: float) -> list[SettledRollout]:
        """Run the checks that are due; return the rollouts that settled (quietly or by timeout)."""
        s = self.settings
        out: list[SettledRollout] = []
        for rid, r in list(self.rollouts.items()):
            if r.finished is None:
                continue
            if r.request is None:
                # Finished but never requested through the proxy: nothing can be trained from it.
                self.stats.orphans += 1
                del self.rollouts[rid]
                self.done.add(rid)
                continue
            if now - r.finished_at >= s.settle_timeout_s:
                out.append(self._settle(rid, r, "timeout"))
                continue
            if now - r.last_check < s.settle_interval_s:
                continue
            r.last_check = now
            count = r.count
            if r.pending or count != r.last_count:
                r.quiet = 0
            else:
                r.quiet += 1
            r.last_count = count
            if r.quiet >= s.settle_checks:
                out.append(self._settle(rid, r, "quiet"))
        return out

    def _settle(self, rid: str, r: _Rollout, how: str) -> SettledRollout:
        del self.rollouts[rid]
        self.done.add(rid)
        assert r.request is not None and r.finished is not None
        stragglers = len(r.pending)
        if how == "timeout":
            self.stats.timed_out += 1
        self.stats.settled += 1
        calls = sorted(r.calls.values(), key=lambda c: c.seq)
        return SettledRollout(
            request=r.request, finished=r.finished, calls=calls,
            failed_calls=sorted(r.failed.values(), key=lambda c: c.seq),
            settle=how, aborted_calls=stragglers,  # type: ignore[arg-type]
        )
