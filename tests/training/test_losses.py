from __future__ import annotations

import math

import torch

from pipeline.training import losses


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_tis_weight_is_capped_and_detached():
    old = t(0.0, 0.0, 0.0).requires_grad_()
    w = losses.tis_weight(old, t(0.0, math.log(2.0), -math.log(4.0)), c_bar=2.0)
    # pi_old/pi_rollout = 1, 0.5, 4 -> capped at c_bar = 2
    torch.testing.assert_close(w, t(1.0, 0.5, 2.0))
    assert not w.requires_grad


def test_asymmetric_clipping_hand_checked():
    old = t(0.0, 0.0, 0.0, 0.0)
    # ratios 1.5 and 0.5 for positive and negative advantages
    logp = torch.log(t(1.5, 0.5, 1.5, 0.5)).requires_grad_()
    adv = t(1.0, 1.0, -1.0, -1.0)
    pt = losses.policy_loss(logp, old, adv, torch.ones(4), clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5: min(1.5, 1.28) = 1.28 (clipped high); A>0, r=0.5: min(0.5, 0.8) = 0.5 (not clipped)
    # A<0, r=1.5: min(-1.5, -1.28) = -1.5 (not clipped); A<0, r=0.5: min(-0.5, -0.8) = -0.8 (clipped low)
    torch.testing.assert_close(pt.loss, t(-1.28, -0.5, 1.5, 0.8))
    assert pt.clipped.tolist() == [True, False, False, True]
    pt.loss.sum().backward()
    # Clipped tokens get no gradient; the others get -A * r (d r / d logp = r).
    torch.testing.assert_close(logp.grad, t(0.0, -0.5, 1.5, 0.0))


def test_policy_loss_scaled_by_tis():
    logp = t(0.0, 0.0).requires_grad_()
    pt = losses.policy_loss(logp, t(0.0, 0.0), t(2.0, 2.0), t(0.5, 2.0))
    torch.testing.assert_close(pt.loss, t(-1.0, -4.0))
    pt.loss.sum().backward()
    torch.testing.assert_close(logp.grad, t(-1.0, -4.0))


def test_value_loss_clipped_hand_checked():
    v = t(1.0, 0.1).requires_grad_()
    vl, clipped = losses.value_loss(v, t(0.0, 0.0), t(0.0, 1.0), clip=0.2)
    # token 0: V=1 is far from R=0; clipped V=0.2 -> max(1, 0.04)/2 = 0.5
    # token 1: V=0.1, R=1: err 0.81; clipped V=0.1 (inside) -> 0.405
    torch.testing.assert_close(vl, t(0.5, 0.405))
    assert clipped.tolist() == [False, False]
    vl2, clipped2 = losses.value_loss(t(-0.5), t(0.0), t(1.0), clip=0.2)
    # V=-0.5: err 2.25, clipped V=-0.2: err 1.44 -> unclipped wins
    torch.testing.assert_close(vl2, t(1.125))
    assert not clipped2.item()
    vl3, clipped3 = losses.value_loss(t(0.5), t(0.0), t(-1.0), clip=0.2)
    # V=0.5: err 2.25; clipped V=0.2: err 1.44 -> max is unclipped 2.25
    torch.testing.assert_close(vl3, t(1.125))
    assert not clipped3.item()
    vl4, clipped4 = losses.value_loss(t(-0.5), t(0.0), t(-1.0), clip=0.2)
    # V=-0.5: err 0.25; clipped V=-0.2: err 0.64 -> the clipped (pessimistic) branch wins
    torch.testing.assert_close(vl4, t(0.32))
    assert clipped4.item()


def test_kl_k3():
    logp = torch.log(t(0.5, 0.25))
    ref = torch.log(t(0.5, 0.5))
    # ratio ref/p = 1 -> 0; ratio 2 -> 2 - ln 2 - 1
    torch.testing.assert_close(losses.kl_k3(logp, ref), t(0.0, 1.0 - math.log(2.0)))


def test_logprobs_and_entropy_match_full_softmax_in_chunks():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    h = torch.randn(10, 8, requires_grad=True)
    tg = torch.randint(0, 11, (10,))
    lp, ent = losses.logprobs_and_entropy(h, head, tg, temperature=0.7, chunk=3)
    logits = head(h) / 0.7
    ref_lp = torch.log_softmax(logits, -1).gather(-1, tg[:, None]).squeeze(-1)
    p = torch.softmax(logits, -1)
    ref_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    g1 = torch.autograd.grad((lp.sum() + ent.sum()), h)[0]
    g2 = torch.autograd.grad((ref_lp.sum() + ref_ent.sum()), h)[0]
    torch.testing.assert_close(g1, g2)
