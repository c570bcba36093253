"""The embedded policy engine: a small torch inference server that speaks SGLang's native HTTP subset.

Run it as its own process (``python -m pipeline.serving.embedded_engine --model DIR --port N``) or from Python with
:func:`pipeline.serving.launch.start_embedded_engine`. Endpoints (shapes as in ``reference/sglang-api.md``):
``POST /generate`` (``input_ids`` only, non-streaming or cumulative ``data:`` streaming), ``/abort_request``,
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``; ``GET /health``,
``/health_generate``, ``/model_info``, ``/server_info`` (batch occupancy statistics).

How it works: an aiohttp server on the main thread; one decode thread owns the model. Between two decode steps
the thread applies control commands (abort, pause, weight update), admits waiting requests (each prefilled on
its own, then left-padded into the running batch's KV cache) and decodes one token for every running request
in one batched forward (attention mask over the padding + explicit position ids, so a row's numbers do not
depend on its neighbours beyond float rounding).

Log-probabilities are SGLang's: ``log_softmax(logits / T)`` of the sampled token, before top-k/top-p filtering;
``T < 1e-6`` means greedy and ``log_softmax(logits)``. Each request may carry ``sampling_seed``; its tokens are
drawn from its own generator, so the same seed gives the same output whatever else runs.

Weight updates apply between decode steps without failing running requests. Running requests' KV caches are
recomputed with the new weights, so every output token is sampled from exactly one version's distribution
given the full context; ``meta_info["weight_version_spans"]`` lists ``[start_index, version]`` per version
(``weight_version`` is the version of the last token).

Reduced vocabulary (``bridle_vocab.json`` in the model folder, see :mod:`pipeline.models.small`): incoming Qwen
ids are mapped to compact ids (unknown ones to the UNK slot), sampled ids are mapped back; the HTTP side only
ever sees Qwen ids. The engine has no tokenizer: ``text`` in responses is always empty.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import web

from pipeline.core.logs import configure, get_logger
from pipeline.models.small import VocabTable, load_vocab_table

log = get_logger(actor="embedded_engine")

GREEDY_EPS = 1e-6  # SGLang treats temperatures below this as greedy

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


class BadRequest(Exception):
    """A request the engine refuses with HTTP 400; the message says what to change."""


# ------------------------------------------------------------------------------------------------ model
class ModelRunner:
    """The model and its forward passes. Used only from the decode thread (and at load time)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, context_length: int | None) -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.vocab: VocabTable | None = load_vocab_table(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.config = self.model.config
        self.dtype = dtype
        self.model_vocab = int(self.config.vocab_size)
        if self.vocab is not None and self.vocab.size != self.model_vocab:
            raise ValueError(
                f"{model_dir}: bridle_vocab.json has {self.vocab.size} ids but config.json vocab_size is "
                f"{self.model_vocab}; the table must list one Qwen id per model row"
            )
        self.input_vocab = self.vocab.qwen_vocab_size if self.vocab else self.model_vocab
        max_pos = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.context_length = min(context_length or max_pos, max_pos)
        eos = self.config.eos_token_id
        eos_compact = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = frozenset(int(i) for i in self.to_outside(eos_compact))
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def to_model(self, ids: list[int]) -> list[int]:
        return ids if self.vocab is None else self.vocab.to_compact(ids).tolist()

    def to_outside(self, ids: list[int]) -> list[int]:
        return ids if self.vocab is None else self.vocab.to_qwen(ids).tolist()

    def new_cache(self, kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=kv, config=self.config) if kv else DynamicCache(config=self.config)

    @staticmethod
    def cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits after the last token (float32, [V]) and the sequence's KV per layer ([1, H, L, D])."""
        cache = self.new_cache()
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[0, -1].float(), self.cache_kv(cache)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], mask: torch.Tensor, cache) -> torch.Tensor:
        """One batched step: next-token logits [B, V] (float32). ``mask`` covers the cache plus the new token."""
        out = self.model(
            input_ids=torch.tensor(tokens, dtype=torch.long)[:, None],
            position_ids=torch.tensor(positions, dtype=torch.long)[:, None],
            attention_mask=mask,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1].float()

    def read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """Load and check a checkpoint folder's tensors against the running model (runs off the decode thread)."""
        from safetensors.torch import load_file

        if not path.is_dir():
            raise BadRequest(f"model_path {str(path)!r} is not a directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise BadRequest(f"model_path {str(path)!r} has no *.safetensors files")
        table = load_vocab_table(path)
        if table != self.vocab:
            raise BadRequest(
                f"{path}: its bridle_vocab.json differs from the running model's (or one of them has none); "
                "a weight update cannot change the vocabulary"
            )
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        own = self.model.state_dict()
        tied = {"lm_head.weight"} if getattr(self.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(own) - set(tensors) - tied)
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise BadRequest(
                f"{path}: checkpoint does not match the running model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, t in tensors.items():
            if t.shape != own[name].shape:
                raise BadRequest(
                    f"{path}: tensor {name} has shape {tuple(t.shape)}, the model has {tuple(own[name].shape)}"
                )
        return tensors

    @torch.inference_mode()
    def apply_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        for name, t in tensors.items():
            own[name].copy_(t.to(own[name].dtype))


# --------------------------------------------------------------------------------------------- requests
@dataclass(eq=False)
class Req:
    rid: str
    prompt: list[int]  # model (compact) ids
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: frozenset[int]  # outside (Qwen) ids
    ignore_eos: bool
    return_logprob: bool
    stream: bool
    generator: torch.Generator
    deliver: Callable[[dict[str, Any], bool], None]  # (payload, final); called on the decode thread
    out_model: list[int] = field(default_factory=list)
    out_ids: list[int] = field(default_factory=list)  # outside ids
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)
    n_cached: int = 0  # tokens of this sequence in the KV cache; out_model[-1] is the pending one
    finish: dict[str, Any] | None = None
    t0: float = field(default_factory=time.monotonic)

    def payload(self, version: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.out_ids),
            "cached_tokens": 0,
            "weight_version": self.spans[-1][1] if self.spans else version,
            "weight_version_spans": [list(s) for s in self.spans],
            "e2e_latency": time.monotonic() - self.t0,
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.out_ids)]
        return {"text": "", "output_ids": list(self.out_ids), "meta_info": meta}


