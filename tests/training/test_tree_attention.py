from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import pack_i32
from pipeline.training import tree_attention as ta
from tests.helpers.learner_trees import Item, pack_paths, random_paths, tiny_qwen3


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matrices on a shared, busy CPU: one thread avoids OpenMP spin contention (100x faster here).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _hand_tree():
    # prompt [1 2] shared; rollout 0 answers [3 4]; rollout 1 answers [5] then, after observation [6], [7];
    # rollout 1 also has a dead retry [8] right after the prompt.
    p = [Item(1), Item(2)]
    a0 = [Item(3, 0, True, -0.1), Item(4, 0, True, -0.2)]
    a1 = [Item(5, 1, True, -0.3)]
    paths = [p + a0, p + a1 + [Item(6, 1), Item(7, 1, True, -0.4)], p + [Item(8, 1, True, -0.5)]]
    return ta.unpack(pack_paths(paths))


def test_hand_tree_layout():
    t = _hand_tree()
    assert t.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert t.positions.tolist() == [0, 1, 2, 3, 2, 3, 4, 2]
    assert t.subtree_end.tolist() == [8, 8, 4, 4, 7, 7, 7, 8]
    # Branch-first tokens 3, 5 and 8 are all predicted from the prompt's last token (index 1).
    assert t.pred.tolist() == [-1, 0, 1, 2, 1, 4, 5, 1]
    assert ta.path_ends(t.subtree_end).tolist() == [3, 6, 7]
    assert [p.tolist() for p in ta.expand_paths(t)] == [[0, 1, 2, 3], [0, 1, 4, 5, 6], [0, 1, 7]]
    vis = ta.visibility(torch.as_tensor(t.subtree_end))
    assert torch.nonzero(vis[6]).flatten().tolist() == [0, 1, 4, 5, 6]
    assert torch.nonzero(vis[7]).flatten().tolist() == [0, 1, 7]


def _broken(field: str, values: list[int]):
    t = _hand_tree()
    return dataclasses.replace(t, **{field: np.asarray(values, dtype=getattr(t, field).dtype)})


@pytest.mark.parametrize(
    "field,values,msg",
    [
        ("pred", [-1, 0, 1, 2, 3, 4, 5, 1], "pred"),  # token 4 claims token 3 (another branch) predicts it
        ("positions", [0, 1, 2, 3, 2, 4, 4, 2], "positions"),
        ("subtree_end", [8, 8, 4, 4, 7, 7, 7, 9], "subtree_end"),
        ("trainable", [1, 0, 1, 1, 1, 0, 1, 1], "trainable"),  # a root's first token
        ("pred", [0, 0, 1, 2, 1, 4, 5, 1], "pred"),  # the first token must start a root
        ("rollout", [-1, -1, -1, 0, 1, 1, 1, 1], "trainable"),  # a trainable shared token
    ],
)
def test_validate_names_broken_field(field, values, msg):
    t = _broken(field, values)
    with pytest.raises(ta.TreeError, match=msg):
        ta.validate(t, "G")


def test_unpack_rejects_length_mismatch():
    packed = pack_paths([[Item(1), Item(2, 0, True, -1.0)]])
    packed.positions = pack_i32([0])
    with pytest.raises(ta.TreeError, match="positions"):
        ta.unpack(packed)


def test_concat_and_pad_keep_structure():
    a, b = _hand_tree(), ta.unpack(pack_paths([[Item(9), Item(10, 0, True, -1.0)]]))
    f, offsets = ta.concat([a, b])
    assert offsets.tolist() == [0, 8]
    assert f.pred[8:].tolist() == [-1, 8] and f.subtree_end[8:].tolist() == [10, 10]
    ta.validate(f)
    vis = ta.visibility(torch.as_tensor(f.subtree_end))
    assert not vis[8:, :8].any() and not vis[:8, 8:].any()
    p = ta.pad_to(f, 16)
    assert len(p) == 16
    ta.validate(p)
    vis_p = ta.visibility(torch.as_tensor(p.subtree_end))
    assert torch.equal(vis_p[:10, :10], vis) and torch.equal(vis_p[10:, 10:], torch.eye(6, dtype=torch.bool))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_random_trees_are_valid_and_paths_cover_visibility(seed, rollouts):
    t = ta.unpack(pack_paths(random_paths(np.random.default_rng(seed), rollouts)))
    vis = ta.visibility(torch.as_tensor(t.subtree_end)).numpy()
    # Each token sees exactly its ancestors: as many as its depth + 1.
    assert (vis.sum(1) == t.positions + 1).all()
    paths = ta.expand_paths(t)
    assert np.array_equal(np.unique(np.concatenate(paths)), np.arange(len(t)))
    for p in paths:
        assert (t.pred[p[1:]] == p[:-1]).all()


@pytest.mark.parametrize("impl", ["sdpa", "eager", "chunked"])
def test_model_on_tree_matches_each_path_alone(impl):
    """transformers honors our 4D mask (or our chunked attention) and position ids: every token's hidden state in
    the packed tree equals its hidden state when its root-to-leaf path runs alone as an ordinary causal sequence."""
    model = tiny_qwen3().eval()
    model.set_attn_implementation(ta.register_chunked() if impl == "chunked" else impl)
    t = ta.unpack(pack_paths(random_paths(np.random.default_rng(3), 3)))
    se = torch.as_tensor(t.subtree_end)
    mask = {"sdpa": lambda: ta.dense_mask(se), "eager": lambda: ta.dense_mask(se, torch.float32),
            "chunked": lambda: ta.chunked_mask(se, 4)}[impl]()
    with torch.no_grad():
        tree_h = model.model(
            input_ids=torch.as_tensor(t.tokens)[None],
            position_ids=torch.as_tensor(t.positions)[None],
            attention_mask=mask,
        ).last_hidden_state[0]
        for p in ta.expand_paths(t):
            path_h = model.model(input_ids=torch.as_tensor(t.tokens[p])[None]).last_hidden_state[0]
            torch.testing.assert_close(tree_h[p], path_h, atol=1e-5, rtol=1e-5)


