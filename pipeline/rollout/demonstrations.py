"""Oracle demonstrations through any harness: the task's neutral oracle actions in the harness's own tools.

A task's ``oracle_actions`` use four neutral tools (``write_file{path, content}``, ``read_file{path}``,
``edit_file{path, old, new}``, ``bash{command}``; ``pipeline/rollout/tasks.py``). Each harness adapter declares a
:class:`DemoTools`: per neutral tool, the harness's tool name and its arguments as templates over the action's
arguments (``"{path}"``; the format spec ``sh`` shell-quotes: ``"cat {path:sh}"``). The scheduler turns the actions
into a script (one tool call per response, then a final text answer) that the proxy's scripted engine plays
through the real harness, so a demonstration is recorded exactly as a sampled rollout would be.
"""

from __future__ import annotations

import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The neutral tools and their arguments.
NEUTRAL_ARGS: dict[str, tuple[str, ...]] = {
    "write_file": ("path", "content"), "read_file": ("path",), "edit_file": ("path", "old", "new"),
    "bash": ("command",),
}
NEUTRAL_TOOLS = tuple(NEUTRAL_ARGS)


class _Formatter(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        if format_spec == "sh":
            return shlex.quote(str(value))
        return super().format_field(value, format_spec)


_FORMAT = _Formatter()


def _fill(template: Any, args: Mapping[str, str], where: str) -> Any:
    """``template`` (a string, or lists / dicts of them) with the action's arguments filled in."""
    if isinstance(template, str):
        try:
            return _FORMAT.vformat(template, (), args)
        except KeyError as e:
            raise ValueError(f"{where}: the template {template!r} uses {e}, which the action does not have "
                             f"(it has {', '.join(sorted(args))})") from None
    if isinstance(template, Mapping):
        return {k: _fill(v, args, where) for k, v in template.items()}
    if isinstance(template, Sequence):
        return [_fill(v, args, where) for v in template]
    return template


@dataclass(frozen=True)
class ToolForm:
    """One neutral tool as a harness calls it: the harness's tool name and its argument templates."""

    name: str
    args: Mapping[str, Any]


@dataclass(frozen=True)
class DemoTools:
    """A harness's tools for the four neutral oracle tools (see the module docstring)."""

    forms: Mapping[str, ToolForm]  # neutral tool -> how this harness calls it
    # The harness refuses to edit a file it has not read in this session (Claude Code): an edit of a file not yet
    # read or written is preceded by a read of it.
    read_before_edit: bool = False

    def __post_init__(self) -> None:
        missing = [t for t in NEUTRAL_TOOLS if t not in self.forms]
        if missing:
            raise ValueError(f"DemoTools: no form for the neutral tools {missing}")

    def calls(self, actions: Sequence[tuple[str, Mapping[str, str]]]) -> list[tuple[str, dict[str, Any]]]:
        """(tool name, arguments) of each call that plays ``actions`` ((neutral tool, arguments) pairs)."""
        seen: set[str] = set()
        out: list[tuple[str, dict[str, Any]]] = []
        for tool, args in actions:
            if tool not in self.forms:
                raise ValueError(f"unknown neutral tool {tool!r}; expected one of {', '.join(NEUTRAL_TOOLS)}")
            path = args.get("path", "")
            if self.read_before_edit and tool == "edit_file" and path not in seen:
                out.append(self._call("read_file", {"path": path}))
            if path:
                seen.add(path)
            out.append(self._call(tool, args))
        return out

    def _call(self, tool: str, args: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
        form = self.forms[tool]
        return form.name, _fill(dict(form.args), args, f"{tool} as {form.name}")


def same_arguments(names: Mapping[str, str]) -> DemoTools:
    """A harness whose tools take the neutral arguments unchanged, under the names ``names`` (neutral -> own)."""
    return DemoTools({t: ToolForm(names[t], {a: "{" + a + "}" for a in args}) for t, args in NEUTRAL_ARGS.items()})


def script(tools: DemoTools, actions: Sequence[tuple[str, Mapping[str, str]]],
           final_text: str = "Done.") -> list[dict[str, Any]]:
    """A scripted rollout: one response per tool call, then ``final_text``."""
    out: list[dict[str, Any]] = [{"tool_calls": [{"name": n, "arguments": a}]} for n, a in tools.calls(actions)]
    out.append({"text": final_text})
    return out
