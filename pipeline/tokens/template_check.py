"""Template verification: is turn-by-turn rendering with splicing consistent with whole rendering?

For each sample conversation the check plays the proxy: for every assistant turn it renders the request before
that turn through a :class:`~pipeline.tokens.splice.Splicer`, takes the turn as the template itself would write it as
the model's "sampled" output, parses and records it, and moves on. It reports

- ``prefix``: a call whose input does not start with the previous call's input + output (splicing or the
  template breaks the token prefix — the tree builder would see a branch where there is none);
- ``whole``: the last incremental rendering differs from rendering the whole conversation at once with the
  template (e.g. Qwen3 drops the thinking of turns before the last user message — expected there, and worth
  knowing: bridle trains on what the model saw, which is the incremental form).

Each divergence names the token index and shows the tokens and the text on both sides. Why splicing needs this:
docs/architecture.md.

    report = check_template(renderer)   # in tests
    startup_check(renderer)             # before serving with a template: logs a warning with the diff, never raises
"""

from __future__ import annotations

import msgspec
import numpy as np

from pipeline.core.logs import get_logger
from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import Renderer
from pipeline.tokens.splice import Splicer

log = get_logger(part="template_check")


class Divergence(msgspec.Struct, kw_only=True):
    conversation: int
    kind: str  # "prefix" | "whole" | "error"
    call: int = -1  # which call (0-based) of the conversation, for "prefix"
    index: int = -1  # first differing token
    expected_tokens: list[str] = msgspec.field(default_factory=list)
    got_tokens: list[str] = msgspec.field(default_factory=list)
    expected_text: str = ""
    got_text: str = ""
    detail: str = ""

    def describe(self) -> str:
        head = f"conversation {self.conversation} {self.kind}"
        if self.call >= 0:
            head += f" call {self.call}"
        if self.detail:
            head += f": {self.detail}"
        if self.index >= 0:
            head += (
                f"\n  first difference at token {self.index}"
                f"\n  expected tokens {self.expected_tokens}\n  got tokens      {self.got_tokens}"
                f"\n  expected text {self.expected_text!r}\n  got text      {self.got_text!r}"
            )
        return head


class TemplateReport(msgspec.Struct, kw_only=True):
    template: str
    conversations: int = 0
    calls: int = 0
    divergences: list[Divergence] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.divergences

    def describe(self) -> str:
        if self.ok:
            return f"{self.template}: {self.calls} calls over {self.conversations} conversations prefix-consistent"
        return "\n".join(
            [f"{self.template}: {len(self.divergences)} divergence(s)"]
            + [d.describe() for d in self.divergences]
        )


def sample_conversations() -> list[Conversation]:
    """An agentic rollout (tools, thinking, several calls per turn, nested JSON, unicode, empty content) and a
    plain multi-user chat."""
    tools = [
        Tool(
            name="bash",
            description="Run a shell command.",
            parameters={
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        ),
        Tool(
            name="edit_file",
            description="Replace text in a file.",
            parameters={
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "edits": {"type": "array", "items": {"type": "object"}},
                },
            },
        ),
    ]
    agentic = Conversation(
        tools=tools,
        messages=[
            Message(role="system", content="You are a coding agent. Work in /workspace."),
            Message(role="user", content="Fix the failing test in café/test_ünïcode.py — it should print ✓."),
            Message(
                role="assistant",
                content="Let me look.",
                thinking="I should list the files first, then read the test.",
                tool_calls=[
                    ToolCall(id="c1", name="bash", arguments={"command": "ls -la café"}),
                    ToolCall(id="c2", name="bash", arguments={"command": "cat café/test_ünïcode.py"}),
                ],
            ),
            Message(role="tool", tool_call_id="c1", name="bash", content="test_ünïcode.py\nmain.py"),
            Message(
                role="tool", tool_call_id="c2", name="bash", content="def test():\n    assert f() == '✓'"
            ),
            Message(
                role="assistant",
                content="",
                thinking="The function returns the wrong glyph.",
                tool_calls=[
                    ToolCall(
                        id="c3",
                        name="edit_file",
                        arguments={
                            "path": "café/main.py",
                            "edits": [{"old": "'x'", "new": "'✓'", "opts": {"n": 1}}],
                        },
                    )
                ],
            ),
            Message(role="tool", tool_call_id="c3", name="edit_file", content="ok"),
            Message(role="assistant", content="Fixed: f() now returns ✓.", thinking="Done."),
        ],
    )
    chat = Conversation(
        messages=[
            Message(role="system", content="Be brief."),
            Message(role="user", content="Hi!"),
            Message(role="assistant", content="Hello! How can I help?"),
            Message(role="user", content="2+2?"),
            Message(role="assistant", content="4"),
            Message(role="user", content="Thanks."),
        ]
    )
    return [agentic, chat]


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.nonzero(a[:n] != b[:n])[0]
    if len(neq):
        return int(neq[0])
    return n if len(a) != len(b) else -1


