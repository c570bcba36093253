from __future__ import annotations

import copy
import json

import msgspec
import numpy as np
import pytest
import torch

from pipeline.messages import RolloutSummary, TreeGroup, ids
from pipeline.training import batches
from pipeline.training import tree_attention as ta
from pipeline.training.learner import Learner
from pipeline.training.stage import StageSettings, stage_settings
from tests.helpers.learner_trees import Item, group, pack_paths, random_paths, tiny_qwen3


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matrices on a shared, busy CPU: one thread avoids OpenMP spin contention (100x faster here).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _learner(model, **kw) -> Learner:
    kw.setdefault("lr", 1e-3)
    kw.setdefault("attention", "dense")
    return Learner(model, stage_settings(**kw))


def _grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in learner.net.named_parameters()
    }


def _random_groups(seed: int) -> list[TreeGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(2):
        n = int(rng.integers(2, 5))
        statuses = ["ok"] * n
        if rng.random() < 0.5:
            statuses[int(rng.integers(n))] = "sandbox_error"
        groups.append(group(random_paths(rng, n), list(rng.random(n).round(2)), statuses, gid=f"g{g}"))
    return groups


# Sampling temperature of the groups per case (TreeGroup.temperature); 1 unless given. Group 1 of the mixed case
# is sampled at another temperature than group 0, so one micro-batch holds rows of both.
TEMPERATURES = {"grpo_kl_entropy_T": (0.8, 0.8), "grpo_mixed_T": (0.8, 1.3)}

CASES = {
    "grpo": {"advantage": "grpo"},
    "grpo_mixed_T": {"advantage": "grpo", "kl_coef": 0.1},
    "grpo_kl_entropy_T": {
        "advantage": "grpo",
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
        "tis_cap": 1.5,
    },
    "ppo": {"advantage": "ppo", "value_trunk_grad": True},
    "grpo_seq_mean": {"advantage": "grpo", "loss_agg": "seq_mean_token_mean"},
    "sft": {},
}


@pytest.mark.parametrize("attention", ["dense", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_tree_equals_path_expanded_reference(case, seed, attention):
    """Loss and every gradient on the packed tree (dense mask, or blocks of 5 queries each against the keys they
    see; several trees per micro-batch) equal those of each root-to-leaf path run alone, with shared tokens
    counted once, within 1e-5 in float32."""
    groups = _random_groups(seed)
    temps = TEMPERATURES.get(case, (1.0, 1.0))
    groups = [msgspec.structs.replace(g, temperature=temps[i]) for i, g in enumerate(groups)]
    model = tiny_qwen3(seed)
    sft = case == "sft"
    tree = _learner(copy.deepcopy(model), micro_batch_tokens=10_000, attention=attention, attention_chunk=5,
                    **CASES[case])
    ref = _learner(copy.deepcopy(model), attention="reference", micro_batch_tokens=1, **CASES[case])
    if case == "ppo":  # a zero value head gives the trunk no value gradient; make it count
        w = torch.randn(tree.net.value_head.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.3
        for lrn in (tree, ref):
            with torch.no_grad():
                lrn.net.value_head.weight.copy_(w)
    m_tree = tree.loss_and_grads(groups, sft=sft)
    m_ref = ref.loss_and_grads(groups, sft=sft)
    assert m_tree["trainable_tokens"] == m_ref["trainable_tokens"] > 0
    assert m_tree["loss"] == pytest.approx(m_ref["loss"], abs=1e-5)
    g_tree, g_ref = _grads(tree), _grads(ref)
    assert any(g.abs().max() > 1e-4 for g in g_tree.values())
    for name in g_tree:
        torch.testing.assert_close(g_tree[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_grpo_loss_hand_checked_through_the_model():
    """Single update: ratio 1, so the loss is -mean(min(pi/pi_rollout, c) * A) over trainable tokens of valid
    rollouts, with pi taken from the parent position of branch-first tokens."""
    model = tiny_qwen3(5)
    p = [Item(11), Item(12)]
    paths = [
        p + [Item(20, 0, True, -5.0), Item(21, 0, True, -0.01)],
        p + [Item(30, 1, True, -1.0)],
        p + [Item(40, 2, True, -2.0)],  # rollout 2's sandbox crashed: no loss, no statistics
    ]
    g = group(paths, [1.0, 0.0, 9.0], ["ok", "ok", "sandbox_error"])
    lrn = _learner(copy.deepcopy(model), tis_cap=2.0)
    metrics = lrn.loss_and_grads([g])
    with torch.no_grad():
        logp0 = torch.log_softmax(model(torch.tensor([[11, 12, 20]])).logits[0], -1)
        logp1 = torch.log_softmax(model(torch.tensor([[11, 12]])).logits[0], -1)
    pi = torch.stack([logp0[1, 20], logp0[2, 21], logp1[1, 30]])
    rollout = torch.tensor([-5.0, -0.01, -1.0])
    a = 1 / np.std([1.0, 0.0], ddof=1)  # rewards 1, 0: +-0.5 / 0.7071
    adv = torch.tensor([0.5 * a, 0.5 * a, -0.5 * a], dtype=torch.float32)
    want = -(torch.exp(pi - rollout).clamp(max=2.0) * adv).mean()
    assert metrics["trainable_tokens"] == 3
    assert metrics["loss"] == pytest.approx(want.item(), abs=1e-5)


def test_seq_mean_token_mean_weighs_every_rollout_the_same():
    """loss_agg = seq_mean_token_mean: mean over each rollout's tokens, then over rollouts (here 2 tokens and 1)."""
    model = tiny_qwen3(5)
    p = [Item(11), Item(12)]
    paths = [p + [Item(20, 0, True, -5.0), Item(21, 0, True, -0.01)], p + [Item(30, 1, True, -1.0)]]
    g = group(paths, [1.0, 0.0], ["ok", "ok"])
    metrics = _learner(copy.deepcopy(model), tis_cap=2.0, loss_agg="seq_mean_token_mean").loss_and_grads([g])
    with torch.no_grad():
        logp0 = torch.log_softmax(model(torch.tensor([[11, 12, 20]])).logits[0], -1)
        logp1 = torch.log_softmax(model(torch.tensor([[11, 12]])).logits[0], -1)
    a = 0.5 / np.std([1.0, 0.0], ddof=1)

    def term(lp, lr, adv):
        return (torch.exp(lp - lr).clamp(max=2.0) * adv).item()

    r0 = (term(logp0[1, 20], -5.0, a) + term(logp0[2, 21], -0.01, a)) / 2
    r1 = term(logp1[1, 30], -1.0, -a)
    assert metrics["trainable_tokens"] == 3
    assert metrics["loss"] == pytest.approx(-(r0 + r1) / 2, abs=1e-5)


def _bandit_group(learner: Learner, rng: torch.Generator, size: int, gid: str) -> TreeGroup:
    """One prompt, ``size`` one-token answers sampled from the current policy; reward 1 for an even token."""
    prompt = [Item(3), Item(4)]
    policy = learner.net.policy
    with torch.no_grad():
        logp = torch.log_softmax(policy(torch.tensor([[3, 4]])).logits[0, -1], -1)
    picks = torch.multinomial(logp.exp(), size, replacement=True, generator=rng).tolist()
    paths = [prompt + [Item(t, i, True, float(logp[t]))] for i, t in enumerate(picks)]
    return group(paths, [float(t % 2 == 0) for t in picks], gid=gid)


def _p_even(learner: Learner) -> float:
    with torch.no_grad():
        p = torch.softmax(learner.net.policy(torch.tensor([[3, 4]])).logits[0, -1], -1)
    return float(p[0::2].sum())


@pytest.mark.parametrize("advantage", ["grpo", "ppo"])
def test_token_bandit_reward_rises(advantage):
    """Fails if an advantage's sign flips: the probability of rewarded tokens must rise, and by a lot."""
    torch.manual_seed(0)
    lrn = _learner(tiny_qwen3(1), lr=1e-2, advantage=advantage, value_warmup_steps=2, max_grad_norm=10.0)
    rng = torch.Generator().manual_seed(0)
    start = _p_even(lrn)
    rewards = []
    for step in range(12):
        groups = [_bandit_group(lrn, rng, 8, f"s{step}g{k}") for k in range(2)]
        rewards.append(np.mean([r.reward for g in groups for r in g.rollouts]))
        lrn.train_step(groups)
    end = _p_even(lrn)
    assert end > start + 0.25, (start, end, rewards)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3])


def test_ppo_value_pretraining_moves_only_the_value_head():
    lrn = _learner(tiny_qwen3(2), advantage="ppo", value_warmup_steps=1, lr=1e-2)
    before = copy.deepcopy(lrn.net.policy.state_dict())
    g = group(random_paths(np.random.default_rng(0), 3), [1.0, 0.0, 0.5])
    m = lrn.train_step([g])
    assert m["value_phase"] == 1.0 and lrn.version == 0 and "pg_loss" not in m
    for k, v in lrn.net.policy.state_dict().items():
        torch.testing.assert_close(v, before[k], msg=k)
    assert lrn.net.value_head.weight.abs().sum() > 0
    m = lrn.train_step([g])
    assert m["value_phase"] == 0.0 and lrn.version == 1 and "pg_loss" in m and "value_loss" in m


def test_value_head_starts_at_zero_and_ppo_advantage_is_the_reward():
    lrn = _learner(tiny_qwen3(2), advantage="ppo")
    g = group([[Item(1), Item(2, 0, True, -1.0)], [Item(1), Item(3, 1, True, -1.0)]], [1.0, 0.0])
    m = lrn.loss_and_grads([g])
    assert m["value_sum"] == 0.0
    assert m["advantage_sum"] == pytest.approx(1.0)  # A = R - 0 for the two tokens: 1 + 0


def test_tis_and_clip_metrics():
    # pi_rollout far below pi_old: every token's ratio is far above the cap.
    paths = [[Item(1), Item(2, r, True, -50.0)] for r in range(2)]
    lrn = _learner(tiny_qwen3(3), tis_cap=2.0)
    m = lrn.loss_and_grads([group(paths, [1.0, 0.0])])
    assert m["is_capped_sum"] == 2 and m["is_ratio_min"] > 2.0


def test_sft_step_lowers_the_loss():
    lrn = _learner(tiny_qwen3(4), lr=1e-2)
    g = group(random_paths(np.random.default_rng(1), 2), [0.0, 0.0])
    first = lrn.sft_step([g])["sft_loss"]
    for _ in range(5):
        last = lrn.sft_step([g])["sft_loss"]
    assert last < first * 0.8
    assert lrn.version == 6


def test_multiple_updates_per_batch_use_recomputed_old_logprobs():
    lrn = _learner(tiny_qwen3(6), lr=5e-2, epochs=2, minibatches=2)
    groups = _random_groups(3) + _random_groups(4)
    m = lrn.train_step(groups)
    # Later updates see a moved policy: some ratios leave the trust region and get clipped.
    assert m["clip_frac"] > 0 and lrn.scheduler.last_epoch == 4 and lrn.version == 1


def test_save_weights_is_a_loadable_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "base"
    tiny_qwen3(7).save_pretrained(src)
    (src / "tokenizer_config.json").write_text("{}")
    lrn = Learner(src, stage_settings(lr=1e-2, attention="dense"))
    lrn.train_step([group(random_paths(np.random.default_rng(2), 2), [1.0, 0.0])])
    out = lrn.save_weights(tmp_path / "w")
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "bridle_weights.json").read_text()) == {"version": 1, "step": 1}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    want = lrn.net.policy.state_dict()
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, want[k], msg=k)
    lrn.save_weights(tmp_path / "w", version=5)  # overwrite in place
    assert json.loads((out / "bridle_weights.json").read_text())["version"] == 5


def test_checkpoint_resume_reproduces_training(tmp_path):
    base = tiny_qwen3(8)
    cfg = {"lr": 1e-2, "schedule": "cosine", "total_steps": 10, "warmup_steps": 1}
    rng = np.random.default_rng(5)
    batches = [[group(random_paths(rng, 3), list(rng.random(3)))] for _ in range(3)]

    a = _learner(copy.deepcopy(base), **cfg)
    a.train_step(batches[0])
    a.save_checkpoint(tmp_path / "ckpt", extra={"event_offset": 1234})
    noise_a = torch.rand(3)
    a.train_step(batches[1])
    a.train_step(batches[2])

    b = _learner(copy.deepcopy(base), **cfg)
    torch.manual_seed(99)  # what resume must undo
    assert b.load_checkpoint(tmp_path / "ckpt") == {"event_offset": 1234}
    torch.testing.assert_close(torch.rand(3), noise_a)  # the RNG state came back too
    assert (b.step, b.version, b.scheduler.last_epoch) == (1, 1, 1)
    b.train_step(batches[1])
    b.train_step(batches[2])
    for (k, va), vb in zip(a.net.state_dict().items(), b.net.state_dict().values(), strict=True):
        torch.testing.assert_close(va, vb, msg=k)
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    torch.testing.assert_close(sa[0]["exp_avg_sq"], sb[0]["exp_avg_sq"])


def test_bad_groups_are_refused_with_the_group_named():
    lrn = _learner(tiny_qwen3(0))
    g = group([[Item(1), Item(2, 3, True, -1.0)]], [1.0])  # slot 3 with one rollout
    with pytest.raises(ValueError, match="g0"):
        lrn.train_step([g])
    broken = msgspec.structs.replace(g.packed, pred=g.packed.subtree_end)
    with pytest.raises(ta.TreeError, match=r"TreeGroup\[0\]\(g0\)\.packed\.pred"):
        lrn.train_step(
            [
                msgspec.structs.replace(
                    g, packed=broken, rollouts=[RolloutSummary(rollout_id="x", reward=0, status="ok")] * 4
                )
            ]
        )
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"optimizer": {"lr": 1e-3, "lrr": 1}}, StageSettings)
    with pytest.raises(msgspec.ValidationError, match=r"Expected `float` > 0.0 - at `\$.optimizer.lr`"):
        msgspec.convert({"optimizer": {"lr": 0.0}}, StageSettings)
    with pytest.raises(ValueError, match="total_steps"):
        Learner(tiny_qwen3(0), stage_settings(schedule="cosine"))


