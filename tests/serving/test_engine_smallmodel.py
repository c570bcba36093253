"""The quickstart model factory and its reduced-vocabulary table."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from pipeline.models.small import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    QWEN_VOCAB_SIZE,
    VOCAB_FILE,
    VocabTable,
    create_small_model,
    load_vocab_table,
)


def test_table_from_sequences_hand_checked():
    t = VocabTable.from_sequences([[30, 10, 20], [10, ENDOFTEXT]], extra_ids=[IM_END])
    assert t.ids == (ENDOFTEXT, 10, 20, 30, IM_END) and t.unk_id == ENDOFTEXT and t.size == 5
    assert t.to_compact([10, 30, IM_END, ENDOFTEXT, 11, 151_000]).tolist() == [1, 3, 4, 0, 0, 0]
    assert t.to_qwen([0, 1, 2, 3, 4]).tolist() == [ENDOFTEXT, 10, 20, 30, IM_END]
    with pytest.raises(ValueError, match="outside the Qwen vocabulary"):
        t.to_compact([QWEN_VOCAB_SIZE])
    with pytest.raises(ValueError, match="outside the Qwen vocabulary"):
        t.to_compact([-1])
    with pytest.raises(ValueError, match="compact id outside"):
        t.to_qwen([5])
    with pytest.raises(ValueError, match="duplicates"):
        VocabTable(ids=(1, 2, 1))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, QWEN_VOCAB_SIZE - 1), max_size=20), max_size=5),
    st.lists(st.integers(0, QWEN_VOCAB_SIZE - 1), max_size=40),
)
def test_mapping_properties(seqs, probe):
    t = VocabTable.from_sequences(seqs)
    members = set(t.ids)
    # every id the table knows survives the round trip; every other id becomes UNK (slot 0)
    back = t.to_qwen(t.to_compact(probe)).tolist()
    assert back == [q if q in members else t.unk_id for q in probe]
    assert t.to_compact(t.to_qwen(np.arange(t.size))).tolist() == list(range(t.size))
    for s in seqs:
        assert set(s) <= members


def test_reduced_model_folder_loads_with_transformers(tmp_path):
    t = VocabTable.from_sequences([[1000, 1001, 1002]])
    d = create_small_model(tmp_path / "m", vocab=t, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    assert {"config.json", "model.safetensors", VOCAB_FILE} <= {p.name for p in d.iterdir()}
    assert load_vocab_table(d) == t
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["vocab_size"] == t.size
    # eos ids are stored as compact ids of the Qwen ids <|im_end|> and <|endoftext|>
    assert sorted(cfg["eos_token_id"]) == sorted(t.to_compact([IM_END, ENDOFTEXT]).tolist())
    m = AutoModelForCausalLM.from_pretrained(d)
    assert m.get_input_embeddings().weight.shape[0] == t.size == m.lm_head.weight.shape[0]
    ids = torch.as_tensor(t.to_compact([IM_START, 1000, 1001]))[None]
    assert m(input_ids=ids).logits.shape == (1, 3, t.size)
    # same seed, same weights
    d2 = create_small_model(
        tmp_path / "m2", vocab=t, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1
    )
    m2 = AutoModelForCausalLM.from_pretrained(d2)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))


def test_bad_vocab_file_is_named(tmp_path):
    (tmp_path / VOCAB_FILE).write_text('{"ids": []}')
    with pytest.raises(ValueError, match=VOCAB_FILE):
        load_vocab_table(tmp_path)
    assert load_vocab_table(tmp_path / "nothing-here") is None


def test_bad_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="num_heads"):
        create_small_model(tmp_path, hidden_size=30, num_heads=4)


def test_build_model_spec_full_vocabulary(tmp_path):
    """[experiment.build_model] vocabulary = "full": every Qwen id, no table, the asked context length."""
    from pipeline.models.quickstart import ModelSpec, ensure_model

    spec = msgspec.convert({"path": str(tmp_path / "full"), "vocabulary": "full", "hidden_size": 16, "num_layers": 1,
                            "num_heads": 2, "num_kv_heads": 1, "max_position_embeddings": 32768}, ModelSpec)
    d = ensure_model(spec)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == QWEN_VOCAB_SIZE and cfg["max_position_embeddings"] == 32768
    assert load_vocab_table(d) is None and not (d / VOCAB_FILE).exists()
    assert sorted(cfg["eos_token_id"]) == sorted([IM_END, ENDOFTEXT])
    with pytest.raises(msgspec.ValidationError, match="vocabulary"):
        msgspec.convert({"vocabulary": "tiny"}, ModelSpec)


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_mean_reply_tokens_gives_the_untrained_model_an_end_of_turn_prior(tmp_path, vocab):
    """Without it a random model ends a turn once in the vocabulary size; with 16, about once in 16 tokens."""
    t = VocabTable.from_sequences([list(range(1000, 3000))]) if vocab == "reduced" else None
    rng = torch.Generator().manual_seed(1)
    probe = torch.randint(0, t.size if t else QWEN_VOCAB_SIZE, (1, 300), generator=rng)
    end = int(t.to_compact([IM_END])[0]) if t else IM_END

    def p_end(**kw) -> torch.Tensor:
        d = create_small_model(tmp_path / str(kw), vocab=t, hidden_size=32, num_layers=2, num_heads=2,
                               num_kv_heads=1, **kw)
        with torch.no_grad():
            return torch.softmax(AutoModelForCausalLM.from_pretrained(d)(input_ids=probe).logits[0], -1)[:, end]

    plain, early = p_end(), p_end(mean_reply_tokens=16)
    n = t.size if t else QWEN_VOCAB_SIZE
    assert float(plain.mean()) < 3 / n
    assert 1 / 32 < float(early.mean()) < 1 / 8 and float(early.min()) > 1 / 400


BLACKBOX = ["claude-code", "codex", "qwen-code", "openclaw"]


@pytest.mark.parametrize("harness", BLACKBOX)
def test_blackbox_vocabulary_covers_every_oracle_answer_and_instruction(harness, tmp_path):
    """A reduced table for a black-box harness holds every id of the oracle's answers as that harness's tool calls
    (what the scripted engine plays, so what the model must write) and of the task instructions; nothing else of
    the harness's prompt is needed, so the table stays a few hundred rows."""
    from pipeline.models.quickstart import ModelSpec, vocabulary
    from pipeline.rollout.scheduling import oracle_script
    from pipeline.rollout.taskgen import generate
    from pipeline.rollout.tasks import materialize
    from pipeline.serving.scripted import Script, ScriptedEngine, ScriptResponse
    from pipeline.tokens.render import qwen3_renderer

    table = vocabulary(ModelSpec(harness=harness, families="create_word", tasks=50))
    assert 100 < table.size < 400
    renderer = qwen3_renderer(enable_thinking=False)
    engine = ScriptedEngine(renderer, Script())
    for seed in (0, 17, 49):  # inside the spec's 50 tasks
        task = materialize(generate("create_word", seed), tmp_path / f"t{seed}")
        answers = [engine.output_ids(msgspec.convert(r, ScriptResponse)) for r in oracle_script(task, harness)]
        need = {i for a in answers for i in a} | set(renderer.tokenizer.encode(task.instruction))
        assert not need - set(table.ids), (harness, seed)


