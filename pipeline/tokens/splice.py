"""Token-in / token-out splicing (docs/architecture.md): the policy is trained on the tokens it sampled and saw.

One :class:`Splicer` per rollout. It remembers the sampled ids of every response the proxy served, keyed by the
*normalized* parsed message (text stripped at its ends, thinking ignored, tool calls as name + canonical JSON with
sorted keys). When a later request carries an assistant turn with that key, the original ids are spliced in place
of the turn's rendered text; everything else is rendered by the chat template.

    splicer = Splicer(renderer)
    res = splicer.render(conv)                       # RenderResult: ids, spliced_turns, rendered_turns, ...
    out = engine.generate(res.ids, stop=splicer.stop_ids)
    parsed = renderer.parse(out)                     # in the model's tool-call format (toolparse.py)
    splicer.record(parsed, out)

A spliced turn is ``generation prompt ids + sampled ids`` (which end with the end-of-turn token the engine
matched); the template's text after the end-of-turn token (``"\\n"`` for ChatML) is rendered. So whenever the
harness keeps history, call i+1's input starts with call i's input + output.

Cost: the ids of the longest previously rendered message prefix are cached (a few prefixes, LRU, so a subagent
interleaving with its parent stays cheap); a request that extends one only renders and tokenizes the new messages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.logs import get_logger
from pipeline.tokens.conversation import Conversation, Message, ToolCall
from pipeline.tokens.render import RenderedText, Renderer
from pipeline.tokens.toolparse import ParsedOutput, split_thinking

log = get_logger(part="splice")


def canonical_args(args: Any) -> str:
    """Tool-call arguments as canonical JSON (sorted keys, no spaces); a non-JSON string stays itself."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return args.strip()
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def turn_key(content: str, tool_calls: Sequence[ToolCall]) -> bytes:
    """Key of an assistant turn as the harness may send it back: thinking and end whitespace do not count."""
    if "</think>" in content:
        content = split_thinking(content)[1]
    return json.dumps(
        [content.strip(), [[c.name, canonical_args(c.arguments)] for c in tool_calls]], ensure_ascii=False
    ).encode()


@dataclass
class RenderResult:
    ids: np.ndarray  # int32 prompt ids, generation prompt included
    spliced_turns: list[int] = field(default_factory=list)  # message indices whose sampled ids were reused
    rendered_turns: list[int] = field(default_factory=list)  # assistant messages rendered from text
    cached_tokens: int = 0  # ids reused from a previously rendered prefix
    cached_messages: int = 0

    @property
    def new_tokens(self) -> int:
        return int(self.ids.shape[0]) - self.cached_tokens


@dataclass
class _Stored:
    ids: np.ndarray  # generation prompt + sampled output
    thinking: str


@dataclass
class _Prefix:
    messages: list[Message]  # compared by value (msgspec equality runs in C: no per-call encoding)
    tools: list[Any]
    ids: np.ndarray  # ids of the rendering up to the message boundary after keys
    spliced: list[int]
    rendered: list[int]


@dataclass
class RenderPlan:
    """What :meth:`Splicer.plan` decided: the cached prefix to reuse and the text to tokenize after it."""

    conv: Conversation
    msgs: list[Message]
    tools: list[Any]
    prefix: _Prefix | None
    start: int  # first message rendered as text
    rendered: RenderedText

    @property
    def chars(self) -> int:
        return len(self.rendered.text)


