"""The embedded engine's HTTP side: request validation and the aiohttp server in front of the batcher.

Endpoints, in the shapes of SGLang's native API: ``POST /generate`` (``input_ids`` only, non-streaming or
cumulative ``data:`` streaming), ``/abort_request``, ``/update_weights_from_disk``, ``/pause_generation``,
``/continue_generation``; weight sync without the disk over a gloo process group (:mod:`pipeline.serving.weight_sync`):
``/init_weights_update_group``, ``/update_weights_from_distributed`` (inside ``/begin_weight_update`` ...
``/end_weight_update``, as SGLang 0.5.23 requires), ``/destroy_weights_update_group``; ``/flush_cache`` (empties the
prefix cache); ``GET /health``, ``/health_generate``, ``/model_info``, ``/server_info`` (batch occupancy and prefix
cache statistics). A bad request gets a 400 whose message names the field and what to send instead.

Behind ``sglang-router`` (:mod:`pipeline.serving.router`) the engine also answers what the router asks of a
worker: ``/health``, ``/server_info`` and ``/model_info`` when it registers the worker (and ``/get_model_info``,
``/get_server_info`` forwarded from clients), ``/flush_cache`` (forwarded to every worker).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from pipeline.core.logs import get_logger
from pipeline.serving.embedded.batcher import (
    Abort,
    Add,
    Batcher,
    Continue,
    Flush,
    Pause,
    Req,
    Stop,
    UpdateWeights,
)
from pipeline.serving.embedded.runner import BadRequest, ModelRunner
from pipeline.serving.weight_sync import WeightSyncError, close_group, open_group, receive

log = get_logger(actor="embedded_engine")

# Sampling parameters SGLang accepts. The first set is implemented; the second is accepted only at its
# neutral value (the embedded engine does not implement it) so that a client sending explicit defaults works.
_SUPPORTED = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
}
_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "stop": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}


# ------------------------------------------------------------------------------------------ validation
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_generate_request(body: Any, runner: ModelRunner) -> dict[str, Any]:
    """Validate a /generate body; returns the request fields or raises BadRequest naming the problem.

    The fields are :class:`~pipeline.serving.embedded.batcher.Req`'s (the prompt in model ids) plus ``seed``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = _prompt(body, runner)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    for key in ("return_logprob", "stream"):
        if key in body and body[key] is not None and not isinstance(body[key], bool):
            raise BadRequest(f"{key} must be a boolean")
    if body.get("logprob_start_len", -1) not in (-1, None):
        raise BadRequest(
            "logprob_start_len other than -1 (input logprobs) is not supported by the embedded engine"
        )
    if body.get("top_logprobs_num", 0) not in (0, None):
        raise BadRequest("top_logprobs_num other than 0 is not supported by the embedded engine")
    return {
        "rid": rid or uuid.uuid4().hex,
        "prompt": prompt,
        **_sampling(body.get("sampling_params") or {}),
        "return_logprob": bool(body.get("return_logprob") or False),
        "stream": bool(body.get("stream") or False),
    }


def _prompt(body: dict[str, Any], runner: ModelRunner) -> list[int]:
    """``input_ids`` checked against the vocabulary and the context, as model ids."""
    if body.get("text") is not None:
        raise BadRequest("the embedded engine has no tokenizer: send input_ids instead of text")
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids is required")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise BadRequest(
            "batched input_ids (a list of lists) are not supported: send one request per sequence"
        )
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        raise BadRequest("input_ids must be a non-empty list of integers")
    for i, t in enumerate(ids):
        if not 0 <= t < runner.input_vocab:
            raise BadRequest(f"input_ids[{i}] = {t} is outside the vocabulary [0, {runner.input_vocab})")
    if len(ids) >= runner.context_length:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens; the context length is {runner.context_length}, which must leave "
            "room for at least one output token"
        )
    return runner.to_model(ids)


