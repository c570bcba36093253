"""A teacher engine (``[proxy.engine] kind = "openai"``): another model, behind any OpenAI-compatible Chat Completions
endpoint, answers the harness's calls, so a run through bridle records it (an ``--eval`` of the teacher on tasks,
whose verified rollouts a later run's cold start learns from: ``[scheduler].sft_recordings``).

The teacher sees the conversation the harness sent (messages, tool calls and results, tools), not token ids: it
may have another vocabulary. Its answer (text, reasoning, tool calls) is rendered with the *policy's* renderer, as
the policy would have written it after the generation prompt, end-of-turn token included, so the recorded call is a
demonstration in the policy's own tokens. The teacher's log-probabilities are not the policy's: every recorded
logprob is 0 and a teacher engine is refused where a learner would train on its samples with RL
(``docs/serving.md``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Literal

import aiohttp
import anyio

from pipeline.serving.engine import (
    EngineBadRequest,
    EngineError,
    EngineSampling,
    EngineUnavailable,
    GenerateResult,
)
from pipeline.tokens.conversation import Conversation, Message, ToolCall
from pipeline.tokens.render import Renderer


def chat_request(conv: Conversation, model: str, sampling: EngineSampling) -> dict[str, Any]:
    """The Chat Completions body that asks for the next assistant turn of ``conv``."""
    messages: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the last assistant turn's calls not answered yet (for results without an id)
    for i, m in enumerate(conv.messages):
        if m.role == "assistant":
            calls = []
            pending = []
            for j, c in enumerate(m.tool_calls):
                cid = c.id or f"call_{i}_{j}"
                pending.append(cid)
                args = c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments, ensure_ascii=False)
                calls.append({"id": cid, "type": "function", "function": {"name": c.name, "arguments": args}})
            out: dict[str, Any] = {"role": "assistant", "content": m.content or None}
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
        elif m.role == "tool":
            cid = m.tool_call_id or (pending[0] if pending else f"call_{i}")
            if cid in pending:
                pending.remove(cid)
            messages.append({"role": "tool", "tool_call_id": cid, "content": m.content})
        else:
            messages.append({"role": m.role, "content": m.content})
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "stream": False,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if conv.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description,
            # a freeform tool (Codex's custom kind) is offered as a function of one string
            "parameters": t.parameters if t.kind == "function" else {
                "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
        }} for t in conv.tools]
    return body


def answer_message(body: dict[str, Any]) -> tuple[Message, Literal["stop", "length"]]:
    """The assistant message of a Chat Completions response, and whether it ended or ran out of tokens."""
    try:
        choice = body["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"the teacher's answer has no choices[0].message: {str(body)[:300]}") from None
    calls = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = raw  # kept as the text it was: the harness is told, as with the policy's own malformed calls
        calls.append(ToolCall(name=str(fn.get("name", "")), arguments=args if isinstance(args, dict) else raw,
                              id=str(c.get("id", ""))))
    # reasoning models behind SGLang / vLLM return their thinking apart from the answer
    thinking = msg.get("reasoning_content") or msg.get("reasoning") or ""
    message = Message(role="assistant", content=msg.get("content") or "", thinking=str(thinking), tool_calls=calls)
    return message, "length" if choice.get("finish_reason") == "length" else "stop"


class TeacherEngine:
    """:class:`pipeline.serving.engine.ConversationEngine` over an OpenAI-compatible endpoint (module docstring)."""

    def __init__(self, renderer: Renderer, url: str, model: str, *, api_key: str = "", timeout_s: float = 300.0,
                 weight_version: int = 0):
        self.renderer = renderer
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.version = weight_version
        self._session: aiohttp.ClientSession | None = None
        self._scopes: dict[str, anyio.CancelScope] = {}
        self.calls = 0

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(headers=headers)
        return self._session

    async def answer(self, conversation: Conversation, input_ids: Sequence[int], sampling: EngineSampling, *,
                     rid: str) -> GenerateResult:
        body = chat_request(conversation, self.model, sampling)
        with anyio.CancelScope() as scope:
            self._scopes[rid] = scope
            try:
                reply = await self._post(body)
            finally:
                self._scopes.pop(rid, None)
        if scope.cancel_called:
            return GenerateResult(rid=rid, output_ids=[], logprobs=[], finish_reason="abort",
                                  weight_version=str(self.version), prompt_tokens=len(input_ids))
        self.calls += 1
        message, finish = answer_message(reply)
        ids = self.renderer.tokenizer.encode(self.renderer.turn_text(message))
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return GenerateResult(
            rid=rid, output_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish,
            matched_stop=ids[-1] if finish == "stop" and ids and ids[-1] in sampling.stop_token_ids else None,
            weight_version=str(self.version), version_spans=[(0, str(self.version))],
            prompt_tokens=len(input_ids), completion_tokens=len(ids), meta={"teacher": self.model},
        )

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        where = f"{self.url}/chat/completions"
        try:
            async with self._sess().post(where, json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise EngineUnavailable(f"teacher {where}: {type(e).__name__}: {e}") from None
        if r.status >= 500 or r.status == 429:
            raise EngineUnavailable(f"teacher {where}: HTTP {r.status}: {text[:300]}")
        if r.status >= 400:
            raise EngineBadRequest(f"teacher {where}: HTTP {r.status}: {text[:300]}")
        try:
            return json.loads(text)
        except ValueError:
            raise EngineError(f"teacher {where}: the answer is not JSON: {text[:300]}") from None

    async def generate(self, input_ids: Sequence[int], sampling: EngineSampling, *,
                       rid: str | None = None) -> GenerateResult:
        raise EngineBadRequest("a teacher engine answers conversations, not token ids (the proxy sends them; "
                               "/generate is not served by a teacher)")

    async def update_weights(self, path: str, version: int | str) -> None:
        raise EngineError("a teacher engine serves another model: it takes no weight updates (a run with a learner "
                          'that trains by RL refuses kind = "openai")')

    async def pause(self, mode: Literal["abort", "retract", "in_place"] = "in_place") -> None:
        return None

    async def resume(self) -> None:
        return None

    async def abort(self, rid: str | None = None) -> None:
        for key, scope in list(self._scopes.items()):
            if rid is None or key == rid:
                scope.cancel()

    async def health(self) -> bool:
        try:
            async with self._sess().get(f"{self.url}/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def model_info(self) -> dict[str, Any]:
        return {"model_path": f"teacher:{self.model}@{self.url}", "weight_version": str(self.version)}

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def api_key_from(env: str) -> str:
    """The key named by ``[proxy.engine].api_key_env`` ("" when none is named); a named but unset variable is an
    error that says which."""
    if not env:
        return ""
    key = os.environ.get(env)
    if key is None:
        raise ValueError(f"[proxy.engine].api_key_env = {env!r}: the environment variable is not set (export it "
                         "with the teacher endpoint's key, or leave api_key_env empty for an endpoint without one)")
    return key
