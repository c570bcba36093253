"""Converters from the three wire protocols' request bodies into the internal conversation
(:mod:`pipeline.tokens.conversation`).

    conv = from_chat(body)        # OpenAI Chat Completions
    conv = from_anthropic(body)   # Anthropic Messages (role "system" inside messages is accepted)
    conv = from_responses(body)   # OpenAI Responses (Codex: namespaced tools, reasoning items)

Conversion rules worth knowing:
- Text blocks of one message are joined with ``"\\n"``; an image becomes the placeholder text ``[image]`` at its
  place (and counts in ``Message.images``).
- ``developer`` is a system message. Anthropic's top-level ``system`` and Responses' ``instructions`` become the
  first system message.
- Anthropic ``tool_result`` blocks become ``tool`` messages placed before the rest of that user message's text.
- Tool-call arguments are parsed into a dict when they are a JSON object; otherwise the raw string is kept.
- Codex namespaced tools ``{"type":"namespace","name":NS,"tools":[...]}`` and function calls carrying
  ``namespace`` are flattened to one name ``NS__name`` (``Tool.namespace`` keeps NS so the proxy can answer with
  the original pair: :meth:`Conversation.wire_tool`).
Bad bodies raise :class:`ConversionError` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.tokens.conversation import (
    IMAGE_PLACEHOLDER,
    NAMESPACE_SEP,
    Conversation,
    Message,
    RequestedSampling,
    Tool,
    ToolCall,
)


class ConversionError(ValueError):
    """A request body that cannot be converted; the message names the offending field."""


# ---------------------------------------------------------------------------------------------- helpers
def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConversionError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConversionError(f"{where}: expected a JSON array, got {type(value).__name__}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConversionError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _args(raw: Any) -> Any:
    """Tool-call arguments as a dict when they are a JSON object (string or already decoded)."""
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            val = json.loads(raw)
        except (ValueError, RecursionError):
            return raw
        return val if isinstance(val, dict) else raw
    return raw


def _text_parts(content: Any, where: str, text_types: tuple[str, ...]) -> tuple[str, int]:
    """Join text blocks with newlines; images become placeholders. Returns (text, image count)."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    parts: list[str] = []
    images = 0
    for i, block in enumerate(_list(content, where)):
        if isinstance(block, str):
            parts.append(block)
            continue
        b = _obj(block, f"{where}[{i}]")
        kind = b.get("type")
        if kind in text_types:
            parts.append(_str(b.get("text", ""), f"{where}[{i}].text"))
        elif kind in ("image", "image_url", "input_image"):
            parts.append(IMAGE_PLACEHOLDER)
            images += 1
        elif kind == "refusal":
            parts.append(_str(b.get("refusal", ""), f"{where}[{i}].refusal"))
        # documents, search results, cache markers and future block types carry nothing we render
    return "\n".join(parts), images


def _sampling(body: dict[str, Any], max_keys: tuple[str, ...], stop_key: str) -> RequestedSampling:
    s = RequestedSampling(stream=bool(body.get("stream", False)))
    for k in max_keys:
        if body.get(k) is not None:
            v = body[k]
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConversionError(f"{k}: expected an integer, got {v!r}")
            s.max_tokens = v
            break
    for k in ("temperature", "top_p"):
        v = body.get(k)
        if v is not None:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConversionError(f"{k}: expected a number, got {v!r}")
            setattr(s, k, float(v))
    v = body.get("top_k")
    if v is not None:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConversionError(f"top_k: expected an integer, got {v!r}")
        s.top_k = v
    stop = body.get(stop_key)
    if isinstance(stop, str):
        s.stop = [stop]
    elif stop is not None:
        s.stop = [_str(x, f"{stop_key}[{i}]") for i, x in enumerate(_list(stop, stop_key))]
    return s


def _name_calls(messages: list[Message]) -> None:
    """Fill in tool-result names from the calls they answer (templates and parsers like to know them)."""
    names: dict[str, str] = {}
    for m in messages:
        for c in m.tool_calls:
            if c.id:
                names[c.id] = c.name
        if m.role == "tool" and not m.name and m.tool_call_id in names:
            m.name = names[m.tool_call_id]


