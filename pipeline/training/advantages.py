"""Advantages over a packed tree (docs/learner.md, "One RL step").

Both estimators work per rollout *slot* (``PackedTree.rollout``), never per path or per segment: every segment of
a rollout (a compaction restart) and every kept branch shares that rollout's number, and the group statistics
have exactly one entry per rollout. Shared-prefix tokens (slot -1) are never trainable and take no advantage.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pipeline.messages import RolloutSummary

# Running out of time is the policy's doing and is scored; a crash of the sandbox, harness or verifier says nothing
# about the policy, so such rollouts are left out of the group statistics and out of the loss (configurable).
DEFAULT_TRAIN_STATUSES: tuple[str, ...] = ("ok", "timeout")


def rollout_valid(
    rollouts: list[RolloutSummary], statuses: Iterable[str] = DEFAULT_TRAIN_STATUSES
) -> np.ndarray:
    allowed = set(statuses)
    return np.array([r.status in allowed for r in rollouts], dtype=bool)


def reward_spread(rewards: np.ndarray, valid: np.ndarray) -> bool:
    """Whether the valid rollouts' rewards differ. A group without a spread (fewer than two valid rollouts, or all
    scoring alike) has every GRPO advantage 0: it adds nothing to the policy gradient."""
    r = np.asarray(rewards, dtype=np.float64)[np.asarray(valid, dtype=bool)]
    return r.size >= 2 and bool(np.ptp(r) > 0)


def grpo_advantages(
    rewards: np.ndarray, valid: np.ndarray, eps: float = 1e-6, scale_by_std: bool = True
) -> np.ndarray:
    """One advantage per rollout: (R_i - mean) / (std + eps) over the valid rollouts of the group.

    ``std`` is the sample standard deviation (ddof=1, as in DeepSeekMath's GRPO). Invalid rollouts get 0, and so
    does everyone when fewer than two rollouts are valid (there is nothing to compare against).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    valid = np.asarray(valid, dtype=bool)
    out = np.zeros(rewards.shape, dtype=np.float64)
    if not reward_spread(rewards, valid):  # exactly 0, whatever rounding the mean of equal rewards has
        return out
    r = rewards[valid]
    centered = r - r.mean()
    out[valid] = centered / (r.std(ddof=1) + eps) if scale_by_std else centered
    return out


def per_token(slot_values: np.ndarray, rollout: np.ndarray) -> np.ndarray:
    """Spread one value per rollout slot onto the tokens of that slot; shared tokens (slot -1) get 0."""
    slot_values = np.asarray(slot_values)
    if rollout.size and rollout.max(initial=-1) >= slot_values.shape[0]:
        bad = int(np.flatnonzero(rollout >= slot_values.shape[0])[0])
        raise ValueError(
            f"PackedTree.rollout[{bad}] = {int(rollout[bad])} but the group has {slot_values.shape[0]} rollouts; "
            "TreeGroup.rollouts must list every rollout the tree refers to"
        )
    return np.where(rollout >= 0, slot_values[np.maximum(rollout, 0)], 0).astype(slot_values.dtype)


def ppo_advantages(returns: torch.Tensor, values_old: torch.Tensor) -> torch.Tensor:
    """gamma = lambda = 1 with reward only at the end: A_t = R - V(s_t), each path backed up on its own.

    ``returns`` is the rollout's reward per token, ``values_old`` the critic's value of the state that predicts
    the token (the hidden state at ``pred[t]``), taken before the update and detached.
    """
    return returns - values_old.detach()
