import json
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.tokens.templates import QWEN3_CHAT_TEMPLATE
from pipeline.tokens.tokenizer import HFTokenizer, QwenTokenizer, qwen_hf_folder

SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

VARIED = [
    "Hello world",
    "",
    " ",
    "   leading and trailing   ",
    "tabs\t\tand\n\n\nnewlines\r\n\r\n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n",
    "毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "emoji 🤖👩‍👩‍👧 and combining e\u0301 vs é",
    "numbers 1234567890 3.14159 -42",
    "I'M SHOUTING it's they're we've",
    '<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{"name": "x"}\n</tool_call>',
    'json {"b":[1,{"c":null}],"a":"ü"}',
    "      \n        indented code\n",
    "مرحبا بالعالم — Привет мир — こんにちは世界",
]


@pytest.fixture(scope="module")
def qwen() -> QwenTokenizer:
    return QwenTokenizer()


@pytest.fixture(scope="module")
def hf() -> HFTokenizer:
    return HFTokenizer(qwen_hf_folder())


def test_known_ids(qwen):
    assert qwen.encode("Hello world") == [9707, 1879]
    assert (
        qwen.encode("system") == [8948]
        and qwen.encode("user") == [872]
        and qwen.encode("assistant") == [77091]
    )
    assert qwen.encode("\n") == [198] and qwen.encode("\n\n") == [271]
    for tok, i in SPECIALS.items():
        assert qwen.encode(tok) == [i]
        assert qwen.token_id(tok) == i
        assert qwen.decode([i]) == tok
    assert qwen.stop_ids == (151645, 151643)
    assert qwen.vocab_size == 151669


def test_padding_row_ids_decode_to_nothing_as_in_hf(qwen, hf):
    """A model with Qwen's 151,936 rows can sample an id past the tokenizer (a random one does): no text, no error."""
    ids = [9707, 151886, 1879, 151935]
    assert qwen.decode(ids) == hf.decode(ids) == "Hello world"


def test_hf_tokenizer_names_a_missing_folder():
    with pytest.raises(FileNotFoundError, match="tokenizer folder"):
        HFTokenizer("/nonexistent/model")


@pytest.mark.parametrize("text", VARIED)
def test_roundtrip_and_hf_agree(qwen, hf, text):
    ids = qwen.encode(text)
    assert qwen.decode(ids) == unicodedata.normalize("NFC", text)
    assert hf.encode(text) == ids
    assert hf.decode(ids) == qwen.decode(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_hf_folder_encodes_like_tiktoken(qwen, hf, text):
    assert hf.encode(text) == qwen.encode(text)


def test_hf_folder_loads_with_transformers(hf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf.folder), local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("<think>") == 151667
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cfg = json.loads((hf.folder / "tokenizer_config.json").read_text())
    assert (
        cfg["added_tokens_decoder"]["151657"]["special"] is False
    )  # tool markers survive skip_special_tokens
    assert tok.decode([151657, 151645], skip_special_tokens=True) == "<tool_call>"
    assert hf.stop_ids[0] == 151645


@pytest.mark.slow
def test_hf_folder_is_cached(tmp_path):
    a = qwen_hf_folder(cache_dir=tmp_path)
    b = qwen_hf_folder(cache_dir=tmp_path)
    assert a == b and (a / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [a.name]  # no half-written leftovers
    other = qwen_hf_folder(cache_dir=tmp_path, chat_template="{{ messages[0].content }}")
    assert other != a
