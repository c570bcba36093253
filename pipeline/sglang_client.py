"""HTTP client for SGLang's native API; the same code path talks to SGLang and to the embedded engine.

``HttpEngine(base_url)`` sends ``/generate`` to ``base_url`` (a server or an sglang router) and control calls
(weight updates, pause/continue) to every URL in ``control_urls`` (the workers behind a router; by default just
``base_url``). Responses are parsed defensively: ``meta_info`` keys drift between SGLang versions, so only
``finish_reason`` and, when logprobs were asked for, ``output_token_logprobs`` are required.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
import numpy as np
import orjson

from pipeline.engine import (
    EngineBadRequest,
    EngineProtocolError,
    EngineUnavailable,
    GenerateResult,
    Sampling,
)
from pipeline.logs import get_logger

if TYPE_CHECKING:
    from typing_extensions import Self

log = get_logger(actor="engine_client")
_JSON = {"Content-Type": "application/json"}


def generate_body(
    input_ids: Sequence[int], sampling: Sampling, rid: str, *, stream: bool = False
) -> dict[str, Any]:
    return {
        "rid": rid,
        # numpy arrays pass through untouched: orjson serializes them natively (20x faster than a list of ints)
        "input_ids": input_ids if isinstance(input_ids, np.ndarray) else [int(i) for i in input_ids],
        "sampling_params": sampling.to_sglang(),
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": stream,
    }


def parse_generate(obj: Any, rid: str, *, require_finish: bool = True) -> GenerateResult:
    """A native /generate response (or, with ``require_finish=False``, a streaming chunk) -> GenerateResult.

    Raises EngineProtocolError for anything it cannot interpret."""
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    if not isinstance(obj, dict) or not isinstance(obj.get("meta_info"), dict):
        raise EngineProtocolError(f"request {rid}: /generate answered without meta_info: {str(obj)[:200]}")
    meta = obj["meta_info"]
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise EngineProtocolError(f"request {rid}: meta_info has no output_token_logprobs list")
    try:
        logprobs = [float(e[0]) for e in entries]
        ids_from_lp = [int(e[1]) for e in entries]
    except (TypeError, ValueError, IndexError):
        raise EngineProtocolError(f"request {rid}: malformed output_token_logprobs entry") from None
    output_ids = obj.get("output_ids")
    if isinstance(output_ids, list) and len(output_ids) == len(ids_from_lp):
        output_ids = [int(i) for i in output_ids]
        if output_ids != ids_from_lp:
            raise EngineProtocolError(f"request {rid}: output_ids disagree with output_token_logprobs")
    else:
        # Some versions return only the newest ids in streaming chunks or omit output_ids: the logprob
        # entries carry the ids too.
        output_ids = ids_from_lp

    fr = meta.get("finish_reason")
    matched: int | None = None
    if isinstance(fr, dict):
        kind = fr.get("type")
        if isinstance(fr.get("matched"), int) and not isinstance(fr.get("matched"), bool):
            matched = fr["matched"]
    elif isinstance(fr, str):
        kind = fr
    else:
        kind = None
    if kind is None and require_finish:
        raise EngineProtocolError(f"request {rid}: finished response without finish_reason")
    if kind not in ("stop", "length", "abort", None):
        raise EngineProtocolError(f"request {rid}: unknown finish_reason type {kind!r}")

    version = meta.get("weight_version")
    version = "" if version is None else str(version)
    spans_raw = meta.get("weight_version_spans")
    if isinstance(spans_raw, list) and all(isinstance(s, (list, tuple)) and len(s) == 2 for s in spans_raw):
        spans = [(int(s[0]), str(s[1])) for s in spans_raw]
    else:
        # SGLang records one version per request (updates wait for running requests unless paused in place).
        spans = [(0, version)] if output_ids and version else []
    prompt_tokens = meta.get("prompt_tokens")
    return GenerateResult(
        rid=str(meta.get("id") or rid),
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=kind,
        matched_stop=matched,
        weight_version=version,
        version_spans=spans,
        prompt_tokens=int(prompt_tokens) if isinstance(prompt_tokens, int) else 0,
        completion_tokens=len(output_ids),
        meta=meta,
    )


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if obj.get(key):
                return str(obj[key])
    return text.strip()[:500]


class HttpEngine:
    """Engine client over SGLang's native HTTP API (see module docstring). Use as an async context manager
    or call :meth:`aclose`. ``timeout_s`` bounds each generation; control calls use ``control_timeout_s``."""

    def __init__(
        self,
        base_url: str,
        *,
        control_urls: Sequence[str] | None = None,
        timeout_s: float = 3600.0,
        control_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.control_urls = [u.rstrip("/") for u in (control_urls or [self.base_url])]
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout_s)

    async def _request(
        self, method: str, url: str, body: Any = None, *, timeout: float | None = None
    ) -> tuple[int, str]:
        try:
            data = None if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            async with self._sess().request(
                method, url, data=data, headers=_JSON if data is not None else None,
                timeout=self._timeout(timeout or self.control_timeout_s),
            ) as resp:
                return resp.status, await resp.text()
        except TimeoutError:
            raise EngineUnavailable(f"{method} {url} timed out") from None
        except aiohttp.ClientError as e:
            raise EngineUnavailable(f"{method} {url} failed: {type(e).__name__}: {e}") from None

    @staticmethod
    def _check(url: str, status: int, text: str) -> Any:
        if status == 400:
            raise EngineBadRequest(f"{url}: {_error_message(text)}")
        if status != 200:
            raise EngineUnavailable(f"{url}: HTTP {status}: {_error_message(text)}")
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError:
            raise EngineProtocolError(f"{url}: response is not JSON: {text[:200]!r}") from None

    # --------------------------------------------------------------------------------------- generation
    async def generate(
        self, input_ids: Sequence[int], sampling: Sampling, *, rid: str | None = None
    ) -> GenerateResult:
        rid = rid or uuid.uuid4().hex
        url = f"{self.base_url}/generate"
        status, text = await self._request(
            "POST", url, generate_body(input_ids, sampling, rid), timeout=self.timeout_s
        )
        res = parse_generate(self._check(url, status, text), rid)
        if not res.prompt_tokens:
            res.prompt_tokens = len(input_ids)
        return res

    async def generate_stream(
        self, input_ids: Sequence[int], sampling: Sampling, *, rid: str | None = None
    ) -> AsyncIterator[GenerateResult]:
        """Yield cumulative snapshots (``finished`` False) and finally the finished result."""
        rid = rid or uuid.uuid4().hex
        url = f"{self.base_url}/generate"
        last: GenerateResult | None = None
        try:
            async with self._sess().post(
                url,
                data=orjson.dumps(generate_body(input_ids, sampling, rid, stream=True),
                                  option=orjson.OPT_SERIALIZE_NUMPY),
                headers=_JSON,
                timeout=self._timeout(self.timeout_s),
            ) as resp:
                if resp.status != 200:
                    self._check(url, resp.status, await resp.text())
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if isinstance(obj, dict) and "error" in obj and "meta_info" not in obj:
                        raise EngineUnavailable(f"{url}: stream error: {_error_message(data)}")
                    last = parse_generate(obj, rid, require_finish=False)
                    yield last
        except TimeoutError:
            raise EngineUnavailable(f"POST {url} (stream) timed out") from None
        except aiohttp.ClientError as e:
            raise EngineUnavailable(f"POST {url} (stream) failed: {type(e).__name__}: {e}") from None
        if last is None or not last.finished:
            raise EngineProtocolError(f"request {rid}: stream ended without a finished chunk")

    # ------------------------------------------------------------------------------------------ control
    async def _control(self, path: str, body: Any) -> list[Any]:
        out = []
        for base in self.control_urls:
            url = f"{base}{path}"
            status, text = await self._request("POST", url, body)
            out.append(self._check(url, status, text))
        return out

    async def update_weights(
        self, path: str, version: int | str, *, abort_all_requests: bool = False
    ) -> None:
        replies = await self._control(
            "/update_weights_from_disk",
            {
                "model_path": str(path),
                "weight_version": str(version),
                "abort_all_requests": abort_all_requests,
            },
        )
        for reply in replies:
            if isinstance(reply, dict) and reply.get("success") is False:
                raise EngineBadRequest(f"weight update to {path}: {reply.get('message')}")
        log.info("engine weights updated", path=str(path), version=str(version))

    async def pause(self, mode: Literal["abort", "retract", "in_place"] = "in_place") -> None:
        await self._control("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._control("/continue_generation", {})

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its generate call returns finish_reason "abort"), or all when rid is None."""
        body = {"abort_all": True} if rid is None else {"rid": rid}
        await self._control("/abort_request", body)

    async def health(self) -> bool:
        try:
            status, _ = await self._request("GET", f"{self.base_url}/health", timeout=self.connect_timeout_s)
        except EngineUnavailable:
            return False
        return status == 200

    async def model_info(self) -> dict[str, Any]:
        url = f"{self.base_url}/model_info"
        status, text = await self._request("GET", url)
        return self._check(url, status, text)

    async def server_info(self) -> dict[str, Any]:
        url = f"{self.base_url}/server_info"
        status, text = await self._request("GET", url)
        return self._check(url, status, text)
