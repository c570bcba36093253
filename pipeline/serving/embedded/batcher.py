"""The embedded engine's continuous batcher: a decode thread, one left-padded KV cache for all running requests.

Between two decode steps the thread applies the commands the server sent (:class:`Add`, :class:`Abort`,
:class:`Pause`, :class:`Continue`, :class:`UpdateWeights`, :class:`Flush`, :class:`Stop`), admits waiting requests
(each prefilled on its own, then left-padded into the running batch's cache) and decodes one token for every
running request in one batched forward. The attention mask covers the padding and position ids are explicit, so a
row's numbers do not depend on its neighbours beyond float rounding.

A request's prefill computes only what follows the longest prefix of its prompt in the prefix cache
(:mod:`~pipeline.serving.embedded.prefix_cache`); its prompt's KV goes into the cache after the prefill, and its
prompt and output's (sliced out of the batch cache) when it finishes, where the next call of the same rollout finds
it. Its answer reports the reused tokens as SGLang does, in ``meta_info["cached_tokens"]``.

A weight update applies between two steps: the prefix cache is emptied first (KV of the old weights must never
serve the new ones), running requests' caches are recomputed with the new weights, so every output token is sampled
from exactly one version's distribution given the full context, and each request records where its tokens' version
changed; its finished answer reports them as SGLang does, in ``meta_info["weight_versions"]`` (format in
:mod:`pipeline.serving.sglang_api`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pipeline.core.logs import get_logger
from pipeline.serving.embedded.prefix_cache import PrefixCache
from pipeline.serving.embedded.runner import KV, ModelRunner
from pipeline.serving.sglang_api import write_weight_versions

log = get_logger(actor="embedded_engine")

GREEDY_EPS = 1e-6  # SGLang treats temperatures below this as greedy


@dataclass(eq=False)
class Req:
    """One generation request and its progress, owned by the decode thread once submitted."""

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
    spans: list[tuple[int, str]] = field(default_factory=list)  # (first index in out_ids, weight version)
    n_cached: int = 0  # tokens of this sequence in the KV cache; out_model[-1] is the pending one
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    finish: dict[str, Any] | None = None
    t0: float = field(default_factory=time.monotonic)

    def payload(self, version: str) -> dict[str, Any]:
        """The /generate answer so far, in SGLang 0.5.23's shape (``version``: the engine's current one).

        As in SGLang, only the finished answer has ``weight_versions``, and its ``weight_version`` is the version
        of the last span (a chunk before that reports the engine's current version)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.out_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": version,
            "e2e_latency": time.monotonic() - self.t0,
        }
        if self.finish is not None:
            spans = write_weight_versions(self.spans, len(self.out_ids), version)
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if self.return_logprob:
            # one logprob per output id: _sample appends both together
            pairs = zip(self.logprobs, self.out_ids, strict=True)
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in pairs]
        return {"text": "", "output_ids": list(self.out_ids), "meta_info": meta}


# ------------------------------------------------------------------------ commands (event loop -> thread)
@dataclass(frozen=True)
class Add:
    req: Req


@dataclass(frozen=True)
class Abort:
    rid: str | None  # None: every waiting and running request


@dataclass(frozen=True)
class Pause:
    mode: Literal["abort", "retract", "in_place"]  # "abort" also aborts every request; the others keep them


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class UpdateWeights:
    tensors: dict[str, torch.Tensor]  # checked by ModelRunner.read_weights
    version: str
    done: Callable[[str | None], None]  # called on the decode thread with None or the error


@dataclass(frozen=True)
class Flush:
    done: Callable[[int], None]  # called on the decode thread with the number of cached tokens dropped


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Abort | Pause | Continue | UpdateWeights | Flush | Stop


