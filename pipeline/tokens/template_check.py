"""Template verification: is turn-by-turn rendering with splicing consistent with whole rendering?

For each sample conversation the check plays the proxy: for every assistant turn it renders the request before
that turn through a :class:`~pipeline.tokens.splice.Splicer`, takes the turn as the template itself writes it as
the model's "sampled" output, parses it with the renderer's tool-call format, serves back what the parser read (as
a harness would) and records it. It reports

- ``error``: the template cannot render a representative conversation (it raises, or writes no clean turn);
- ``parse``: the tool-call parser does not read back the calls the template writes (wrong ``tool_format``);
- ``history``: the template renders the messages before an assistant turn differently once the turn follows
  them (Mistral v0.3's template, for one, shows the system prompt only while a user message is last), so the
  prompt the model answered is not the start of what it is trained on;
- ``prefix``: a call's input does not start with the previous call's input + output (the template re-renders
  history differently, e.g. moves the system prompt: every such call starts a new branch in the tree);
- ``whole``: the last incremental rendering, what the model sees under bridle, differs from rendering the whole
  conversation at once with the template (the model would be trained on a form of its history that its template
  never produces);
- ``thinking``: a ``whole`` difference that is only the reasoning (``<think>`` blocks) of earlier turns, which
  templates such as Qwen3's drop and bridle keeps (the model is trained on what it saw). Accepted: logged, never
  a mismatch.

Each divergence names the conversation, the token index, and shows token ids, tokens and text on both sides.

    report = check_template(renderer)
    startup_check(renderer, "error")    # the proxy at start-up: raises TemplateMismatch with the report
"""

from __future__ import annotations

import os
import time
from typing import Literal

import msgspec
import numpy as np

from pipeline.core.logs import get_logger
from pipeline.tokens.conversation import Conversation, Message, Tool, ToolCall
from pipeline.tokens.render import Renderer
from pipeline.tokens.splice import Splicer, canonical_args
from pipeline.tokens.toolparse import ParsedOutput, without_reasoning

log = get_logger(part="template_check")

CheckMode = Literal["error", "warn", "off"]
ACCEPTED = frozenset({"thinking"})

_SIDES = {  # kind -> (what "expected" is, what "got" is)
    "prefix": ("previous call's input + output", "this call's input"),
    "history": ("the call's prompt", "the same messages once the turn follows"),
    "whole": ("the template, whole", "bridle, turn by turn"),
    "thinking": ("the template, whole", "bridle, turn by turn"),
}


class Divergence(msgspec.Struct, kw_only=True):
    conversation: int
    kind: str  # "error" | "parse" | "history" | "prefix" | "whole" | "thinking"
    name: str = ""  # the sample conversation's name
    call: int = -1  # which call (0-based) of the conversation, for "prefix"
    index: int = -1  # first differing token
    expected_ids: list[int] = msgspec.field(default_factory=list)  # tokens index-3 .. index+8
    got_ids: list[int] = msgspec.field(default_factory=list)
    expected_tokens: list[str] = msgspec.field(default_factory=list)
    got_tokens: list[str] = msgspec.field(default_factory=list)
    same_text: str = ""  # the text both share just before the difference
    expected_text: str = ""  # the text from the difference on
    got_text: str = ""
    detail: str = ""

    @property
    def accepted(self) -> bool:
        return self.kind in ACCEPTED

    def describe(self) -> str:
        head = f"conversation {self.conversation}" + (f" ({self.name})" if self.name else "") + f": {self.kind}"
        if self.call >= 0:
            head += f" at call {self.call}"
        if self.accepted:
            head += " (accepted: only the reasoning of earlier turns differs)"
        if self.detail:
            head += f": {self.detail}"
        if self.index < 0:
            return head
        exp, got = _SIDES.get(self.kind, ("expected", "got"))
        w = max(len(exp), len(got))
        return "\n".join([
            head,
            f"  first difference at token {self.index}; token ids and tokens from {max(0, self.index - 3)}:",
            f"    {exp:<{w}}  {self.expected_ids}  {self.expected_tokens}",
            f"    {got:<{w}}  {self.got_ids}  {self.got_tokens}",
            f"  text: {self.same_text[-80:]!r} then",
            f"    {exp:<{w}}  {self.expected_text!r}",
            f"    {got:<{w}}  {self.got_text!r}",
        ])