# ------------------------------------------------------------------------------------ chat completions
def from_chat(body: dict[str, Any]) -> Conversation:
    """OpenAI Chat Completions request body -> Conversation."""
    body = _obj(body, "body")
    msgs: list[Message] = []
    for i, raw in enumerate(_list(body.get("messages"), "messages")):
        where = f"messages[{i}]"
        m = _obj(raw, where)
        role = m.get("role")
        text, images = _text_parts(
            m.get("content"), f"{where}.content", ("text", "input_text", "output_text")
        )
        if role in ("system", "developer"):
            msgs.append(Message(role="system", content=text, images=images))
        elif role == "user":
            msgs.append(Message(role="user", content=text, images=images))
        elif role == "assistant":
            calls = []
            for j, tc in enumerate(m.get("tool_calls") or []):
                tcw = f"{where}.tool_calls[{j}]"
                fn = _obj(_obj(tc, tcw).get("function"), f"{tcw}.function")
                calls.append(
                    ToolCall(
                        id=str(tc.get("id") or ""),
                        name=_str(fn.get("name"), f"{tcw}.function.name"),
                        arguments=_args(fn.get("arguments")),
                    )
                )
            thinking = m.get("reasoning_content") or m.get("reasoning") or ""
            msgs.append(
                Message(
                    role="assistant",
                    content=text,
                    thinking=thinking if isinstance(thinking, str) else "",
                    tool_calls=calls,
                    images=images,
                )
            )
        elif role in ("tool", "function"):
            msgs.append(
                Message(
                    role="tool",
                    content=text,
                    tool_call_id=str(m.get("tool_call_id") or ""),
                    name=str(m.get("name") or ""),
                    images=images,
                )
            )
        else:
            raise ConversionError(
                f"{where}.role: unknown role {role!r} (system/developer/user/assistant/tool)"
            )
    _name_calls(msgs)
    tools = []
    for i, t in enumerate(body.get("tools") or []):
        tw = f"tools[{i}]"
        t = _obj(t, tw)
        if t.get("type", "function") != "function":
            continue  # only function tools can be called by a chat-template model
        fn = _obj(t.get("function"), f"{tw}.function")
        tools.append(
            Tool(
                name=_str(fn.get("name"), f"{tw}.function.name"),
                description=str(fn.get("description") or ""),
                parameters=fn.get("parameters") or {},
            )
        )
    return Conversation(
        messages=msgs,
        tools=tools,
        sampling=_sampling(body, ("max_completion_tokens", "max_tokens"), "stop"),
        model=str(body.get("model") or ""),
        protocol="chat",
    )


# ------------------------------------------------------------------------------------ anthropic messages
# Claude Code's first system block is request metadata for Anthropic's API, not an instruction: its version, entry
# point and a fingerprint of the conversation's first user message (``cc_version=2.1.197.2a3``; 7 values over 100
# create_word tasks). Left in, every task's prompt would differ 22 tokens into Claude Code's 18.8k: no prefix shared
# across tasks in the engine's cache, nor in a training tree (an SFT pack of 64 demonstrations: 210k tokens).
ATTRIBUTION = "x-anthropic-billing-header:"


def attribution(system: Any) -> str:
    """The attribution blocks of an Anthropic ``system`` field, joined (what call labels read: Claude Code marks a
    subagent's requests ``cc_is_subagent=true`` there)."""
    if not isinstance(system, list):
        return ""
    return "\n".join(b["text"] for b in system if _is_attribution(b))


def _is_attribution(block: Any) -> bool:
    return (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
            and block["text"].startswith(ATTRIBUTION))


def from_anthropic(body: dict[str, Any]) -> Conversation:
    """Anthropic Messages request body -> Conversation (Claude Code's shape included). The policy never sees the
    attribution block (``ATTRIBUTION``)."""
    body = _obj(body, "body")
    msgs: list[Message] = []
    raw_system = body.get("system")
    if isinstance(raw_system, list):
        raw_system = [b for b in raw_system if not _is_attribution(b)]
    system, images = _text_parts(raw_system, "system", ("text",))
    if system or images:
        msgs.append(Message(role="system", content=system, images=images))
    for i, raw in enumerate(_list(body.get("messages"), "messages")):
        where = f"messages[{i}]"
        m = _obj(raw, where)
        role = m.get("role")
        content = m.get("content")
        if role == "system":
            text, images = _text_parts(content, f"{where}.content", ("text",))
            msgs.append(Message(role="system", content=text, images=images))
        elif role == "user":
            msgs += _anthropic_user(content, where)
        elif role == "assistant":
            msgs.append(_anthropic_assistant(content, where))
        else:
            raise ConversionError(f"{where}.role: unknown role {role!r} (user/assistant/system)")
    _name_calls(msgs)
    return Conversation(
        messages=msgs,
        tools=_anthropic_tools(body.get("tools")),
        sampling=_sampling(body, ("max_tokens",), "stop_sequences"),
        model=str(body.get("model") or ""),
        protocol="anthropic",
    )


