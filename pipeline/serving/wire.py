"""The three wire protocols the proxy speaks, as response builders (docs/wire-protocols.md).

Each protocol turns one finished generation (a :class:`Reply`) into either a JSON body or the full sequence of
SSE frames, and knows its opening events, its keep-alive and its error shapes. The proxy streams in a *buffered*
way: opening events as soon as the engine has not answered within the proxy's first watch tick (<= 0.5 s),
keep-alives while it works, then every remaining event after the output was parsed once with the non-streaming
parser; a quicker answer goes out whole, in one write. These builders are pure functions of their inputs (plus fresh ids), so
they are tested frame by frame without a server.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from pipeline.tokens.conversation import Conversation, ToolCall
from pipeline.tokens.toolparse import ParsedOutput

Finish = Literal["stop", "length", "tool_calls"]
ErrorKind = Literal["invalid_request", "authentication", "not_found", "too_large", "overloaded", "context_length", "server"]


def new_id(prefix: str, n: int = 24) -> str:
    return prefix + os.urandom(16).hex()[:n]  # random hex like uuid4's, without building a UUID per id


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _args_json(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _args_obj(args: Any) -> dict[str, Any]:
    """Anthropic's ``input`` must be an object; a call whose JSON was not an object keeps its value under 'value'."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):
            return {"input": args}
        return parsed if isinstance(parsed, dict) else {"value": parsed}
    return {"value": args}


@dataclass
class Reply:
    """One finished generation, protocol-neutral."""

    parsed: ParsedOutput
    finish: Finish
    input_tokens: int
    output_tokens: int
    model: str
    conv: Conversation = field(default_factory=Conversation)

    @property
    def calls(self) -> list[ToolCall]:
        return self.parsed.tool_calls


@dataclass
class StreamState:
    """Ids shared by every frame of one streamed answer, and the Responses sequence counter."""

    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    include_usage: bool = False
    input_tokens: int = 0

    def next_seq(self) -> int:
        s = self.seq
        self.seq += 1
        return s


class Protocol:
    name: str
    id_prefix: str

    def new_state(self, model: str, input_tokens: int, include_usage: bool = False) -> StreamState:
        return StreamState(model=model, id=new_id(self.id_prefix), include_usage=include_usage,
                           input_tokens=input_tokens)

    def response(self, reply: Reply) -> dict[str, Any]:
        raise NotImplementedError

    def stream_open(self, st: StreamState) -> bytes:
        raise NotImplementedError

    def keepalive(self, st: StreamState) -> bytes:
        raise NotImplementedError

    def stream_rest(self, st: StreamState, reply: Reply) -> bytes:
        raise NotImplementedError

    def stream_error(self, st: StreamState, kind: ErrorKind, message: str) -> bytes:
        raise NotImplementedError

    def error(self, kind: ErrorKind, message: str) -> tuple[int, dict[str, Any]]:
        raise NotImplementedError


_STATUS = {
    "invalid_request": 400,
    "authentication": 401,
    "not_found": 404,
    "too_large": 413,
    "context_length": 400,
    "overloaded": 503,
    "server": 500,
}


# ------------------------------------------------------------------------------------- Chat Completions
class ChatCompletions(Protocol):
    name = "chat"
    id_prefix = "chatcmpl-"

    def _tool_calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        return [
            {"id": c.id or new_id("call_"), "type": "function",
             "function": {"name": c.name, "arguments": _args_json(c.arguments)}}
            for c in calls
        ]

    def response(self, reply: Reply) -> dict[str, Any]:
        p = reply.parsed
        msg: dict[str, Any] = {"role": "assistant", "content": p.text if (p.text or not p.tool_calls) else None}
        if p.thinking:
            msg["reasoning_content"] = p.thinking
        if p.tool_calls:
            msg["tool_calls"] = self._tool_calls(p.tool_calls)
        return {
            "id": new_id(self.id_prefix),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": reply.model,
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": reply.finish}],
            "usage": {
                "prompt_tokens": reply.input_tokens,
                "completion_tokens": reply.output_tokens,
                "total_tokens": reply.input_tokens + reply.output_tokens,
            },
        }

    def _chunk(self, st: StreamState, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({
            "id": st.id, "object": "chat.completion.chunk", "created": st.created, "model": st.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        })

    def stream_open(self, st: StreamState) -> bytes:
        return self._chunk(st, {"role": "assistant", "content": ""})

    def keepalive(self, st: StreamState) -> bytes:
        return b": keepalive\n\n"

    def stream_rest(self, st: StreamState, reply: Reply) -> bytes:
        p = reply.parsed
        out = []
        if p.thinking:
            out.append(self._chunk(st, {"reasoning_content": p.thinking}))
        if p.text:
            out.append(self._chunk(st, {"content": p.text}))
        for i, c in enumerate(self._tool_calls(p.tool_calls)):
            # First fragment: id, type, name, empty arguments; then arguments alone (repeating id/name would
            # make clients concatenate them).
            out.append(self._chunk(st, {"tool_calls": [
                {"index": i, "id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": ""}}]}))
            out.append(self._chunk(st, {"tool_calls": [
                {"index": i, "function": {"arguments": c["function"]["arguments"]}}]}))
        out.append(self._chunk(st, {}, reply.finish))
        if st.include_usage:
            out.append(sse({
                "id": st.id, "object": "chat.completion.chunk", "created": st.created, "model": st.model,
                "choices": [],
                "usage": {"prompt_tokens": reply.input_tokens, "completion_tokens": reply.output_tokens,
                          "total_tokens": reply.input_tokens + reply.output_tokens},
            }))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def stream_error(self, st: StreamState, kind: ErrorKind, message: str) -> bytes:
        return sse({"error": {"message": message, "type": "server_error" if kind in ("server", "overloaded")
                              else "invalid_request_error", "code": kind}})

    def error(self, kind: ErrorKind, message: str) -> tuple[int, dict[str, Any]]:
        typ = {"authentication": "authentication_error", "overloaded": "server_error", "server": "server_error",
               "context_length": "invalid_request_error"}.get(kind, "invalid_request_error")
        code = {"context_length": "context_length_exceeded", "authentication": "invalid_api_key"}.get(kind, kind)
        return _STATUS[kind], {"error": {"message": message, "type": typ, "param": None, "code": code}}


