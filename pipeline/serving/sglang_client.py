"""HTTP client for SGLang's native API; the same code path talks to SGLang and to the embedded engine.

``HttpEngine(base_url)`` sends ``/generate`` to ``base_url`` (a server or an sglang router) and control calls
(weight updates, pause/continue, abort) to every URL in ``control_urls`` at once (the workers behind a router,
which forwards none of them; by default just ``base_url``). A weight update returns only when every worker has
applied it and reports the new version (``/model_info``); a worker that fails it is asked once more, then the
update fails with :class:`~pipeline.serving.engine.EngineVersionMismatch` naming each worker's version when some
workers moved and others did not. ``model_info`` / ``server_info`` describe the first worker. Responses are parsed
defensively: ``meta_info`` keys drift between SGLang versions, so only
``finish_reason`` and, when logprobs were asked for, ``output_token_logprobs`` are required; ``weight_versions``
(which version sampled which output tokens), when present, must be well formed. The keys sent and read are listed,
and checked against SGLang's source, in :mod:`pipeline.serving.sglang_api`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp
import anyio
import numpy as np
import orjson

from pipeline.core.logs import get_logger
from pipeline.serving.engine import (
    EngineBadRequest,
    EngineError,
    EngineProcess,
    EngineProtocolError,
    EngineSampling,
    EngineUnavailable,
    EngineVersionMismatch,
    GenerateResult,
)
from pipeline.serving.http_conn import Conn, expire
from pipeline.serving.sglang_api import FINISH_TYPES, read_weight_versions

if TYPE_CHECKING:
    from typing import Self

log = get_logger(actor="engine_client")
_JSON = {"Content-Type": "application/json"}
T = TypeVar("T")


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
        update_retries: int = 1,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.control_urls = [u.rstrip("/") for u in (control_urls or [self.base_url])]
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.update_retries = update_retries
        # Set by the launcher when bridle started the servers (and the router): the watchdog polls these processes
        # instead of /health, unless watch_health says some servers are not among them.
        self.processes: list[EngineProcess] = []
        self.watch_health = False
        self._session: aiohttp.ClientSession | None = None
        self._generate_url = f"{self.base_url}/generate"
        u = urlsplit(self.base_url)
        self._direct = u.scheme == "http" and u.hostname is not None
        self._host, self._port = u.hostname or "", u.port or 80
        # every /generate request head is this one followed by its Content-Length and a blank line
        self._generate_head = (b"POST " + f"{u.path.rstrip('/')}/generate".encode("latin-1") + b" HTTP/1.1\r\nHost: "
                               + u.netloc.encode("latin-1") + b"\r\nContent-Type: application/json\r\nContent-Length: ")
        self._idle: list[Conn] = []
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
                        loop.create_connection(Conn, self._host, self._port), self.connect_timeout_s
                    )
                except (TimeoutError, OSError) as e:
                    raise EngineUnavailable(f"POST {url} failed: cannot connect: {type(e).__name__}: {e}") from None
            assert conn.transport is not None
            waiter = conn.start()
            ok = False
            timer = loop.call_at(deadline, expire, waiter)
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
    async def _each(self, urls: Sequence[str], fn: Callable[[str], Awaitable[T]]) -> list[T | EngineError]:
        """``fn(url)`` for every URL at once; each one's result or EngineError, in order."""
        out: list[Any] = [None] * len(urls)

        async def one(i: int, url: str) -> None:
            try:
                out[i] = await fn(url)
            except EngineError as e:
                out[i] = e

        async with anyio.create_task_group() as tg:
            for i, url in enumerate(urls):
                tg.start_soon(one, i, url)
        return out

    async def _post(self, url: str, body: Any) -> Any:
        status, raw = await self._request("POST", url, body)
        return self._check(url, status, raw)

    async def _control(self, path: str, body: Any) -> list[Any]:
        out = await self._each(self.control_urls, lambda base: self._post(f"{base}{path}", body))
        for r in out:
            if isinstance(r, EngineError):
                raise r
        return out

    async def _update_one(self, base: str, body: dict[str, Any]) -> None:
        url = f"{base}/update_weights_from_disk"
        for attempt in range(self.update_retries + 1):
            try:
                reply = await self._post(url, body)
                break
            except EngineUnavailable as e:  # a timeout or a 5xx; re-applying the same weights is harmless
                if attempt == self.update_retries:
                    raise
                log.warning("weight update failed; asking again", worker=base, error=str(e))
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineBadRequest(f"{url}: weight update to {body['model_path']}: {reply.get('message')}")

    async def update_weights(
        self, path: str, version: int | str, *, abort_all_requests: bool = False
    ) -> None:
        """Load the checkpoint at ``path`` as ``version`` on every worker at once; return when all report it."""
        body = {"model_path": str(path), "weight_version": str(version), "abort_all_requests": abort_all_requests}
        results = await self._each(self.control_urls, lambda base: self._update_one(base, body))
        failed = [(u, r) for u, r in zip(self.control_urls, results, strict=True) if isinstance(r, EngineError)]
        if failed and len(failed) == len(self.control_urls):
            raise failed[0][1]  # no worker moved: they still agree, on the old version
        versions = await self._each(self.control_urls, self._version)
        moved = dict(zip(self.control_urls, versions, strict=True))
        problems = [f"{u}: {e}" for u, e in failed] + [
            f"{u} answered success but reports version {v!r}" for u, v in moved.items()
            if v != str(version) and not any(u == f for f, _ in failed) and not isinstance(v, Exception)]
        if problems:
            raise EngineVersionMismatch(
                f"weight update to version {version} ({path}) did not reach every worker: {'; '.join(problems)}. "
                f"The workers now hold {_describe(moved)}: they would sample the next rollouts from different "
                "policies, so the update fails; see the failing worker's log"
            )
        log.info("engine weights updated", path=str(path), version=str(version), workers=len(self.control_urls))

    # ------------------------------------------------------------------ weight sync without the disk
    async def init_weights_update_group(
        self, master_address: str, master_port: int, join: Callable[[], Awaitable[None]], *,
        backend: str, group_name: str,
    ) -> None:
        """Make every worker join a process group whose rank 0 is the caller: worker ``i`` as rank ``1 + i``.
        ``join`` joins rank 0 and runs while the workers' calls wait (neither side returns before all have
        joined). Raises the first failure; the workers that did join are then asked to leave again."""
        world = len(self.control_urls) + 1

        def body(i: int) -> dict[str, Any]:
            return {"master_address": master_address, "master_port": master_port, "rank_offset": i + 1,
                    "world_size": world, "group_name": group_name, "backend": backend}

        urls = list(enumerate(self.control_urls))
        results = await self._with_sender(
            join, [lambda i=i, u=u: self._post_ok(f"{u}/init_weights_update_group", body(i)) for i, u in urls])
        if failed := [r for r in results if isinstance(r, BaseException)]:
            await self.destroy_weights_update_group(group_name, quiet=True)
            raise failed[0] if isinstance(failed[0], EngineError) else EngineUnavailable(str(failed[0]))

    async def destroy_weights_update_group(self, group_name: str, *, quiet: bool = False) -> None:
        """Every worker leaves the group (``quiet``: whatever they answer; a worker that never joined says so)."""
        out = await self._each(self.control_urls, lambda base: self._post_ok(
            f"{base}/destroy_weights_update_group", {"group_name": group_name}))
        for r in out:
            if isinstance(r, EngineError) and not quiet:
                raise r

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], version: int | str,
        send: Callable[[], Awaitable[None]], *, group_name: str, flush_cache: bool = True,
    ) -> None:
        """Load the weights ``send`` broadcasts (the tensors ``names`` / ``dtypes`` / ``shapes`` describe, in that
        order) as ``version`` on every worker; return when all report it. SGLang 0.5.23 takes such an update only
        inside a weight-update session: ``/begin_weight_update`` ... ``/end_weight_update``. Raises on any failure
        (the session is closed on every worker first); :class:`EngineVersionMismatch` when the workers answered but
        do not all hold ``version``."""
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": flush_cache, "weight_version": str(version)}
        try:
            results: list[Any] = await self._each(
                self.control_urls, lambda base: self._post_ok(f"{base}/begin_weight_update", {}))
            if not any(isinstance(r, BaseException) for r in results):
                results = await self._with_sender(send, [
                    lambda u=u: self._post_ok(f"{u}/update_weights_from_distributed", body)
                    for u in self.control_urls])
        finally:
            # shielded: a session left open on a worker refuses the next begin
            with anyio.CancelScope(shield=True):
                ended = await self._each(
                    self.control_urls, lambda base: self._post_ok(f"{base}/end_weight_update", {}))
        if failed := [r for r in results + ended if isinstance(r, BaseException)]:
            raise failed[0] if isinstance(failed[0], EngineError) else EngineUnavailable(
                f"weight update to version {version} over the process group failed: {failed[0]}")
        versions = await self.worker_versions()
        if any(v != str(version) for v in versions.values()):
            raise EngineVersionMismatch(f"weight update to version {version} over the process group: the workers "
                                        f"answered success but hold {_describe(versions)}")
        log.info("engine weights updated over the process group", version=str(version),
                 workers=len(self.control_urls), tensors=len(names))

    async def _with_sender(
        self, send: Callable[[], Awaitable[None]], calls: Sequence[Callable[[], Awaitable[Any]]]
    ) -> list[Any]:
        """``send()`` and every call at once, each to its end (a collective needs every side; a failure of one
        does not cancel the others, which end by their own timeouts). Each one's result or exception, ``send``'s
        last."""
        out: list[Any] = [None] * (len(calls) + 1)

        async def one(i: int, fn: Callable[[], Awaitable[Any]]) -> None:
            try:
                out[i] = await fn()
            except Exception as e:  # noqa: BLE001 — reported to the caller, which raises the first one
                out[i] = e

        async with anyio.create_task_group() as tg:
            for i, fn in enumerate([*calls, send]):
                tg.start_soon(one, i, fn)
        return out

    async def _post_ok(self, url: str, body: Any) -> Any:
        """POST a call SGLang answers with ``{"success", "message"}`` (400 when it did not succeed)."""
        reply = await self._post(url, body)
        if isinstance(reply, dict):
            ok, message = reply.get("success"), reply.get("message")
            if ok is False:
                raise EngineBadRequest(f"{url}: {message}")
        return reply

    async def _version(self, base: str) -> str:
        url = f"{base}/model_info"
        status, raw = await self._request("GET", url)
        version = self._check(url, status, raw).get("weight_version")
        if version is None:
            raise EngineProtocolError(f"{url} reports no weight_version (SGLang has it since 0.5.0: upgrade it)")
        return str(version)

    async def worker_versions(self) -> dict[str, str]:
        """Each worker's weight version, by URL. Raises the first worker's error if one cannot be asked."""
        versions = await self._each(self.control_urls, self._version)
        for v in versions:
            if isinstance(v, EngineError):
                raise v
        return dict(zip(self.control_urls, versions, strict=True))  # type: ignore[arg-type]

    async def check_versions(self) -> str:
        """The workers' common weight version; EngineVersionMismatch naming each one's when they differ."""
        versions = await self.worker_versions()
        if len(set(versions.values())) > 1:
            raise EngineVersionMismatch(f"the workers behind {self.base_url} hold different weight versions: "
                                        f"{_describe(versions)}; start them from the same checkpoint and version")
        return next(iter(versions.values()))

    async def pause(self, mode: Literal["abort", "retract", "in_place"] = "in_place") -> None:
        await self._control("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._control("/continue_generation", {})

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its generate call returns finish_reason "abort"), or all when rid is None. Behind a
        router every worker is asked: only the one running ``rid`` has it."""
        body = {"abort_all": True} if rid is None else {"rid": rid}
        await self._control("/abort_request", body)

    async def _healthy(self, base: str) -> bool:
        try:
            status, _ = await self._request("GET", f"{base}/health", timeout_s=self.connect_timeout_s)
        except EngineUnavailable:
            return False
        return status == 200

    async def health(self) -> bool:
        """Whether ``base_url`` and every worker answer /health."""
        answers = await self._each(list(dict.fromkeys([self.base_url, *self.control_urls])), self._healthy)
        return all(a is True for a in answers)

    async def model_info(self) -> dict[str, Any]:
        url = f"{self.control_urls[0]}/model_info"
        status, raw = await self._request("GET", url)
        return self._check(url, status, raw)

    async def server_info(self) -> dict[str, Any]:
        url = f"{self.control_urls[0]}/server_info"
        status, raw = await self._request("GET", url)
        return self._check(url, status, raw)


def _describe(versions: Sequence[Any] | dict[str, Any]) -> str:
    items = versions.items() if isinstance(versions, dict) else enumerate(versions)
    return ", ".join(f"{u} -> {'unreachable (' + str(v) + ')' if isinstance(v, Exception) else repr(v)}"
                     for u, v in items)
