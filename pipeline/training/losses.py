"""Per-token loss terms (docs/learner.md, "One RL step"). Every function returns one value per token; the learner
sums them and divides by the number of trainable tokens in the batch, so micro-batches add up to the token mean
exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PolicyTerms(NamedTuple):
    loss: torch.Tensor  # per-token clipped surrogate, TIS-weighted
    ratio: torch.Tensor  # pi_theta / pi_old
    clipped: torch.Tensor  # bool: the clipped branch was the active (smaller) one
    tis: torch.Tensor  # the detached importance weight actually used


def tis_weight(logp_old: torch.Tensor, logp_rollout: torch.Tensor, c_bar: float) -> torch.Tensor:
    """Token-level truncated importance sampling: min(pi_old / pi_rollout, c_bar), detached.

    Corrects for the rollout engine's numerics (and stale versions) differing from the trainer's.
    """
    return torch.exp(logp_old.detach() - logp_rollout).clamp(max=c_bar).detach()


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    tis: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> PolicyTerms:
    """-tis * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) with r = exp(logp - logp_old)."""
    ratio = torch.exp(logp - logp_old.detach())
    unclipped = ratio * advantages
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    obj = torch.minimum(unclipped, clipped_obj)
    return PolicyTerms(
        loss=-tis * obj, ratio=ratio.detach(), clipped=(clipped_obj < unclipped).detach(), tis=tis
    )


def value_loss(
    values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor, clip: float | None = 0.2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, +-clip).

    Returns the per-token loss and a bool mask of tokens where the clipped branch won. ``clip=None`` disables
    clipping.
    """
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    v_clip = values_old.detach() + (values - values_old.detach()).clamp(-clip, clip)
    err_clip = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(err, err_clip), (err_clip > err).detach()


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) from samples of pi_theta: e^(ref - p) - (ref - p) - 1."""
    d = logp_ref.detach() - logp
    return torch.exp(d) - d - 1.0


def logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk: int = 4096,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(lm_head(h) / T)[target] and the entropy, for rows of hidden states, in row chunks.

    ``temperature`` is one value, or one per row (rows of groups sampled at different temperatures).

    The full (rows, vocab) logits of a long tree would not fit (28k rows x 152k vocab is 17 GB in float32), so each
    chunk is recomputed in the backward pass (activation checkpointing) instead of being kept.
    """
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        temp = temperature[start : start + chunk, None] if isinstance(temperature, torch.Tensor) else temperature
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(
                _chunk_logprobs, h, t, lm_head, temp, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs(h, t, lm_head, temp, with_entropy)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)


def _chunk_logprobs(
    h: torch.Tensor, t: torch.Tensor, lm_head: torch.nn.Module, temperature: float | torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(h).float()
    if isinstance(temperature, torch.Tensor) or temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, t[:, None]).squeeze(-1) - logz
    if not with_entropy:
        return lp, torch.zeros_like(lp)
    probs = torch.softmax(logits, dim=-1)
    ent = logz - (probs * logits).sum(-1)
    return lp, ent
