"""Call labels: is a harness call the main agent's, a subagent's, or a context compaction?

Each harness shows it differently (headers, request metadata, model names, prompt markers); :func:`detect_label`
reads all of them (the table is in the README, "Call labels"). The label travels in
:class:`pipeline.messages.ModelCall`; the tree builder confirms or corrects it from the calls' structure.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.tokens.conversation import Conversation
from pipeline.tokens.from_wire import attribution

COMPACTION_MARKERS = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.",  # Claude Code
    "component that summarizes a conversation",  # Qwen Code
    "You are a context summarization assistant",  # OpenClaw
)
SUBAGENT_MARKERS = (
    "## Subagent Context",  # OpenClaw (sessions_spawn through its gateway)
    "subagent working for a parent agent",  # Qwen Code
    "cc_is_subagent=true",  # Claude Code's billing line (it also sends x-claude-code-agent-id)
)


def detect_label(protocol: str, headers: Any, body: dict[str, Any], conv: Conversation, subagent_model: str) -> str:
    """main / subagent / compaction from what each harness shows (see the module docstring)."""
    explicit = headers.get("x-bridle-call-label", "")  # our white-box harness says it
    if explicit in ("main", "subagent", "compaction"):
        return explicit
    if protocol == "responses":  # Codex
        meta: Any = headers.get("x-codex-turn-metadata") or (body.get("client_metadata") or {}).get(
            "x-codex-turn-metadata", "")
        if isinstance(meta, str):
            try:
                meta = json.loads(meta) if meta else {}
            except ValueError:
                meta = {}
        if isinstance(meta, dict):
            if meta.get("request_kind") == "compaction":
                return "compaction"
            if meta.get("thread_source") == "subagent":
                return "subagent"
        if headers.get("x-openai-subagent"):
            return "subagent"
    if protocol == "anthropic" and (headers.get("x-claude-code-agent-id") or conv.model == subagent_model):
        return "subagent"
    # The whole system prompt: OpenClaw 2026.9.6 puts its "## Subagent Context" section ~20,000 characters in;
    # Claude Code's attribution block, which the policy never sees, says cc_is_subagent=true.
    system = " ".join([m.content for m in conv.messages if m.role == "system"]
                      + ([attribution(body.get("system"))] if protocol == "anthropic" and isinstance(body, dict)
                         else []))
    if any(s in system for s in SUBAGENT_MARKERS):
        return "subagent"
    last_user = next((m.content for m in reversed(conv.messages) if m.role == "user"), "")
    if any(last_user.lstrip().startswith(s) for s in COMPACTION_MARKERS[:1]):
        return "compaction"
    if not conv.tools and any(s in system for s in COMPACTION_MARKERS[1:]):
        return "compaction"
    return "main"