def _anthropic_user(content: Any, where: str) -> list[Message]:
    """A user message: its tool_result blocks as tool messages, then the rest of it as one user message."""
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    msgs: list[Message] = []
    rest: list[Any] = []
    for j, block in enumerate(_list(content, f"{where}.content")):
        b = _obj(block, f"{where}.content[{j}]")
        if b.get("type") == "tool_result":
            text, images = _text_parts(b.get("content"), f"{where}.content[{j}].content", ("text",))
            msgs.append(Message(role="tool", content=text, tool_call_id=str(b.get("tool_use_id") or ""),
                                is_error=bool(b.get("is_error", False)), images=images))
        else:
            rest.append(b)
    if rest:
        text, images = _text_parts(rest, f"{where}.content", ("text",))
        msgs.append(Message(role="user", content=text, images=images))
    return msgs


def _anthropic_assistant(content: Any, where: str) -> Message:
    """An assistant message: its text, thinking and tool_use blocks."""
    if isinstance(content, str):
        return Message(role="assistant", content=content)
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(_list(content, f"{where}.content")):
        bw = f"{where}.content[{j}]"
        b = _obj(block, bw)
        kind = b.get("type")
        if kind == "text":
            texts.append(_str(b.get("text", ""), f"{bw}.text"))
        elif kind == "thinking":
            thinking.append(_str(b.get("thinking", ""), f"{bw}.thinking"))
        elif kind == "tool_use":
            calls.append(ToolCall(id=str(b.get("id") or ""), name=_str(b.get("name"), f"{bw}.name"),
                                  arguments=_args(b.get("input"))))
        # redacted_thinking and server-side tool blocks carry nothing the policy produced here
    return Message(role="assistant", content="\n".join(texts), thinking="\n".join(thinking), tool_calls=calls)


def _anthropic_tools(raw: Any) -> list[Tool]:
    tools = []
    for i, t in enumerate(raw or []):
        t = _obj(t, f"tools[{i}]")
        if "input_schema" not in t:
            continue  # server tools (web_search_2025…, bash_2025…) are Anthropic-hosted, not ours to call
        name = _str(t.get("name"), f"tools[{i}].name")
        tools.append(Tool(name=name, description=str(t.get("description") or ""),
                          parameters=t.get("input_schema") or {}))
    return tools


# ---------------------------------------------------------------------------------------- responses
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "the tool's freeform input"}},
    "required": ["input"],
}


def _responses_tools(raw: Any) -> list[Tool]:
    tools: list[Tool] = []
    for i, t in enumerate(raw or []):
        _add_responses_tool(tools, _obj(t, f"tools[{i}]"), f"tools[{i}]", "")
    return tools


# A module function, not a closure: a closure that calls itself is a reference cycle, left for the cyclic GC on
# every call (tests/serving/test_proxy_fastpath.py checks a call leaves none).
def _add_responses_tool(tools: list[Tool], t: dict[str, Any], where: str, namespace: str) -> None:
    kind = t.get("type", "function")
    if kind == "namespace":
        ns = _str(t.get("name"), f"{where}.name")
        for j, sub in enumerate(_list(t.get("tools") or [], f"{where}.tools")):
            _add_responses_tool(tools, _obj(sub, f"{where}.tools[{j}]"), f"{where}.tools[{j}]", ns)
        return
    if kind not in ("function", "custom"):
        return  # hosted tools (web_search, file_search, …) are not callable by our policy
    name = _str(t.get("name"), f"{where}.name")
    flat = f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name
    if kind == "custom":
        tools.append(
            Tool(
                name=flat,
                description=str(t.get("description") or ""),
                parameters=_CUSTOM_PARAMETERS,
                kind="custom",
                namespace=namespace,
            )
        )
    else:
        tools.append(
            Tool(
                name=flat,
                description=str(t.get("description") or ""),
                parameters=t.get("parameters") or {},
                namespace=namespace,
            )
        )


