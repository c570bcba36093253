"""The embedded engine's model: loading a HF folder, prefill and batched decode, reading and applying weights.

A :class:`ModelRunner` is used only from the decode thread (and at load time, and :meth:`ModelRunner.read_weights`
from a worker thread of the server); it knows nothing about requests or HTTP. With a reduced vocabulary
(``bridle_vocab.json`` in the model folder, see :mod:`pipeline.models.small`) it maps Qwen ids to the model's
compact rows and back: :meth:`to_model` / :meth:`to_outside`.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from pipeline.models.small import VocabTable, load_vocab_table

# A KV cache as plain tensors: one (keys, values) pair per layer, each [batch, kv heads, sequence, head dim].
KV = list[tuple[torch.Tensor, torch.Tensor]]


class BadRequest(Exception):
    """A request the engine refuses with HTTP 400; the message says what to change."""


def parse_device(device: str) -> torch.device:
    """``--device``: "cpu", "cuda" or "cuda:N"; refused with what to do when this machine cannot run it."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f'--device {device!r}: expected "cpu", "cuda" or "cuda:N"') from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f'--device {device!r}: the embedded engine runs on "cpu" or "cuda[:N]"')
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU build: install a CUDA build of torch" if torch.version.cuda is None
                   else "torch sees no CUDA GPU: check CUDA_VISIBLE_DEVICES and the driver")
            raise ValueError(f"--device {device!r} ([proxy.engine] device): {why}, or use the CPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


class ModelRunner:
    """The model and its forward passes (see the module docstring for which thread calls what)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, context_length: int | None, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = parse_device(device)
        self.model_dir = model_dir
        self.vocab: VocabTable | None = load_vocab_table(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.config = self.model.config
        self.dtype = dtype
        self.model_vocab = int(self.config.vocab_size)
        if self.vocab is not None and self.vocab.size != self.model_vocab:
            raise ValueError(
                f"{model_dir}: bridle_vocab.json has {self.vocab.size} ids but config.json vocab_size is "
                f"{self.model_vocab}; the table must list one Qwen id per model row"
            )
        self.input_vocab = self.vocab.qwen_vocab_size if self.vocab else self.model_vocab
        max_pos = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.context_length = min(context_length or max_pos, max_pos)
        eos = self.config.eos_token_id
        eos_compact = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = frozenset(int(i) for i in self.to_outside(eos_compact))
        params = inspect.signature(self.model.forward).parameters
        # transformers' cache would keep only a sliding-window layer's last window of KV, but the prefix cache and
        # the batch's left padding index KV by position: such a model gets full layers (the model's own sliding
        # mask still hides keys beyond the window), at the memory cost of full attention.
        sliding = "sliding_attention" in (getattr(self.config, "layer_types", None) or [])
        self._cache_config = None if sliding else self.config
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes in the cache (all layers)."""
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return 2 * c.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize

    def to_model(self, ids: list[int]) -> list[int]:
        """Qwen ids -> the model's rows (ids outside a reduced table map to its UNK row)."""
        return ids if self.vocab is None else self.vocab.to_compact(ids).tolist()

    def to_outside(self, ids: list[int]) -> list[int]:
        """The model's rows -> Qwen ids."""
        return ids if self.vocab is None else self.vocab.to_qwen(ids).tolist()

    def new_cache(self, kv: KV | None = None):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=kv, config=self._cache_config) if kv else DynamicCache(
            config=self._cache_config)

    @staticmethod
    def cache_kv(cache) -> KV:
        return [(layer.keys, layer.values) for layer in cache.layers]

    @torch.inference_mode()
    def prefill(self, ids: list[int], past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """Logits after the last token (float32, [V]) and the sequence's KV per layer ([1, H, L, D]).

        ``past``: the KV of tokens before ``ids`` (a cached prefix); the result covers them and ``ids``. The model
        numbers ``ids`` from the cache's length on, so their positions (and rotary phases) are the ones a prefill
        of the whole sequence gives them; the cache copies ``past`` and appends by ``torch.cat``, so ``past`` is
        never written."""
        cache = self.new_cache(past)
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[0, -1].float(), self.cache_kv(cache)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], mask: torch.Tensor, cache) -> torch.Tensor:
        """One batched step: next-token logits [B, V] (float32). ``mask`` covers the cache plus the new token."""
        out = self.model(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None],
            position_ids=torch.tensor(positions, dtype=torch.long, device=self.device)[:, None],
            attention_mask=mask,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1].float()

    def read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """Load and check a checkpoint folder's tensors against the running model (runs off the decode thread)."""
        from safetensors.torch import load_file

        if not path.is_dir():
            raise BadRequest(f"model_path {str(path)!r} is not a directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise BadRequest(f"model_path {str(path)!r} has no *.safetensors files")
        table = load_vocab_table(path)
        if table != self.vocab:
            raise BadRequest(
                f"{path}: its bridle_vocab.json differs from the running model's (or one of them has none); "
                "a weight update cannot change the vocabulary"
            )
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self.check_weights(tensors, str(path))
        return tensors

    def check_weights(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Refuse tensors (a checkpoint's, or a broadcast's) that are not exactly the running model's weights."""
        own = self.model.state_dict()
        tied = {"lm_head.weight"} if getattr(self.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(own) - set(tensors) - tied)
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise BadRequest(
                f"{source}: the weights do not match the running model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, t in tensors.items():
            if t.shape != own[name].shape:
                raise BadRequest(
                    f"{source}: tensor {name} has shape {tuple(t.shape)}, the model has {tuple(own[name].shape)}"
                )

    @torch.inference_mode()
    def apply_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors (:meth:`check_weights`) into the model in place; on the decode thread."""
        own = self.model.state_dict()
        for name, t in tensors.items():
            own[name].copy_(t.to(own[name].dtype))
