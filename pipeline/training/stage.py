"""``[learner.train]`` and ``[learner.sft]``: what one learner stage optimizes and how, nested by concern: the
optimizer, its schedule, the objective, the compute layout (``[learner.train.optimizer]``, ``.schedule``,
``.objective``, ``.compute``). Read by :class:`pipeline.training.learner.Learner`; the learner actor's own section,
with the steps and checkpoints, is ``actors.learner.LearnerSettings``."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pipeline.core.config import NonNegFloat, NonNegInt, PosFloat, PosInt
from pipeline.messages import RolloutStatus
from pipeline.training import advantages as adv

Beta = Annotated[float, msgspec.Meta(ge=0, lt=1)]


class OptimizerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """AdamW and the update's guards."""

    lr: PosFloat = 1e-6  # the peak learning rate (the schedule scales it)
    weight_decay: NonNegFloat = 0.0  # AdamW's decoupled weight decay
    betas: tuple[Beta, Beta] = (0.9, 0.999)  # AdamW's moment decays
    adam_eps: PosFloat = 1e-8  # larger damps the first updates of weights whose gradients are tiny
    max_grad_norm: PosFloat = 1.0  # gradients are clipped to this global norm
    # updates with a non-finite gradient in a row (each skipped, the policy left as it was) that stop the run
    max_nonfinite_updates: PosInt = 3


class ScheduleSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the learning rate moves over the stage's optimizer steps."""

    kind: Literal["constant", "linear", "cosine"] = "constant"  # the shape after the warm-up
    warmup_steps: NonNegInt = 0  # optimizer steps of linear warm-up
    # Optimizer steps the linear/cosine decay spans. 0 in an experiment: [run].steps x epochs x minibatches (the
    # learner actor fills it in); the Learner itself needs it > 0 for those schedules.
    total_steps: NonNegInt = 0
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0  # the decay's floor, a fraction of lr


class ObjectiveSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The loss: advantages, the clipped and importance-corrected policy term, the KL and entropy terms, PPO's value
    loss, and how tokens are averaged."""

    advantage: Literal["grpo", "ppo"] = "grpo"  # grpo: group-relative rewards; ppo: GAE from a value head
    grpo_eps: PosFloat = 1e-6  # added to a group's reward std before dividing by it
    grpo_scale_by_std: bool = True  # off: advantages are reward - group mean (Dr. GRPO)
    # the rollout statuses whose rewards count (a timeout's workspace is still scored); others are left out, counted
    train_statuses: list[RolloutStatus] = msgspec.field(default_factory=lambda: list(adv.DEFAULT_TRAIN_STATUSES))
    clip_low: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2  # the ratio's lower clip, 1 - clip_low
    clip_high: NonNegFloat = 0.28  # the ratio's upper clip, 1 + clip_high (DAPO's clip-higher)
    tis_cap: PosFloat = 2.0  # c_bar of token-level truncated importance sampling
    kl_coef: NonNegFloat = 0.0  # k3 KL to the initial policy; a frozen copy is kept only when > 0
    entropy_coef: float = 0.0  # a bonus; negative penalizes entropy
    value_coef: NonNegFloat = 0.5  # PPO only
    value_clip: PosFloat | None = 0.2  # PPO: the value prediction's clip around the old one (none: unclipped)
    value_warmup_steps: NonNegInt = 0  # PPO: first train_steps fit only the value head; the policy does not move
    value_trunk_grad: bool = False  # let the value loss reach the shared transformer (off: head only)
    # token_mean: every trainable token weighs the same, so long rollouts weigh more. seq_mean_token_mean: every
    # rollout weighs the same; with many long failing samples (a small policy's garbage runs to max_new_tokens)
    # token_mean tilts each step towards pushing logits down, which lifts every other token and can end in a
    # uniform policy — the per-rollout mean keeps a group's advantages summing to zero.
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"


class ComputeSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a step is laid out on the hardware; none of it changes the loss beyond floating-point rounding."""

    micro_batch_tokens: PosInt = 16384  # packed tokens per forward/backward (gradients accumulate across them)
    logits_chunk: PosInt = 4096  # rows of (rows x vocab) logits materialized at once
    # auto: flex on CUDA, chunked otherwise. flex runs forward-only on CPU (inductor; torch has no CPU backward);
    # chunked runs attention_chunk queries at a time (memory linear in tokens); dense builds an N x N mask;
    # reference runs every root-to-leaf path as its own sequence and is for tests.
    attention: Literal["auto", "flex", "chunked", "dense", "reference"] = "auto"
    attention_chunk: PosInt = 1024  # queries per block of chunked attention
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA, no otherwise
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # the trained weights' dtype
    gradient_checkpointing: bool = False  # recompute each layer's activations in the backward: less memory


class StageSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    optimizer: OptimizerSettings = msgspec.field(default_factory=OptimizerSettings)  # [learner.X.optimizer]
    schedule: ScheduleSettings = msgspec.field(default_factory=ScheduleSettings)  # [learner.X.schedule]
    objective: ObjectiveSettings = msgspec.field(default_factory=ObjectiveSettings)  # [learner.X.objective]
    compute: ComputeSettings = msgspec.field(default_factory=ComputeSettings)  # [learner.X.compute]
    epochs: PosInt = 1  # passes over a step's batch
    minibatches: PosInt = 1  # optimizer steps per pass
    seed: int = 0  # torch, numpy and random, seeded when the stage starts (and the SFT plan's order); [experiment].seed by default
    initial_version: NonNegInt = 0  # the policy version of the weights the stage starts from


GROUPS = {"optimizer": OptimizerSettings, "schedule": ScheduleSettings, "objective": ObjectiveSettings,
          "compute": ComputeSettings}


def stage_settings(**flat: object) -> StageSettings:
    """A StageSettings from flat field names (``lr=1e-3, attention="dense", epochs=2``; ``schedule`` names the
    schedule's kind): for code and tests that set a few fields of several groups. Experiment files nest them."""
    nested: dict[str, dict[str, object]] = {g: {} for g in GROUPS}
    top: dict[str, object] = {}
    for key, value in flat.items():
        group = "schedule" if key == "schedule" else next(
            (g for g, t in GROUPS.items() if key in t.__struct_fields__), None)
        if group is None:
            top[key] = value
        else:
            nested[group]["kind" if key == "schedule" else key] = value
    return msgspec.convert({**top, **nested}, StageSettings)
