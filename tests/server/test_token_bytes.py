"""Logprob tokens' raw bytes and text offsets (``server/formatting.py``'s ``TokenText.raw``
and the offsets of completions ``logprobs``) with the embedded model's real byte-level BPE
tokenizer: characters split over tokens come back whole when their bytes are joined."""

from __future__ import annotations

import pytest

from pdserve.engine.step import TokenLogprob
from pdserve.model.loader import embedded_tokenizer
from pdserve.server.formatting import (
    TokenText,
    _byte_level_alphabet,
    chat_logprobs,
    completion_logprobs,
)

TEXT = "！！ マスタ Café, 東京 — ¿qué? 😀"


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def test_the_byte_level_alphabet_covers_every_byte_once():
    alphabet = _byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["!"] == ord("!") and alphabet["\u0120"] == ord(" ")  # "Ġ" is the space


def test_raw_bytes_of_split_characters_join_to_the_text(tok):
    tt = TokenText(tok)
    ids = tok.encode(TEXT)
    assert any(tt(i) == "\ufffd" for i in ids), "the text should split a character over tokens"
    assert b"".join(tt.raw(i) for i in ids).decode("utf-8") == TEXT
    for i in ids:
        if "\ufffd" not in tt(i):
            assert tt.raw(i) == tt(i).encode("utf-8")
    special = tok.convert_tokens_to_ids("<|im_end|>")
    assert tt.raw(special) == b"<|im_end|>"


def test_chat_bytes_and_completion_offsets_follow_the_characters(tok):
    tt = TokenText(tok)
    ids = tok.encode("！！")
    entries = [TokenLogprob(token_id=i, logprob=-0.5, top=((i, -0.5),)) for i in ids]
    content = chat_logprobs(entries, tt)["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode("utf-8") == "！！"
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    lp = completion_logprobs(entries, tt, offset=3)
    # each token starts where its character starts: the text is 2 characters in len(ids) tokens
    assert lp["text_offset"][0] == 3 and lp["text_offset"][-1] == 3 + 1
    assert lp["text_offset"] == sorted(lp["text_offset"])