def test_pack_helper_is_what_the_contract_says():
    t = ta.unpack(pack_paths([[Item(1), Item(2, 0, True, -1.0)], [Item(1), Item(3, 1, True, -1.0)]]))
    assert t.pred.tolist() == [-1, 0, 0] and t.subtree_end.tolist() == [3, 2, 3]


@pytest.mark.slow
def test_flex_attention_path_equals_dense():
    """The GPU code path (flex-attention BlockMask) run on CPU through inductor gives the dense path's log-probs
    and values. Forward only: torch has no flex-attention backward on CPU."""
    groups = _random_groups(0)
    model = tiny_qwen3(0)
    out = {}
    for attention in ("dense", "flex"):
        lrn = _learner(copy.deepcopy(model), attention=attention, advantage="ppo")
        with torch.no_grad():
            lrn.net.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
        mbs = batches.micro_batches([batches.prepare(g, i, lrn.config) for i, g in enumerate(groups)],
                                    lrn.config.compute.micro_batch_tokens)
        lrn._fill_old(mbs, need_logp=True)
        out[attention] = (
            torch.cat([mb.old["logp"] for mb in mbs]),
            torch.cat([mb.old["value"] for mb in mbs]),
        )
    torch.testing.assert_close(out["flex"][0], out["dense"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["flex"][1], out["dense"][1], atol=1e-5, rtol=1e-5)


def test_micro_batches_split_at_roots_without_changing_the_step():
    """Segments (extra roots) may land in different micro-batches; loss and gradients stay the same."""
    groups = _random_groups(1) + _random_groups(2)
    assert any((ids(g.packed.pred) == -1).sum() > 1 for g in groups)
    model = tiny_qwen3(1)
    whole = _learner(copy.deepcopy(model), micro_batch_tokens=100_000)
    split = _learner(copy.deepcopy(model), micro_batch_tokens=1)
    trees = [batches.prepare(g, i, split.config) for i, g in enumerate(groups)]
    n_split = len(batches.micro_batches(trees, split.config.compute.micro_batch_tokens))
    assert n_split > len(groups)
    m_whole, m_split = whole.loss_and_grads(groups), split.loss_and_grads(groups)
    assert m_whole["loss"] == pytest.approx(m_split["loss"], abs=1e-6)
    g_whole, g_split = _grads(whole), _grads(split)
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attention", ["dense", "chunked"])
def test_a_micro_batch_over_the_budget_is_trained_with_activation_checkpointing(attention):
    """A tree larger than micro_batch_tokens goes alone; its forward and backward run with activation checkpointing
    (only layer inputs kept), and nothing changes numerically. Micro-batches within the budget run without it, and
    no hook is left behind on the embeddings."""
    groups = _random_groups(0)
    model = tiny_qwen3(0)
    kw = {"attention": attention, "attention_chunk": 5, "kl_coef": 0.1}
    plain = _learner(copy.deepcopy(model), micro_batch_tokens=100_000, **kw)
    tight = _learner(copy.deepcopy(model), micro_batch_tokens=8, **kw)
    seen: dict[str, list[bool]] = {"plain": [], "tight": []}
    for name, lrn in (("plain", plain), ("tight", tight)):
        layers = lrn._policy().model.layers
        layers[0].register_forward_pre_hook(
            lambda m, args, name=name: seen[name].append(bool(m.gradient_checkpointing and torch.is_grad_enabled())))
    m_plain, m_tight = plain.loss_and_grads(groups), tight.loss_and_grads(groups)
    assert seen["plain"] and not any(seen["plain"])
    assert seen["tight"] and all(seen["tight"])  # every micro-batch of this tree is over 8 tokens
    assert not tight._policy().model.layers[0].gradient_checkpointing  # off again after the step
    assert not getattr(tight._policy(), "_require_grads_hooks", [])
    assert m_tight["loss"] == pytest.approx(m_plain["loss"], abs=1e-6)
    g_plain, g_tight = _grads(plain), _grads(tight)
    for name in g_plain:
        torch.testing.assert_close(g_tight[name], g_plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_tree_builder_groups_match_the_reference():
    """End to end with the real tree builder: random harness-like rollouts (retries, forks, subagents,
    compaction segments) -> assemble_group -> the packed step equals the path-expanded reference."""
    from pipeline.trees.packing import assemble_group
    from tests.helpers.treegen import Spec, generate_group

    rng = np.random.default_rng(11)
    spec = Spec(turns=4, vocab=50, p_retry=0.3, p_fork=0.3, p_subagent=0.3, p_compaction=0.3, p_truncate=0.2)
    groups = []
    for _ in range(2):
        msg = assemble_group([g.settled for g in generate_group(rng, spec, 3)])
        assert isinstance(msg, TreeGroup), msg
        groups.append(msg)
    vocab = 1 + max(int(ids(g.packed.tokens).max()) for g in groups)
    model = tiny_qwen3(3, vocab=vocab)
    tree = _learner(copy.deepcopy(model), micro_batch_tokens=64)
    ref = _learner(copy.deepcopy(model), attention="reference")
    m_tree, m_ref = tree.loss_and_grads(groups), ref.loss_and_grads(groups)
    assert m_tree["trainable_tokens"] == m_ref["trainable_tokens"] > 0
    assert m_tree["loss"] == pytest.approx(m_ref["loss"], abs=1e-5)
    g_tree, g_ref = _grads(tree), _grads(ref)
    for name in g_tree:
        torch.testing.assert_close(g_tree[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=name)
    assert tree.train_step(groups)["version"] == 1


def test_resume_restores_the_kl_reference_not_the_base_model(tmp_path):
    """The RL stage's KL reference is the policy it started from (after a cold start: the SFT weights). A resumed
    learner is built from the run's base model; its checkpoint must bring the reference back, or the KL term pulls
    the policy towards the base (seen as KL 0.006 -> 5.85 at the first resumed step, entropy to uniform)."""
    base, sft = tiny_qwen3(8), tiny_qwen3(9)  # two different policies
    cfg = {"lr": 1e-2, "kl_coef": 0.1}
    rng = np.random.default_rng(5)
    batches = [[group(random_paths(rng, 3), list(rng.random(3)))] for _ in range(2)]
    a = _learner(copy.deepcopy(sft), initial_version=7, **cfg)
    a.train_step(batches[0])
    a.save_checkpoint(tmp_path / "ckpts" / "step00001")
    assert (tmp_path / "ckpts" / "reference-v00007" / "reference.safetensors").is_file()
    a.save_checkpoint(tmp_path / "ckpts" / "step00002")  # written once per RL stage
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["reference-v00007", "step00001", "step00002"]

    b = _learner(copy.deepcopy(base), **cfg)
    b.load_checkpoint(tmp_path / "ckpts" / "step00001")
    for (k, ra), rb in zip(a.reference.state_dict().items(), b.reference.state_dict().values(), strict=True):
        torch.testing.assert_close(ra, rb, msg=k)
    ma, mb = a.train_step(batches[1]), b.train_step(batches[1])
    assert mb["kl"] == pytest.approx(ma["kl"], abs=1e-6) and ma["kl"] > 0


def test_a_checkpoint_without_its_reference_is_refused_when_kl_is_on(tmp_path):
    a = _learner(tiny_qwen3(8), lr=1e-2)  # kl_coef 0: no reference
    a.save_checkpoint(tmp_path / "step00001")
    b = _learner(tiny_qwen3(8), lr=1e-2, kl_coef=0.1)
    with pytest.raises(FileNotFoundError, match="names no KL reference policy"):
        b.load_checkpoint(tmp_path / "step00001")


def test_a_checkpoint_appears_whole_and_a_cut_one_is_never_resumed(tmp_path, monkeypatch):
    """kill -9 during save_checkpoint must not leave a step folder that looks complete: the run's resume picked a
    folder whose learner_state.json existed but was still empty (CI, JSONDecodeError)."""
    from types import SimpleNamespace

    from pipeline.cli.launch import find_resume
    from pipeline.training import learner as learner_mod

    a = _learner(tiny_qwen3(8), lr=1e-2)
    ckpts = tmp_path / "checkpoints"
    a.save_checkpoint(ckpts / "step00001", extra={"steps_done": 1})

    class Killed(Exception):
        pass

    def killed(*_args, **_kw):
        raise Killed  # the folder as a kill -9 at that instant leaves it

    monkeypatch.setattr(learner_mod, "json", SimpleNamespace(dumps=killed))
    with pytest.raises(Killed):
        a.save_checkpoint(ckpts / "step00002", extra={"steps_done": 2})
    assert not (ckpts / "step00002").exists() and (ckpts / "step00002.tmp").is_dir()

    res = find_resume(tmp_path)
    assert res.checkpoint == ckpts / "step00001" and res.steps_done == 1
    assert not (ckpts / "step00002.tmp").exists()  # the cut one is cleared away


def test_a_non_finite_gradient_is_never_applied_and_enough_in_a_row_stop_the_run():
    from pipeline.training.learner import NonFiniteError

    lrn = _learner(tiny_qwen3(7), entropy_coef=float("nan"), max_nonfinite_updates=2)
    before = {k: v.clone() for k, v in lrn.policy_state().items()}
    groups = _random_groups(3)
    m = lrn.train_step(groups)
    assert m["skipped_updates"] == 1 and lrn.skipped_updates == 1
    assert all(torch.equal(before[k], v) for k, v in lrn.policy_state().items())  # nothing reached the weights
    with pytest.raises(NonFiniteError, match="2 updates in a row had a non-finite loss or gradient"):
        lrn.train_step(groups)
    assert all(torch.equal(before[k], v) for k, v in lrn.policy_state().items())
    # a finite update in between resets the count
    ok = _learner(tiny_qwen3(7), max_nonfinite_updates=2)
    ok.config.objective.entropy_coef = float("nan")
    ok.train_step(groups)
    ok.config.objective.entropy_coef = 0.0
    assert ok.train_step(groups)["skipped_updates"] == 0 and ok.nonfinite_in_a_row == 0
    ok.config.objective.entropy_coef = float("nan")
    ok.train_step(groups)
    assert ok.nonfinite_in_a_row == 1