# ------------------------------------------------------------------------------------------- the batcher
class Batcher:
    """The decode thread: continuous batching over one left-padded KV cache (see the module docstring).

    The event loop only calls :meth:`submit` and :meth:`info`; everything else runs on :attr:`thread`.
    """

    def __init__(self, runner: ModelRunner, *, version: str, max_running: int, prefix_cache_bytes: int = 0) -> None:
        self.runner = runner
        self.version = version
        self.max_running = max_running
        self.inbox: queue.Queue[Command] = queue.Queue()
        self.waiting: list[Req] = []
        self.rows: list[Req] = []  # row i of the batch cache
        self.joining: list[Req] = []  # taken from waiting, being prefilled
        self.cache: Any = None  # the batch's DynamicCache, rebuilt only when rows join or leave
        self.mask = self._no_mask()
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.paused = False
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="decode", daemon=True)
        # prefill_tokens: computed; cached_tokens: reused from the prefix cache; cache_hits: prefills that reused some
        self.stats = {"decode_steps": 0, "decoded_tokens": 0, "prefills": 0, "max_batch": 0, "requests": 0,
                      "prefill_tokens": 0, "cached_tokens": 0, "cache_hits": 0}
        self.batch_hist: dict[int, int] = {}
        self.error: str = ""

    # called from the event loop ------------------------------------------------------------------------
    def submit(self, cmd: Command) -> None:
        self.inbox.put(cmd)

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
            "prefix_cache": {**self.prefix.info(), "kv_bytes_per_token": self.runner.kv_bytes_per_token},
            "weight_version": self.version,
            "decode_thread_alive": self.thread.is_alive(),
            "last_error": self.error,
        }

    # decode thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopped:
            idle = self.paused or not (self.rows or self.waiting)
            try:
                cmd: Command | None = self.inbox.get() if idle else self.inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._command(cmd)
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

    def _no_mask(self) -> torch.Tensor:
        return torch.zeros(0, 0, dtype=torch.long, device=self.runner.device)

    def _fail_all(self, error: str) -> None:
        """Answer every admitted request with an error (HTTP 500) and start from an empty batch."""
        self.error = error
        for r in self.rows + self.joining:
            if r.finish is None:
                r.finish = {"type": "abort", "message": f"engine error: {error}"}
                r.deliver({"error": error}, True)
        self.rows, self.joining, self.cache = [], [], None
        self.mask = self._no_mask()

    def _command(self, cmd: Command) -> None:
        match cmd:
            case Add(req):
                self.waiting.append(req)
                self.stats["requests"] += 1
            case Abort(rid):
                self._abort(rid, "aborted by request")
            case Pause(mode):
                if mode == "abort":
                    self._abort(None, "aborted by request")
                self.paused = True
            case Continue():
                self.paused = False
            case UpdateWeights():
                self._update_weights(cmd)
            case Flush(done):
                done(self.prefix.flush())
            case Stop():
                self.stopped = True
                self._abort(None, "engine shutting down")

    def _abort(self, rid: str | None, message: str) -> None:
        for r in self.rows + self.waiting:
            if r.finish is None and (rid is None or r.rid == rid):
                self._finish(r, {"type": "abort", "message": message})
        self.waiting = [r for r in self.waiting if r.finish is None]

    def _update_weights(self, cmd: UpdateWeights) -> None:
        try:
            self._drop_finished()
            self.prefix.flush()  # before the weights change: a failed update leaves them neither version's
            self.runner.apply_weights(cmd.tensors)
            self.version = cmd.version
            if self.rows:
                self._recompute_kv()
        except Exception as e:
            log.exception("weight update failed; failing running requests")
            self._fail_all(f"weight update failed: {type(e).__name__}: {e}")
            cmd.done(f"{type(e).__name__}: {e}")
        else:
            cmd.done(None)

    def _finish(self, r: Req, reason: dict[str, Any]) -> None:
        r.finish = reason
        r.deliver(r.payload(self.version), True)

    def _admit(self) -> None:
        """Prefill waiting requests (up to max_running in all), sample their first tokens, add them to the batch."""
        joining: list[tuple[Req, KV]] = []
        while self.waiting and len(self.rows) + len(joining) < self.max_running:
            r = self.waiting.pop(0)
            if r.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
                continue
            self.joining.append(r)
            logits, kv, r.cached_tokens = self._prefill(r.prompt)
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

    def _prefill(self, ids: list[int]) -> tuple[torch.Tensor, KV, int]:
        """Logits after ``ids``, their KV, and how many leading tokens were reused from the prefix cache.

        Only what follows the longest cached prefix is computed, at least the last token (its logits sample the
        first output token); the whole sequence's KV then goes into the cache."""
        hit = self.prefix.match(ids[:-1])
        self.prefix.hold(hit)
        try:
            logits, kv = self.runner.prefill(ids[hit.length :], self.prefix.kv(hit))
            self.prefix.insert(ids, kv)
        finally:
            self.prefix.release(hit)
        self.stats["prefill_tokens"] += len(ids) - hit.length
        self.stats["cached_tokens"] += hit.length
        self.stats["cache_hits"] += hit.length > 0
        return logits, kv, hit.length

    def _set_batch(self, members: list[tuple[Req, KV, int]]) -> None:
        """Rebuild the batch from (request, kv source, row in that source); left-pad to the longest sequence."""
        if not members:
            self.rows, self.cache, self.mask = [], None, self._no_mask()
            return
        width = max(r.n_cached for r, _, _ in members)
        kv: KV = []
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
        mask = torch.zeros(len(members), width, dtype=torch.long, device=self.runner.device)
        for i, (r, _, _) in enumerate(members):
            mask[i, width - r.n_cached :] = 1
        self.rows, self.cache, self.mask = [r for r, _, _ in members], self.runner.new_cache(kv), mask

    def _recompute_kv(self) -> None:
        """After a weight update: each running sequence's cache anew (its pending token excluded)."""
        members = []
        for r in self.rows:
            _, kv, _ = self._prefill(r.prompt + r.out_model[:-1])
            members.append((r, kv, 0))
        self._set_batch(members)

    @property
    def kv(self) -> KV:
        return [] if self.cache is None else self.runner.cache_kv(self.cache)

    def _drop_finished(self) -> None:
        """Rebuild the batch without its finished rows; their KV goes into the prefix cache first."""
        if not any(r.finish is not None for r in self.rows):
            return
        kv = self.kv
        width = kv[0][0].shape[2]
        for i, r in enumerate(self.rows):
            if r.finish is not None:
                # the next call of its rollout starts with this prompt and output; the pending last token has no KV
                start = width - r.n_cached
                self.prefix.insert(r.prompt + r.out_model[:-1],
                                   [(k[i : i + 1, :, start:], v[i : i + 1, :, start:]) for k, v in kv])
        self._set_batch([(r, kv, i) for i, r in enumerate(self.rows) if r.finish is None])

    def _step(self) -> None:
        b = len(self.rows)
        mask = torch.cat([self.mask, self.mask.new_ones(b, 1)], dim=1)
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

        The recorded logprob is SGLang's: ``log_softmax(logits / T)`` of the sampled token, before top-k/top-p
        filtering (``log_softmax(logits)`` when greedy).
        """
        greedy = [r.temperature < GREEDY_EPS for r in rows]
        temps = torch.tensor([1.0 if g else r.temperature for r, g in zip(rows, greedy, strict=True)],
                             device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        toks = torch.argmax(logits, dim=-1)
        sampled = [i for i, g in enumerate(greedy) if not g]
        if sampled:
            toks[sampled] = _draw([rows[i] for i in sampled], logp[sampled].double().exp())
        chosen = logp.gather(1, toks[:, None])[:, 0].tolist()
        toks_l = toks.tolist()
        # one token, one id, one logprob per row
        for r, tok, outside, lp in zip(rows, toks_l, self.runner.to_outside(toks_l), chosen, strict=True):
            r.out_model.append(tok)
            r.out_ids.append(outside)
            r.logprobs.append(lp)
            if not r.spans or r.spans[-1][1] != self.version:
                r.spans.append((len(r.out_ids) - 1, self.version))
            if outside in r.stop_ids or (not r.ignore_eos and outside in self.runner.eos_ids):
                self._finish(r, {"type": "stop", "matched": outside})
            elif len(r.out_ids) >= r.max_new_tokens or r.n_cached + 1 >= self.runner.context_length:
                self._finish(r, {"type": "length", "length": len(r.out_ids)})
            elif r.stream:
                r.deliver(r.payload(self.version), False)


def _draw(rows: list[Req], probs: torch.Tensor) -> torch.Tensor:
    """One token per request from its row of ``probs`` [B, V] (float64), after its top-k and top-p filters.

    Each request draws one uniform from its own generator and inverts the CDF of its filtered distribution, so its
    tokens depend only on its seed and its logits, not on its batch neighbours. ``probs`` is filtered in place.
    """
    for k, r in enumerate(rows):
        if 0 < r.top_k < probs.shape[1]:
            kth = torch.topk(probs[k], r.top_k).values[-1]
            probs[k] = torch.where(probs[k] >= kth, probs[k], 0.0)
        if r.top_p < 1.0:
            sp, order = torch.sort(probs[k], descending=True)
            cum = torch.cumsum(sp, dim=0)
            drop = (cum - sp) > r.top_p * cum[-1]  # keep the smallest prefix reaching top_p of the mass
            probs[k] = probs[k].scatter(0, order, torch.where(drop, 0.0, sp))
    # the generators are the CPU's (a request's seed gives the same draws on any device)
    u = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in rows]).to(probs.device)
    cdf = torch.cumsum(probs, dim=1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u < 1, but rounding could still land past the last token with probability > 0
    last = probs.shape[1] - 1 - torch.argmax(torch.flip(probs > 0, dims=[1]).to(torch.uint8), dim=1)
    return torch.minimum(picked, last)
