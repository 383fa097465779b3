"""The shipped tiny tokenizer: special ids, exact round trips, streaming decode, reproducible build."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from gymrpc.chat import ChatTokenizer, default_tokenizer
from gymrpc.chat.tokenizer import DEFAULT_TOKENIZER

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<think>", "</think>"]  # fmt: skip


def _random_text(rng: random.Random, n: int) -> str:
    pools = [
        (0x20, 0x7E),  # ASCII
        (0x00, 0x1F),  # control characters
        (0xA0, 0x24F),  # Latin
        (0x3040, 0x30FF),  # kana
        (0x4E00, 0x4FFF),  # CJK
        (0x1F300, 0x1F6FF),  # emoji (4-byte UTF-8)
        (0xE000, 0xE0FF),  # private use
    ]
    out = []
    for _ in range(n):
        low, high = rng.choice(pools)
        out.append(chr(rng.randint(low, high)))
    return "".join(out)


def test_special_tokens_have_the_reference_ids() -> None:
    tok = default_tokenizer()
    assert [tok.encode(s) for s in SPECIALS] == [[i] for i in range(len(SPECIALS))]
    assert (tok.endoftext_id, tok.im_start_id, tok.im_end_id) == (0, 1, 2)
    assert tok.stop_token_ids == (2, 0)
    assert tok.vocab_size == 2048
    assert DEFAULT_TOKENIZER.stat().st_size < 300_000


@pytest.mark.parametrize(
    "text",
    [
        "",
        "add 4 then add 5 then get the count",
        "  leading and trailing spaces  ",
        "\n\n\ttabs\r\nand CRLF\x00nul\x7f",
        "héllo wörld — “quotes” 日本語 🌍🚀 👩‍👩‍👧",
        '<|im_start|>user\n<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call><|im_end|>',
        "<|im_start",
        "<tool_call",
        "</think>text<think>",  # partial and misordered tags
        "\ufffd\ufeff\u200b",
    ],
)
def test_round_trip_exact(text: str) -> None:
    tok = default_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_random_unicode() -> None:
    tok = default_tokenizer()
    rng = random.Random(1234)
    for _ in range(300):
        text = _random_text(rng, rng.randint(1, 80))
        assert tok.decode(tok.encode(text)) == text, repr(text)


def test_specials_in_text_encode_as_single_ids() -> None:
    tok = default_tokenizer()
    ids = tok.encode("a<tool_call>b")
    assert 3 in ids
    assert tok.decode(ids) == "a<tool_call>b"


def test_incremental_decoder_never_splits_a_character() -> None:
    tok = default_tokenizer()
    text = "count 🌍 is 日本 done"
    ids = tok.encode(text)
    decoder = tok.decoder()
    pieces = [decoder.push([i]) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.split())  # the emoji really spans several byte tokens


def test_strip_stop_removes_only_a_final_stop_token() -> None:
    tok = default_tokenizer()
    assert tok.strip_stop([5, 6, 2]) == [5, 6]
    assert tok.strip_stop([5, 6, 0]) == [5, 6]
    assert tok.strip_stop([2, 5]) == [2, 5]
    assert tok.strip_stop([]) == []


def test_tokenizer_without_chat_specials_is_refused() -> None:
    from tokenizers import Tokenizer, models

    with pytest.raises(ValueError, match="lacks the special tokens"):
        ChatTokenizer(Tokenizer(models.BPE()))


def test_shipped_file_is_what_the_build_script_makes() -> None:
    spec = importlib.util.spec_from_file_location("make_tokenizer", ROOT / "tools" / "make_tokenizer.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = json.loads(module.serialize(module.build()))
    shipped = json.loads(DEFAULT_TOKENIZER.read_text(encoding="utf-8"))
    assert built["model"]["vocab"] == shipped["model"]["vocab"]
    assert built["model"]["merges"] == shipped["model"]["merges"]
    assert built["added_tokens"] == shipped["added_tokens"]