def from_responses(body: dict[str, Any]) -> Conversation:
    """OpenAI Responses request body -> Conversation (Codex's shape included).

    Consecutive assistant-side items (reasoning, assistant message, function calls) form one assistant turn, as
    one response produced them; a reasoning item after text or calls starts the next turn.
    """
    body = _obj(body, "body")
    msgs: list[Message] = []
    instructions = body.get("instructions")
    if instructions:
        msgs.append(Message(role="system", content=_str(instructions, "instructions")))
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    turns = _Turns(msgs)
    for i, raw in enumerate(_list(items if items is not None else [], "input")):
        where = f"input[{i}]"
        it = _obj(raw, where)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            _responses_message(turns, it, where)
        elif kind == "reasoning":
            _responses_reasoning(turns, it, where)
        elif kind in _CALL_ITEMS:
            call = _responses_call(it, kind, where)
            turns.turn().tool_calls.append(call)
        elif kind in _CALL_OUTPUT_ITEMS:
            turns.close()
            text, images = _text_parts(it.get("output"), f"{where}.output", _RESPONSES_TEXT)
            call_id = str(it.get("call_id") or it.get("id") or "")
            msgs.append(Message(role="tool", content=text, tool_call_id=call_id, images=images))
        elif kind is None:
            raise ConversionError(f"{where}: item has neither type nor role")
        # web_search_call, item_reference, compaction markers and other hosted items are not policy tokens
    _name_calls(msgs)
    return Conversation(
        messages=msgs,
        tools=_responses_tools(body.get("tools")),
        sampling=_sampling(body, ("max_output_tokens",), "stop"),
        model=str(body.get("model") or ""),
        protocol="responses",
    )


_RESPONSES_TEXT = ("input_text", "output_text", "text")  # the text blocks of messages and call outputs
_CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call")
_CALL_OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")


class _Turns:
    """The messages of a Responses input as they are assembled: the assistant turn being built, if any."""

    def __init__(self, msgs: list[Message]) -> None:
        self.msgs = msgs
        self.cur: Message | None = None

    def turn(self) -> Message:
        """The assistant turn being built, started (appended) if there is none."""
        if self.cur is None:
            self.cur = Message(role="assistant")
            self.msgs.append(self.cur)
        return self.cur

    def close(self) -> None:
        self.cur = None


def _responses_message(turns: _Turns, it: dict[str, Any], where: str) -> None:
    """A message item: assistant text joins the current turn (a new one after calls); others stand alone."""
    role = it.get("role")
    text, images = _text_parts(it.get("content"), f"{where}.content", (*_RESPONSES_TEXT, "summary_text"))
    if role == "assistant":
        t = turns.turn()
        if t.tool_calls:
            turns.close()
            t = turns.turn()
        t.content = f"{t.content}\n{text}" if t.content else text
        t.images += images
        return
    turns.close()
    if role in ("system", "developer"):
        turns.msgs.append(Message(role="system", content=text, images=images))
    elif role == "user":
        turns.msgs.append(Message(role="user", content=text, images=images))
    else:
        raise ConversionError(f"{where}.role: unknown role {role!r} (user/assistant/system/developer)")


def _responses_reasoning(turns: _Turns, it: dict[str, Any], where: str) -> None:
    """A reasoning item: the thinking of the current turn, or of the next one after its text or calls."""
    parts = it.get("content") or it.get("summary") or []
    text, _ = _text_parts(parts, f"{where}.content", ("reasoning_text", "summary_text", "text"))
    if turns.cur is not None and (turns.cur.content or turns.cur.tool_calls):
        turns.close()
    t = turns.turn()
    t.thinking = f"{t.thinking}\n{text}" if t.thinking else text


def _responses_call(it: dict[str, Any], kind: str, where: str) -> ToolCall:
    """A function, custom-tool or local-shell call item as a ToolCall (namespaced names flattened)."""
    call_id = str(it.get("call_id") or it.get("id") or "")
    if kind == "function_call":
        name = _str(it.get("name"), f"{where}.name")
        ns = it.get("namespace")
        if ns:
            name = f"{_str(ns, f'{where}.namespace')}{NAMESPACE_SEP}{name}"
        args = _args(it.get("arguments"))
    elif kind == "custom_tool_call":
        name = _str(it.get("name"), f"{where}.name")
        args = {"input": _str(it.get("input", ""), f"{where}.input")}
    else:
        name = "local_shell"
        args = it.get("action") or {}
    return ToolCall(id=call_id, name=name, arguments=args)
