"""A call's :class:`~pipeline.messages.CallTrace`: what the request offered and reported back, what the output did.

Recorded by the proxy with every ModelCall, from what it already has in hand (the converted request and the parsed
output), for the behavioural metrics of pipeline.eval. A tool result failed when the protocol says so (Anthropic's
``is_error``) or, where a protocol has no flag (Chat Completions, Responses), when its text reads as a failure:
a non-zero exit code, a Python traceback, a leading ``Error``, a JSON ``"status": "error"``, Claude Code's
``<tool_use_error>``, ``command not found`` or ``No such file or directory``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeline.messages import TRACE_ARG_CHARS, CallTrace, ToolOutcome, ToolUse
from pipeline.tokens.conversation import Conversation
from pipeline.tokens.toolparse import ParsedOutput

_FAILED = re.compile(
    r"(?:exit(?:ed)?(?: with)?(?: status| code)?:?\s*[1-9]\d*\b"
    r"|\bexit code:?\s*[1-9]\d*\b"
    r"|Traceback \(most recent call last\)"
    r"|^\s*(?:error|ERROR|Error)\b"
    r"|\"status\"\s*:\s*\"error\""
    r"|<tool_use_error>"
    r"|command not found"
    r"|No such file or directory)",
    re.IGNORECASE | re.MULTILINE,
)
_TEXT_CHARS = 4000  # a failure shows near the start of a result; long outputs are not scanned whole


def failed(text: str) -> bool:
    return bool(_FAILED.search(text[:_TEXT_CHARS]))


def _args(arguments: Any) -> dict[str, str]:
    if not isinstance(arguments, dict):
        return {"input": str(arguments)[:TRACE_ARG_CHARS]}
    return {str(k): (v if isinstance(v, str) else json.dumps(v))[:TRACE_ARG_CHARS] for k, v in arguments.items()}


def call_trace(conv: Conversation, parsed: ParsedOutput) -> CallTrace:
    msgs = conv.messages
    last_assistant = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
    names = {tc.id: tc.name for m in msgs if m.role == "assistant" for tc in m.tool_calls if tc.id}
    outcomes = [ToolOutcome(m.name or names.get(m.tool_call_id, ""), m.is_error or failed(m.content))
                for m in msgs[last_assistant + 1:] if m.role == "tool"]
    if parsed.malformed:
        output = "malformed"
    elif parsed.tool_calls:
        output = "tool_calls"
    elif parsed.text.strip() or parsed.thinking.strip():
        output = "answer"
    else:
        output = "empty"
    return CallTrace(offered=[t.name for t in conv.tools], outcomes=outcomes, output=output,
                     uses=[ToolUse(tc.name, _args(tc.arguments)) for tc in parsed.tool_calls])
