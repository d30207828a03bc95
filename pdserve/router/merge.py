"""Merging the prefill leg's prompt logprobs into the decode leg's answer.

The decode worker never ran the prompt, so its answer has no prompt logprobs; the
prefill worker's answer has them (when asked for). Field names, per endpoint:
``/generate``: ``meta_info.input_token_logprobs`` and ``meta_info.input_top_logprobs``;
OpenAI endpoints: ``choices[i].prompt_logprobs`` (a vLLM-style extension); and on
``/v1/completions`` with ``echo``, the echoed prompt's entries of ``choices[i].logprobs``
(``token_logprobs`` / ``top_logprobs``, which the decode worker leaves null for the
prompt's ``usage.prompt_tokens`` positions; the prefill leg has them).
The same functions work on whole answers and on single stream chunks.
"""

from __future__ import annotations

from typing import Any

GENERATE_PROMPT_KEYS = ("input_token_logprobs", "input_top_logprobs")
OPENAI_PROMPT_KEY = "prompt_logprobs"


def _generate_items(answer: Any) -> list[dict]:
    if isinstance(answer, dict):
        return [answer]
    if isinstance(answer, list):
        return [a for a in answer if isinstance(a, dict)]
    return []


def _prefill_generate_meta(prefill: Any) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for pos, item in enumerate(_generate_items(prefill)):
        meta = item.get("meta_info") or {}
        out[int(item.get("index", pos))] = {
            k: meta[k] for k in GENERATE_PROMPT_KEYS if meta.get(k) is not None
        }
    return out


def _prefill_openai(prefill: Any, key: str) -> dict[int, Any]:
    out: dict[int, Any] = {}
    if isinstance(prefill, dict):
        for choice in prefill.get("choices") or []:
            if isinstance(choice, dict) and choice.get(key) is not None:
                out[int(choice.get("index", 0))] = choice[key]
    return out


def _fill_echo(decode_lp: Any, prefill_lp: Any, num_prompt: int) -> None:
    """Fill the null prompt entries of a completions ``logprobs`` object in place."""
    if not isinstance(decode_lp, dict) or not isinstance(prefill_lp, dict):
        return
    for key in ("token_logprobs", "top_logprobs"):
        mine, theirs = decode_lp.get(key), prefill_lp.get(key)
        if not isinstance(mine, list) or not isinstance(theirs, list):
            continue
        for j in range(min(num_prompt, len(mine), len(theirs))):
            if mine[j] is None:
                mine[j] = theirs[j]


def merge_prompt_logprobs(
    endpoint: str, decode: Any, prefill: Any, done: set[int] | None = None
) -> Any:
    """Copy prompt logprobs from ``prefill`` (the prefill leg's full answer) into ``decode``
    (a full answer or one stream chunk), in place; returns ``decode``.

    ``done``: OpenAI streams only: sample indices already given their prompt logprobs (only
    the first chunk of each sample carries them); updated in place. ``/generate`` stream
    chunks are cumulative, so each one gets them.
    """
    done = set() if done is None else done
    if endpoint == "/generate":
        source = _prefill_generate_meta(prefill)
        for pos, item in enumerate(_generate_items(decode)):
            index = int(item.get("index", pos))
            if source.get(index):
                item.setdefault("meta_info", {}).update(source[index])
    else:
        source = _prefill_openai(prefill, OPENAI_PROMPT_KEY)
        echoed = _prefill_openai(prefill, "logprobs") if endpoint == "/v1/completions" else {}
        usage = prefill.get("usage") if isinstance(prefill, dict) else None
        num_prompt = usage.get("prompt_tokens", 0) if isinstance(usage, dict) else 0
        if isinstance(decode, dict):
            for choice in decode.get("choices") or []:
                index = int(choice.get("index", 0)) if isinstance(choice, dict) else -1
                if index in done or (index not in source and index not in echoed):
                    continue
                if index in source:
                    choice[OPENAI_PROMPT_KEY] = source[index]
                if index in echoed:
                    _fill_echo(choice.get("logprobs"), echoed[index], num_prompt)
                done.add(index)
    return decode


def _cached_of(endpoint: str, answer: Any) -> dict[int, int] | int | None:
    if endpoint == "/generate":
        out: dict[int, int] = {}
        for pos, item in enumerate(_generate_items(answer)):
            value = (item.get("meta_info") or {}).get("cached_tokens")
            if isinstance(value, int):
                out[int(item.get("index", pos))] = value
        return out
    if isinstance(answer, dict):
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return value if isinstance(value, int) else None
    return None


def merge_cached_tokens(endpoint: str, decode: Any, prefill: Any) -> Any:
    """Report the prefill leg's cached prompt tokens (its prefix-cache hit, the prompt
    compute it saved) in ``decode`` (a full answer or one stream chunk), in place; returns
    ``decode``.  ``/generate``: ``meta_info.cached_tokens`` per sample; OpenAI endpoints:
    ``usage.prompt_tokens_details.cached_tokens`` where decode's answer has a usage.  So
    the client sees one count, the prefill worker's, never a sum of both legs."""
    source = _cached_of(endpoint, prefill)
    if endpoint == "/generate":
        assert isinstance(source, dict)
        for pos, item in enumerate(_generate_items(decode)):
            index = int(item.get("index", pos))
            meta = item.get("meta_info")
            if isinstance(meta, dict) and index in source:
                meta["cached_tokens"] = source[index]
    elif isinstance(source, int) and isinstance(decode, dict):
        usage = decode.get("usage")
        if isinstance(usage, dict):
            usage.setdefault("prompt_tokens_details", {})["cached_tokens"] = source
    return decode


def is_final_chunk(endpoint: str, chunk: Any) -> bool:
    """Whether a stream chunk carries the answer's counts: an OpenAI usage chunk, or a
    ``/generate`` chunk with a finish reason (its counts should be prefill's)."""
    if endpoint == "/generate":
        return any(
            (item.get("meta_info") or {}).get("finish_reason") is not None
            for item in _generate_items(chunk)
        )
    return isinstance(chunk, dict) and chunk.get("usage") is not None
