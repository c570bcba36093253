"""Tiny Qwen3-architecture models for CPU runs, with an optional reduced vocabulary.

A 151,936-row output head makes a tiny model ~10x slower per token on a CPU, so the quickstart model can use a
*reduced vocabulary*: a table of the real Qwen ids its prompts use. The model's embedding and LM head have one
row per table entry. Everything outside the engine (proxy, tree builder, event log) only ever sees real Qwen ids:

- ``bridle_vocab.json`` lists ``ids``; compact id ``c`` stands for Qwen id ``ids[c]``.
- Compact id 0 is the UNK slot. Its Qwen id is ``ids[0]`` (``unk_id``, by default ``<|endoftext|>``), so a sampled
  UNK maps back to a real token and the round trip is exact for every id the model can produce.
- A Qwen id that is not in the table (but inside ``qwen_vocab_size``) maps *in* to the UNK slot.

The learner must map ids the same way before its forward (:meth:`VocabTable.to_compact`) so that its
log-probabilities are over the same rows the engine sampled from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

VOCAB_FILE = "bridle_vocab.json"
VOCAB_FORMAT = "bridle-reduced-vocab/1"
QWEN_VOCAB_SIZE = 151_936  # rows of Qwen2.5/Qwen3 embeddings (the tokenizer itself uses fewer)
ENDOFTEXT, IM_START, IM_END = 151_643, 151_644, 151_645
THINK, END_THINK = 151_667, 151_668
TOOL_CALL, END_TOOL_CALL = 151_657, 151_658
QWEN_CHAT_SPECIALS = (ENDOFTEXT, IM_START, IM_END, TOOL_CALL, END_TOOL_CALL, THINK, END_THINK)


class VocabTable(msgspec.Struct, kw_only=True, frozen=True):
    """Compact id ``c`` <-> Qwen id ``ids[c]``; ``ids[0]`` is the UNK slot (see the module docstring)."""

    ids: tuple[int, ...]
    qwen_vocab_size: int = QWEN_VOCAB_SIZE
    format: str = VOCAB_FORMAT

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError("VocabTable.ids is empty: it needs at least the UNK slot")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("VocabTable.ids has duplicates: each Qwen id may own one compact slot")
        bad = [i for i in self.ids if not 0 <= i < self.qwen_vocab_size]
        if bad:
            raise ValueError(f"VocabTable.ids {bad[:5]} are outside [0, {self.qwen_vocab_size})")
        if self.format != VOCAB_FORMAT:
            raise ValueError(f"vocab table format {self.format!r} is not {VOCAB_FORMAT!r}")

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def unk_id(self) -> int:
        return self.ids[0]

    @classmethod
    def from_sequences(
        cls,
        sequences: Iterable[Sequence[int]],
        *,
        unk_id: int = ENDOFTEXT,
        extra_ids: Iterable[int] = QWEN_CHAT_SPECIALS,
        qwen_vocab_size: int = QWEN_VOCAB_SIZE,
    ) -> VocabTable:
        """The table of every id in ``sequences`` and ``extra_ids`` (sorted), with ``unk_id`` as slot 0."""
        seen: set[int] = {int(i) for i in extra_ids}
        for seq in sequences:
            seen.update(int(i) for i in seq)
        seen.discard(unk_id)
        return cls(ids=(unk_id, *sorted(seen)), qwen_vocab_size=qwen_vocab_size)

    def _maps(self) -> tuple[np.ndarray, np.ndarray]:
        cached = _MAPS.get(self.ids)
        if cached is None:
            to_qwen = np.asarray(self.ids, dtype=np.int64)
            to_compact = np.zeros(self.qwen_vocab_size, dtype=np.int64)  # 0 = UNK slot
            to_compact[to_qwen] = np.arange(len(to_qwen))
            cached = _MAPS[self.ids] = (to_compact, to_qwen)
        return cached

    def to_compact(self, qwen_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Qwen ids -> compact ids; ids missing from the table become 0 (UNK). Out-of-range ids raise."""
        arr = np.asarray(qwen_ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.qwen_vocab_size):
            raise ValueError(f"token id outside the Qwen vocabulary [0, {self.qwen_vocab_size})")
        return self._maps()[0][arr]

    def to_qwen(self, compact_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(compact_ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.size):
            raise ValueError(f"compact id outside [0, {self.size})")
        return self._maps()[1][arr]

    def save(self, model_dir: Path) -> Path:
        path = Path(model_dir) / VOCAB_FILE
        path.write_bytes(msgspec.json.encode(self))
        return path


_MAPS: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}