# -------------------------------------------------------------------------------------------- scheduler
class Scheduler:
    """The decode thread: continuous batching over one left-padded KV cache."""

    def __init__(self, runner: ModelRunner, *, version: str, max_running: int) -> None:
        self.runner = runner
        self.version = version
        self.max_running = max_running
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.waiting: list[Req] = []
        self.rows: list[Req] = []  # row i of the batch cache
        self.joining: list[Req] = []  # taken from waiting, being prefilled
        self.cache: Any = None  # the batch's DynamicCache, rebuilt only when rows join or leave
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.paused = False
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self.stats = {"decode_steps": 0, "decoded_tokens": 0, "prefills": 0, "max_batch": 0, "requests": 0}
        self.batch_hist: dict[int, int] = {}
        self.error: str = ""

    # called from the event loop ------------------------------------------------------------------------
    def submit(self, kind: str, arg: Any = None) -> None:
        self.inbox.put((kind, arg))

    def info(self) -> dict[str, Any]:
        steps = self.stats["decode_steps"]
        return {
            **self.stats,
            "running": len(self.rows),
            "waiting": len(self.waiting),
            "paused": self.paused,
            "max_running_requests": self.max_running,
            "mean_batch": self.stats["decoded_tokens"] / steps if steps else 0.0,
            # dict() copies in one C call, so the decode thread cannot resize it mid-iteration
            "batch_size_histogram": {str(k): v for k, v in sorted(dict(self.batch_hist).items())},
            "weight_version": self.version,
            "decode_thread_alive": self.thread.is_alive(),
            "last_error": self.error,
        }

    # decode thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopped:
            idle = self.paused or not (self.rows or self.waiting)
            try:
                cmd = self.inbox.get() if idle else self.inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._command(*cmd)
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            self._drop_finished()
            if self.stopped or self.paused:
                continue
            try:
                self._admit()
                if self.rows:
                    self._step()
            except Exception as e:  # a failing forward must not kill the server: fail the batch, keep serving
                log.exception("decode step failed; failing running requests")
                self._fail_all(f"{type(e).__name__}: {e}")
            self._drop_finished()

    def _fail_all(self, error: str) -> None:
        """Answer every admitted request with an error (HTTP 500) and start from an empty batch."""
        self.error = error
        for r in self.rows + self.joining:
            if r.finish is None:
                r.finish = {"type": "abort", "message": f"engine error: {error}"}
                r.deliver({"error": error}, True)
        self.rows, self.joining, self.cache = [], [], None
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    def _command(self, kind: str, arg: Any) -> None:
        if kind == "add":
            self.waiting.append(arg)
            self.stats["requests"] += 1
        elif kind == "abort":
            for r in self.rows + self.waiting:
                if r.finish is None and (arg is None or r.rid == arg):
                    self._finish(r, {"type": "abort", "message": "aborted by request"})
            self.waiting = [r for r in self.waiting if r.finish is None]
        elif kind == "pause":
            if arg == "abort":
                self._command("abort", None)
            self.paused = True
        elif kind == "continue":
            self.paused = False
        elif kind == "update":
            tensors, version, done = arg
            try:
                self._drop_finished()
                self.runner.apply_weights(tensors)
                self.version = version
                if self.rows:
                    self._recompute_kv()
            except Exception as e:
                log.exception("weight update failed; failing running requests")
                self._fail_all(f"weight update failed: {type(e).__name__}: {e}")
                done(f"{type(e).__name__}: {e}")
            else:
                done(None)
        elif kind == "stop":
            self.stopped = True
            for r in self.rows + self.waiting:
                if r.finish is None:
                    self._finish(r, {"type": "abort", "message": "engine shutting down"})

    def _finish(self, r: Req, reason: dict[str, Any]) -> None:
        r.finish = reason
        r.deliver(r.payload(self.version), True)

    def _admit(self) -> None:
        joining: list[tuple[Req, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        while self.waiting and len(self.rows) + len(joining) < self.max_running:
            r = self.waiting.pop(0)
            if r.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
                continue
            self.joining.append(r)
            logits, kv = self.runner.prefill(r.prompt)
            self.stats["prefills"] += 1
            r.n_cached = len(r.prompt)
            self._sample([r], logits[None])
            if r.finish is None:
                joining.append((r, kv))
        if joining:
            self._set_batch(
                [(r, self.kv, i) for i, r in enumerate(self.rows)] + [(r, kv, 0) for r, kv in joining]
            )
        self.joining = []

    def _set_batch(self, members: list[tuple[Req, list[tuple[torch.Tensor, torch.Tensor]], int]]) -> None:
        """Rebuild the batch from (request, kv source, row in that source); left-pad to the longest sequence."""
        if not members:
            self.rows, self.cache, self.mask = [], None, torch.zeros(0, 0, dtype=torch.long)
            return
        width = max(r.n_cached for r, _, _ in members)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(len(members[0][1])):
            ks, vs = [], []
            for r, src, row in members:
                k, v = src[layer][0][row : row + 1], src[layer][1][row : row + 1]
                k, v = k[:, :, k.shape[2] - r.n_cached :], v[:, :, v.shape[2] - r.n_cached :]
                pad = width - r.n_cached
                if pad:
                    k = torch.cat([k.new_zeros(*k.shape[:2], pad, k.shape[3]), k], dim=2)
                    v = torch.cat([v.new_zeros(*v.shape[:2], pad, v.shape[3]), v], dim=2)
                ks.append(k)
                vs.append(v)
            kv.append((torch.cat(ks), torch.cat(vs)))
        mask = torch.zeros(len(members), width, dtype=torch.long)
        for i, (r, _, _) in enumerate(members):
            mask[i, width - r.n_cached :] = 1
        self.rows, self.cache, self.mask = [r for r, _, _ in members], self.runner.new_cache(kv), mask

    def _recompute_kv(self) -> None:
        members = []
        for r in self.rows:
            _, kv = self.runner.prefill(r.prompt + r.out_model[:-1])
            members.append((r, kv, 0))
        self._set_batch(members)

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [] if self.cache is None else self.runner.cache_kv(self.cache)

    def _drop_finished(self) -> None:
        if any(r.finish is not None for r in self.rows):
            self._set_batch([(r, self.kv, i) for i, r in enumerate(self.rows) if r.finish is None])

    def _step(self) -> None:
        b = len(self.rows)
        mask = torch.cat([self.mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
        logits = self.runner.decode(
            [r.out_model[-1] for r in self.rows], [r.n_cached for r in self.rows], mask, self.cache
        )
        self.mask = mask
        self.stats["decode_steps"] += 1
        self.stats["decoded_tokens"] += b
        self.stats["max_batch"] = max(self.stats["max_batch"], b)
        self.batch_hist[b] = self.batch_hist.get(b, 0) + 1
        for r in self.rows:
            r.n_cached += 1
        self._sample(self.rows, logits)

    def _sample(self, rows: list[Req], logits: torch.Tensor) -> None:
        """Sample one token per request from its row of ``logits`` [B, V], record it, and check for a finish.

        Each request draws one uniform from its own generator and inverts the CDF of its (filtered)
        distribution, so its tokens depend only on its seed and its logits, not on its batch neighbours.
        """
        greedy = torch.tensor([r.temperature < GREEDY_EPS for r in rows])
        temps = torch.tensor([1.0 if g else r.temperature for r, g in zip(rows, greedy.tolist())])
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        toks = torch.argmax(logits, dim=-1)
        sampled = [i for i, g in enumerate(greedy.tolist()) if not g]
        if sampled:
            probs = logp[sampled].double().exp()
            for k, i in enumerate(sampled):
                r = rows[i]
                if 0 < r.top_k < probs.shape[1]:
                    kth = torch.topk(probs[k], r.top_k).values[-1]
                    probs[k] = torch.where(probs[k] >= kth, probs[k], 0.0)
                if r.top_p < 1.0:
                    sp, order = torch.sort(probs[k], descending=True)
                    cum = torch.cumsum(sp, dim=0)
                    drop = (cum - sp) > r.top_p * cum[
                        -1
                    ]  # keep the smallest prefix reaching top_p of the mass
                    probs[k] = probs[k].scatter(0, order, torch.where(drop, 0.0, sp))
            u = torch.cat([torch.rand(1, generator=rows[i].generator, dtype=torch.float64) for i in sampled])
            cdf = torch.cumsum(probs, dim=1)
            picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
            # u < 1, but rounding could still land past the last token with probability > 0
            last = probs.shape[1] - 1 - torch.argmax(torch.flip(probs > 0, dims=[1]).to(torch.uint8), dim=1)
            toks[sampled] = torch.minimum(picked, last)
        chosen = logp.gather(1, toks[:, None])[:, 0].tolist()
        toks_l = toks.tolist()
        for r, tok, outside, lp in zip(rows, toks_l, self.runner.to_outside(toks_l), chosen):
            r.out_model.append(tok)
            r.out_ids.append(outside)
            r.logprobs.append(lp)
            if not r.spans or r.spans[-1][1] != self.version:
                r.spans.append([len(r.out_ids) - 1, self.version])
            if outside in r.stop_ids or (not r.ignore_eos and outside in self.runner.eos_ids):
                self._finish(r, {"type": "stop", "matched": outside})
            elif len(r.out_ids) >= r.max_new_tokens or r.n_cached + 1 >= self.runner.context_length:
                self._finish(r, {"type": "length", "length": len(r.out_ids)})
            elif r.stream:
                r.deliver(r.payload(self.version), False)


# ------------------------------------------------------------------------------------------ validation
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_generate_request(body: Any, runner: ModelRunner) -> dict[str, Any]:
    """Validate a /generate body; returns the request fields or raises BadRequest naming the problem."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
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
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    for key, ok in (("return_logprob", bool), ("stream", bool)):
        if key in body and body[key] is not None and not isinstance(body[key], ok):
            raise BadRequest(f"{key} must be a boolean")
    if body.get("logprob_start_len", -1) not in (-1, None):
        raise BadRequest(
            "logprob_start_len other than -1 (input logprobs) is not supported by the embedded engine"
        )
    if body.get("top_logprobs_num", 0) not in (0, None):
        raise BadRequest("top_logprobs_num other than 0 is not supported by the embedded engine")
    sp = body.get("sampling_params") or {}
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
        "rid": rid or uuid.uuid4().hex,
        "prompt": runner.to_model(ids),
        "max_new_tokens": max_new,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": top_k,
        "stop_ids": frozenset(stop),
        "ignore_eos": ignore_eos,
        "return_logprob": bool(body.get("return_logprob") or False),
        "stream": bool(body.get("stream") or False),
        "seed": seed,
    }


# ------------------------------------------------------------------------------------------- HTTP server
class EngineServer:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, model_path: str) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.model_path = model_path
        self.live: set[str] = set()
        self.update_lock = asyncio.Lock()
        self.seeds = np.random.SeedSequence()  # unseeded requests each get a fresh child of this sequence

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.post("/abort_request", self.abort),
                web.post("/update_weights_from_disk", self.update_weights),
                web.post("/pause_generation", self.pause),
                web.post("/continue_generation", self.resume),
                web.get("/health", self.health),
                web.get("/health_generate", self.health),
                web.get("/model_info", self.model_info),
                web.get("/get_model_info", self.model_info),
                web.get("/server_info", self.server_info),
                web.get("/get_server_info", self.server_info),
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
        if not self.scheduler.thread.is_alive():
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
            try:
                loop.call_soon_threadsafe(updates.put_nowait, (payload, final))
            except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting any more
                pass

        req = Req(generator=gen, deliver=deliver, **fields)
        self.live.add(req.rid)
        self.scheduler.submit("add", req)
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
                self.scheduler.submit("abort", req.rid)

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
        except BadRequest as e:
            return self._error(str(e))
        if not isinstance(body, dict):
            return self._error("the request body must be a JSON object")
        if body.get("abort_all"):
            self.scheduler.submit("abort", None)
        elif isinstance(body.get("rid"), str):
            self.scheduler.submit("abort", body["rid"])
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
                loop = asyncio.get_running_loop()
                done: asyncio.Future[str | None] = loop.create_future()
                if body.get("abort_all_requests"):
                    self.scheduler.submit("abort", None)
                new_version = str(version) if version is not None else self.scheduler.version
                self.scheduler.submit(
                    "update",
                    (tensors, new_version, lambda err: loop.call_soon_threadsafe(done.set_result, err)),
                )
                err = await done
        except BadRequest as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        if err:
            return web.json_response({"success": False, "message": err}, status=500)
        self.model_path = body["model_path"]
        log.info("weights updated", path=body["model_path"], version=new_version)
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def pause(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
        except BadRequest as e:
            return self._error(str(e))
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in ("abort", "retract", "in_place"):
            return self._error('mode must be "abort", "retract" or "in_place"')
        self.scheduler.submit("pause", mode)
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        self.scheduler.submit("continue")
        return web.json_response({})

    async def health(self, request: web.Request) -> web.Response:
        if not self.scheduler.thread.is_alive():
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
                "weight_version": self.scheduler.version,
                "vocab": "reduced" if r.vocab else "full",
                "input_vocab_size": r.input_vocab,
                "model_vocab_size": r.model_vocab,
                "context_length": r.context_length,
                "dtype": str(r.dtype).removeprefix("torch."),
                "eos_token_ids": sorted(r.eos_ids),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"engine": "bridle-embedded", "torch_threads": torch.get_num_threads(), **self.scheduler.info()}
        )


async def serve(args: argparse.Namespace) -> None:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    runner = await asyncio.to_thread(ModelRunner, Path(args.model), dtype, args.context_length)
    scheduler = Scheduler(runner, version=args.weight_version, max_running=args.max_running_requests)
    scheduler.thread.start()
    server = EngineServer(runner, scheduler, args.model)
    runner_ = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner_.setup()
    site = web.TCPSite(runner_, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    log.info(
        "embedded engine ready",
        url=f"http://{args.host}:{port}",
        model=args.model,
        vocab="reduced" if runner.vocab else "full",
        threads=torch.get_num_threads(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()

    async def orphan_watch() -> None:
        # The engine runs in its own session; if whoever started it is killed (kill -9), nobody will stop it.
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("parent process exited; shutting down")
        stop.set()

    watch = asyncio.create_task(orphan_watch())
    await stop.wait()
    watch.cancel()
    scheduler.submit("stop")
    await asyncio.to_thread(scheduler.thread.join, 10)
    await runner_.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.serving.embedded_engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default="", help="write the bound port here once serving")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = half the cores: oversubscribed OpenMP threads are much slower)",
    )
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    configure(level=args.log_level)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
