"""A deterministic policy that plays a script: real harnesses end to end without a trained model.

Script file (JSON or TOML), responses in a neutral form::

    {
      "default": [                                   # every rollout without its own list plays this one
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "a.txt", "content": "hi"}}]},
        {"text": "Done."}
      ],
      "rollouts": {"roll-7": [{"text": "…", "thinking": "…"}]},   # optional, per rollout id
      "routes": [{"opening": "Create notes.txt", "responses": [...]}],  # optional, side conversations
      "after_end": {"text": "Done."},                # answer once a rollout's list is used up
      "latency_s": 0.0,                              # simulated generation time per call
      "fail_calls": [3]                              # fault injection: calls (0-based, all rollouts)
    }                                                #   that fail like an engine HTTP 500

The n-th call of a rollout gets its n-th response (a retry advances the script too, as a sampling policy would
produce a new answer). Each response is rendered with the chat template exactly as the model would have produced
it after the generation prompt, end-of-turn token included (in the model's own tool-call format), so the proxy parses, answers and records real ids.
Log-probabilities are 0 (a deterministic policy). The rollout is read from the request id the proxy sends,
``<rollout_id>|<call_id>``.

A subagent runs beside the main agent (Codex and OpenClaw spawn it in the background), so the order of their calls
is not fixed and one list cannot serve both. A *route* gives such a side conversation a list of its own: a call
whose conversation opens with text containing ``opening`` (the prompt up to its first assistant turn: system prompt,
tools and the first user messages, where a subagent finds the task its parent wrote) plays the route's responses,
counted per rollout and route, like a policy that reads its prompt to know which conversation it is in.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec

from pipeline.serving.engine import EngineBadRequest, EngineSampling, EngineUnavailable, GenerateResult
from pipeline.tokens.conversation import Message, ToolCall
from pipeline.tokens.render import Renderer


class ScriptCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)


class ScriptResponse(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    text: str = ""
    thinking: str = ""
    tool_calls: list[ScriptCall] = msgspec.field(default_factory=list)


class ScriptRoute(msgspec.Struct, forbid_unknown_fields=True):
    opening: str  # text the conversation's opening (the prompt before its first assistant turn) contains
    responses: list[ScriptResponse]


class Script(msgspec.Struct, forbid_unknown_fields=True):
    default: list[ScriptResponse] = msgspec.field(default_factory=list)
    rollouts: dict[str, list[ScriptResponse]] = msgspec.field(default_factory=dict)
    routes: list[ScriptRoute] = msgspec.field(default_factory=list)
    after_end: ScriptResponse = msgspec.field(default_factory=lambda: ScriptResponse(text="Done."))
    latency_s: float = 0.0
    fail_calls: list[int] = msgspec.field(default_factory=list)


def load_script(path: str | Path) -> Script:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: cannot read script: {e}") from None
    try:
        return msgspec.convert(raw, Script)
    except msgspec.ValidationError as e:
        raise ValueError(f"{p}: bad script: {e}") from None


def rollout_of(rid: str | None) -> str:
    return (rid or "").split("|", 1)[0]


class ScriptedEngine:
    """In-process :class:`pipeline.serving.engine.Engine` that plays a :class:`Script`."""

    def __init__(
        self, renderer: Renderer, script: Script, *, weight_version: int = 0, context_length: int = 1 << 20
    ):
        self.renderer = renderer
        self.script = script
        self.version = weight_version
        self.context_length = context_length
        self._next: dict[str, int] = {}
        self._paused = anyio.Event()
        self._paused.set()
        self._aborts: dict[str, anyio.Event] = {}  # rid -> set once abort() was called for it
        self.calls = 0

    def responses_for(self, rollout_id: str) -> list[ScriptResponse]:
        return self.script.rollouts.get(rollout_id, self.script.default)

    def _playing(self, rollout: str, input_ids: Sequence[int]) -> tuple[str, list[ScriptResponse]]:
        """(the counter's key, the list) a call plays: its route's, if its conversation's opening names one."""
        if self.script.routes:
            opening = self.renderer.tokenizer.decode(list(input_ids)).split("<|im_start|>assistant", 1)[0]
            for k, route in enumerate(self.script.routes):
                if route.opening in opening:
                    return f"{rollout}\x00route{k}", route.responses
        return rollout, self.responses_for(rollout)

    def output_ids(self, r: ScriptResponse) -> list[int]:
        """The ids a model would sample for ``r`` after the generation prompt, end-of-turn token included."""
        msg = Message(
            role="assistant", content=r.text, thinking=r.thinking,
            tool_calls=[ToolCall(name=c.name, arguments=c.arguments) for c in r.tool_calls],
        )
        return self.renderer.tokenizer.encode(self.renderer.turn_text(msg))

    async def generate(
        self, input_ids: Sequence[int], sampling: EngineSampling, *, rid: str | None = None
    ) -> GenerateResult:
        await self._paused.wait()
        rid = rid or f"scripted-{self.calls}"
        if len(input_ids) >= self.context_length:
            raise EngineBadRequest(
                f"prompt of {len(input_ids)} tokens exceeds the context length {self.context_length}"
            )
        if self.calls in self.script.fail_calls:
            self.calls += 1
            raise EngineUnavailable(f"HTTP 500: injected fault (call {self.calls - 1})")
        key, lst = self._playing(rollout_of(rid), input_ids)
        n = self._next.get(key, 0)
        self._next[key] = n + 1
        self.calls += 1
        resp = lst[n] if n < len(lst) else self.script.after_end
        ids = self.output_ids(resp)
        finish: Literal["stop", "length", "abort"] = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        aborted = self._aborts.setdefault(rid, anyio.Event())
        try:
            if self.script.latency_s:
                with anyio.move_on_after(self.script.latency_s):
                    await aborted.wait()
        finally:
            self._aborts.pop(rid, None)
        if aborted.is_set():
            return GenerateResult(rid=rid, output_ids=[], logprobs=[], finish_reason="abort",
                                  weight_version=str(self.version), version_spans=[(0, str(self.version))],
                                  prompt_tokens=len(input_ids))
        return GenerateResult(
            rid=rid, output_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish,
            matched_stop=ids[-1] if finish == "stop" and ids and ids[-1] in sampling.stop_token_ids else None,
            weight_version=str(self.version), version_spans=[(0, str(self.version))],
            prompt_tokens=len(input_ids), completion_tokens=len(ids),
        )

    async def update_weights(self, path: str, version: int | str) -> None:
        self.version = int(version)

    async def pause(self, mode: Literal["abort", "retract", "in_place"] = "in_place") -> None:
        self._paused = anyio.Event()

    async def resume(self) -> None:
        self._paused.set()

    async def abort(self, rid: str | None = None) -> None:
        if rid is not None:
            self._aborts.setdefault(rid, anyio.Event()).set()

    async def health(self) -> bool:
        return True

    async def model_info(self) -> dict[str, Any]:
        return {"model_path": "scripted", "weight_version": str(self.version), "context_length": self.context_length}

    async def aclose(self) -> None:
        return None
