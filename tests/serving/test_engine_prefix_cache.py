"""The embedded engine's prefix cache inside the batcher, driven step by step in-process (no HTTP, no thread).

Requests that reuse cached KV (a shared system prompt, the next call of a rollout extending a finished call's prompt
and output, requests admitted together) get the log-probabilities of a teacher-forced forward of the whole sequence
and of the same engine with the cache off (the tolerance of test_engine_batcher.py); a weight update empties the
cache before anything is prefilled with the new weights; cached tensors are never written after they are stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.models.small import VocabTable, create_small_model
from pipeline.serving.embedded.batcher import Add, Batcher, Flush, Req, UpdateWeights
from pipeline.serving.embedded.runner import ModelRunner
from tests.helpers.batcher import drive, logprobs, make_req, teacher_forced

ATOL = 1e-4  # as test_engine_batcher.py: batched and padded forwards differ from one forward by float rounding
BUDGET = 64 << 20
SYSTEM = [1 + (5 * j) % 59 for j in range(40)]  # what the rollouts of a group share


def build(root: Path, seed: int = 0, window: int = 0) -> Path:
    return create_small_model(root, vocab=VocabTable.from_sequences([range(500, 560)]), hidden_size=32,
                              num_layers=2, num_heads=2, num_kv_heads=1, seed=seed, sliding_window=window)


# window 8: a sliding-window policy (configs/blackbox.toml's kind), whose prompts and outputs run past the window
@pytest.fixture(scope="module", params=[0, 8], ids=["full", "window8"])
def runner(tmp_path_factory, request) -> ModelRunner:
    torch.set_num_threads(1)
    return ModelRunner(build(tmp_path_factory.mktemp("m") / "m", window=request.param), torch.float32,
                       context_length=512)


def rollout_wave() -> list[tuple[int, Req, dict]]:
    """Four rollouts of one group: the same system prompt, their own instructions; two arrive together."""
    sink: dict = {}
    reqs = []
    for i, at in enumerate([0, 0, 2, 5]):
        prompt = SYSTEM + [1 + (11 * i + 3 * j) % 59 for j in range(6 + i)]
        reqs.append((at, make_req(f"w{i}", prompt, 8 + 3 * i, seed=i, sink=sink), sink))
    return reqs


@pytest.mark.parametrize("max_running", [1, 4])
def test_shared_prefixes_equal_teacher_forcing_and_the_cache_off(runner, max_running):
    outs = {}
    for budget in (0, BUDGET):
        batcher = Batcher(runner, version="0", max_running=max_running, prefix_cache_bytes=budget)
        wave = rollout_wave()
        drive(batcher, [(at, r) for at, r, _ in wave])
        outs[budget] = (wave, batcher.stats)
    (off, off_stats), (on, on_stats) = outs[0], outs[BUDGET]
    for (_, r_off, sink_off), (_, r_on, sink_on) in zip(off, on, strict=True):
        got = logprobs(sink_on[r_on.rid])
        assert r_on.out_model == r_off.out_model
        assert torch.allclose(got, logprobs(sink_off[r_off.rid]), atol=ATOL, rtol=0)
        assert torch.allclose(got, teacher_forced(runner, r_on), atol=ATOL, rtol=0)
    # the first rollout computes the system prompt; each later one reuses it (and not more: instructions differ)
    cached = [sink[r.rid]["meta_info"]["cached_tokens"] for _, r, sink in on]
    assert cached[0] == 0 and all(c >= len(SYSTEM) for c in cached[1:]), cached
    assert all(sink[r.rid]["meta_info"]["cached_tokens"] == 0 for _, r, sink in off)
    total = sum(len(r.prompt) for _, r, _ in on)
    assert off_stats["prefill_tokens"] == total and off_stats["cached_tokens"] == 0
    assert on_stats["prefill_tokens"] + on_stats["cached_tokens"] == total
    assert on_stats["cached_tokens"] == sum(cached) and on_stats["cache_hits"] == 3


def test_the_next_call_of_a_rollout_reuses_the_previous_prompt_and_output(runner):
    """A finished request leaves its prompt and output in the cache (less the last sampled token, which was
    never fed back); the next call, its prompt + output + a tool result, computes only what is new."""
    batcher = Batcher(runner, version="0", max_running=4, prefix_cache_bytes=BUDGET)
    sink: dict = {}
    prompt = SYSTEM + [7, 8, 9]
    calls = []
    for turn in range(3):
        r = make_req(f"t{turn}", prompt, 6 + turn, seed=turn, sink=sink)
        drive(batcher, [(0, r)])
        calls.append(r)
        assert torch.allclose(logprobs(sink[r.rid]), teacher_forced(runner, r), atol=ATOL, rtol=0)
        prompt = r.prompt + r.out_model + [30 + turn, 31, 32]  # the harness appends the tool's answer
    cached = [sink[r.rid]["meta_info"]["cached_tokens"] for r in calls]
    assert cached[0] == 0
    assert cached[1:] == [len(c.prompt) + len(c.out_model) - 1 for c in calls[:-1]]
    assert batcher.stats["prefill_tokens"] == len(calls[0].prompt) + sum(len(r.prompt) - n
                                                                         for r, n in zip(calls[1:], cached[1:],
                                                                                         strict=True))


def test_an_identical_prompt_still_computes_its_last_token(runner):
    batcher = Batcher(runner, version="0", max_running=2, prefix_cache_bytes=BUDGET)
    sink: dict = {}
    a, b = (make_req(rid, SYSTEM[:20], 5, seed=3, sink=sink) for rid in ("a", "b"))
    drive(batcher, [(0, a), (3, b)])
    assert sink["b"]["meta_info"]["cached_tokens"] == 19
    assert a.out_model == b.out_model  # same seed, same distribution
    assert torch.allclose(logprobs(sink["b"]), logprobs(sink["a"]), atol=ATOL, rtol=0)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8), st.integers(1, 6), st.integers(0, 6)),
                min_size=1, max_size=6),
       st.integers(1, 3), st.sampled_from([BUDGET, 3000]))
def test_any_arrivals_equal_teacher_forcing(runner, shapes, max_running, budget):
    """Requests sharing prefixes of the system prompt at random, arriving at random steps, with the cache large
    or so small that it evicts all the time (3000 bytes: ~12 tokens of this model)."""
    batcher = Batcher(runner, version="0", max_running=max_running, prefix_cache_bytes=budget)
    sink: dict = {}
    arrivals = []
    for i, (share, tail, n, at) in enumerate(shapes):
        prompt = SYSTEM[: 8 * share] + [1 + (13 * i + j) % 59 for j in range(tail)] or [1]
        arrivals.append((at, make_req(f"h{i}", prompt, n, seed=i, sink=sink)))
    drive(batcher, arrivals)
    for _, r in arrivals:
        assert torch.allclose(logprobs(sink[r.rid]), teacher_forced(runner, r), atol=ATOL, rtol=0)
    assert batcher.prefix.bytes <= budget


def test_cached_tensors_are_never_written(runner):
    batcher = Batcher(runner, version="0", max_running=4, prefix_cache_bytes=BUDGET)
    first = rollout_wave()
    drive(batcher, [(at, r) for at, r, _ in first])
    stored = []
    stack = list(batcher.prefix.root.children.values())
    while stack:
        node = stack.pop()
        stored += [(t, t.clone()) for pair in node.kv for t in pair]
        stack.extend(node.children.values())
    assert stored
    # every request of the second wave hits the cache (its prompts are the first wave's), then decodes
    second = rollout_wave()
    drive(batcher, [(at, r) for at, r, _ in second])
    assert all(sink[r.rid]["meta_info"]["cached_tokens"] > 0 for _, r, sink in second)
    assert all(torch.equal(t, copy) for t, copy in stored)


def test_a_weight_update_never_serves_kv_of_the_old_weights(tmp_path):
    """Prefill a prompt, update the weights, send the same prompt: nothing is reused across the update, and the
    log-probabilities are the new weights' teacher forcing; after that the new KV is reused. A request running
    through the update is recomputed (reusing what the cache has of the new weights only)."""
    runner = ModelRunner(build(tmp_path / "v0"), torch.float32, context_length=512)
    new = runner.read_weights(build(tmp_path / "v1", seed=1))
    batcher = Batcher(runner, version="0", max_running=4, prefix_cache_bytes=BUDGET)
    sink: dict = {}
    prompt = SYSTEM + [3, 4]
    drive(batcher, [(0, make_req("before", prompt, 6, seed=0, sink=sink))])
    assert batcher.prefix.tokens > 0
    long = make_req("through", SYSTEM + [9], 40, seed=1, sink=sink)
    batcher._command(Add(long))
    batcher._admit()
    batcher._step()
    assert sink.get("through") is None and long.cached_tokens == len(SYSTEM)
    errors: list = []
    cached_before = batcher.stats["cached_tokens"]
    batcher._command(UpdateWeights(new, "1", errors.append))
    assert errors == [None] and batcher.prefix.flushes == 1
    # the running request's KV was recomputed (the cache was empty: nothing reused), and put into the cache
    assert batcher.stats["cached_tokens"] == cached_before and batcher.prefix.tokens == len(long.prompt) + 1
    after = make_req("after", prompt, 6, seed=0, sink=sink)
    drive(batcher, [(0, after)])
    assert sink["after"]["meta_info"]["cached_tokens"] == len(SYSTEM)  # the new weights' KV of the system prompt
    again = make_req("again", prompt, 6, seed=0, sink=sink)
    drive(batcher, [(0, again)])
    assert sink["again"]["meta_info"]["cached_tokens"] == len(prompt) - 1
    for r in (after, again):
        assert torch.allclose(logprobs(sink[r.rid]), teacher_forced(runner, r), atol=ATOL, rtol=0)
    spans = sink["through"]["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    flushed: list = []
    batcher._command(Flush(flushed.append))
    assert flushed and flushed[0] > 0 and batcher.prefix.tokens == 0 and batcher.prefix.flushes == 2


def test_the_setting_is_bounded_and_named():
    """``[proxy.engine] prefix_cache_mb`` and the engine's ``--prefix-cache-mb``: MiB >= 0 (0 turns the cache off);
    a value in bytes by mistake (over 1 TiB in MiB) is refused, naming the field."""
    import argparse

    import msgspec

    from pipeline.serving.embedded.__main__ import _mebibytes
    from pipeline.serving.factory import EngineSettings

    assert EngineSettings().prefix_cache_mb > 0 and msgspec.convert({"prefix_cache_mb": 0}, EngineSettings)
    for bad in (-1, 2 << 30):
        with pytest.raises(msgspec.ValidationError, match="prefix_cache_mb"):
            msgspec.convert({"prefix_cache_mb": bad}, EngineSettings)
    assert _mebibytes("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 0"):
        _mebibytes("-5")
