"""Parse one generated assistant turn, once, non-streaming: thinking, text, and Qwen/Hermes tool calls.

    parsed = parse_output(tokenizer.decode(output_ids))

The model writes tool calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one or several
per turn) after optional text, and may open with ``<think>…</think>``. A call whose JSON does not parse, lacks a
name, or is cut off stays in ``text`` verbatim and sets ``malformed`` (with the reason in ``errors``); parsing
never raises, so the harness gets back what the model wrote and can react to it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pipeline.tokens.conversation import ToolCall

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
END_MARKERS = ("<|im_end|>", "<|endoftext|>")


class ParsedOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    malformed: bool = False  # some <tool_call> could not be parsed and was left in text
    errors: list[str] = msgspec.field(default_factory=list)


def split_thinking(text: str) -> tuple[str, str]:
    """(thinking, rest). Follows Qwen3's template: thinking is what precedes ``</think>`` (after ``<think>``),
    stripped of newlines at its ends; the rest loses its leading newlines. An unclosed ``<think>`` (cut off by the
    token limit) makes everything after it thinking."""
    if THINK_CLOSE in text:
        head, _, rest = text.partition(THINK_CLOSE)
        thinking = head.split(THINK_OPEN)[-1]
        return thinking.strip("\n"), rest.lstrip("\n")
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN) :].strip("\n"), ""
    return "", text


def _strip_end(text: str) -> str:
    changed = True
    while changed:
        changed = False
        for m in END_MARKERS:
            if text.endswith(m):
                text = text[: -len(m)]
                changed = True
    return text


_decoder = json.JSONDecoder()


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _as_call(obj: Any) -> ToolCall | str:
    """A ToolCall, or the reason the decoded JSON is not one."""
    if not isinstance(obj, dict):
        return "tool call JSON is not an object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "tool call has no string 'name'"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # some models double-encode; accept a string that holds a JSON object
        try:
            args = json.loads(args)
        except ValueError:
            return f"arguments of {name!r} are a string that is not JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"arguments of {name!r} are not a JSON object"
    return ToolCall(name=name, arguments=args)


def _next_call(s: str, i: int) -> tuple[ToolCall | str, int]:
    """Parse the call whose ``<tool_call>`` starts at i: (call or error, end offset; -1 when never closed)."""
    j = _skip_ws(s, i + len(TOOL_OPEN))
    try:
        obj, end = _decoder.raw_decode(s, j)
    except ValueError as e:
        obj, end, err = None, -1, f"invalid JSON: {e}"
    else:
        k = _skip_ws(s, end)
        if s.startswith(TOOL_CLOSE, k):
            return _as_call(obj), k + len(TOOL_CLOSE)
        err = "text after the JSON object inside <tool_call>"
    close = s.find(TOOL_CLOSE, i + len(TOOL_OPEN))
    if close < 0:
        return "unclosed <tool_call> (output cut off?)", -1
    return err, close + len(TOOL_CLOSE)


def parse_output(text: str) -> ParsedOutput:
    """Split a decoded assistant turn into thinking, text and tool calls. Never raises."""
    thinking, rest = split_thinking(_strip_end(text))
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []  # text outside well-formed calls, in order
    pos = 0
    i = rest.find(TOOL_OPEN)
    while i >= 0:
        kept.append(rest[pos:i])
        res, end = _next_call(rest, i)
        if end < 0:
            errors.append(res if isinstance(res, str) else "unclosed <tool_call>")
            pos = i
            break
        if isinstance(res, ToolCall):
            calls.append(res)
        else:
            errors.append(res)
            kept.append(rest[i:end])
        pos = end
        i = rest.find(TOOL_OPEN, pos)
    kept.append(rest[pos:])
    # the template puts a newline between the text and each call; drop those separators, keep inner text as is
    out = "\n".join(p.strip("\n") for p in kept if p.strip("\n")) if calls or errors else rest
    return ParsedOutput(text=out, thinking=thinking, tool_calls=calls, malformed=bool(errors), errors=errors)