class Splicer:
    """Per-rollout store of sampled turns + prefix cache.

    ``render`` is ``tokenize(plan(conv))``; ``tokenize`` may run in a worker thread while ``record`` runs on the
    event loop: ``record`` only adds store entries (single dict/list operations, atomic under the GIL) and
    ``tokenize`` only reads them. Two renders of one Splicer must not overlap (both update the prefix cache); the
    proxy holds a per-rollout lock from ``plan`` to the end of ``tokenize``.
    """

    def __init__(self, renderer: Renderer, *, max_prefixes: int = 8) -> None:
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.max_prefixes = max_prefixes
        self._store: dict[bytes, list[_Stored]] = {}
        self._prefixes: list[_Prefix] = []  # most recently used last
        eot = getattr(renderer, "eot", "") or self.tokenizer.eot_text
        self._eot_ids = self.tokenizer.encode_np(eot)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.renderer.stop_ids

    # ----------------------------------------------------------------------------------------- record
    def record(
        self,
        parsed: ParsedOutput | Message,
        output_ids: Sequence[int] | np.ndarray,
        *,
        prompt_ids: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Remember the sampled ids of a response as it was served (``parsed``: what the harness received).

        ``prompt_ids`` is the generation prompt the output followed; the renderer's default when omitted.
        """
        out = np.asarray(output_ids, dtype=np.int32)
        gen = (
            self.renderer.generation_prompt_ids
            if prompt_ids is None
            else np.asarray(prompt_ids, dtype=np.int32)
        )
        text = parsed.text if isinstance(parsed, ParsedOutput) else parsed.content
        key = turn_key(text, parsed.tool_calls)
        self._store.setdefault(key, []).append(
            _Stored(ids=np.concatenate([gen, out]), thinking=parsed.thinking.strip())
        )

    def _lookup(self, m: Message) -> np.ndarray | None:
        found = self._store.get(turn_key(m.content, m.tool_calls))
        if not found:
            return None
        think = m.thinking.strip()
        if think:
            for s in reversed(found):
                if s.thinking == think:
                    return s.ids
        return found[-1].ids

    # ----------------------------------------------------------------------------------------- render
    def _best_prefix(self, msgs: list[Message], tools: list[Any]) -> _Prefix | None:
        best: _Prefix | None = None
        for p in self._prefixes:
            n = len(p.messages)
            if (
                n <= len(msgs)
                and (best is None or n > len(best.messages))
                and p.tools == tools
                and msgs[:n] == p.messages
            ):
                best = p
        return best

    def render(self, conv: Conversation, *, add_generation_prompt: bool = True) -> RenderResult:
        return self.tokenize(self.plan(conv, add_generation_prompt=add_generation_prompt))

    def plan(self, conv: Conversation, *, add_generation_prompt: bool = True) -> RenderPlan:
        """The cheap half of :meth:`render`: pick the cached prefix and render the text after it.

        ``plan.chars`` says how much text :meth:`tokenize` (the costly half) will encode."""
        msgs = list(conv.messages)
        tools = list(conv.tools)
        prefix = self._best_prefix(msgs, tools)
        start = len(prefix.messages) if prefix is not None else 0
        r = self.renderer.render_text(conv, start=start, add_generation_prompt=add_generation_prompt)
        if r is None:  # the template does not render this prefix cleanly: render all of it
            prefix, start = None, 0
            r = self.renderer.render_text(conv, start=0, add_generation_prompt=add_generation_prompt)
            assert r is not None
        return RenderPlan(conv=conv, msgs=msgs, tools=tools, prefix=prefix, start=start, rendered=r)

    def tokenize(self, plan: RenderPlan) -> RenderResult:
        """The costly half of :meth:`render`: tokenize the planned text and splice in the stored turns."""
        conv, prefix, start, r = plan.conv, plan.prefix, plan.start, plan.rendered
        enc = self.tokenizer.encode_np
        text = r.text
        chunks: list[np.ndarray] = [prefix.ids] if prefix is not None else []
        spliced = list(prefix.spliced) if prefix is not None else []
        rendered = list(prefix.rendered) if prefix is not None else []
        spans = {t.message for t in r.turns}
        for i in range(start, len(conv.messages)):
            if conv.messages[i].role == "assistant" and i not in spans:
                rendered.append(i)  # the template gave no clean span for this turn
        pos = 0
        boundary_ids = -1
        cut = r.boundary
        for t in r.turns:  # every span lies before the boundary (it is after the last message)
            chunks.append(enc(text[pos : t.start]))
            stored = self._lookup(conv.messages[t.message])
            if stored is not None:
                chunks.append(stored)
                if len(stored) == 0 or not _ends_with(stored, self._eot_ids):
                    chunks.append(
                        self._eot_ids
                    )  # cut off by the token limit: the template still closes the turn
                spliced.append(t.message)
            else:
                chunks.append(enc(text[t.start : t.end]))
                rendered.append(t.message)
            pos = t.end
        if cut >= pos:
            chunks.append(enc(text[pos:cut]))
            pos = cut
            boundary_ids = sum(len(c) for c in chunks)
        chunks.append(enc(text[pos:]))
        ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        ids = ids.astype(np.int32, copy=False)
        spliced.sort()
        rendered.sort()
        if boundary_ids >= 0:
            self._remember(
                _Prefix(
                    messages=plan.msgs,
                    tools=plan.tools,
                    ids=ids[:boundary_ids],
                    spliced=spliced[:],
                    rendered=rendered[:],
                )
            )
        return RenderResult(
            ids=ids,
            spliced_turns=spliced,
            rendered_turns=rendered,
            cached_tokens=len(prefix.ids) if prefix is not None else 0,
            cached_messages=start,
        )

    def _remember(self, p: _Prefix) -> None:
        # a prefix the new one equals or extends is no longer needed; others (a subagent's, a branch's) stay
        self._prefixes = [
            q
            for q in self._prefixes
            if not (
                len(q.messages) <= len(p.messages)
                and q.tools == p.tools
                and p.messages[: len(q.messages)] == q.messages
            )
        ]
        self._prefixes.append(p)
        if len(self._prefixes) > self.max_prefixes:
            self._prefixes.pop(0)


def _ends_with(a: np.ndarray, suffix: np.ndarray) -> bool:
    n = len(suffix)
    return n > 0 and len(a) >= n and bool(np.array_equal(a[-n:], suffix))
