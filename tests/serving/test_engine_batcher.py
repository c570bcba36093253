"""The embedded engine's continuous batcher, driven step by step in-process (no HTTP, no thread).

Property: whatever the arrival pattern (requests joining between decode steps, finishing at different lengths,
prompts of different lengths -> left padding), every token's log-probability equals a teacher-forced forward of
that request alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.models.small import VocabTable, create_small_model
from pipeline.serving.embedded.batcher import Add, Batcher, Stop
from pipeline.serving.embedded.runner import ModelRunner
from tests.helpers.batcher import drive, logprobs, make_req, teacher_forced


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    torch.set_num_threads(1)
    vocab = VocabTable.from_sequences([range(500, 560)])
    path = create_small_model(
        tmp_path_factory.mktemp("m") / "m",
        vocab=vocab,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
    )
    return ModelRunner(Path(path), torch.float32, context_length=256)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 30), st.integers(1, 12), st.integers(0, 6), st.sampled_from([0.0, 0.7, 1.3])
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 4),
)
def test_batched_logprobs_equal_teacher_forcing(runner, reqs, max_running):
    batcher = Batcher(runner, version="0", max_running=max_running)
    sink: dict = {}
    made = []
    for i, (plen, n, _, temp) in enumerate(reqs):
        prompt = [1 + (7 * i + 3 * j) % 60 for j in range(plen)]
        made.append(make_req(f"r{i}", prompt, n, temperature=temp, seed=i, sink=sink))
    drive(batcher, [(arrive, req) for req, (_, _, arrive, _) in zip(made, reqs, strict=True)], max_steps=200)
    assert not batcher.rows and not batcher.waiting
    for req, (_, n, _, _) in zip(made, reqs, strict=True):
        out = sink[req.rid]
        assert len(out["output_ids"]) == n and out["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": n,
        }
        got = logprobs(out)
        ref = teacher_forced(runner, req)
        assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got, ref)


def test_a_failing_step_answers_every_running_request_and_the_engine_continues(runner, monkeypatch):
    batcher = Batcher(runner, version="0", max_running=4)
    sink: dict = {}
    for i in range(3):
        batcher._command(Add(make_req(f"f{i}", [1, 2, 3 + i], 5, temperature=1.0, seed=i, sink=sink)))
    real = runner.decode
    monkeypatch.setattr(runner, "decode", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    batcher.thread.start()
    try:
        # the thread picks the requests up from its inbox; inject them through submit for realism
        for i in range(3, 5):
            batcher.submit(Add(make_req(f"f{i}", [4, 5], 5, temperature=1.0, seed=i, sink=sink)))
        deadline = 200
        while len(sink) < 5 and deadline:
            batcher.thread.join(0.05)
            deadline -= 1
        assert all(sink[f"f{i}"] == {"error": "RuntimeError: boom"} for i in range(5))
        monkeypatch.setattr(runner, "decode", real)
        batcher.submit(Add(make_req("ok", [1, 2], 4, temperature=1.0, seed=0, sink=sink)))
        deadline = 200
        while "ok" not in sink and deadline:
            batcher.thread.join(0.05)
            deadline -= 1
        assert len(sink["ok"]["output_ids"]) == 4 and batcher.info()["last_error"] == "RuntimeError: boom"
    finally:
        batcher.submit(Stop())
        batcher.thread.join(10)


def test_full_vocabulary_model(tmp_path):
    """Without bridle_vocab.json the engine passes Qwen ids through unchanged (the SGLang-loadable variant)."""
    path = create_small_model(tmp_path / "full", hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    full = ModelRunner(Path(path), torch.float32, context_length=64)
    assert full.vocab is None and full.input_vocab == full.model_vocab == 151_936
    assert full.eos_ids == {151_643, 151_645}
    batcher = Batcher(full, version="0", max_running=2)
    sink: dict = {}
    prompt = [151_644, 9707, 11, 1879]
    reqs = [make_req(f"q{i}", prompt[: 2 + i], 6, temperature=0.9, seed=i, sink=sink) for i in range(2)]
    for req in reqs:
        batcher._command(Add(req))
    while len(sink) < 2:
        batcher._admit()
        if batcher.rows:
            batcher._step()
        batcher._drop_finished()
    for req in reqs:
        out = sink[req.rid]
        assert out["output_ids"] == req.out_model  # a full vocabulary: model ids are Qwen ids
        assert torch.allclose(logprobs(out), teacher_forced(full, req), atol=1e-4)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.6), (2.0, 4, 0.9)],
)
def test_sampler_follows_the_filtered_distribution(runner, temperature, top_k, top_p):
    v = runner.model_vocab
    logits = torch.zeros(v)
    logits[:6] = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.2])
    # expected: softmax(logits / T), keep the top-k, then the smallest prefix with top_p of the mass, renormalize
    p = torch.softmax(logits.double() / temperature, dim=0)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros(v, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or mass >= top_p * p[order[: (top_k if top_k > 0 else v)]].sum():
            break
        keep[i] = True
        mass += float(p[i])
    expected = torch.where(keep, p, 0.0)
    expected /= expected.sum()

    n = 4000
    batcher = Batcher(runner, version="0", max_running=n)
    reqs = [make_req(str(i), [1], 10, temperature=temperature, seed=i, sink={}) for i in range(n)]
    for r in reqs:
        r.top_k, r.top_p, r.n_cached = top_k, top_p, 1
    batcher._sample(reqs, logits.expand(n, v).clone())
    toks = torch.tensor([r.out_model[0] for r in reqs])
    freq = torch.bincount(toks, minlength=v).double() / n
    assert set(toks.tolist()) <= set(torch.nonzero(keep)[:, 0].tolist())
    assert torch.allclose(freq, expected, atol=0.03), (freq[:8], expected[:8])
    # logprobs are log_softmax(logits / T) of the sampled token, not renormalized after filtering
    lp = torch.log_softmax(logits / temperature, dim=0)
    assert all(abs(r.logprobs[0] - float(lp[r.out_model[0]])) < 1e-6 for r in reqs[:50])
