"""How a run's rollouts ended: counts by status and the first reason given for each failing status.

The live display, the end of a run (its exit code) and ``run.py --replay``'s summary all show the same lines, so a run
whose every rollout failed says why where a person looks, not only inside ``events.msgpack``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from pipeline.messages import RolloutFinished

REASON_CHARS = 160
# A reason may quote what a harness or Docker wrote: one line of printable text, never a terminal escape sequence.
_UNPRINTABLE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x1f\x7f-\x9f]+")


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    flat = " ".join(_UNPRINTABLE.sub(" ", text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@dataclass
class Outcomes:
    counts: Counter[str] = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)  # status other than ok -> the first reason given

    def add(self, fin: RolloutFinished) -> None:
        self.counts[fin.status] += 1
        if fin.status != "ok" and fin.status not in self.first:
            # the verdict's first line, cut; bridle's own notes after it ("note: ...") whole, they are short
            head, *rest = fin.details.split("\n") or [""]
            notes = [one_line(x, 400) for x in rest if x.startswith("note: ")]
            self.first[fin.status] = "; ".join([one_line(head) or "(no reason given)", *notes])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def none_succeeded(self) -> bool:
        """Rollouts ran and not one ended ok (its harness ran and its verifier scored it)."""
        return self.total > 0 and not self.counts["ok"]

    def counts_text(self) -> str:
        if not self.total:
            return "none finished yet"
        return ", ".join(f"{s} {n}" for s, n in self.counts.most_common())

    def reasons(self) -> list[str]:
        """One line per failing status, most frequent first: ``sandbox_error 32, first: <reason>``."""
        return [f"{s} {n}, first: {self.first[s]}" for s, n in self.counts.most_common() if s in self.first]

    def verdict(self) -> str:
        """What a run whose rollouts all failed says at its end."""
        return f"no rollout succeeded ({self.total} finished: {self.counts_text()}): " + " | ".join(self.reasons())