class TemplateReport(msgspec.Struct, kw_only=True):
    template: str
    conversations: int = 0
    calls: int = 0
    seconds: float = 0.0
    divergences: list[Divergence] = msgspec.field(default_factory=list)

    @property
    def mismatches(self) -> list[Divergence]:
        return [d for d in self.divergences if not d.accepted]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def describe(self, *, accepted: bool = True) -> str:
        """Mismatches first; then the accepted differences (only counted when ``accepted`` is False)."""
        bad = self.mismatches
        rest = [d for d in self.divergences if d.accepted]
        head = (f"{self.template}: {self.calls} calls over {self.conversations} conversations "
                + ("consistent" if self.ok else f"with {len(bad)} mismatch(es)"))
        lines = [head] + [d.describe() for d in bad]
        if rest and accepted:
            lines += [d.describe() for d in rest]
        elif rest:
            lines.append(f"(and {len(rest)} accepted difference(s): the reasoning of earlier turns)")
        return "\n".join(lines)


class TemplateMismatch(Exception):
    """The served model's template failed the check; ``str(e)`` is the readable report."""

    def __init__(self, report: TemplateReport) -> None:
        super().__init__(report.describe(accepted=False))
        self.report = report


def _tools() -> list[Tool]:
    return [
        Tool(name="bash", description="Run a shell command.",
             parameters={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),
        Tool(name="edit_file", description="Replace text in a file.",
             parameters={"type": "object", "properties": {
                 "path": {"type": "string"}, "edits": {"type": "array", "items": {"type": "object"}}}}),
    ]


def sample_conversations(*, parallel_calls: bool = True) -> list[Conversation]:
    """An agentic rollout (system, tools, thinking, several calls per turn, tool results, nested JSON, unicode,
    empty content) and a plain multi-turn chat. ``parallel_calls=False`` (a family whose template renders one
    call per turn) gives each call a turn of its own."""
    agent = [
        Message(role="system", content="You are a coding agent. Work in /workspace."),
        Message(role="user", content="Fix the failing test in café/test_ünïcode.py — it should print ✓."),
        Message(role="assistant", content="Let me look.",
                thinking="I should list the files first, then read the test.",
                tool_calls=[ToolCall(id="c1", name="bash", arguments={"command": "ls -la café"}),
                            ToolCall(id="c2", name="bash", arguments={"command": "cat café/test_ünïcode.py"})]),
        Message(role="tool", tool_call_id="c1", name="bash", content="test_ünïcode.py\nmain.py"),
        Message(role="tool", tool_call_id="c2", name="bash", content="def test():\n    assert f() == '✓'"),
        Message(role="assistant", content="", thinking="The function returns the wrong glyph.",
                tool_calls=[ToolCall(id="c3", name="edit_file", arguments={
                    "path": "café/main.py", "edits": [{"old": "'x'", "new": "'✓'", "opts": {"n": 1}}]})]),
        Message(role="tool", tool_call_id="c3", name="edit_file", content="ok"),
        Message(role="assistant", content="Fixed: f() now returns ✓.", thinking="Done."),
    ]
    if not parallel_calls:
        agent = _one_call_per_turn(agent)
    chat = [
        Message(role="system", content="Be brief."),
        Message(role="user", content="Hi!"),
        Message(role="assistant", content="Hello! How can I help?"),
        Message(role="user", content="2+2?"),
        Message(role="assistant", content="4"),
        Message(role="user", content="Thanks."),
    ]
    return [Conversation(tools=_tools(), messages=agent), Conversation(messages=chat)]


SAMPLE_NAMES = ("agent: system, tools, calls, results, thinking", "chat: several user turns")


def _one_call_per_turn(msgs: list[Message]) -> list[Message]:
    split = [m for m in msgs if m.role == "assistant" and len(m.tool_calls) > 1]
    results = {m.tool_call_id: m for m in msgs if m.role == "tool"}
    moved = {c.id for m in split for c in m.tool_calls}
    out: list[Message] = []
    for m in msgs:
        if m.role == "tool" and m.tool_call_id in moved:
            continue  # placed after its call below
        if len(m.tool_calls) < 2:
            out.append(m)
            continue
        for k, c in enumerate(m.tool_calls):
            first = k == 0
            out.append(msgspec.structs.replace(m, tool_calls=[c], content=m.content if first else "",
                                               thinking=m.thinking if first else ""))
            out.append(results[c.id])
    return out


def _with_call_ids(conv: Conversation, renderer: Renderer) -> Conversation:
    """The conversation with the call ids the proxy would hand out (the format's own, else like the wire's): some
    templates check them (Mistral's wants 9 alphanumeric characters)."""
    new: dict[str, str] = {}

    def fresh(old: str) -> str:
        if old not in new:
            new[old] = renderer.tool_format.call_id() or "call_" + os.urandom(12).hex()
        return new[old]

    msgs = [msgspec.structs.replace(m, tool_calls=[msgspec.structs.replace(c, id=fresh(c.id)) for c in m.tool_calls],
                                    tool_call_id=fresh(m.tool_call_id) if m.tool_call_id else "")
            for m in conv.messages]
    return msgspec.structs.replace(conv, messages=msgs)


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.nonzero(a[:n] != b[:n])[0]
    if len(neq):
        return int(neq[0])
    return n if len(a) != len(b) else -1


def _divergence(renderer: Renderer, conv_i: int, name: str, kind: str, expected: np.ndarray, got: np.ndarray,
                call: int = -1) -> Divergence | None:
    i = _first_diff(expected, got)
    if i < 0:
        return None
    tok = renderer.tokenizer
    note = ""
    if kind == "whole":
        texts = tok.decode(expected), tok.decode(got)
        a, b = without_reasoning(texts[0]), without_reasoning(texts[1])
        if a == b:
            kind = "thinking"
        elif (a, b) != texts:  # show the difference that is not accepted, not a dropped <think> before it
            expected, got = tok.encode_np(a), tok.encode_np(b)
            i = _first_diff(expected, got)
            note = "; shown with the <think> blocks of both removed (differences there are accepted)"
    lo = max(0, i - 3)
    return Divergence(
        conversation=conv_i, name=name, kind=kind, call=call, index=i,
        expected_ids=[int(x) for x in expected[lo : i + 8]], got_ids=[int(x) for x in got[lo : i + 8]],
        expected_tokens=tok.tokens(expected[lo : i + 8]), got_tokens=tok.tokens(got[lo : i + 8]),
        same_text=tok.decode(expected[max(0, i - 32) : i]),
        expected_text=tok.decode(expected[i : i + 32]), got_text=tok.decode(got[i : i + 32]),
        detail=f"lengths {len(expected)} and {len(got)} tokens{note}",
    )


def _sampled_output(renderer: Renderer, conv: Conversation, j: int) -> tuple[np.ndarray, Message] | str:
    """The ids of assistant message j as the template writes a final turn (what a model of this template
    samples) and the message they stand for, or why they cannot be derived ("history": see _history_change)."""
    m = conv.messages[j]
    # with thinking switched off (e.g. enable_thinking=False) the model writes no thinking: try without it too
    for msg in (m, msgspec.structs.replace(m, thinking="")):
        upto = Conversation(messages=[*conv.messages[:j], msg], tools=conv.tools)
        r = renderer.render_text(upto, add_generation_prompt=False, causal=False)
        assert r is not None
        span = next((t for t in r.turns if t.message == j), None)
        if span is None:
            return "history"
        text = r.text[span.start : span.end]
        if text.startswith(renderer.generation_prompt):
            return renderer.tokenizer.encode_np(text[len(renderer.generation_prompt) :]), msg
    return f"assistant message {j} does not start with the generation prompt {renderer.generation_prompt!r}"


def _history_change(renderer: Renderer, conv: Conversation, j: int, conv_i: int, name: str,
                    call: int) -> Divergence:
    """The template renders the messages before assistant message j differently once j follows them: the prompt
    the model answered is not the start of the conversation it is trained on, and its turn cannot be spliced."""
    prompt = renderer.render_ids(Conversation(messages=conv.messages[:j], tools=conv.tools))
    after = renderer.render_ids(Conversation(messages=conv.messages[: j + 1], tools=conv.tools),
                                add_generation_prompt=False)
    d = _divergence(renderer, conv_i, name, "history", prompt, after[: len(prompt)], call=call)
    detail = f"the template re-renders the history once assistant message {j} follows it (no turn to splice)"
    if d is None:
        return Divergence(conversation=conv_i, name=name, kind="error", call=call, detail=detail)
    d.detail = detail
    return d


def _served(renderer: Renderer, m: Message, parsed: ParsedOutput, out_ids: np.ndarray) -> Message | str:
    """The assistant message a harness sends back after receiving ``parsed``, or why the parser misread the
    template's own rendering of ``m``."""
    want = [(c.name, canonical_args(c.arguments)) for c in m.tool_calls]
    read = [(c.name, canonical_args(c.arguments)) for c in parsed.tool_calls]
    if want != read or parsed.malformed:
        text = renderer.tokenizer.decode(out_ids)
        return (f"the {renderer.tool_format.name!r} tool-call parser read {read} {parsed.errors or ''} from the "
                f"template's own rendering {text!r}, which holds {want}: set the model's tool_format")
    calls = [msgspec.structs.replace(p, id=p.id or c.id) for p, c in zip(parsed.tool_calls, m.tool_calls, strict=True)]
    return Message(role="assistant", content=parsed.text, thinking=parsed.thinking, tool_calls=calls)


def check_conversation(renderer: Renderer, conv: Conversation, conv_i: int = 0,
                       name: str = "") -> tuple[int, list[Divergence]]:
    conv = _with_call_ids(conv, renderer)
    splicer = Splicer(renderer)
    found: list[Divergence] = []
    prev: np.ndarray | None = None
    calls = 0
    served = list(conv.messages)  # the conversation as the harness would send it back
    for j, m in enumerate(conv.messages):
        if m.role != "assistant" or j == 0:
            continue
        res = splicer.render(Conversation(messages=served[:j], tools=conv.tools))
        if prev is not None and not any(d.kind == "prefix" for d in found):
            d = _divergence(renderer, conv_i, name, "prefix", prev, res.ids[: len(prev)], call=calls)
            if d is not None:
                found.append(d)
        out = _sampled_output(renderer, Conversation(messages=[*served[:j], *conv.messages[j:]], tools=conv.tools), j)
        if out == "history":
            now = Conversation(messages=[*served[:j], *conv.messages[j:]], tools=conv.tools)
            found.append(_history_change(renderer, now, j, conv_i, name, calls))
            return calls, found
        if isinstance(out, str):
            found.append(Divergence(conversation=conv_i, name=name, kind="error", call=calls, detail=out))
            return calls, found
        out_ids, msg = out
        parsed = renderer.parse(out_ids)
        back = _served(renderer, msg, parsed, out_ids)
        if isinstance(back, str):
            found.append(Divergence(conversation=conv_i, name=name, kind="parse", call=calls, detail=back))
            return calls, found
        served[j] = back
        splicer.record(parsed, out_ids)
        prev = np.concatenate([res.ids, out_ids])
        calls += 1
    conv = Conversation(messages=served, tools=conv.tools)
    final = splicer.render(conv)
    whole = renderer.render_ids(conv, add_generation_prompt=True, causal=False)
    d = _divergence(renderer, conv_i, name, "whole", whole, final.ids)
    if d is not None:
        found.append(d)
    return calls + 1, found


def check_template(renderer: Renderer, conversations: list[Conversation] | None = None) -> TemplateReport:
    """Run the check (over :func:`sample_conversations` by default); an exception of the template is reported as
    an ``error`` divergence, never raised."""
    t0 = time.perf_counter()
    names: tuple[str, ...] = ()
    if conversations is None:
        conversations, names = sample_conversations(parallel_calls=renderer.tool_format.parallel_calls), SAMPLE_NAMES
    report = TemplateReport(template=_describe_renderer(renderer))
    for i, conv in enumerate(conversations):
        name = names[i] if i < len(names) else ""
        report.conversations += 1
        try:
            calls, found = check_conversation(renderer, conv, i, name)
        except Exception as e:  # noqa: BLE001 - a user's template may raise on any conversation; that is the finding
            calls, found = 0, [Divergence(conversation=i, name=name, kind="error",
                                          detail=f"the template raised {type(e).__name__}: {e}")]
        report.calls += calls
        report.divergences.extend(found)
    report.seconds = time.perf_counter() - t0
    return report


def _describe_renderer(renderer: Renderer) -> str:
    where = getattr(renderer.tokenizer, "folder", None)
    return (f"{type(renderer).__name__}({where or renderer.tokenizer.name}, "
            f"tool format {renderer.tool_format.name})")


def startup_check(renderer: Renderer, mode: CheckMode = "error",
                  conversations: list[Conversation] | None = None) -> TemplateReport | None:
    """The check the proxy runs before serving: ``error`` raises :class:`TemplateMismatch` on a mismatch, ``warn``
    logs it and returns, ``off`` skips the check (None). Accepted differences are logged."""
    if mode == "off":
        return None
    report = check_template(renderer, conversations)
    if report.ok:
        log.info("template check ok", template=report.template, calls=report.calls,
                 seconds=round(report.seconds, 3), accepted=[d.describe() for d in report.divergences])
        return report
    if mode == "error":
        raise TemplateMismatch(report)
    # the report in the message, not a field: the console prints it as lines instead of one escaped string
    log.warning('template check mismatch, serving anyway (template_check = "warn"):\n' + report.describe(),
                template=report.template, mismatches=len(report.mismatches))
    return report
