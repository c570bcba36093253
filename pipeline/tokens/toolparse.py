"""Parse one generated assistant turn, once, non-streaming: thinking, text and tool calls, in the tool-call format
of the model's family.

    fmt = tool_format("hermes")                           # or detect_tool_format(chat_template, config)
    parsed = fmt.parse(tokenizer.decode(output_ids))      # what Renderer.parse does

A small registry, one entry per documented format (sources in docs/tokens.md):

- ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one or
  several per turn, after optional text.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the turn *is* the call, ``{"name": ...,
  "parameters": {...}}``, optionally after ``<|python_tag|>``; several separated by ``;``.
- ``mistral`` (Mistral models with the v3 tokenizer: Mistral-7B-Instruct-v0.3, Mistral-Nemo, ...):
  ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` after optional text.

Every format may open with ``<think>…</think>`` (reasoning models of any family). A call whose JSON does not parse,
lacks a name, or is cut off stays in ``text`` verbatim and sets ``malformed`` (the reason in ``errors``); parsing
never raises, so the harness gets back what the model wrote and can react to it.
"""

from __future__ import annotations

import json
import os
import re
import string
from typing import Any, ClassVar

import msgspec

from pipeline.tokens.conversation import ToolCall

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
# end-of-turn texts of the supported families, in case the engine's output still carries one
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>")


class ParsedOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    malformed: bool = False  # some tool call could not be parsed and was left in text
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


_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE) + r"\s*", re.DOTALL)


def without_reasoning(text: str) -> str:
    """``text`` with every ``<think>…</think>`` block (and the whitespace after it) removed."""
    return _THINK_BLOCK.sub("", text)


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
        except (ValueError, RecursionError):
            return f"arguments of {name!r} are a string that is not JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"arguments of {name!r} are not a JSON object"
    if too_deep(args, MAX_ARGS_DEPTH):
        return f"arguments of {name!r} are nested deeper than {MAX_ARGS_DEPTH} levels"
    return ToolCall(name=name, arguments=args)


# Nesting a policy may give a tool call's arguments: deeper ones would stop the JSON encoders the call later meets
# (orjson stops at 255 levels, Python's json near its recursion limit). No real tool takes arguments this deep.
MAX_ARGS_DEPTH = 64


def too_deep(obj: Any, limit: int) -> bool:
    """Whether decoded JSON ``obj`` nests lists and objects deeper than ``limit`` levels (iteratively: any depth)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        elif not isinstance(o, list):
            continue
        if d > limit:
            return True
        stack.extend((v, d + 1) for v in o if isinstance(v, dict | list))
    return False


class ToolFormat:
    """How one model family writes tool calls. ``parse`` never raises."""

    name: ClassVar[str] = ""
    parallel_calls: ClassVar[bool] = True  # the family's template renders several calls in one turn

    def call_id(self) -> str:
        """A fresh id for a call the model wrote without one, in a form this family's template accepts; "" lets
        the proxy pick its protocol's usual id."""
        return ""

    def parse(self, text: str) -> ParsedOutput:
        thinking, rest = split_thinking(_strip_end(text))
        return self.parse_calls(rest, thinking)

    def parse_calls(self, rest: str, thinking: str) -> ParsedOutput:
        raise NotImplementedError


