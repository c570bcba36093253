"""What bridle uses of SGLang's native HTTP API, pinned to the SGLang release it was checked against.

:class:`pipeline.serving.sglang_client.HttpEngine` sends and reads exactly the keys named here
(``tests/serving/test_engine_sglang_client.py`` checks that it uses no other), and
``tests/serving/test_sglang_fidelity.py`` checks each of them against the source of SGLang :data:`SGLANG_VERSION`
(its wheel, downloaded once and read, never installed), so a drift between bridle and SGLang fails CI.

Weight-version spans: a finished (or aborted) ``/generate`` answer of SGLang 0.5.23 says which weight version
sampled which output tokens in ``meta_info["weight_versions"]``: ``[{"version", "start", "end"}]``, contiguous
half-open ranges ``[start, end)`` of output token indices, the first starting at 0 and the last ending at the
number of output tokens (one span when no update landed mid-request; a single ``[0, 0)`` span for an empty
output). Token ``i`` was sampled by the version of the span holding ``i``. Unfinished streaming chunks carry no
spans. :func:`read_weight_versions` turns that into bridle's ``(start, version)`` pairs; the embedded engine
writes it with :func:`write_weight_versions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SGLANG_VERSION = "0.5.23"

# POST /generate: the request body's keys, the sampling_params keys EngineSampling.to_sglang() can send (SGLang
# answers 400 to an unknown one), and the response keys the client reads.
GENERATE_REQUEST = frozenset(
    {"rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "stream"}
)
SAMPLING_PARAMS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "sampling_seed",
    }
)
GENERATE_RESPONSE = frozenset({"output_ids", "meta_info"})
META_INFO = frozenset(
    {"id", "finish_reason", "prompt_tokens", "output_token_logprobs", "weight_version", "weight_versions"}
)
FINISH_REASON = frozenset({"type", "matched"})
FINISH_TYPES = frozenset({"stop", "length", "abort"})
WEIGHT_VERSION_SPAN = frozenset({"version", "start", "end"})

# Every other call, (method, path) -> the keys its JSON body may carry (None: the call has no body).
CONTROL: dict[tuple[str, str], frozenset[str] | None] = {
    ("POST", "/update_weights_from_disk"): frozenset({"model_path", "weight_version", "abort_all_requests"}),
    ("POST", "/pause_generation"): frozenset({"mode"}),
    ("POST", "/continue_generation"): frozenset(),
    ("POST", "/abort_request"): frozenset({"rid", "abort_all"}),
    # weight sync without the disk (pipeline.serving.weight_sync): the group, the session SGLang 0.5.23 requires
    # around an update, the update itself
    ("POST", "/init_weights_update_group"): frozenset(
        {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}),
    ("POST", "/destroy_weights_update_group"): frozenset({"group_name"}),
    ("POST", "/begin_weight_update"): frozenset(),
    ("POST", "/end_weight_update"): frozenset(),
    ("POST", "/update_weights_from_distributed"): frozenset(
        {"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version"}),
    ("GET", "/health"): None,
    ("GET", "/model_info"): None,
    ("GET", "/server_info"): None,
}
UPDATE_WEIGHTS_REPLY = frozenset({"success", "message"})
# the weight-sync calls answer the same two keys (400 when success is false)
SYNC_CALLS = ("/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
              "/end_weight_update", "/update_weights_from_distributed")
# GET /model_info: what the client reads of it (each worker's version, to check a weight update reached it)
MODEL_INFO = frozenset({"weight_version"})
PAUSE_MODES = frozenset({"abort", "retract", "in_place"})


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_weight_versions(raw: Any, n_output: int) -> list[tuple[int, str]]:
    """``meta_info["weight_versions"]`` of an answer with ``n_output`` output tokens -> ``(start, version)`` per
    span that holds tokens (output tokens from ``start`` to the next span's start were sampled by ``version``).

    Raises ValueError saying what is wrong: the spans must tile ``[0, n_output)`` exactly, or the tokens could
    not be attributed."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"expected a non-empty list of spans, got {str(raw)[:200]}")
    out: list[tuple[int, str]] = []
    end = 0
    for i, span in enumerate(raw):
        if not isinstance(span, dict) or any(k not in span for k in WEIGHT_VERSION_SPAN):
            raise ValueError(f"span {i} is not an object with keys version, start, end: {str(span)[:200]}")
        version, start, stop = span["version"], span["start"], span["end"]
        if not isinstance(version, str) or not _int(start) or not _int(stop):
            raise ValueError(f"span {i} must have a string version and integer start and end: {span}")
        if start != end:
            raise ValueError(f"span {i} starts at {start}, not where the previous one ended ({end})")
        if stop <= start and not (n_output == 0 and len(raw) == 1):
            raise ValueError(f"span {i} is empty or reversed: [{start}, {stop})")
        if stop > start:
            out.append((start, version))
        end = stop
    if end != n_output:
        raise ValueError(f"the spans end at token {end} but the answer has {n_output} output tokens")
    return out


def write_weight_versions(starts: Sequence[tuple[int, str]], n_output: int, version: str) -> list[dict[str, Any]]:
    """SGLang's ``meta_info["weight_versions"]`` for ``n_output`` tokens whose versions change at ``starts``
    (``(first token index, version)``, the first at 0); ``version`` (the engine's current one) labels an empty
    output."""
    if not starts:
        return [{"version": version, "start": 0, "end": 0}]
    ends = [s for s, _ in starts[1:]] + [n_output]
    return [{"version": v, "start": s, "end": e} for (s, v), e in zip(starts, ends, strict=True)]
