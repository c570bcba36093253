"""The module the learner trains: the causal LM with a value head (:class:`PolicyValue`), loaded from a Hugging
Face folder in the configured parameter dtype (:func:`load_policy`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from pipeline.training import losses
from pipeline.training.stage import StageSettings


class PolicyValue(nn.Module):
    """The causal LM plus a zero-initialized linear value head on its final hidden states.

    ``forward`` returns, for selected rows of hidden states, the log-prob of a target token, the entropy and the
    value — so that everything goes through one module call (which DDP needs to see for its gradient hooks).
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        hidden = policy.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Any,
        rows: torch.Tensor,
        targets: torch.Tensor,
        temperature: float | torch.Tensor = 1.0,
        logits_chunk: int = 4096,
        values: Literal["none", "detached", "attached"] = "none",
    ) -> dict[str, torch.Tensor]:
        out = self.policy.base_model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        )
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[rows]
        logp, ent = losses.logprobs_and_entropy(
            hidden, self.policy.get_output_embeddings(), targets, temperature, logits_chunk
        )
        res = {"logp": logp, "entropy": ent}
        if values != "none":
            h = hidden.detach() if values == "detached" else hidden
            res["value"] = self.value_head(h.float()).squeeze(-1)
        return res


def load_policy(path: str | os.PathLike[str], config: StageSettings) -> nn.Module:
    """The causal LM in a HF folder, in the config's parameter dtype (the slow part of building a Learner)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Learner model path {path} does not exist")
    dtype = torch.float32 if config.compute.param_dtype == "float32" else torch.bfloat16
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
