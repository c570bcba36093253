"""``[learner.train]`` and ``[learner.sft]``: what one learner stage optimizes and how (the optimizer, its schedule,
the objective, the compute layout). Read by :class:`pipeline.training.learner.Learner`; the learner actor's own
section, with the steps and checkpoints, is ``actors.learner.LearnerSettings``."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pipeline.core.config import NonNegFloat, NonNegInt, PosFloat, PosInt
from pipeline.messages import RolloutStatus
from pipeline.training import advantages as adv


class StageSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # optimizer and schedule
    lr: PosFloat = 1e-6
    weight_decay: NonNegFloat = 0.0
    betas: tuple[Annotated[float, msgspec.Meta(ge=0, lt=1)], Annotated[float, msgspec.Meta(ge=0, lt=1)]] = (0.9, 0.999)
    adam_eps: PosFloat = 1e-8
    max_grad_norm: PosFloat = 1.0
    # updates with a non-finite gradient in a row (each skipped, the policy left as it was) that stop the run
    max_nonfinite_updates: PosInt = 3
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0  # optimizer steps of linear warm-up
    # Optimizer steps the linear/cosine decay spans. 0 in an experiment: [run].steps x epochs x minibatches (the
    # learner actor fills it in); the Learner itself needs it > 0 for those schedules.
    total_steps: NonNegInt = 0
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    # objective
    advantage: Literal["grpo", "ppo"] = "grpo"
    grpo_eps: PosFloat = 1e-6
    grpo_scale_by_std: bool = True
    train_statuses: list[RolloutStatus] = msgspec.field(default_factory=lambda: list(adv.DEFAULT_TRAIN_STATUSES))
    clip_low: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2
    clip_high: NonNegFloat = 0.28
    tis_cap: PosFloat = 2.0  # c_bar of token-level truncated importance sampling
    kl_coef: NonNegFloat = 0.0  # k3 KL to the initial policy; a frozen copy is kept only when > 0
    entropy_coef: float = 0.0  # a bonus; negative penalizes entropy
    value_coef: NonNegFloat = 0.5  # PPO only
    value_clip: PosFloat | None = 0.2
    value_warmup_steps: NonNegInt = 0  # PPO: first train_steps fit only the value head; the policy does not move
    value_trunk_grad: bool = False  # let the value loss reach the shared transformer (off: head only)
    epochs: PosInt = 1
    minibatches: PosInt = 1
    # token_mean: every trainable token weighs the same, so long rollouts weigh more. seq_mean_token_mean: every
    # rollout weighs the same; with many long failing samples (a small policy's garbage runs to max_new_tokens)
    # token_mean tilts each step towards pushing logits down, which lifts every other token and can end in a
    # uniform policy — the per-rollout mean keeps a group's advantages summing to zero.
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    # compute
    micro_batch_tokens: PosInt = 16384
    logits_chunk: PosInt = 4096  # rows of (rows x vocab) logits materialized at once
    # auto: flex on CUDA, chunked otherwise. flex runs forward-only on CPU (inductor; torch has no CPU backward);
    # chunked runs attention_chunk queries at a time (memory linear in tokens); dense builds an N x N mask;
    # reference runs every root-to-leaf path as its own sequence and is for tests.
    attention: Literal["auto", "flex", "chunked", "dense", "reference"] = "auto"
    attention_chunk: PosInt = 1024
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA, no otherwise
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False
    seed: int = 0
    initial_version: NonNegInt = 0
