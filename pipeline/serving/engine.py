"""The policy-engine interface: what the proxy (and the proxy actor, for weight updates) needs from whatever
serves the policy.

Every engine process speaks SGLang's native HTTP subset, so one client
(:class:`pipeline.serving.sglang_client.HttpEngine`) serves both a real SGLang server and our embedded engine
(:mod:`pipeline.serving.embedded`); the scripted engine (:mod:`pipeline.serving.scripted`) implements the same
protocol in-process. This module holds only the types: the sampling request, the result, the errors, and the
:class:`Engine` protocol. It imports neither torch nor aiohttp.

Weight versions are strings on the wire (SGLang's ``weight_version``); the pipeline names versions with integers
and sends ``str(version)``, so :meth:`GenerateResult.spans` turns them back into :class:`VersionSpan`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from pipeline.messages import VersionSpan
from pipeline.tokens.conversation import Conversation

FinishReason = Literal["stop", "length", "abort"]


class EngineSampling(msgspec.Struct, kw_only=True, frozen=True):
    """One generation's sampling. Every field is sent explicitly: engine defaults differ between endpoints.

    ``top_k = -1`` and ``top_p = 1.0`` disable those filters; ``temperature = 0`` is greedy.
    ``seed`` makes sampling reproducible per request (SGLang's ``sampling_seed``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` object of a native ``/generate`` call."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


class GenerateResult(msgspec.Struct, kw_only=True):
    """One finished (or aborted) generation.

    ``output_ids`` include the matched stop token; ``logprobs[i]`` is ``log_softmax(logits / T)`` of
    ``output_ids[i]`` (``log_softmax(logits)`` when T = 0), i.e. pi_rollout. ``version_spans`` are
    ``(start_index, weight_version)`` pairs: output tokens from ``start_index`` on were sampled by that version.
    ``meta`` is the engine's raw ``meta_info`` (its keys drift between SGLang versions).
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None  # None only in an unfinished streaming snapshot
    matched_stop: int | None = None
    weight_version: str = ""
    version_spans: list[tuple[int, str]] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    meta: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def spans(self) -> list[VersionSpan]:
        """``version_spans`` with integer versions, as :class:`pipeline.messages.ModelCall` records them."""
        out = []
        for start, version in self.version_spans:
            try:
                out.append(VersionSpan(start=start, version=int(version)))
            except ValueError:
                raise EngineProtocolError(
                    f"request {self.rid}: weight_version {version!r} is not an integer policy version; "
                    "start the engine with an integer weight version (e.g. --weight-version 0)"
                ) from None
        return out


class EngineError(Exception):
    """Base of engine failures."""


class EngineBadRequest(EngineError):
    """The engine refused the request (HTTP 400): fix the request, retrying will not help."""


class EngineUnavailable(EngineError):
    """The engine could not be reached, timed out, or failed internally (connection error, 5xx)."""


class EngineProtocolError(EngineError):
    """The engine answered something this client cannot interpret."""


class EngineVersionMismatch(EngineError):
    """The workers behind one engine do not all hold the same weight version: a weight update reached some of them
    and not others (or they were started apart). The message names each worker and its version."""


@dataclass(frozen=True)
class EngineProcess:
    """A process bridle started for the engine (a server, or the router in front of several): the watchdog
    (:mod:`pipeline.serving.watchdog`) fails the run with its exit code and the end of its log when it exits."""

    name: str
    process: subprocess.Popen
    log_path: Path


@runtime_checkable
class ConversationEngine(Protocol):
    """An engine that answers the conversation the harness sent rather than its token ids: a teacher model behind
    another API (:class:`pipeline.serving.teacher.TeacherEngine`). The proxy still renders the prompt (the record's
    input ids) and the answer comes back in the policy's tokens."""

    async def answer(self, conversation: Conversation, input_ids: Sequence[int], sampling: EngineSampling, *,
                     rid: str) -> GenerateResult: ...


class Engine(Protocol):
    """What the pipeline calls. Implemented by :class:`pipeline.serving.sglang_client.HttpEngine` and
    :class:`pipeline.serving.scripted.ScriptedEngine`."""

    async def generate(
        self, input_ids: Sequence[int], sampling: EngineSampling, *, rid: str | None = None
    ) -> GenerateResult: ...

    async def update_weights(self, path: str, version: int | str) -> None: ...

    async def pause(self, mode: Literal["abort", "retract", "in_place"] = "in_place") -> None: ...

    async def resume(self) -> None: ...

    async def abort(self, rid: str | None = None) -> None: ...

    async def health(self) -> bool: ...

    async def model_info(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...