class HermesFormat(ToolFormat):
    """``<tool_call>{json}</tool_call>`` blocks after optional text (Qwen2.5/Qwen3 and Hermes templates)."""

    name = "hermes"

    @staticmethod
    def _next_call(s: str, i: int) -> tuple[ToolCall | str, int]:
        """Parse the call whose ``<tool_call>`` starts at i: (call or error, end offset; -1 when never closed)."""
        j = _skip_ws(s, i + len(TOOL_OPEN))
        try:
            obj, end = _decoder.raw_decode(s, j)
        except (ValueError, RecursionError) as e:
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

    def parse_calls(self, rest: str, thinking: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        errors: list[str] = []
        kept: list[str] = []  # text outside well-formed calls, in order
        pos = 0
        i = rest.find(TOOL_OPEN)
        while i >= 0:
            kept.append(rest[pos:i])
            res, end = self._next_call(rest, i)
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


class Llama3JsonFormat(ToolFormat):
    """Llama 3.x JSON tool calling: the whole turn is ``{"name": ..., "parameters": {...}}`` (Meta's template
    renders one call per turn; ``;`` between several is accepted, as some fine-tunes write them)."""

    name = "llama3_json"
    parallel_calls = False

    def parse_calls(self, rest: str, thinking: str) -> ParsedOutput:
        body = rest.strip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            if tagged:  # built-in tools (brave_search.call(...)) are Python, not JSON: not supported
                return ParsedOutput(text=rest, thinking=thinking, malformed=True,
                                    errors=["<|python_tag|> not followed by a JSON tool call"])
            return ParsedOutput(text=rest, thinking=thinking)
        calls: list[ToolCall] = []
        pos = 0
        while True:
            try:
                obj, end = _decoder.raw_decode(body, pos)
            except (ValueError, RecursionError) as e:
                err = f"invalid JSON: {e}"
                break
            res = _as_call(obj)
            if isinstance(res, str):
                if not tagged and not calls and not (isinstance(obj, dict) and "name" in obj):
                    return ParsedOutput(text=rest, thinking=thinking)  # an answer that happens to be JSON
                err = res
                break
            calls.append(res)
            pos = _skip_ws(body, end)
            if pos == len(body):
                return ParsedOutput(thinking=thinking, tool_calls=calls)
            if body[pos] != ";":
                err = "text after the tool call JSON"
                break
            pos = _skip_ws(body, pos + 1)
        if not tagged and not calls and '"name"' not in body:
            return ParsedOutput(text=rest, thinking=thinking)  # broken JSON that was never meant as a call
        return ParsedOutput(text=rest, thinking=thinking, malformed=True, errors=[err])


_ID_CHARS = string.ascii_letters + string.digits


class MistralFormat(ToolFormat):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral's v3 tokenizer format). The template
    requires every call id to be 9 alphanumeric characters (it raises otherwise), so calls get such ids."""

    name = "mistral"

    def call_id(self) -> str:
        return "".join(_ID_CHARS[b % len(_ID_CHARS)] for b in os.urandom(9))

    def parse_calls(self, rest: str, thinking: str) -> ParsedOutput:
        i = rest.find(MISTRAL_CALLS)
        if i < 0:
            return ParsedOutput(text=rest.strip(), thinking=thinking)  # the template writes " " + content|trim
        try:
            items, end = _decoder.raw_decode(rest, _skip_ws(rest, i + len(MISTRAL_CALLS)))
        except (ValueError, RecursionError) as e:
            return self._malformed(rest, thinking, f"invalid JSON after [TOOL_CALLS]: {e}")
        if not isinstance(items, list) or not items:
            return self._malformed(rest, thinking, "[TOOL_CALLS] is not followed by a JSON array of calls")
        if rest[end:].strip():
            return self._malformed(rest, thinking, "text after the [TOOL_CALLS] array")
        calls = []
        for obj in items:
            res = _as_call(obj)
            if isinstance(res, str):
                return self._malformed(rest, thinking, res)
            cid = obj.get("id")
            ok = isinstance(cid, str) and len(cid) == 9 and cid.isascii() and cid.isalnum()
            calls.append(msgspec.structs.replace(res, id=cid if ok else self.call_id()))
        return ParsedOutput(text=rest[:i].strip(), thinking=thinking, tool_calls=calls)

    @staticmethod
    def _malformed(rest: str, thinking: str, err: str) -> ParsedOutput:
        return ParsedOutput(text=rest.strip(), thinking=thinking, malformed=True, errors=[err])


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}
HERMES = FORMATS["hermes"]

# model_type (config.json) -> format, for folders whose chat template names none of the markers below
_BY_MODEL_TYPE = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral",
}


def tool_format(name: str) -> ToolFormat:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return fmt


def detect_tool_format(chat_template: str | None, config: dict[str, Any] | None = None) -> tuple[str, str]:
    """(format name, why) for a model: markers its chat template writes first (a Llama fine-tune with a Hermes
    template writes Hermes calls), then config.json's ``model_type``, else ``hermes``."""
    t = chat_template or ""
    if TOOL_OPEN in t:
        return "hermes", f"the chat template writes {TOOL_OPEN}"
    if MISTRAL_CALLS in t:
        return "mistral", f"the chat template writes {MISTRAL_CALLS}"
    if PYTHON_TAG in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return "llama3_json", "the chat template writes Llama 3 JSON calls"
    model_type = str((config or {}).get("model_type", ""))
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type], f"config.json model_type {model_type!r}"
    return "hermes", "no known marker in the chat template or config.json (the default)"


def parse_output(text: str, fmt: str = "hermes") -> ParsedOutput:
    """Split a decoded assistant turn into thinking, text and tool calls. Never raises."""
    return tool_format(fmt).parse(text)
