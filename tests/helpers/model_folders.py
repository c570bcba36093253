"""Local model folders for tests of "bring your own model": a Hugging Face tokenizer folder with a given chat
template, special tokens and config.json, built in milliseconds, no download.

The tokenizer is byte-level BPE without merges (every byte one token) plus the family's special tokens, each one
token, so any text round-trips exactly and the templates' markers tokenize as the real models' do.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "tokens" / "templates"

FAMILIES: dict[str, dict] = {
    "chatml": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                     "<tool_response>", "</tool_response>", "<think>", "</think>"],
        "bos": None, "eos": "<|im_end|>", "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
    },
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    },
    "mistral": {
        "specials": ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                     "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        "bos": "<s>", "eos": "</s>", "model_type": "mistral", "architectures": ["MistralForCausalLM"],
    },
}


def template(name: str) -> str:
    """A test chat template from tests/tokens/templates (``llama3_json``, ``mistral_v3``, ...)."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def model_folder(path: Path, family: str, chat_template: str, *, config: bool = True) -> Path:
    """Write a tokenizer folder of ``family`` (FAMILIES) with ``chat_template`` at ``path``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    f = FAMILIES[family]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in f["specials"]])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": f["bos"],
        "eos_token": f["eos"],
        "additional_special_tokens": [t for t in f["specials"] if t not in (f["bos"], f["eos"])],
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    if config:
        (path / "config.json").write_text(json.dumps({"model_type": f["model_type"],
                                                      "architectures": f["architectures"]}))
    return path


def broken_chatml() -> str:
    """Qwen3's template, except that earlier assistant turns with tool calls lose their text (a common pitfall:
    history rendered differently from the last turn)."""
    from pipeline.tokens.templates import QWEN3_CHAT_TEMPLATE

    old = "{%- set body = m.content if m.content is string else '' %}"
    assert old in QWEN3_CHAT_TEMPLATE
    return QWEN3_CHAT_TEMPLATE.replace(
        old, old + "\n{%- if m.tool_calls and not loop.last %}{%- set body = '' %}{%- endif %}")
