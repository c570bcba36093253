"""Rendering a Conversation to prompt text (and ids) with a model's chat template.

Two renderers with one interface:

- :class:`Qwen3Renderer`: the ChatML-with-tools format of the Qwen3 family written in Python (tools in the system
  prompt, calls as ``<tool_call>{json}</tool_call>``, results as ``<tool_response>`` inside a user turn,
  ``<think>`` blocks). Rendering a whole conversation gives exactly what Qwen3's official jinja template gives
  (``QWEN3_CHAT_TEMPLATE`` in pipeline/tokens/templates.py behaves the same; the tests compare both).
- :class:`HFTemplateRenderer`: any local Hugging Face model folder, through ``apply_chat_template`` of its own
  jinja template.

``render_text`` returns the text plus, for every assistant message, the character span that the splicer may
replace with the ids the model sampled (from the turn's generation prompt up to and including the end-of-turn
token). ``start=k`` renders only from message k on (what a cached prefix of k messages does not cover).

Qwen3's official template drops the thinking of assistant turns that precede the last real user message, so
rendering a conversation whole is not always a prefix-extension of rendering it turn by turn. ``causal=True``
(what the splicer uses) decides each message's text from the messages before it only, so a later request never
changes the text of an earlier turn; ``causal=False`` is the official whole-conversation behaviour.
:mod:`pipeline.tokens.template_check` reports where the two differ.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np

from pipeline.tokens.conversation import Conversation, Message, Tool
from pipeline.tokens.tokenizer import HFTokenizer, Tokenizer
from pipeline.tokens.toolparse import (
    HERMES,
    ParsedOutput,
    ToolFormat,
    detect_tool_format,
    split_thinking,
    tool_format,
)

_json = msgspec.json.Encoder()



class TurnSpan(msgspec.Struct, frozen=True, array_like=True):
    """Assistant message ``message`` occupies text[start:end], from its generation prompt to its end-of-turn token
    inclusive; what follows (e.g. ``"\\n"``) belongs to the template, not to the sampled turn."""

    message: int
    start: int
    end: int


class RenderedText(msgspec.Struct, kw_only=True):
    text: str  # rendering of messages[start_message:] (+ generation prompt)
    turns: list[TurnSpan]  # spans of assistant messages >= start_message, offsets into text
    start_message: int = 0
    boundary: int = -1  # offset in text where a rendering with more messages would continue; -1 unknown


def openai_tool(t: Tool) -> dict[str, Any]:
    """The tool as chat templates expect it (OpenAI function format)."""
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }


def _is_query(m: Message) -> bool:
    c = m.content
    return m.role == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>"))


def _last_query(msgs: list[Message], first: int, causal: bool) -> int:
    """The last real user query the rendering starts from: causal, the last one before ``first`` (the message
    loop moves it on), else the last one of the whole conversation (the official template: n - 1 if none)."""
    if causal:
        return next((i for i in range(first - 1, -1, -1) if _is_query(msgs[i])), -1)
    n = len(msgs)
    return next((i for i in range(n - 1, -1, -1) if _is_query(msgs[i])), n - 1)


def _with_think(i: int, n: int, last_query: int, causal: bool) -> bool | None:
    """Assistant message ``i``'s think block (Qwen3Renderer.assistant_body's ``with_think``): never before the last
    query, always for the official template's last message, else when it has thinking."""
    after_query = (0 <= last_query < i) if causal else (i > last_query)
    if not after_query:
        return False
    if not causal and i == n - 1:
        return True
    return None


