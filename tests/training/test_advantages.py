from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import RolloutSummary
from pipeline.training import advantages as adv


def test_grpo_hand_checked():
    # mean 0.25, sample std 0.5: (1 - 0.25) / 0.5 = 1.5 and (0 - 0.25) / 0.5 = -0.5
    a = adv.grpo_advantages(np.array([1.0, 0.0, 0.0, 0.0]), np.ones(4, bool), eps=0.0)
    np.testing.assert_allclose(a, [1.5, -0.5, -0.5, -0.5])
    # rewards 1, 2, 3: mean 2, std 1
    np.testing.assert_allclose(
        adv.grpo_advantages(np.array([1.0, 2.0, 3.0]), np.ones(3, bool), eps=0.0), [-1, 0, 1]
    )
    np.testing.assert_allclose(
        adv.grpo_advantages(np.array([1.0, 2.0, 3.0]), np.ones(3, bool), scale_by_std=False), [-1, 0, 1]
    )


def test_grpo_invalid_rollouts_are_left_out_of_statistics():
    # Rollout 2 crashed in its sandbox: its reward 100 must not move the mean, and it gets no advantage.
    a = adv.grpo_advantages(np.array([1.0, 3.0, 100.0]), np.array([True, True, False]), eps=0.0)
    s = np.std([1.0, 3.0], ddof=1)
    np.testing.assert_allclose(a, [-1 / s, 1 / s, 0.0])


def test_grpo_degenerate_groups_give_zero():
    np.testing.assert_array_equal(
        adv.grpo_advantages(np.array([0.1, 0.1, 0.1]), np.ones(3, bool), eps=0.0), [0, 0, 0]
    )
    np.testing.assert_array_equal(adv.grpo_advantages(np.array([1.0, 0.0]), np.array([True, False])), [0, 0])


def test_rollout_valid_by_status():
    rs = [
        RolloutSummary(rollout_id=str(i), reward=0.0, status=s)
        for i, s in enumerate(["ok", "timeout", "sandbox_error", "harness_error", "verifier_error"])
    ]
    assert adv.rollout_valid(rs).tolist() == [True, True, False, False, False]
    assert adv.rollout_valid(rs, ["ok"]).tolist() == [True, False, False, False, False]


def test_per_token_segments_share_the_rollout_advantage():
    # Two segments of rollout 1 (segment ids are irrelevant: the slot decides), shared prefix gets 0.
    rollout = np.array([-1, -1, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(adv.per_token(np.array([2.0, -3.0]), rollout), [0, 0, 2, 2, -3, -3, -3, -3])
    with pytest.raises(ValueError, match="rollout"):
        adv.per_token(np.array([1.0]), rollout)


def test_ppo_advantage_is_return_minus_detached_value():
    v = torch.tensor([0.25, -0.5], requires_grad=True)
    a = adv.ppo_advantages(torch.tensor([1.0, 1.0]), v)
    torch.testing.assert_close(a, torch.tensor([0.75, 1.5]))
    assert not a.requires_grad


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-10, 10), min_size=2, max_size=16))
def test_grpo_is_centered_and_scaled(rewards):
    r = np.array(rewards)
    if r.std() < 1e-6:  # near-equal rewards: scaling by a denormal std is meaningless
        return
    a = adv.grpo_advantages(r, np.ones(len(r), bool), eps=0.0)
    assert abs(a.mean()) < 1e-9
    assert abs(a.std(ddof=1) - 1.0) < 1e-9
    # Order is preserved: a better reward never gets a smaller advantage.
    assert (np.diff(a[np.argsort(r, kind="stable")]) >= -1e-12).all()