def load_vocab_table(model_dir: str | Path) -> VocabTable | None:
    """The model folder's reduced-vocabulary table, or None for a full-vocabulary model."""
    path = Path(model_dir) / VOCAB_FILE
    if not path.exists():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=VocabTable)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid bridle vocabulary table: {e}") from None


def create_small_model(
    out_dir: str | Path,
    *,
    vocab: VocabTable | None = None,
    hidden_size: int = 192,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    eos_ids: Sequence[int] = (IM_END, ENDOFTEXT),
    seed: int = 0,
    mean_reply_tokens: int = 0,
    sliding_window: int = 0,
) -> Path:
    """Randomly initialise a Qwen3ForCausalLM and save it as a HF folder (config.json + model.safetensors).

    With ``vocab`` the model gets ``vocab.size`` rows and the table is saved as ``bridle_vocab.json``;
    without it the model has the full Qwen vocabulary (loadable by SGLang too, with ``--skip-tokenizer-init``
    or a tokenizer copied into the folder). ``eos_ids`` are Qwen ids; for a reduced vocabulary the config stores
    their compact ids (those not in the table are dropped). ``mean_reply_tokens`` > 0: the untrained model ends a
    turn after about that many tokens (:func:`end_turns_early`); 0: it almost never does (1 in the vocabulary size
    per token). ``sliding_window`` > 0: every layer attends only to that many positions back (transformers'
    Qwen3 sliding-window layers), which a tiny policy needs to find a few tokens in a harness's long prompt.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size {hidden_size} must divide by num_heads {num_heads}, "
            f"and num_heads by num_kv_heads {num_kv_heads}"
        )
    if vocab is None:
        vocab_size, eos = QWEN_VOCAB_SIZE, [int(i) for i in eos_ids]
    else:
        vocab_size = vocab.size
        eos = [int(c) for c, q in enumerate(vocab.ids) if q in set(eos_ids)]
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos or None,
        bos_token_id=None,
        pad_token_id=None,
        **({"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * num_layers} if sliding_window else {}),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    if mean_reply_tokens:
        end = IM_END if vocab is None else int(vocab.to_compact([IM_END])[0])
        end_turns_early(model, end, mean_reply_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if vocab is not None:
        vocab.save(out)
    (out / "bridle_model.json").write_text(
        json.dumps({"created_by": "pipeline.models.small.create_small_model", "seed": seed}, indent=1)
    )
    return out


def end_turns_early(model: Any, end_id: int, mean_tokens: int) -> None:
    """Give a randomly initialized Qwen3 model a prior to end its turn: ``end_id`` gets probability about
    ``1 / mean_tokens`` at every position, every other row stays near uniform.

    A random model samples the end-of-turn token once in the vocabulary size, so without this a black-box harness
    never sees a turn end: every answer runs to the token cap, and Claude Code, after three "output token limit"
    recoveries, exits with an error. The Qwen3 LM head has no bias, so one hidden dimension is made a constant
    feature: dimension 0 of every token embedding is set to one value, no layer writes to it (row 0 of every
    attention and MLP output projection is zero), and after the final RMSNorm it is nearly the same at every
    position; the end-of-turn row reads only that dimension, scaled to the wanted logit. Training may change all
    of this like any other weight.
    """
    import torch

    cfg = model.config
    hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = float(emb[:, 1:].std()) * hidden**0.5  # about the norm of the other dimensions together
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        head = model.get_output_embeddings().weight
        head[end_id, :] = 0.0
        probe = torch.randint(0, vocab, (1, 256), generator=torch.Generator().manual_seed(0))
        h0 = float(model.model(input_ids=probe).last_hidden_state[0, :, 0].mean())
        # softmax: e^b / (e^b + (vocab - 1)) = 1 / mean_tokens
        head[end_id, 0] = math.log((vocab - 1) / max(mean_tokens - 1, 1e-9)) / h0
