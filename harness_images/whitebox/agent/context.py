"""C: context management. C0 keeps the full history; C1 replaces older turns with a summary (an extra model
call) above a budget; C2 writes the task's state to a file and starts a new segment (system + instruction +
state) above a budget. Sizes are counted in characters of content and tool calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .components import STATE_PREFIX, STATE_PROMPT, SUMMARY_PREFIX, SUMMARY_PROMPT

Ask = Callable[
    [list[dict]], str
]  # sends messages as an auxiliary ("compaction") call, returns the reply text


@dataclass(frozen=True)
class Budgets:
    summary_chars: int  # C1: summarize above this
    compaction_chars: int  # C2: new segment above this
    keep_recent: int  # C1: turns kept verbatim
    state_file: str  # C2: where the state is saved, relative to the workspace


class Rewrite(NamedTuple):
    """The context was replaced: the new messages, the transcript event (``summary`` or ``segment``) and its
    fields, and whether a new segment begins."""

    messages: list[dict]
    event: str
    record: dict
    new_segment: bool


def message_chars(messages: list[dict]) -> int:
    total = 0
    for m in messages:
        total += len(m.get("content") or "")
        for tc in m.get("tool_calls") or []:
            total += len(tc["function"]["name"]) + len(tc["function"]["arguments"])
    return total


def turn_groups(body: list[dict]) -> list[list[dict]]:
    """Split messages into groups that each start at an assistant message, so a group's tool calls and
    their results are never separated."""
    groups: list[list[dict]] = []
    for m in body:
        if m["role"] == "assistant" or not groups:
            groups.append([])
        groups[-1].append(m)
    return groups


def digest(messages: list[dict], outputs: dict[str, str]) -> str:
    """A mechanical account of messages, used when the model returns an empty summary. ``outputs`` maps a
    tool call id to its unwrapped result, so O1/O2 wrappers do not crowd out the content."""
    lines = []
    for m in messages:
        for tc in m.get("tool_calls") or []:
            lines.append(f"- called {tc['function']['name']} {tc['function']['arguments'][:120]}")
        if m["role"] == "tool":
            first = outputs.get(m["tool_call_id"], m.get("content") or "").strip().splitlines()
            lines.append(f"  -> {first[0][:120] if first else '(no output)'}")
        elif m["role"] in ("user", "assistant") and m.get("content"):
            lines.append(f"- {m['role']}: {m['content'].strip()[:200]}")
    return "\n".join(lines) or "(nothing yet)"


@dataclass
class Context:
    """C<level> for one episode. The first two messages are always the system prompt and the instruction."""

    level: int
    budgets: Budgets
    system: str
    instruction: str
    workspace: Path
    state: str = ""  # C2: the last state written

    def manage(self, messages: list[dict], outputs: dict[str, str], ask: Ask) -> Rewrite | None:
        """After a tool turn: the replacement of ``messages`` if they are over this level's budget."""
        chars = message_chars(messages)
        if self.level == 1 and chars > self.budgets.summary_chars:
            return self._summarize(messages, chars, outputs, ask)
        if self.level == 2 and chars > self.budgets.compaction_chars:
            return self._compact(messages, chars, outputs, ask)
        return None

    def _summarize(
        self, messages: list[dict], chars: int, outputs: dict[str, str], ask: Ask
    ) -> Rewrite | None:
        keep = self.budgets.keep_recent
        head, groups = messages[:2], turn_groups(messages[2:])
        if len(groups) <= keep:
            return None
        old, recent = groups[: len(groups) - keep], groups[len(groups) - keep :]
        summary, source = ask([*messages, {"role": "user", "content": SUMMARY_PROMPT}]).strip(), "model"
        old_msgs = [m for g in old for m in g]
        if not summary:
            summary, source = digest(old_msgs, outputs), "harness"
        new = head + [{"role": "user", "content": SUMMARY_PREFIX + summary}] + [m for g in recent for m in g]
        record = {
            "chars_before": chars,
            "chars_after": message_chars(new),
            "replaced_messages": len(old_msgs),
            "source": source,
            "summary": summary,
        }
        return Rewrite(new, "summary", record, new_segment=False)

    def _compact(self, messages: list[dict], chars: int, outputs: dict[str, str], ask: Ask) -> Rewrite | None:
        body = messages[2:]
        if not any(m["role"] == "assistant" for m in body):
            return None
        state, source = ask([*messages, {"role": "user", "content": STATE_PROMPT}]).strip(), "model"
        if not state:  # the model saw the earlier state in its context; the digest has to carry it along
            state, source = (self.state + "\n" if self.state else "") + digest(body, outputs), "harness"
        self.state = state
        state_file = self.budgets.state_file
        state_path = self.workspace / state_file
        state_path.parent.mkdir(parents=True, exist_ok=True)
        state_path.write_text(state + "\n", encoding="utf-8")
        new = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.instruction + STATE_PREFIX.format(path=state_file) + state},
        ]
        record = {
            "chars_before": chars,
            "chars_after": message_chars(new),
            "state_file": state_file,
            "source": source,
            "state": state,
        }
        return Rewrite(new, "segment", record, new_segment=True)