# ------------------------------------------------------------------------------------ Anthropic Messages
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicMessages(Protocol):
    name = "anthropic"
    id_prefix = "msg_"

    def _blocks(self, reply: Reply) -> list[dict[str, Any]]:
        p = reply.parsed
        blocks: list[dict[str, Any]] = []
        if p.thinking:
            blocks.append({"type": "thinking", "thinking": p.thinking, "signature": "bridle"})
        if p.text or not p.tool_calls:
            blocks.append({"type": "text", "text": p.text})
        for c in p.tool_calls:
            blocks.append({"type": "tool_use", "id": c.id or new_id("toolu_"), "name": c.name,
                           "input": _args_obj(c.arguments)})
        return blocks

    def response(self, reply: Reply) -> dict[str, Any]:
        return {
            "id": new_id(self.id_prefix),
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": self._blocks(reply),
            "stop_reason": _STOP[reply.finish],
            "stop_sequence": None,
            "usage": {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }

    def stream_open(self, st: StreamState) -> bytes:
        return sse({"type": "message_start", "message": {
            "id": st.id, "type": "message", "role": "assistant", "model": st.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": st.input_tokens, "output_tokens": 1,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }}, "message_start")

    def keepalive(self, st: StreamState) -> bytes:
        return sse({"type": "ping"}, "ping")

    def stream_rest(self, st: StreamState, reply: Reply) -> bytes:
        out = []
        for i, b in enumerate(self._blocks(reply)):
            if b["type"] == "thinking":
                start = {"type": "thinking", "thinking": "", "signature": ""}
                deltas = [{"type": "thinking_delta", "thinking": b["thinking"]},
                          {"type": "signature_delta", "signature": b["signature"]}]
            elif b["type"] == "text":
                start = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": b["text"]}] if b["text"] else []
            else:
                start = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
                deltas = [{"type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}]
            out.append(sse({"type": "content_block_start", "index": i, "content_block": start},
                           "content_block_start"))
            for d in deltas:
                out.append(sse({"type": "content_block_delta", "index": i, "delta": d}, "content_block_delta"))
            out.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
        out.append(sse({"type": "message_delta",
                        "delta": {"stop_reason": _STOP[reply.finish], "stop_sequence": None},
                        "usage": {"output_tokens": reply.output_tokens}}, "message_delta"))
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return b"".join(out)

    def _etype(self, kind: ErrorKind) -> str:
        return {"invalid_request": "invalid_request_error", "context_length": "invalid_request_error",
                "authentication": "authentication_error", "not_found": "not_found_error",
                "too_large": "request_too_large", "overloaded": "overloaded_error",
                "server": "api_error"}[kind]

    def stream_error(self, st: StreamState, kind: ErrorKind, message: str) -> bytes:
        return sse({"type": "error", "error": {"type": self._etype(kind), "message": message}}, "error")

    def error(self, kind: ErrorKind, message: str) -> tuple[int, dict[str, Any]]:
        return _STATUS[kind], {"type": "error", "error": {"type": self._etype(kind), "message": message}}


# --------------------------------------------------------------------------------------- Responses
class Responses(Protocol):
    name = "responses"
    id_prefix = "resp_"

    def _items(self, reply: Reply) -> list[dict[str, Any]]:
        p = reply.parsed
        items: list[dict[str, Any]] = []
        if p.thinking:
            items.append({"type": "reasoning", "id": new_id("rs_"),
                          "summary": [{"type": "summary_text", "text": p.thinking}]})
        if p.text or not p.tool_calls:
            items.append({"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": p.text, "annotations": []}]})
        for c in p.tool_calls:
            ns, name = reply.conv.wire_tool(c.name)
            tool = reply.conv.tool(c.name)
            if tool is not None and tool.kind == "custom":
                args = c.arguments
                text = args.get("input", "") if isinstance(args, dict) else str(args)
                items.append({"type": "custom_tool_call", "id": new_id("ctc_"), "status": "completed",
                              "call_id": c.id or new_id("call_"), "name": name, "input": text})
                continue
            item = {"type": "function_call", "id": new_id("fc_"), "status": "completed",
                    "call_id": c.id or new_id("call_"), "name": name, "arguments": _args_json(c.arguments)}
            if ns:
                item["namespace"] = ns
            items.append(item)
        return items

    def _usage(self, reply: Reply) -> dict[str, Any]:
        return {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens,
                "total_tokens": reply.input_tokens + reply.output_tokens,
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}

    def _resp(self, rid: str, model: str, created: int, status: str, output: list[Any],
              usage: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, "usage": usage, "error": error, "incomplete_details": None}

    def response(self, reply: Reply) -> dict[str, Any]:
        return self._resp(new_id(self.id_prefix), reply.model, int(time.time()), "completed", self._items(reply),
                          self._usage(reply))

    def _ev(self, st: StreamState, typ: str, **fields: Any) -> bytes:
        return sse({"type": typ, "sequence_number": st.next_seq(), **fields}, typ)

    def stream_open(self, st: StreamState) -> bytes:
        r = self._resp(st.id, st.model, st.created, "in_progress", [], None)
        return self._ev(st, "response.created", response=r) + self._ev(st, "response.in_progress", response=r)

    def keepalive(self, st: StreamState) -> bytes:
        # `: ping` comments do not reset Codex's idle timer; a keepalive event does.
        return self._ev(st, "keepalive")

    def stream_rest(self, st: StreamState, reply: Reply) -> bytes:
        out = []
        items = self._items(reply)
        for i, item in enumerate(items):
            t = item["type"]
            if t == "message":
                text = item["content"][0]["text"]
                out.append(self._ev(st, "response.output_item.added", output_index=i,
                                    item={**item, "status": "in_progress", "content": []}))
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(self._ev(st, "response.content_part.added", item_id=item["id"], output_index=i,
                                    content_index=0, part=part))
                if text:
                    out.append(self._ev(st, "response.output_text.delta", item_id=item["id"], output_index=i,
                                        content_index=0, delta=text))
                out.append(self._ev(st, "response.output_text.done", item_id=item["id"], output_index=i,
                                    content_index=0, text=text))
                out.append(self._ev(st, "response.content_part.done", item_id=item["id"], output_index=i,
                                    content_index=0, part={**part, "text": text}))
            elif t == "function_call":
                out.append(self._ev(st, "response.output_item.added", output_index=i,
                                    item={**item, "status": "in_progress", "arguments": ""}))
                out.append(self._ev(st, "response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=i, delta=item["arguments"]))
                out.append(self._ev(st, "response.function_call_arguments.done", item_id=item["id"],
                                    output_index=i, arguments=item["arguments"]))
            else:
                out.append(self._ev(st, "response.output_item.added", output_index=i, item=item))
            out.append(self._ev(st, "response.output_item.done", output_index=i, item=item))
        done = self._resp(st.id, st.model, st.created, "completed", items, self._usage(reply))
        out.append(self._ev(st, "response.completed", response=done))
        return b"".join(out)

    def _code(self, kind: ErrorKind) -> str:
        # Codex re-sends the whole turn on unknown failure codes; these are the ones it does not retry.
        return {"context_length": "context_length_exceeded", "overloaded": "server_is_overloaded",
                "invalid_request": "invalid_request_error", "server": "server_is_overloaded"}.get(kind, kind)

    def stream_error(self, st: StreamState, kind: ErrorKind, message: str) -> bytes:
        r = self._resp(st.id, st.model, st.created, "failed", [], None,
                       {"code": self._code(kind), "message": message})
        return self._ev(st, "response.failed", response=r)

    def error(self, kind: ErrorKind, message: str) -> tuple[int, dict[str, Any]]:
        # Codex retries 5xx: engine trouble is answered 400 so that a broken engine cannot cause a retry storm.
        status = 400 if kind in ("server", "overloaded") else _STATUS[kind]
        return status, {"error": {"message": message, "type": "invalid_request_error" if status == 400 else kind,
                                  "code": self._code(kind), "param": None}}


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (ChatCompletions(), AnthropicMessages(), Responses())}