def _sampling(sp: Any) -> dict[str, Any]:
    """``sampling_params`` -> the sampling fields of a Req (and ``seed``)."""
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object")
    unknown = sorted(set(sp) - _SUPPORTED - set(_NEUTRAL))
    if unknown:
        raise BadRequest(f"unknown sampling parameter(s) {unknown}")
    for key, neutral in _NEUTRAL.items():
        if key in sp and sp[key] not in (neutral, None) and not (key == "stop" and sp[key] == []):
            raise BadRequest(f"sampling parameter {key}={sp[key]!r} is not supported by the embedded engine")
    temperature = sp.get("temperature", 1.0)
    top_p = sp.get("top_p", 1.0)
    top_k = sp.get("top_k", -1)
    max_new = sp.get("max_new_tokens", 128)
    stop = sp.get("stop_token_ids") or []
    seed = sp.get("sampling_seed")
    ignore_eos = sp.get("ignore_eos", False)
    if not _is_num(temperature) or temperature < 0:
        raise BadRequest("temperature must be a number >= 0")
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]")
    if not _is_int(top_k) or not (top_k == -1 or top_k >= 1):
        raise BadRequest("top_k must be -1 (disabled) or an integer >= 1")
    if not _is_int(max_new) or max_new < 0:
        raise BadRequest("max_new_tokens must be an integer >= 0")
    if not isinstance(stop, list) or not all(_is_int(t) for t in stop):
        raise BadRequest("stop_token_ids must be a list of integers")
    if seed is not None and not _is_int(seed):
        raise BadRequest("sampling_seed must be an integer")
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be a boolean")
    return {
        "max_new_tokens": max_new,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": top_k,
        "stop_ids": frozenset(stop),
        "ignore_eos": ignore_eos,
        "seed": seed,
    }