@given(seed=st.integers(0, 10_000), rollouts=st.integers(1, 5), chunk=st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_chunked_blocks_are_the_visibility_matrix(seed, rollouts, chunk):
    """The blocks, put back together, are exactly the N x N visibility rule: no visible key is skipped."""
    t = ta.unpack(pack_paths(random_paths(np.random.default_rng(seed), rollouts)))
    se = torch.as_tensor(t.subtree_end)
    whole = torch.zeros(len(t), len(t), dtype=torch.bool)
    tree = ta.chunked_mask(se, chunk)["full_attention"]
    for start, end, keys in tree.blocks():
        mask = tree.block_mask(start, end, keys)
        assert (end - start <= chunk) and mask.shape == (end - start, keys.shape[0])
        whole[start:end, keys] = mask
    assert torch.equal(whole, ta.visibility(se))


def test_chunked_skips_finished_branches():
    # root 0 with two branches [1, 2] and [3, 4]: queries 3..4 never see tokens 1..2
    t = ta.unpack(pack_paths([[Item(5), Item(6), Item(7)], [Item(5), Item(8), Item(9)]]))
    assert t.subtree_end.tolist() == [5, 3, 3, 5, 5]
    blocks = ta.chunked_mask(torch.as_tensor(t.subtree_end), 2)["full_attention"].blocks()
    assert [(s, e, k.tolist()) for s, e, k in blocks] == [(0, 2, [0, 1]), (2, 4, [0, 1, 2, 3]), (4, 5, [0, 3, 4])]


def test_root_ranges_and_slices():
    seg = [Item(7, 0), Item(8, 0, True, -1.0, segment=1)]
    t = ta.unpack(pack_paths([[Item(1), Item(2, 0, True, -1.0)], [Item(5, 0, segment=1), *seg[1:]]]))
    assert ta.root_ranges(t) == [(0, 2), (2, 4)]
    s = ta.slice_tree(t, 2, 4)
    ta.validate(s)
    assert s.tokens.tolist() == [5, 8] and s.pred.tolist() == [-1, 0] and s.subtree_end.tolist() == [2, 2]
    bad = dataclasses.replace(t, subtree_end=np.array([3, 2, 4, 4]))  # root 0 claims a token of root 2
    with pytest.raises(ta.TreeError, match="subtree"):
        ta.validate(bad)


def test_a_sliding_window_model_trains_on_trees_as_transformers_runs_it():
    """Chunked tree attention with a model's sliding window gives transformers' own sliding-window logits, on a
    plain sequence and on each path of a tree; the window really masks (full attention differs)."""
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=50, use_sliding_window=True, sliding_window=16,
                      max_window_layers=0)
    assert ta.sliding_window(cfg) == 16
    sdpa = copy.deepcopy(cfg)
    sdpa._attn_implementation = "sdpa"
    ref = Qwen3ForCausalLM(sdpa).eval()
    tree = Qwen3ForCausalLM(copy.deepcopy(cfg)).eval()
    tree.load_state_dict(ref.state_dict())
    tree.set_attn_implementation(ta.register_chunked())
    full_cfg = copy.deepcopy(sdpa)
    full_cfg.layer_types, full_cfg.sliding_window = ["full_attention"] * 2, None
    full = Qwen3ForCausalLM(full_cfg).eval()
    full.load_state_dict(ref.state_dict())
    # a trunk of 40 tokens and two branches of 12: packed depth-first, positions are depths on the path
    trunk, b1, b2 = (torch.randint(0, 50, (n,)) for n in (40, 12, 12))
    tokens = torch.cat([trunk, b1, b2])
    positions = torch.cat([torch.arange(40), torch.arange(40, 52), torch.arange(40, 52)])
    subtree_end = torch.cat([torch.full((40,), 64), torch.full((12,), 52), torch.full((12,), 64)])
    with torch.no_grad():
        got = tree(input_ids=tokens[None], position_ids=positions[None],
                   attention_mask=ta.chunked_mask(subtree_end, 8, positions, 16)).logits[0]
        for branch, rows in ((b1, slice(40, 52)), (b2, slice(52, 64))):
            path = torch.cat([trunk, branch])[None]
            want = ref(input_ids=path).logits[0]
            assert torch.allclose(got[:40], want[:40], atol=1e-5)
            assert torch.allclose(got[rows], want[40:], atol=1e-5)
            assert not torch.allclose(want, full(input_ids=path).logits[0], atol=1e-3)
    # the window prunes the keys a block reads, not only masks them: exact (above) and fewer
    windowed = ta.chunked_mask(subtree_end, 8, positions, 16)
    seen = [len(k) for *_, k in windowed["sliding_attention"].blocks()]
    unpruned = [len(k) for *_, k in windowed["full_attention"].blocks()]
    assert sum(seen) < sum(unpruned) and max(seen) < max(unpruned), (seen, unpruned)