def _divergence(
    renderer: Renderer, conv_i: int, kind: str, expected: np.ndarray, got: np.ndarray, call: int = -1
) -> Divergence | None:
    i = _first_diff(expected, got)
    if i < 0:
        return None
    tok = renderer.tokenizer
    lo = max(0, i - 3)
    return Divergence(
        conversation=conv_i,
        kind=kind,
        call=call,
        index=i,
        expected_tokens=tok.tokens(expected[lo : i + 8]),
        got_tokens=tok.tokens(got[lo : i + 8]),
        expected_text=tok.decode(expected[max(0, i - 24) : i + 24]),
        got_text=tok.decode(got[max(0, i - 24) : i + 24]),
        detail=f"lengths expected {len(expected)} got {len(got)}",
    )


def _sampled_output(renderer: Renderer, conv: Conversation, j: int) -> tuple[np.ndarray, Message] | str:
    """The ids of assistant message j as the template writes a final turn (what a model of this template
    samples) and the message they stand for, or why they cannot be derived."""
    m = conv.messages[j]
    # with thinking switched off (e.g. enable_thinking=False) the model writes no thinking: try without it too
    for msg in (m, msgspec.structs.replace(m, thinking="")):
        upto = Conversation(messages=[*conv.messages[:j], msg], tools=conv.tools)
        r = renderer.render_text(upto, add_generation_prompt=False, causal=False)
        assert r is not None
        span = next((t for t in r.turns if t.message == j), None)
        if span is None:
            return f"the template gives no clean span for assistant message {j}"
        text = r.text[span.start : span.end]
        if text.startswith(renderer.generation_prompt):
            return renderer.tokenizer.encode_np(text[len(renderer.generation_prompt) :]), msg
    return f"assistant message {j} does not start with the generation prompt {renderer.generation_prompt!r}"


def check_conversation(
    renderer: Renderer, conv: Conversation, conv_i: int = 0
) -> tuple[int, list[Divergence]]:
    splicer = Splicer(renderer)
    found: list[Divergence] = []
    prev: np.ndarray | None = None
    calls = 0
    served = list(conv.messages)  # the conversation as the harness would send it back
    for j, m in enumerate(conv.messages):
        if m.role != "assistant" or j == 0:
            continue
        request = Conversation(messages=served[:j], tools=conv.tools)
        res = splicer.render(request)
        if prev is not None and len(found) == 0:
            d = _divergence(renderer, conv_i, "prefix", prev, res.ids[: len(prev)], call=calls)
            if d is not None:
                found.append(d)
        out = _sampled_output(renderer, conv, j)
        if isinstance(out, str):
            found.append(Divergence(conversation=conv_i, kind="error", call=calls, detail=out))
            return calls, found
        out_ids, served[j] = out
        splicer.record(renderer.parse(out_ids), out_ids)
        prev = np.concatenate([res.ids, out_ids])
        calls += 1
    conv = Conversation(messages=served, tools=conv.tools)
    final = splicer.render(conv)
    whole = renderer.render_ids(conv, add_generation_prompt=True, causal=False)
    d = _divergence(renderer, conv_i, "whole", whole, final.ids)
    if d is not None:
        found.append(d)
    return calls + 1, found


def check_template(renderer: Renderer, conversations: list[Conversation] | None = None) -> TemplateReport:
    convs = sample_conversations() if conversations is None else conversations
    report = TemplateReport(template=f"{type(renderer).__name__}({renderer.tokenizer.name})")
    for i, conv in enumerate(convs):
        calls, found = check_conversation(renderer, conv, i)
        report.conversations += 1
        report.calls += calls
        report.divergences.extend(found)
    return report


def startup_check(renderer: Renderer, conversations: list[Conversation] | None = None) -> TemplateReport:
    """Run the check for the served model; log a warning with the diff when it fails. Never raises."""
    try:
        report = check_template(renderer, conversations)
    except Exception as e:  # noqa: BLE001 - a user template may fail on our samples; the proxy must start anyway
        log.warning("template_check_failed", error=f"{type(e).__name__}: {e}")
        return TemplateReport(
            template=type(renderer).__name__,
            divergences=[Divergence(conversation=-1, kind="error", detail=f"{type(e).__name__}: {e}")],
        )
    if report.ok:
        log.info("template_check_ok", template=report.template, calls=report.calls)
    else:
        log.warning("template_check_diverges", template=report.template, report=report.describe())
    return report
