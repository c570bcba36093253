"""The one internal conversation model every harness request becomes (converters from the wire protocols'
request bodies: :mod:`pipeline.tokens.from_wire`).

A :class:`Conversation` is a list of :class:`Message` (system / user / assistant / tool), the tools in one neutral
form ``{name, description, parameters}`` (:class:`Tool`), and the sampling fields the harness asked for
(:class:`RequestedSampling`). Codex namespaced tools are flattened to one name ``NS__name``; ``Tool.namespace``
keeps NS so the proxy can answer with the original pair (:meth:`Conversation.wire_tool`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

IMAGE_PLACEHOLDER = "[image]"
NAMESPACE_SEP = "__"

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    arguments: Any = msgspec.field(
        default_factory=dict
    )  # dict when the JSON was an object, else the raw string
    id: str = ""


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Role
    content: str = ""
    thinking: str = ""  # assistant reasoning, without <think> tags
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    tool_call_id: str = ""  # tool results: the call they answer
    name: str = ""  # tool results: the tool's name when known
    is_error: bool = False  # tool results flagged as errors by the harness
    images: int = 0  # images replaced by IMAGE_PLACEHOLDER in content


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str  # flattened name the model sees (NS__name for namespaced tools)
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)  # JSON schema
    kind: Literal["function", "custom"] = "function"  # custom: freeform input, arguments {"input": str}
    namespace: str = ""  # Responses namespace the tool came from


class RequestedSampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling fields as the harness asked for them; None = not given (the rollout's own settings apply)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stream: bool = False


class Conversation(msgspec.Struct, kw_only=True, omit_defaults=True):
    messages: list[Message] = msgspec.field(default_factory=list)
    tools: list[Tool] = msgspec.field(default_factory=list)
    sampling: RequestedSampling = msgspec.field(default_factory=RequestedSampling)
    model: str = ""
    protocol: Literal["chat", "anthropic", "responses", "internal"] = "internal"

    def wire_tool(self, name: str) -> tuple[str, str]:
        """(namespace, name) to answer the harness with, for a tool name the model produced."""
        for t in self.tools:
            if t.name == name and t.namespace:
                return t.namespace, name[len(t.namespace) + len(NAMESPACE_SEP) :]
        return "", name

    def tool(self, name: str) -> Tool | None:
        for t in self.tools:
            if t.name == name:
                return t
        return None