class Renderer:
    """Conversation -> prompt text/ids for one tokenizer + chat template."""

    tokenizer: Tokenizer
    generation_prompt: str = ""
    tool_format: ToolFormat = HERMES  # how the model writes tool calls (pipeline/tokens/toolparse.py)
    # render_text and the tokenizer may run in worker threads, several at once (the proxy renders big requests off
    # its event loop); False keeps every render on the caller's thread
    thread_safe: bool = False

    def render_text(
        self, conv: Conversation, *, start: int = 0, add_generation_prompt: bool = True, causal: bool = True
    ) -> RenderedText | None:
        """Text from message ``start`` on; None when ``start`` is not a clean boundary for this template."""
        raise NotImplementedError

    def render_ids(
        self, conv: Conversation, *, add_generation_prompt: bool = True, causal: bool = False
    ) -> np.ndarray:
        """The whole conversation tokenized in one go (no splicing): what a plain chat-template user would feed."""
        r = self.render_text(conv, add_generation_prompt=add_generation_prompt, causal=causal)
        assert r is not None  # start=0 always renders
        return self.tokenizer.encode_np(r.text)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids the engine must stop on (the matched one is part of the output)."""
        return self.tokenizer.stop_ids

    @property
    def generation_prompt_ids(self) -> np.ndarray:
        cached = getattr(self, "_gen_ids", None)
        if cached is None:
            cached = self.tokenizer.encode_np(self.generation_prompt)
            self._gen_ids = cached
        return cached

    def parse(self, output_ids: Any) -> ParsedOutput:
        """Decode an engine output (stop token included or not) and parse it in the model's tool-call format."""
        ids = [int(i) for i in output_ids]
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tool_format.parse(self.tokenizer.decode(ids))

    def turn_text(self, m: Message) -> str:
        """The text a model of this template writes for assistant message ``m`` after the generation prompt,
        end-of-turn token included (what the scripted engine plays)."""
        raise NotImplementedError


class Qwen3Renderer(Renderer):
    """Qwen3-family ChatML with tools, in Python (fast, and causal per message for the splicer)."""

    @property
    def thread_safe(self) -> bool:  # type: ignore[override]
        return self.tokenizer.thread_safe  # render_text itself only reads

    def __init__(self, tokenizer: Tokenizer, *, enable_thinking: bool = True) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.eot = "<|im_end|>"
        self.generation_prompt = "<|im_start|>assistant\n" + (
            "" if enable_thinking else "<think>\n\n</think>\n\n"
        )

    @staticmethod
    def tools_header(system: str | None, tools: list[Tool]) -> str:
        head = "<|im_start|>system\n" + (system + "\n\n" if system is not None else "")
        head += (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        )
        for t in tools:
            head += "\n" + json.dumps(openai_tool(t), ensure_ascii=False)
        head += (
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call><|im_end|>\n"
        )
        return head

    def assistant_body(self, m: Message, with_think: bool | None) -> str:
        """``<|im_start|>assistant\\n…<|im_end|>`` for a rendered (not spliced) assistant message.

        ``with_think``: True renders a think block (empty if no thinking), False never, None when thinking exists.
        """
        content, think = m.content, m.thinking
        if not think and "</think>" in content:
            think, content = split_thinking(content)
        show = bool(think) if with_think is None else with_think
        if show:
            out = (
                "<|im_start|>assistant\n<think>\n"
                + think.strip("\n")
                + "\n</think>\n\n"
                + content.lstrip("\n")
            )
        else:
            out = "<|im_start|>assistant\n" + content
        for k, c in enumerate(m.tool_calls):
            if k or content:
                out += "\n"
            args = (
                c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments, ensure_ascii=False)
            )
            out += '<tool_call>\n{"name": "' + c.name + '", "arguments": ' + args + "}\n</tool_call>"
        return out + self.eot

    def turn_text(self, m: Message) -> str:
        body = self.assistant_body(m, None)
        return body[len("<|im_start|>assistant\n") :]

    def _head(self, conv: Conversation) -> tuple[str, int]:
        """The system turn (the tools header when there are tools) and the index of the first message after it."""
        msgs = conv.messages
        has_sys = bool(msgs) and msgs[0].role == "system"
        if conv.tools:
            return self.tools_header(msgs[0].content if has_sys else None, conv.tools), int(has_sys)
        if has_sys:
            return "<|im_start|>system\n" + msgs[0].content + "<|im_end|>\n", 1
        return "", 0

    def render_text(
        self, conv: Conversation, *, start: int = 0, add_generation_prompt: bool = True, causal: bool = True
    ) -> RenderedText:
        msgs = conv.messages
        n = len(msgs)
        parts: list[str] = []
        turns: list[TurnSpan] = []
        size = 0

        def put(s: str) -> None:
            nonlocal size
            parts.append(s)
            size += len(s)

        first = start
        if start == 0:
            head, first = self._head(conv)
            if head:
                put(head)
        last_query = _last_query(msgs, first, causal)
        for i in range(first, n):
            m = msgs[i]
            prev_tool = i > 0 and msgs[i - 1].role == "tool"
            if m.role != "tool" and prev_tool:
                put("<|im_end|>\n")
            if m.role == "user" or m.role == "system":
                put("<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n")
                if causal and _is_query(m):
                    last_query = i
            elif m.role == "assistant":
                body = self.assistant_body(m, _with_think(i, n, last_query, causal))
                turns.append(TurnSpan(i, size, size + len(body)))
                put(body)
                put("\n")
            else:  # tool
                if not prev_tool:
                    put("<|im_start|>user")
                put("\n<tool_response>\n" + m.content + "\n</tool_response>")
        boundary = size
        if n and msgs[-1].role == "tool":
            put("<|im_end|>\n")
        if add_generation_prompt:
            put(self.generation_prompt)
        return RenderedText(text="".join(parts), turns=turns, start_message=start, boundary=boundary)


