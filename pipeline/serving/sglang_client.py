"""HTTP client for SGLang's native API; the same code path talks to SGLang and to the embedded engine.

``HttpEngine(base_url)`` sends ``/generate`` to ``base_url`` (a server or an sglang router) and control calls
(weight updates, pause/continue) to every URL in ``control_urls`` (the workers behind a router; by default just
``base_url``). Responses are parsed defensively: ``meta_info`` keys drift between SGLang versions, so only
``finish_reason`` and, when logprobs were asked for, ``output_token_logprobs`` are required; ``weight_versions``
(which version sampled which output tokens), when present, must be well formed. The keys sent and read are listed,
and checked against SGLang's source, in :mod:`pipeline.serving.sglang_api`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import aiohttp
import httptools
import numpy as np
import orjson

from pipeline.core.logs import get_logger
from pipeline.serving.engine import (
    EngineBadRequest,
    EngineProtocolError,
    EngineSampling,
    EngineUnavailable,
    GenerateResult,
)
from pipeline.serving.sglang_api import FINISH_TYPES, read_weight_versions

if TYPE_CHECKING:
    from typing import Self

log = get_logger(actor="engine_client")
_JSON = {"Content-Type": "application/json"}


def generate_body(input_ids: Sequence[int], sampling: EngineSampling, rid: str) -> dict[str, Any]:
    """A native, non-streaming ``/generate`` body asking for the output tokens' logprobs."""
    return {
        "rid": rid,
        # numpy arrays pass through untouched: orjson serializes them natively (20x faster than a list of ints)
        "input_ids": input_ids if isinstance(input_ids, np.ndarray) else [int(i) for i in input_ids],
        "sampling_params": sampling.to_sglang(),
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
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
    if kind is not None and kind not in FINISH_TYPES:
        raise EngineProtocolError(f"request {rid}: unknown finish_reason type {kind!r}")

    version = meta.get("weight_version")
    version = "" if version is None else str(version)
    if meta.get("weight_versions") is not None:
        try:
            spans = read_weight_versions(meta["weight_versions"], len(output_ids))
        except ValueError as e:
            raise EngineProtocolError(f"request {rid}: meta_info.weight_versions: {e}") from None
    else:
        # an unfinished streaming chunk, or an SGLang older than the spans: the whole output is one version's
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


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


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


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time. httptools (llhttp, in C) frames the
    response as it arrives: Content-Length, chunked, or (HTTP/1.0, no length) until the server closes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.got_bytes = False  # any response byte since the request was sent
        self.reusable = False
        self._parser = httptools.HttpResponseParser(self)
        self._status = 0
        self._body = bytearray()
        self._framed = False  # the response says where its body ends (a length or chunks), not "at close"
        self._in_body = False  # the final response's headers are in; its body may be running
        self._complete = False

    def start(self) -> asyncio.Future[tuple[int, bytes]]:
        self._body.clear()
        self.got_bytes = self.reusable = self._complete = self._framed = self._in_body = False
        self._status = 0
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    # httptools callbacks (from inside feed_data)
    def on_message_begin(self) -> None:
        if self._complete:  # bytes after the answer: this connection cannot carry another request
            self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an informational response (100 Continue): the real one follows
            self._framed = False
            return
        self._status = status
        self._in_body = True

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        if not self._in_body or self._complete:
            return
        self._complete = True
        self.reusable = self._parser.should_keep_alive()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        w = self.waiter
        if w is None or w.done():
            return
        if self._complete or (self._in_body and not self._framed):  # the close ends a body framed "until close"
            w.set_result((self._status, bytes(self._body)))
        else:  # cut off mid-response: a connection failure, not a malformed reply
            w.set_exception(exc or ConnectionResetError("the engine closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        w = self.waiter
        if w is None or w.done():  # bytes nobody asked for: this connection cannot carry another request
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self.reusable = False
            if not self._complete:
                self.closed = True
                w.set_exception(EngineProtocolError(f"malformed HTTP response from the engine: {e}"))
                return
        if self._complete:
            w.set_result((self._status, bytes(self._body)))


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class HttpEngine:
    """Engine client over SGLang's native HTTP API (see module docstring). Use as an async context manager
    or call :meth:`aclose`. ``timeout_s`` bounds each generation; control calls use ``control_timeout_s``.

    ``/generate`` on an ``http://`` URL goes over a small pool of keep-alive connections this class drives
    itself, with httptools (llhttp) parsing the answers: a generation is one write and a parse of one JSON
    answer. aiohttp's client costs more CPU per call (≈1.2× this path's with h11 as the parser, ≈0.09 ms more
    than with httptools; it adds up in the proxy's event loop). Everything else goes through aiohttp."""

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
        # Set by the launcher when bridle started the server: the watchdog polls the process instead of /health.
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._session: aiohttp.ClientSession | None = None
        self._generate_url = f"{self.base_url}/generate"
        u = urlsplit(self.base_url)
        self._direct = u.scheme == "http" and u.hostname is not None
        self._host, self._port = u.hostname or "", u.port or 80
        # every /generate request head is this one followed by its Content-Length and a blank line
        self._generate_head = (b"POST " + f"{u.path.rstrip('/')}/generate".encode("latin-1") + b" HTTP/1.1\r\nHost: "
                               + u.netloc.encode("latin-1") + b"\r\nContent-Type: application/json\r\nContent-Length: ")
        self._idle: list[_Conn] = []
        self._idle_loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for c in self._idle:
            if c.transport is not None:
                c.transport.close()
        self._idle.clear()
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
        self, method: str, url: str, body: Any = None, *, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        try:
            data = None if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            async with self._sess().request(
                method, url, data=data, headers=_JSON if data is not None else None,
                timeout=self._timeout(timeout_s or self.control_timeout_s),
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            raise EngineUnavailable(f"{method} {url} timed out") from None
        except aiohttp.ClientError as e:
            raise EngineUnavailable(f"{method} {url} failed: {type(e).__name__}: {e}") from None

    @staticmethod
    def _check(url: str, status: int, raw: bytes) -> Any:
        if status == 400:
            raise EngineBadRequest(f"{url}: {_error_message(_text(raw))}")
        if status != 200:
            raise EngineUnavailable(f"{url}: HTTP {status}: {_error_message(_text(raw))}")
        if not raw.strip():
            return {}
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        try:  # what orjson refuses but json reads (Infinity / NaN logprobs from a json.dumps server)
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise EngineProtocolError(f"{url}: response is not JSON: {_text(raw)[:200]!r}") from None

    # --------------------------------------------------------------------------------------- generation
    async def generate(
        self, input_ids: Sequence[int], sampling: EngineSampling, *, rid: str | None = None
    ) -> GenerateResult:
        rid = rid or uuid.uuid4().hex
        url = self._generate_url
        body = generate_body(input_ids, sampling, rid)
        if self._direct:
            status, raw = await self._post_generate(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))
        else:
            status, raw = await self._request("POST", url, body, timeout_s=self.timeout_s)
        res = parse_generate(self._check(url, status, raw), rid)
        if not res.prompt_tokens:
            res.prompt_tokens = len(input_ids)
        return res

    async def _post_generate(self, data: bytes) -> tuple[int, bytes]:
        """POST /generate over a pooled connection; (status, body)."""
        loop = asyncio.get_running_loop()
        if self._idle_loop is not loop:  # connections belong to the loop that opened them
            self._idle, self._idle_loop = [], loop
        head = self._generate_head + str(len(data)).encode() + b"\r\n\r\n"
        url = self._generate_url
        deadline = loop.time() + self.timeout_s
        for attempt in (0, 1):
            conn = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed and c.transport is not None and not c.transport.is_closing():
                    conn = c
                    break
            reused = conn is not None
            if conn is None:
                try:
                    _, conn = await asyncio.wait_for(
                        loop.create_connection(_Conn, self._host, self._port), self.connect_timeout_s
                    )
                except (TimeoutError, OSError) as e:
                    raise EngineUnavailable(f"POST {url} failed: cannot connect: {type(e).__name__}: {e}") from None
            assert conn.transport is not None
            waiter = conn.start()
            ok = False
            timer = loop.call_at(deadline, _expire, waiter)
            try:
                conn.transport.write(head + data)  # one buffer: the request goes out in one write
                status, raw = await waiter
                ok = True
            except TimeoutError:  # before OSError: since Python 3.11 it is one
                raise EngineUnavailable(f"POST {url} timed out") from None
            except OSError as e:
                # a kept-alive connection the server closed while idle: nothing was answered, so send again on
                # a fresh one (once)
                if reused and not conn.got_bytes and attempt == 0:
                    continue
                raise EngineUnavailable(f"POST {url} failed: {type(e).__name__}: {e}") from None
            finally:
                timer.cancel()
                if ok and conn.reusable and not conn.closed:
                    self._idle.append(conn)
                else:  # cancelled, failed or not reusable: a half-read response must not reach the next request
                    conn.closed = True
                    conn.transport.close()
            return status, raw
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------ control
    async def _control(self, path: str, body: Any) -> list[Any]:
        out = []
        for base in self.control_urls:
            url = f"{base}{path}"
            status, raw = await self._request("POST", url, body)
            out.append(self._check(url, status, raw))
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
            status, _ = await self._request("GET", f"{self.base_url}/health", timeout_s=self.connect_timeout_s)
        except EngineUnavailable:
            return False
        return status == 200

    async def model_info(self) -> dict[str, Any]:
        url = f"{self.base_url}/model_info"
        status, raw = await self._request("GET", url)
        return self._check(url, status, raw)

    async def server_info(self) -> dict[str, Any]:
        url = f"{self.base_url}/server_info"
        status, raw = await self._request("GET", url)
        return self._check(url, status, raw)
