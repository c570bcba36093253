"""The learner's compute: one optimization step over a batch of TreeGroups, SFT, weight saving, checkpoints. What
it optimizes is configured by :class:`pipeline.training.stage.StageSettings`; the module it trains is
:class:`pipeline.training.policy.PolicyValue`.

Synchronous by design — the learner actor runs these methods in a worker thread so the event loop stays free.
Accelerate owns device placement, mixed precision and (under ``accelerate launch``) the gradient all-reduce.

One ``train_step``:
1. unpack and validate each group's PackedTree; per rollout slot, the GRPO advantage (or, for PPO, the reward as
   the return); rollouts whose status is not in ``train_statuses`` are left out of statistics and loss;
2. split the groups into ``minibatches``; inside each, pack whole trees end to end into micro-batches of at most
   ``micro_batch_tokens`` tokens (a larger tree goes alone);
3. log pi_old: with a single update per batch (``epochs == minibatches == 1``) pi_old *is* the current policy, so
   its log-probs are the detached values of the same forward pass; otherwise a no-grad pass computes them first;
4. per trainable token: TIS weight min(pi_old / pi_rollout, tis_cap), clipped surrogate with asymmetric
   clipping, optional k3 KL to the initial policy and entropy bonus, PPO value loss; aggregated by ``loss_agg``:
   ``token_mean`` divides the sum by the number of trainable tokens of the minibatch (shared prefixes counted once
   by construction); ``seq_mean_token_mean`` averages each rollout's tokens first, then the rollouts, so every
   rollout weighs the same whatever its length (GRPO's original form; SFT is always a token mean);
5. clip the gradient norm, AdamW step, LR schedule step.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch import nn

from pipeline.core.logs import get_logger
from pipeline.messages import TreeGroup, ids
from pipeline.training import advantages as adv
from pipeline.training import batches, losses
from pipeline.training import tree_attention as ta
from pipeline.training.batches import MicroBatch
from pipeline.training.policy import PolicyValue, load_policy
from pipeline.training.stage import StageSettings


def _log() -> Any:
    # Bound per call: a logger bound at import would keep structlog's defaults from before configure() ran.
    return get_logger(actor="learner")


STATE_FILE = "learner_state.json"
REFERENCE_FILE = "reference.safetensors"
WEIGHTS_INFO_FILE = "bridle_weights.json"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)


class Learner:
    """Owns the model, optimizer and schedule. See the module docstring for what one step does."""

    def __init__(
        self,
        model: str | os.PathLike[str] | nn.Module,
        config: StageSettings | None = None,
        accelerator: Accelerator | None = None,
        model_path: str | os.PathLike[str] | None = None,  # with a module: the folder it came from (tokenizer files)
    ):
        self.config = cfg = config or StageSettings()
        if cfg.schedule.kind != "constant" and cfg.schedule.total_steps <= 0:
            raise ValueError(f"StageSettings.schedule.total_steps must be > 0 for schedule.kind={cfg.schedule.kind!r}")
        if accelerator is None:
            mp = cfg.compute.mixed_precision
            if mp == "auto":
                mp = "bf16" if torch.cuda.is_available() else "no"
            # Unused parameters (the value head under GRPO) would stall DDP's all-reduce; this only matters (and
            # only costs) under several processes.
            accelerator = Accelerator(mixed_precision=mp, kwargs_handlers=[
                DistributedDataParallelKwargs(find_unused_parameters=True)])
        self.accelerator = acc = accelerator
        set_seed(cfg.seed)
        self.attention = cfg.compute.attention
        if self.attention == "auto":
            self.attention = "flex" if acc.device.type == "cuda" else "chunked"
        impl = {"flex": "flex_attention", "chunked": ta.register_chunked()}.get(self.attention, "sdpa")
        dtype = torch.float32 if cfg.compute.param_dtype == "float32" else torch.bfloat16

        self.model_path: Path | None = Path(model_path) if model_path is not None else None
        if isinstance(model, nn.Module):
            policy = model
        else:
            self.model_path = Path(model)
            policy = load_policy(self.model_path, cfg)
        policy.to(dtype)
        policy.set_attn_implementation(impl)
        self.window = ta.sliding_window(policy.config)  # sliding-window layers: masked by the tree attention too
        if cfg.compute.gradient_checkpointing:
            _checkpointing(policy, True)
        policy.train()

        self.reference: nn.Module | None = None
        self._reference_name = ""  # the reference's folder, once a checkpoint named it (resume)
        if cfg.objective.kl_coef > 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False).to(acc.device)

        net = PolicyValue(policy)
        optimizer = torch.optim.AdamW(
            net.parameters(), lr=cfg.optimizer.lr, betas=cfg.optimizer.betas, eps=cfg.optimizer.adam_eps, weight_decay=cfg.optimizer.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        self.net, self.optimizer = acc.prepare(net, optimizer)
        # Not prepared: an AcceleratedScheduler steps once per process; ours counts optimizer steps.
        acc.register_for_checkpointing(self.scheduler)
        self.step = 0
        self.version = cfg.initial_version
        self._told_oversized = False
        self.skipped_updates = 0  # optimizer updates not applied: their gradient was not finite
        self.nonfinite_in_a_row = 0

    # ----------------------------------------------------------------------------------------- public API
    def train_step(self, groups: list[TreeGroup]) -> dict[str, float]:
        """One RL step over a batch of groups; returns metrics. Bumps ``version`` unless in value pre-training.

        Under several processes every rank is given the same batch and trains its share (:meth:`_share`); the
        metrics returned are the whole batch's, on every rank."""
        cfg = self.config
        t0 = time.perf_counter()
        if not groups:
            raise ValueError("Learner.train_step needs at least one TreeGroup")
        value_phase = cfg.objective.advantage == "ppo" and self.step < cfg.objective.value_warmup_steps
        everything = np.arange(len(groups))
        splits = self._share(groups, [list(s) for s in np.array_split(everything, min(cfg.minibatches, len(groups)))])
        trees = {i: batches.prepare(groups[i], i, self.config) for s in splits for i in s}
        micros = [batches.micro_batches([trees[i] for i in s], cfg.compute.micro_batch_tokens) for s in splits]
        micros, skipped = self._even(micros)
        single_update = cfg.epochs * len(splits) == 1
        for mbs in micros:
            self._fill_old(mbs, need_logp=not single_update)
        sums: dict[str, float] = {"tree_targets": float(sum(len(t.targets) for t in trees.values())),
                                  "reward_sum": float(sum(t.reward_mean for t in trees.values()))}
        grad_norms = []
        for _ in range(cfg.epochs):
            for mbs in micros:
                _merge(sums, self._accumulate(mbs, value_phase=value_phase))
                grad_norms.append(self._optimizer_step())
        sums["tokens"] = sums.get("tokens", 0.0) + skipped * cfg.epochs
        sums = self._global(sums)
        self.step += 1
        if not value_phase:
            self.version += 1
        metrics = self._finish_metrics(sums, grad_norms, t0)
        metrics["trainable_tokens"] = sums["tree_targets"]
        metrics["reward_mean"] = sums["reward_sum"] / len(groups)
        metrics["value_phase"] = float(value_phase)
        if self.accelerator.is_main_process:  # the metrics are global: one line, not one per rank
            _log().info("train_step", **{k: round(v, 6) for k, v in metrics.items()})
        return metrics

    def sft_step(self, groups: list[TreeGroup]) -> dict[str, float]:
        """Cold-start SFT: token-mean negative log-likelihood of every trainable token; no advantages."""
        if not groups:
            raise ValueError("Learner.sft_step needs at least one TreeGroup")
        t0 = time.perf_counter()
        (share,) = self._share(groups, [list(range(len(groups)))])
        trees = [batches.prepare(groups[i], i, self.config, sft=True) for i in share]
        (mbs,), skipped = self._even([batches.micro_batches(trees, self.config.compute.micro_batch_tokens)])
        sums = self._accumulate(mbs, sft=True)
        sums["tokens"] += skipped
        grad_norm = self._optimizer_step()
        sums = self._global(sums)
        self.step += 1
        self.version += 1
        metrics = self._finish_metrics(sums, [grad_norm], t0)
        if self.accelerator.is_main_process:
            _log().info("sft_step", **{k: round(v, 6) for k, v in metrics.items()})
        return metrics

    def loss_and_grads(self, groups: list[TreeGroup], sft: bool = False) -> dict[str, float]:
        """Forward and backward of one single-update step without the optimizer step (gradients stay in .grad)."""
        self.optimizer.zero_grad(set_to_none=True)
        trees = [batches.prepare(g, i, self.config, sft=sft) for i, g in enumerate(groups)]
        mbs = batches.micro_batches(trees, self.config.compute.micro_batch_tokens)
        if not sft:
            self._fill_old(mbs, need_logp=False)
        value_phase = self.config.objective.advantage == "ppo" and self.step < self.config.objective.value_warmup_steps
        return self._accumulate(mbs, value_phase=value_phase, sft=sft)

    def save_weights(self, directory: str | os.PathLike[str], version: int | None = None) -> Path:
        """Write the policy as a Hugging Face folder (config.json + model.safetensors), loadable with
        ``from_pretrained`` and by the serving engine. Written to a temporary sibling and renamed into place, so a
        reader never sees a half-written folder. Tokenizer files are copied along when the model came from a path.
        """
        acc = self.accelerator
        version = self.version if version is None else version
        out = Path(directory)
        state = acc.get_state_dict(self.net)  # gathers shards under FSDP/DeepSpeed
        if acc.is_main_process:
            policy_state = {k[len("policy.") :]: v for k, v in state.items() if k.startswith("policy.")}
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self._policy().save_pretrained(tmp, state_dict=policy_state, safe_serialization=True)
            if self.model_path is not None:
                for name in _TOKENIZER_FILES:
                    if (self.model_path / name).is_file():
                        shutil.copy2(self.model_path / name, tmp / name)
            (tmp / WEIGHTS_INFO_FILE).write_text(json.dumps({"version": version, "step": self.step}))
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            _log().info("weights_saved", path=str(out), version=version, step=self.step)
        acc.wait_for_everyone()
        return out

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights by their Hugging Face names, a tensor shared by several names (tied embeddings) once
        under its first, as :meth:`save_weights` writes them: what weight sync without the disk broadcasts."""
        state = self.accelerator.get_state_dict(self.net)
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in state.items():
            if name.startswith("policy.") and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out[name[len("policy.") :]] = t
        return out

    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
        """Model (with value head), optimizer, scheduler, RNG states, step, version, the KL reference policy and
        ``extra`` — an opaque JSON-able dict for the caller (the event-log offset to resume reading from).

        The reference (the policy the RL stage started from: after a cold start, the SFT weights, which are long
        pruned from the weights folder by then) is written once per RL stage, beside the checkpoints, as
        ``reference-v<first version>/``, and each checkpoint names it."""
        out = Path(directory)
        # Written under a temporary name and renamed whole: a kill -9 mid-save leaves a ``.tmp`` folder that resume
        # ignores, never a checkpoint folder with a half-written file in it.
        tmp = out.with_name(out.name + ".tmp")
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        # every rank's part (its RNG state) is in the folder before rank 0 marks it complete and renames it: a rank
        # still writing would put its file into a new .tmp folder, and a kill then would leave a checkpoint without it
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            state = {"step": self.step, "version": self.version, "extra": extra or {}}
            if self.reference is not None:
                state["reference"] = self._save_reference(out.parent).name
            (tmp / STATE_FILE).write_text(json.dumps(state))
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        self.accelerator.wait_for_everyone()
        _log().info("checkpoint_saved", path=str(out), step=self.step, version=self.version)
        return out

    def _save_reference(self, parent: Path) -> Path:
        from safetensors.torch import save_model  # handles tied embeddings (shared tensors)

        assert self.reference is not None
        dest = parent / (self._reference_name or f"reference-v{self.config.initial_version:05d}")
        if not (dest / REFERENCE_FILE).is_file():
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_model(self.reference, str(tmp / REFERENCE_FILE))
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        return dest

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore everything :meth:`save_checkpoint` wrote; returns its ``extra``."""
        src = Path(directory)
        if not (src / STATE_FILE).is_file():
            raise FileNotFoundError(f"{src / STATE_FILE} not found: {src} is not a learner checkpoint")
        self.accelerator.load_state(str(src))
        state = json.loads((src / STATE_FILE).read_text())
        self.step, self.version = int(state["step"]), int(state["version"])
        if self.reference is not None:
            if "reference" not in state:
                raise FileNotFoundError(
                    f"{src / STATE_FILE} names no KL reference policy (a checkpoint written before references were "
                    "saved); the KL term would pull towards the wrong policy. Resume with "
                    "--set learner.train.objective.kl_coef=0, or start a new run")
            from safetensors.torch import load_model

            dev = self.accelerator.device  # "cpu:0" on a gloo rank, which safetensors does not take
            load_model(self.reference, str(src.parent / state["reference"] / REFERENCE_FILE),
                       device="cpu" if dev.type == "cpu" else str(dev))
            self._reference_name = state["reference"]  # later checkpoints name it again, not a copy of it
        _log().info("checkpoint_loaded", path=str(src), step=self.step, version=self.version,
                    reference=state.get("reference", ""))
        return dict(state["extra"])

    # ------------------------------------------------------------------------------------------ internals
    def _share(self, groups: list[TreeGroup], splits: list[list[int]]) -> list[list[int]]:
        """This rank's groups of each minibatch: whole trees, balanced by tokens (:func:`batches.shares`). The
        minibatches themselves are cut from the whole batch first, so they are the same whatever the ranks."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return splits
        out = []
        for s in splits:
            mine = batches.shares([len(ids(groups[i].packed.tokens)) for i in s], acc.num_processes)
            out.append([s[j] for j in mine[acc.process_index]])
        return out

    def _even(self, micros: list[list[MicroBatch]]) -> tuple[list[list[MicroBatch]], int]:
        """Under several processes: every rank gets as many micro-batches per update as the busiest (padded with
        :func:`batches.padding`), so the collectives of the forward and backward calls pair up. A micro-batch
        without a trainable token is left out (its loss has no graph to run a backward through; it adds nothing);
        returns the micro-batches and the tokens left out, which the metrics still count."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return micros, 0
        kept = [[mb for mb in mbs if len(mb.targets)] for mbs in micros]
        skipped = sum(len(mb.forest) for mbs in micros for mb in mbs if not len(mb.targets))
        counts = torch.tensor([len(mbs) for mbs in kept], device=acc.device)
        most = acc.gather(counts).reshape(acc.num_processes, -1).amax(0).tolist()
        return [mbs + [batches.padding() for _ in range(int(m) - len(mbs))] for mbs, m in zip(kept, most,
                                                                                              strict=True)], skipped

    def _global(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums of all ranks, merged (every rank returns the same metrics)."""
        if self.accelerator.num_processes == 1:
            return sums
        from accelerate.utils import gather_object

        merged: dict[str, float] = {}
        for part in gather_object([sums]):
            _merge(merged, part)
        return merged

    def _policy(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.net).policy

    def _lr_factor(self, opt_step: int) -> float:
        cfg = self.config
        if opt_step < cfg.schedule.warmup_steps:
            return (opt_step + 1) / cfg.schedule.warmup_steps
        if cfg.schedule.kind == "constant":
            return 1.0
        span = max(1, cfg.schedule.total_steps - cfg.schedule.warmup_steps)
        frac = min(1.0, (opt_step - cfg.schedule.warmup_steps) / span)
        decay = 1.0 - frac if cfg.schedule.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return cfg.schedule.min_lr_ratio + (1.0 - cfg.schedule.min_lr_ratio) * decay

    def _forward(
        self, mb: MicroBatch, values: Literal["none", "detached", "attached"]
    ) -> dict[str, torch.Tensor]:
        cfg = self.config
        return self.net(
            **batches.model_inputs(mb.forest, mb.targets, self.attention, self.accelerator.device,
                                   cfg.compute.attention_chunk, self.window),
            temperature=self._temperature(mb),
            logits_chunk=cfg.compute.logits_chunk,
            values=values,
        )

    @contextlib.contextmanager
    def _checkpointing_if_oversized(self, mb: MicroBatch) -> Iterator[None]:
        """Activation checkpointing for the forward and backward of a micro-batch over ``micro_batch_tokens``: a root
        subtree larger than the budget goes alone (attention cannot be cut inside a tree), and its activations would
        not fit where the budget's do (on an H200 a 59k-token tree of Qwen3-0.6B needs more than its 141 GB without
        checkpointing, benchmarks/results/2026-12-04-gpu-h200.md). Only layer inputs are kept; each layer is
        recomputed in the backward pass. Nothing changes numerically."""
        cfg = self.config
        if cfg.compute.gradient_checkpointing or len(mb.forest) <= cfg.compute.micro_batch_tokens:
            yield
            return
        if not self._told_oversized:  # once per learner, rank 0 only: a property of the data, not an event
            self._told_oversized = True
            if self.accelerator.is_main_process:
                _log().info("oversized_micro_batch", tokens=len(mb.forest),
                            micro_batch_tokens=cfg.compute.micro_batch_tokens, activation_checkpointing=True)
        policy = self._policy()
        _checkpointing(policy, True)
        try:
            yield
        finally:
            _checkpointing(policy, False)
            # enabling hooks the input embeddings (their output must require grad) and disabling leaves the hook;
            # one more per oversized micro-batch would pile up over a run
            policy.disable_input_require_grads()

    def _temperature(self, mb: MicroBatch) -> float | torch.Tensor:
        """One value when the whole micro-batch shares it (the usual case), else one per target row."""
        if mb.temperature.size and (mb.temperature == mb.temperature[0]).all():
            return float(mb.temperature[0])
        return torch.as_tensor(mb.temperature, device=self.accelerator.device)

    @torch.no_grad()
    def _fill_old(self, mbs: list[MicroBatch], need_logp: bool) -> None:
        """pi_old log-probs and values (when more than one update uses this batch) and pi_ref log-probs."""
        ppo = self.config.objective.advantage == "ppo"
        for mb in mbs:
            mb.old = {}
            if need_logp:
                out = self._forward(mb, values="detached" if ppo else "none")
                mb.old["logp"] = out["logp"].float()
                if ppo:
                    mb.old["value"] = out["value"].float()
            if self.reference is not None:
                inputs = batches.model_inputs(mb.forest, mb.targets, self.attention, self.accelerator.device,
                                              self.config.compute.attention_chunk, self.window)
                with self.accelerator.autocast():
                    h = self.reference.base_model(
                        input_ids=inputs["input_ids"],
                        position_ids=inputs["position_ids"],
                        attention_mask=inputs["attention_mask"],
                        use_cache=False,
                    ).last_hidden_state
                    h = h.reshape(-1, h.shape[-1])[inputs["rows"]]
                    lp, _ = losses.logprobs_and_entropy(
                        h,
                        self.reference.get_output_embeddings(),
                        inputs["targets"],
                        self._temperature(mb),
                        self.config.compute.logits_chunk,
                        with_entropy=False,
                    )
                mb.old["ref"] = lp.float()

    def _accumulate(
        self, mbs: list[MicroBatch], value_phase: bool = False, sft: bool = False
    ) -> dict[str, float]:
        """Forward + backward over the micro-batches of one update; the loss is a weighted mean over all of them
        (weights from ``loss_agg``: 1 per token for a token mean)."""
        cfg, acc = self.config, self.accelerator
        ppo = cfg.objective.advantage == "ppo" and not sft
        dev = acc.device
        local = sum(len(mb.targets) for mb in mbs if not mb.pad)
        local_weight = float(sum(mb.weight.sum(dtype=np.float64) for mb in mbs))
        # DDP averages gradients over processes; scaling by processes / global weight keeps a global mean.
        total = acc.reduce(torch.tensor(local_weight, device=dev), reduction="sum").item()
        scale = acc.num_processes / max(total, 1.0)
        value_mode = (
            "none" if not ppo else ("attached" if cfg.objective.value_trunk_grad and not value_phase else "detached")
        )
        sums: dict[str, float] = {"tokens": 0.0, "trainable_tokens": float(local), "loss": 0.0}
        for k, mb in enumerate(mbs):
            sync = contextlib.nullcontext() if k == len(mbs) - 1 else acc.no_sync(self.net)
            with sync, self._checkpointing_if_oversized(mb):
                out = self._forward(mb, values=value_mode)
                logp = out["logp"]
                parts = self._loss_parts(mb, out, logp, ppo=ppo, value_phase=value_phase, sft=sft)
                loss = parts.pop("loss_sum") * (0.0 if mb.pad else scale)
                if loss.requires_grad:  # false only for a micro-batch without a single trainable token
                    acc.backward(loss)
            if mb.pad:
                continue
            sums["tokens"] += len(mb.forest)
            # this rank's part of the update's global weighted mean: the parts of all ranks add up to it
            sums["loss"] += float(loss.detach()) / scale / max(total, 1e-12)
            _merge(sums, parts)
        return sums

    def _loss_parts(
        self,
        mb: MicroBatch,
        out: dict[str, torch.Tensor],
        logp: torch.Tensor,
        ppo: bool,
        value_phase: bool,
        sft: bool,
    ) -> dict[str, Any]:
        """The summed loss of one micro-batch and metric sums; see the module docstring for the terms."""
        cfg = self.config
        dev = logp.device
        logp = logp.float()
        ent = out["entropy"].float()
        parts: dict[str, Any] = {"entropy_sum": ent.detach().sum().item()}
        if sft:
            nll = -logp
            parts["loss_sum"] = nll.sum()
            parts["sft_nll_sum"] = nll.detach().sum().item()
            return parts
        score = torch.as_tensor(mb.score, device=dev)
        weight = torch.as_tensor(mb.weight, device=dev)
        logp_old = mb.old["logp"] if "logp" in mb.old else logp.detach()
        total = torch.zeros((), device=dev)
        if ppo:
            values = out["value"].float()
            values_old = mb.old["value"] if "value" in mb.old else values.detach()
            vloss, vclipped = losses.value_loss(values, values_old, score, cfg.objective.value_clip)
            total = total + cfg.objective.value_coef * (weight * vloss).sum()
            parts["value_loss_sum"] = vloss.detach().sum().item()
            parts["value_clip_sum"] = vclipped.sum().item()
            parts["value_sum"] = values_old.sum().item()
        if not value_phase:
            advantage = adv.ppo_advantages(score, values_old) if ppo else score
            logp_rollout = torch.as_tensor(mb.logp_rollout, device=dev)
            tis = losses.tis_weight(logp_old, logp_rollout, cfg.objective.tis_cap)
            pt = losses.policy_loss(logp, logp_old, advantage, tis, cfg.objective.clip_low, cfg.objective.clip_high)
            per_token = pt.loss
            raw_ratio = torch.exp(logp_old - logp_rollout)
            parts["pg_loss_sum"] = pt.loss.detach().sum().item()
            parts["clip_sum"] = pt.clipped.sum().item()
            parts["is_ratio_sum"] = raw_ratio.sum().item()
            if raw_ratio.numel():
                parts["is_ratio_max"] = raw_ratio.max().item()
                parts["is_ratio_min"] = raw_ratio.min().item()
            parts["is_capped_sum"] = (raw_ratio > cfg.objective.tis_cap).sum().item()
            parts["advantage_sum"] = advantage.detach().sum().item()
            if "ref" in mb.old:
                kl = losses.kl_k3(logp, mb.old["ref"])
                per_token = per_token + cfg.objective.kl_coef * kl
                parts["kl_sum"] = kl.detach().sum().item()
            if cfg.objective.entropy_coef:
                per_token = per_token - cfg.objective.entropy_coef * ent
            total = total + (weight * per_token).sum()
        parts["loss_sum"] = total
        return parts

    def _optimizer_step(self) -> float:
        """Clip and apply the gradients; returns their norm. A non-finite norm (a NaN or infinite loss, or an
        overflow) is not applied: the policy, the optimizer's moments and the schedule stay as they were, so nothing
        non-finite reaches the engine. It is counted (``skipped_updates``), and ``max_nonfinite_updates`` of them in
        a row stop the run with :class:`NonFiniteError`. (The norm is global: under several processes every rank
        decides the same.)"""
        acc = self.accelerator
        grad_norm = float(acc.clip_grad_norm_(self.net.parameters(), self.config.optimizer.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_updates += 1
            self.nonfinite_in_a_row += 1
            _log().warning("non-finite gradient: update skipped", grad_norm=grad_norm, step=self.step,
                           in_a_row=self.nonfinite_in_a_row, skipped_total=self.skipped_updates)
            if self.nonfinite_in_a_row >= self.config.optimizer.max_nonfinite_updates:
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(
                    f"{self.nonfinite_in_a_row} updates in a row had a non-finite loss or gradient (step "
                    f"{self.step}); none was applied, so the policy is the one before them. Lower the learning "
                    "rate ([learner.train].lr, [learner.sft].lr) or max_grad_norm, or look for a setting that makes "
                    "the loss overflow")
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _finish_metrics(self, sums: dict[str, float], grad_norms: list[float], t0: float) -> dict[str, float]:
        elapsed = time.perf_counter() - t0
        n = max(sums.get("trainable_tokens", 0.0), 1.0)
        m: dict[str, float] = {
            "step": float(self.step),
            "version": float(self.version),
            "lr": float(self.scheduler.get_last_lr()[0]),
            "grad_norm": float(np.mean([g for g in grad_norms if math.isfinite(g)] or [0.0])),
            "skipped_updates": float(sum(1 for g in grad_norms if not math.isfinite(g))),
            "tokens": sums.get("tokens", 0.0),
            "trainable_tokens": sums.get("trainable_tokens", 0.0),
            "tokens_per_s": sums.get("tokens", 0.0) / elapsed if elapsed > 0 else 0.0,
            "step_s": elapsed,
            "entropy": sums.get("entropy_sum", 0.0) / n,
            "loss": sums.get("loss", 0.0) / max(len(grad_norms), 1),  # mean over the optimizer steps
        }
        for key, name in (
            ("sft_nll_sum", "sft_loss"),
            ("pg_loss_sum", "pg_loss"),
            ("value_loss_sum", "value_loss"),
            ("value_clip_sum", "value_clip_frac"),
            ("value_sum", "value_mean"),
            ("clip_sum", "clip_frac"),
            ("is_ratio_sum", "is_ratio_mean"),
            ("is_capped_sum", "is_capped_frac"),
            ("advantage_sum", "advantage_mean"),
            ("kl_sum", "kl"),
        ):
            if key in sums:
                m[name] = sums[key] / n
        for key in ("is_ratio_max", "is_ratio_min"):
            if key in sums:
                m[key] = sums[key]
        return m


class NonFiniteError(RuntimeError):
    """Too many optimizer updates in a row had a non-finite gradient (see Learner._optimizer_step)."""


def _checkpointing(policy: nn.Module, on: bool) -> None:
    """Activation checkpointing of the transformer's layers on or off (transformers >= 5.25 names it "activation
    checkpointing" and deprecates the older "gradient checkpointing" methods, which earlier 5.x releases alone have).
    Non-reentrant: it works with inputs that need no gradient and with DDP."""
    if on:
        if hasattr(policy, "activation_checkpointing_enable"):
            policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(policy, "activation_checkpointing_disable"):
        policy.activation_checkpointing_disable()
    else:
        policy.gradient_checkpointing_disable()


def _merge(sums: dict[str, float], parts: dict[str, Any]) -> None:
    """Add metric parts into running sums; ``*_max`` / ``*_min`` keep the extreme instead."""
    for name, v in parts.items():
        if name.endswith("_max"):
            sums[name] = max(sums.get(name, -math.inf), float(v))
        elif name.endswith("_min"):
            sums[name] = min(sums.get(name, math.inf), float(v))
        else:
            sums[name] = sums.get(name, 0.0) + float(v)