def test_one_blackbox_vocabulary_serves_several_harnesses():
    from pipeline.models.quickstart import ModelSpec, vocabulary

    spec = {"families": "create_word", "tasks": 20}
    each = [set(vocabulary(ModelSpec(harness=h, **spec)).ids) for h in BLACKBOX]
    both = vocabulary(ModelSpec(harness=BLACKBOX, **spec))
    assert set(both.ids) == set.union(*each)
    assert both.unk_id == ENDOFTEXT


def test_build_model_sliding_window_and_a_stale_build_refused(tmp_path):
    """sliding_window builds transformers' sliding-window layers; a model already at the path with another shape is
    refused with what to do, not trained silently."""
    from pipeline.models.quickstart import ModelSpec, ensure_model

    spec = {"path": str(tmp_path / "m"), "vocabulary": "full", "hidden_size": 16, "num_layers": 2, "num_heads": 2,
            "num_kv_heads": 1}
    d = ensure_model(msgspec.convert({**spec, "sliding_window": 64}, ModelSpec))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["sliding_window"] == 64 and cfg["layer_types"] == ["sliding_attention"] * 2
    assert ensure_model(msgspec.convert({**spec, "sliding_window": 64}, ModelSpec)) == d
    with pytest.raises(ValueError, match=r"sliding_window 64 \(asked 0\).*Set \[run\].model"):
        ensure_model(msgspec.convert(spec, ModelSpec))
    with pytest.raises(msgspec.ValidationError, match="sliding_window"):
        msgspec.convert({**spec, "sliding_window": -1}, ModelSpec)