# ------------------------------------------------------------------------------------------- HTTP server
class EngineServer:
    """The aiohttp handlers; the model runs on the batcher's thread, this side only validates and waits."""

    def __init__(self, runner: ModelRunner, batcher: Batcher, model_path: str) -> None:
        self.runner = runner
        self.batcher = batcher
        self.model_path = model_path
        self.live: set[str] = set()
        self.update_lock = asyncio.Lock()
        self.seeds = np.random.SeedSequence()  # unseeded requests each get a fresh child of this sequence
        self.groups: dict[str, Any] = {}  # weight update groups joined, by name
        self.session = False  # inside /begin_weight_update ... /end_weight_update
        self.group_timeout_s = 600.0  # a rendezvous or a broadcast that does not complete in this fails

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.post("/abort_request", self.abort),
                web.post("/update_weights_from_disk", self.update_weights),
                web.post("/init_weights_update_group", self.init_group),
                web.post("/destroy_weights_update_group", self.destroy_group),
                web.post("/begin_weight_update", self.begin_update),
                web.post("/end_weight_update", self.end_update),
                web.post("/update_weights_from_distributed", self.update_weights_distributed),
                web.post("/pause_generation", self.pause),
                web.post("/continue_generation", self.resume),
                web.get("/health", self.health),
                web.get("/health_generate", self.health),
                web.get("/model_info", self.model_info),
                web.get("/get_model_info", self.model_info),
                web.get("/server_info", self.server_info),
                web.get("/get_server_info", self.server_info),
                web.post("/flush_cache", self.flush_cache),
                web.get("/flush_cache", self.flush_cache),
            ]
        )
        return app

    @staticmethod
    def _error(message: str, status: int = 400) -> web.Response:
        return web.json_response(
            {"object": "error", "message": message, "code": status, "error": {"message": message}},
            status=status,
        )

    @staticmethod
    async def _json(request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON body: {e}") from None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            fields = parse_generate_request(await self._json(request), self.runner)
        except BadRequest as e:
            return self._error(str(e))
        if not self.batcher.thread.is_alive():
            return self._error("the decode thread is not running; restart the engine", 503)
        if fields["rid"] in self.live:
            return self._error(f"rid {fields['rid']!r} is already running; rids must be unique")
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[dict[str, Any], bool]] = asyncio.Queue()
        seed = fields.pop("seed")
        gen = torch.Generator().manual_seed(
            # spawn(): generate_state() on the same sequence would hand every unseeded request the same seed
            int(seed) if seed is not None else int(self.seeds.spawn(1)[0].generate_state(1)[0])
        )

        def deliver(payload: dict[str, Any], final: bool) -> None:
            # RuntimeError: the event loop has closed (shutdown), nobody is waiting any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(updates.put_nowait, (payload, final))

        req = Req(generator=gen, deliver=deliver, **fields)
        self.live.add(req.rid)
        self.batcher.submit(Add(req))
        final = False
        try:
            if not req.stream:
                while not final:
                    payload, final = await updates.get()
                if "error" in payload:
                    return self._error(payload["error"], 500)
                return web.json_response(payload)
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            while not final:
                payload, final = await updates.get()
                await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.live.discard(req.rid)
            if not final:  # the client went away: as in SGLang, a dropped connection aborts the request
                self.batcher.submit(Abort(req.rid))

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
        except BadRequest as e:
            return self._error(str(e))
        if not isinstance(body, dict):
            return self._error("the request body must be a JSON object")
        if body.get("abort_all"):
            self.batcher.submit(Abort(None))
        elif isinstance(body.get("rid"), str):
            self.batcher.submit(Abort(body["rid"]))
        else:
            return self._error('send {"rid": "..."} or {"abort_all": true}')
        return web.json_response({})

    async def update_weights(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
                raise BadRequest("model_path (a string) is required")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, (str, int)):
                raise BadRequest("weight_version must be a string")
            async with self.update_lock:
                tensors = await asyncio.to_thread(self.runner.read_weights, Path(body["model_path"]))
                err = await self._apply(tensors, version, bool(body.get("abort_all_requests")))
        except BadRequest as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if err:
            return web.json_response({"success": False, "message": err}, status=500)
        self.model_path = body["model_path"]
        log.info("weights updated", path=body["model_path"], version=self.batcher.version)
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def _apply(self, tensors: dict[str, torch.Tensor], version: Any, abort_all: bool) -> str | None:
        """Hand checked tensors to the decode thread (between two steps); None or the error."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str | None] = loop.create_future()
        if abort_all:
            self.batcher.submit(Abort(None))
        new_version = str(version) if version is not None else self.batcher.version
        self.batcher.submit(
            UpdateWeights(tensors, new_version, lambda err: loop.call_soon_threadsafe(done.set_result, err))
        )
        return await done

    @staticmethod
    def _result(ok: bool, message: str) -> web.Response:
        """SGLang's answer to the weight-sync calls: 200 on success, 400 otherwise, with the same body."""
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
            if missing:
                raise BadRequest(f"{', '.join(missing)} required")
            if not all(_is_int(body[k]) for k in ("master_port", "rank_offset", "world_size")):
                raise BadRequest("master_port, rank_offset and world_size must be integers")
            backend = body.get("backend", "nccl")
            if backend != "gloo":
                raise BadRequest(f"backend {backend!r}: the embedded engine receives weights over gloo only; "
                                 "set [learner] sync_backend = \"gloo\"")
            name = str(body.get("group_name") or "weight_update_group")
            if name in self.groups:
                raise BadRequest(f"group {name!r} exists; destroy it first")
        except BadRequest as e:
            return self._result(False, str(e))
        try:
            # one rank per engine (no tensor parallelism): its rank is its offset
            self.groups[name] = await asyncio.to_thread(
                open_group, backend, str(body["master_address"]), body["master_port"], body["rank_offset"],
                body["world_size"], group_name=name, timeout_s=self.group_timeout_s)
        except WeightSyncError as e:
            log.error("weight update group not joined", error=str(e))
            return self._result(False, f"Failed to initialize custom process group: {e}.")
        log.info("weight update group joined", group=name, rank=body["rank_offset"], world_size=body["world_size"])
        return self._result(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
        except BadRequest as e:
            return self._result(False, str(e))
        name = str((body.get("group_name") if isinstance(body, dict) else None) or "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return self._result(False, "The group to be destroyed does not exist.")
        async with self.update_lock:  # not under a receive that is using it
            await asyncio.to_thread(close_group, group)
        log.info("weight update group left", group=name)
        return self._result(True, "Succeeded to destroy custom process group.")

    async def begin_update(self, request: web.Request) -> web.Response:
        if self.session:
            return self._result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session = True
        return self._result(True, "Success")

    async def end_update(self, request: web.Request) -> web.Response:
        if not self.session:
            return self._result(False, "no weight-update session is open; call begin_weight_update() first")
        self.session = False
        return self._result(True, "Success")

    async def update_weights_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            if not isinstance(body, dict) or not all(isinstance(body.get(k), list)
                                                     for k in ("names", "dtypes", "shapes")):
                raise BadRequest("names, dtypes and shapes (lists) are required")
            if not self.session:
                raise BadRequest("update_weights_from_distributed must run between begin_weight_update() and "
                                 "end_weight_update()")
            name = str(body.get("group_name") or "weight_update_group")
            if name not in self.groups:
                raise BadRequest(f"Group {name} not in {list(self.groups)}. Please call `init_weights_update_group` "
                                 "first.")
            version = body.get("weight_version")
            async with self.update_lock:
                try:
                    tensors = await asyncio.to_thread(
                        receive, self.groups[name], body["names"], body["dtypes"], body["shapes"])
                except (ValueError, WeightSyncError) as e:
                    raise BadRequest(f"Failed to receive weights: {e}") from None
                self.runner.check_weights(tensors, "the broadcast weights")
                err = await self._apply(tensors, version, bool(body.get("abort_all_requests")))
        except BadRequest as e:
            return self._result(False, str(e))
        if err:
            return self._result(False, f"Failed to update parameter online: {err}")
        self.model_path = f"(weight update group {name})"
        log.info("weights updated over the process group", group=name, version=self.batcher.version,
                 tensors=len(tensors))
        return self._result(True, "Succeeded to update parameter online.")

    async def pause(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
        except BadRequest as e:
            return self._error(str(e))
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in ("abort", "retract", "in_place"):
            return self._error('mode must be "abort", "retract" or "in_place"')
        self.batcher.submit(Pause(mode))
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        self.batcher.submit(Continue())
        return web.json_response({})

    async def health(self, request: web.Request) -> web.Response:
        if not self.batcher.thread.is_alive():
            return web.Response(status=503, text="decode thread is not running")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        r = self.runner
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": None,
                "is_generation": True,
                "engine": "bridle-embedded",
                "weight_version": self.batcher.version,
                "vocab": "reduced" if r.vocab else "full",
                "input_vocab_size": r.input_vocab,
                "model_vocab_size": r.model_vocab,
                "context_length": r.context_length,
                "dtype": str(r.dtype).removeprefix("torch."),
                "device": str(r.device),
                "eos_token_ids": sorted(r.eos_ids),
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Empty the prefix cache, answered as SGLang 0.5.23 answers: 200 and "Cache flushed." or 400 and why not.

        SGLang refuses while requests run (its radix tree holds their KV) unless ``?timeout=`` lets it wait for
        idle; here running requests keep their KV in the batch, not in the cache, so the flush applies at once
        (between two decode steps) and ``timeout`` is accepted and has nothing to wait for. Requests that finish
        afterwards put their KV in again, as in SGLang."""
        if not self.batcher.thread.is_alive():
            return web.Response(status=400, text="Flush cache failed: the decode thread is not running; restart "
                                                 "the engine.\n")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self.batcher.submit(Flush(lambda n: loop.call_soon_threadsafe(done.set_result, n)))
        dropped = await done
        log.info("prefix cache flushed", tokens=dropped)
        return web.Response(text=f"Cache flushed.\n{dropped} cached prefix tokens dropped.\n")

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"engine": "bridle-embedded", "torch_threads": torch.get_num_threads(), **self.batcher.info()}
        )


class _QuietGrpcProbe(logging.Filter):
    """sglang-router asks every worker whether it speaks gRPC (an HTTP/2 preface) before settling on HTTP; aiohttp
    logs each probe as a request-handling error with a traceback, which would bury real errors in the engine's
    log (the log's end is what a failed run shows)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc))


def _publish_port(port_file: str, port: int) -> None:
    """Write the bound port where the launcher waits for it; the rename makes it appear whole."""
    tmp = Path(port_file + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)


async def _orphan_watch(parent: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent`` (the process that launched the engine) is gone.

    The engine runs in its own session; if whoever started it is killed (kill -9), nobody will stop it. Nothing
    signals a parent's exit to its child (PR_SET_PDEATHSIG fires when the spawning *thread* ends), so poll once a
    second: getppid() changes only when the parent has gone. ``parent`` is the launcher's own pid (``--parent-pid``),
    so a launcher killed before this process got this far (its imports, the model load) is noticed too."""
    while os.getppid() == parent:  # noqa: ASYNC110 — nothing to wait on (above)
        await asyncio.sleep(1.0)
    log.warning("parent process exited; shutting down", parent=parent)
    stop.set()


async def serve(args: argparse.Namespace) -> None:
    """Load the model, start the decode thread and the HTTP server; serve until SIGTERM/SIGINT or orphaned."""
    parent = getattr(args, "parent_pid", 0) or os.getppid()
    stop = asyncio.Event()
    # watched from the start: a launcher killed while the model loads must not leave an engine serving for ever
    watch = asyncio.create_task(_orphan_watch(parent, stop))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    runner = await asyncio.to_thread(ModelRunner, Path(args.model), dtype, args.context_length, args.device)
    if os.getppid() != parent:  # no port is published for a launcher that is gone (nor read by its next start)
        watch.cancel()
        log.warning("parent process exited while the model loaded; not serving", parent=parent)
        return
    batcher = Batcher(runner, version=args.weight_version, max_running=args.max_running_requests,
                      prefix_cache_bytes=args.prefix_cache_mb << 20)
    batcher.thread.start()
    server = EngineServer(runner, batcher, args.model)
    logging.getLogger("aiohttp.server").addFilter(_QuietGrpcProbe())
    app_runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if args.port_file:
        await asyncio.to_thread(_publish_port, args.port_file, port)
    log.info(
        "embedded engine ready",
        url=f"http://{args.host}:{port}",
        model=args.model,
        vocab="reduced" if runner.vocab else "full",
        device=str(runner.device),
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        prefix_cache_mb=args.prefix_cache_mb,
        prefix_cache_tokens=(args.prefix_cache_mb << 20) // runner.kv_bytes_per_token,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    watch.cancel()
    batcher.submit(Stop())
    await asyncio.to_thread(batcher.thread.join, 10)
    await app_runner.cleanup()
    # what it served, for whoever reads the log (with several engines: how the router spread the work)
    log.info("embedded engine stopped", weight_version=batcher.version, **batcher.stats)
