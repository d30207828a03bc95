"""Prompt text -> token ids for the endpoints: a cheap length bound checked before
tokenizing, and tokenization / chat templates run off the event loop (a long prompt would
otherwise stall every request and ``/health`` of the worker)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.server.serving import APIError

MIN_CHARS_PER_TOKEN = 16  # the bound's floor; see max_prompt_chars


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Longest prompt text (in characters) that could still fit ``max_model_len`` tokens.

    One token stands for at most as many characters as its longest vocabulary entry (the
    vocabulary's strings spell out a token's bytes, e.g. byte-level BPE's one character per
    byte, and a character is at least one byte), so ``max_model_len * longest entry`` is an
    upper bound on the characters of any prompt that fits; the factor is at least
    ``MIN_CHARS_PER_TOKEN`` in case a normalizer drops characters. Text longer than this
    cannot fit and is rejected without tokenizing it.
    """
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 a tokenizer without get_vocab: a generous fixed factor
        longest = 0
    return max_model_len * max(MIN_CHARS_PER_TOKEN, longest)


def check_text(text: str, field: str, *, limit: int, max_model_len: int) -> None:
    """400 naming ``field`` for text that is not valid Unicode (lone surrogates) or longer
    than ``limit`` characters (which cannot fit the context limit)."""
    if limit and len(text) > limit:
        raise APIError(
            400,
            f"{field} is {len(text)} characters long, more than can fit this model's context "
            f"limit of {max_model_len} tokens (at most {limit} characters)",
            field,
            code="context_length_exceeded",
        )
    try:
        text.encode("utf-8")
    except (
        UnicodeEncodeError
    ) as exc:  # a \ud800 escape without its pair: the tokenizer raises TypeError
        raise APIError(
            400,
            f"{field} is not valid Unicode: a lone surrogate at character {exc.start} "
            f"(\\ud800-\\udfff escapes must come in pairs)",
            field,
        ) from None


async def encode(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text, **kwargs)`` in a worker thread."""
    return await asyncio.to_thread(tokenizer.encode, text, **kwargs)


async def apply_chat_template(tokenizer: Any, messages: list[dict], **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`` in a worker
    thread; 400 naming ``messages`` when the model has no template or it rejects them."""
    try:
        return await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, tokenize=False, **kwargs
        )
    except Exception as exc:  # no template, or the template rejects the roles
        raise APIError(400, f"cannot apply the model's chat template: {exc}", "messages") from exc