class HFTemplateRenderer(Renderer):
    """Any local HF model folder, rendered by its own jinja chat template (``apply_chat_template``).

    Only the messages after a cached prefix are tokenized, but the template itself is re-evaluated over the whole
    conversation (jinja cannot render a suffix; about 20 ms per evaluation at 64k tokens, two per call when the
    request extends the previous one); a turn's span starts where the rendering of the conversation before
    it ends and runs to the next end-of-turn token. A template for which that is not a clean prefix cannot splice that
    turn; the splicer then renders it from text and reports it.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        tool_format: str = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or tokenizer.chat_template
        if not self.chat_template:
            raise ValueError(
                f"{tokenizer.folder}: no chat template (tokenizer_config.json chat_template or chat_template.jinja); "
                "pass chat_template="
            )
        self.template_kwargs = dict(template_kwargs or {})
        self._memo: dict[bytes, str] = {}
        self.eot = tokenizer.eot_text
        probe = [{"role": "user", "content": "x"}]
        with_gen = self._apply(probe, [], True)
        without = self._apply(probe, [], False)
        if not with_gen.startswith(without):
            raise ValueError(
                f"{tokenizer.folder}: the chat template's generation prompt is not appended at the end; "
                "bridle cannot splice with this template"
            )
        self.generation_prompt = with_gen[len(without) :]
        self.tool_format_reason = "set explicitly"
        if tool_format == "auto":
            tool_format, self.tool_format_reason = detect_tool_format(self.chat_template, _model_config(tokenizer))
        self.tool_format = _tool_format(tool_format)

    def _apply(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]], gen: bool) -> str:
        # a request that extends the previous one needs the previous rendering again (its prefix, the span of its
        # last turn): remember a few renderings by content (encoding is ~100x cheaper than the template)
        key = _json.encode((gen, tools, msgs))
        hit = self._memo.pop(key, None)
        if hit is None:
            hit = self.tokenizer.hf.apply_chat_template(
                msgs,
                tools=tools or None,
                chat_template=self.chat_template,
                add_generation_prompt=gen,
                tokenize=False,
                **self.template_kwargs,
            )
        self._memo[key] = hit
        while len(self._memo) > 16:
            self._memo.pop(next(iter(self._memo)))
        return hit

    @staticmethod
    def hf_message(m: Message) -> dict[str, Any]:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant":
            if m.thinking:
                d["reasoning_content"] = m.thinking
            if m.tool_calls:
                d["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in m.tool_calls
                ]
        elif m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        return d

    def turn_text(self, m: Message) -> str:
        calls = [c if c.id else msgspec.structs.replace(c, id=self.tool_format.call_id() or f"call_{k}")
                 for k, c in enumerate(m.tool_calls)]
        msg = msgspec.structs.replace(m, tool_calls=calls)
        r = self.render_text(Conversation(messages=[Message(role="user", content="x"), msg]),
                             add_generation_prompt=False)
        span = next((t for t in r.turns if t.message == 1), None) if r is not None else None
        text = r.text[span.start : span.end] if r is not None and span is not None else ""
        if span is None or not text.startswith(self.generation_prompt):
            raise ValueError(f"{self.tokenizer.name}: the chat template writes no clean assistant turn for {m}")
        return text[len(self.generation_prompt) :]

    def render_text(
        self, conv: Conversation, *, start: int = 0, add_generation_prompt: bool = True, causal: bool = True
    ) -> RenderedText | None:
        msgs = [self.hf_message(m) for m in conv.messages]
        tools = [openai_tool(t) for t in conv.tools]
        full = self._apply(msgs, tools, add_generation_prompt)
        base = 0
        if start > 0:
            prefix = self._apply(msgs[:start], tools, False)
            if not full.startswith(prefix):
                return None
            base = len(prefix)
        turns = []
        for j in range(max(start, 1), len(msgs)):
            if msgs[j]["role"] != "assistant":
                continue
            pn = self._apply(msgs[:j], tools, False)
            if not (full.startswith(pn) and len(pn) >= base):
                # the template re-rendered earlier history differently (e.g. Qwen3 dropping old thinking): later
                # turns contain that history too, so stop looking (and stop paying a template call per turn)
                break
            e = full.find(self.eot, len(pn))
            if e < 0:
                continue
            turns.append(TurnSpan(j, len(pn) - base, e + len(self.eot) - base))
        # last, so that it is the freshest memo entry: the next request's prefix is this rendering
        nogen = self._apply(msgs, tools, False) if add_generation_prompt else full
        boundary = len(nogen) - base if full.startswith(nogen) else -1
        return RenderedText(text=full[base:], turns=turns, start_message=start, boundary=boundary)


def qwen3_renderer(*, enable_thinking: bool = True) -> Qwen3Renderer:
    """The built-in renderer: offline Qwen tokenizer + Qwen3 ChatML."""
    from pipeline.tokens.tokenizer import QwenTokenizer

    return Qwen3Renderer(QwenTokenizer(), enable_thinking=enable_thinking)


def _tool_format(name: str) -> ToolFormat:
    try:
        return tool_format(name)
    except ValueError as e:
        raise ValueError(f"tool_format: {e}") from None


def _model_config(tokenizer: HFTokenizer) -> dict[str, Any]:
    """The folder's config.json (model_type, architectures), {} when absent or unreadable."""
    try:
        cfg = json.loads((tokenizer.folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


BUILTIN_QWEN = ("qwen", "qwen3", "qwen2.5", "builtin:qwen")  # renderer names meaning the built-in Qwen3 one


def load_renderer(model: str, *, enable_thinking: bool = True, tool_format: str = "auto") -> Renderer:
    """``"qwen3"`` -> built-in Qwen3 renderer; a local folder -> its HF template (Qwen3-family folders whose
    template renders like ours also get the HF path; pick ``"qwen3"`` for the fast Python renderer).

    ``tool_format``: how the model writes tool calls (a name in :data:`pipeline.tokens.toolparse.FORMATS`);
    ``"auto"`` detects it from the folder's chat template and config.json."""
    if model.lower() in BUILTIN_QWEN:
        r: Renderer = qwen3_renderer(enable_thinking=enable_thinking)
        if tool_format != "auto":
            r.tool_format = _tool_format(tool_format)
        return r
    kwargs = {} if enable_thinking else {"enable_thinking": False}
    return HFTemplateRenderer(HFTokenizer(model), template_kwargs=kwargs, tool_format=tool_format)
