"""The config checks' field names, written as the flags a command's user typed."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bounds import check_min, flag_message


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**kw)


def test_a_leading_field_name_becomes_its_flag():
    args = _args(page_size=0, num_prompts="0")
    assert flag_message(ValueError("page_size must be >= 1, got 0"), args) == (
        "--page-size must be >= 1, got 0"
    )
    assert flag_message(ValueError("num-prompts must be integers"), args) == (
        "--num-prompts must be integers"
    )
    assert flag_message(ValueError("page_size: bad"), args) == "--page-size: bad"


def test_other_messages_are_left_as_they_are():
    args = _args(page_size=0)
    for text in ("block_size must be >= 1", "--page-size must be >= 1", "a sentence", "x"):
        assert flag_message(ValueError(text), args) == text


def test_check_min_message_through_flag_message():
    class Spec:
        output_len = -4

    with pytest.raises(ValueError) as info:
        check_min(Spec(), 1, "output_len")
    assert flag_message(info.value, _args(output_len=-4)) == "--output-len must be >= 1, got -4"


def test_every_field_name_with_an_underscore_becomes_its_flag():
    args = _args(speculative_ngram_max=2, speculative_ngram_min=5, model="x")
    msg = "speculative_ngram_max (2) must be >= speculative_ngram_min (5) for model x"
    assert flag_message(ValueError(msg), args) == (
        "--speculative-ngram-max (2) must be >= --speculative-ngram-min (5) for model x"
    )
    assert flag_message(ValueError("model must be set"), args) == "--model must be set"
