"""One engine call on behalf of the proxy: a failed engine is asked again, and what still fails becomes the error
kind and message the harness is told; the policy versions the output was sampled by."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from pipeline.core.logs import get_logger
from pipeline.messages import VersionSpan
from pipeline.serving.engine import (
    ConversationEngine,
    Engine,
    EngineBadRequest,
    EngineError,
    EngineSampling,
    EngineUnavailable,
    GenerateResult,
)
from pipeline.serving.wire import ErrorKind
from pipeline.tokens.conversation import Conversation

ENGINE_RETRY_S = 0.5


@functools.cache
def _answers_conversations(kind: type) -> bool:
    # once per engine class: a runtime Protocol check costs microseconds, and this is every call's path
    return issubclass(kind, ConversationEngine)


async def run_engine(
    engine: Engine, input_ids: Any, sampling: EngineSampling, rid: str, retries: int = 0,
    conversation: Conversation | None = None,
) -> tuple[GenerateResult | None, tuple[ErrorKind, str] | None]:
    """(result, None), or (None, (error kind, message)) for an engine failure the client is told about. A failure
    of the engine itself (EngineUnavailable) is retried ``retries`` times first. An engine that answers
    conversations (a teacher) gets ``conversation`` too."""
    for attempt in range(retries + 1):
        try:
            if conversation is not None and _answers_conversations(type(engine)):
                return await engine.answer(conversation, input_ids, sampling, rid=rid), None
            return await engine.generate(input_ids, sampling, rid=rid), None
        except EngineBadRequest as e:
            msg = str(e)
            return None, ("context_length" if "context" in msg.lower() or "longer" in msg.lower()
                          else "invalid_request", msg)
        except EngineUnavailable as e:
            if attempt == retries:
                return None, ("server", f"engine failed: {e}" + (f" ({retries + 1} attempts)" if retries else ""))
            get_logger(actor="proxy").warning("engine failed; asking it again", rid=rid, attempt=attempt + 1,
                                              error=str(e))
            await asyncio.sleep(ENGINE_RETRY_S)
        except EngineError as e:
            return None, ("server", f"engine failed: {e}")
    raise AssertionError("unreachable")


def result_versions(res: GenerateResult, fallback: int) -> list[VersionSpan]:
    """The result's version spans; ``fallback`` (the proxy's policy version) for the whole output when the engine
    gave none or garbled ones."""
    try:
        spans = res.spans()
    except EngineError:
        spans = []
    return spans or [VersionSpan(0, fallback)]
