"""Merging the prefill leg's answer into decode's, for whole answers and single stream
chunks.

The decode worker never ran the prompt, so its answer has no prompt logprobs and
no prefix-cache count; the prefill worker's answer has them. Field names, per endpoint:
``/generate``: ``meta_info.input_token_logprobs`` and ``meta_info.input_top_logprobs``;
OpenAI endpoints: ``choices[i].prompt_logprobs`` (chat: top-level ``prompt_logprobs``,
vLLM's extensions); and on
``/v1/completions`` with ``echo``, the echoed prompt's entries of ``choices[i].logprobs``
(``token_logprobs`` / ``top_logprobs``, which the decode worker leaves null for the
prompt's ``usage.prompt_tokens`` positions; the prefill leg has them).
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


def _merge_chat_prompt_logprobs(decode: Any, prefill: Any) -> None:
    """Chat: the top-level ``prompt_logprobs`` (vLLM's place) of prefill's answer into a
    decode answer or chunk that has the key (its first chunk of a sample)."""
    if (
        isinstance(decode, dict)
        and isinstance(prefill, dict)
        and OPENAI_PROMPT_KEY in decode
        and prefill.get(OPENAI_PROMPT_KEY) is not None
    ):
        decode[OPENAI_PROMPT_KEY] = prefill[OPENAI_PROMPT_KEY]


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
    elif endpoint == "/v1/chat/completions":
        _merge_chat_prompt_logprobs(decode, prefill)
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
        usage = _usage_of(endpoint, answer) or {}
        details = usage.get(_DETAILS.get(endpoint, "prompt_tokens_details")) or {}
        value = details.get("cached_tokens")
        return value if isinstance(value, int) else None
    return None


_DETAILS = {"/v1/responses": "input_tokens_details"}  # else OpenAI's prompt_tokens_details


def _usage_of(endpoint: str, answer: dict) -> Any:
    """The ``usage`` of an OpenAI answer or chunk; a Responses stream event carries it in
    its ``response`` (``response.completed``)."""
    if endpoint == "/v1/responses" and isinstance(answer.get("response"), dict):
        return answer["response"].get("usage")
    return answer.get("usage")


def merge_cached_tokens(endpoint: str, decode: Any, prefill: Any) -> Any:
    """Report the prefill leg's cached prompt tokens (its prefix-cache hit, the prompt
    compute it saved) in ``decode`` (a full answer or one stream chunk), in place; returns
    ``decode``.  ``/generate``: ``meta_info.cached_tokens`` per sample; OpenAI endpoints:
    ``usage.prompt_tokens_details.cached_tokens`` where decode's answer has a usage
    (``/v1/responses``: ``usage.input_tokens_details``, in a stream event's ``response``).  So
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
        usage = _usage_of(endpoint, decode)
        if isinstance(usage, dict):
            key = _DETAILS.get(endpoint, "prompt_tokens_details")
            usage.setdefault(key, {})["cached_tokens"] = source
    return decode


def timing_blocks(endpoint: str, answer: Any) -> dict[int, dict]:
    """Sample index -> the ``timing`` block (``return_timing``) of a full answer or chunk."""
    if endpoint == "/generate":
        pairs = [
            (int(item.get("index", pos)), (item.get("meta_info") or {}).get("timing"))
            for pos, item in enumerate(_generate_items(answer))
        ]
    else:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        pairs = [
            (int(c.get("index", 0)), c.get("timing")) for c in choices or [] if isinstance(c, dict)
        ]
    return {index: block for index, block in pairs if isinstance(block, dict)}


def merge_timing(endpoint: str, decode: Any, prefill: Any) -> Any:
    """Add the prefill leg's timing block (``{"prefill": {...}}``, asked with
    ``return_timing``) to each sample's block in ``decode`` (a full answer or one stream
    chunk), in place; returns ``decode``. The client sees both workers' phases."""
    theirs = timing_blocks(endpoint, prefill)
    if theirs:
        for index, block in timing_blocks(endpoint, decode).items():
            block.update(theirs.get(index) or {})
    return decode


def merge_router_timing(endpoint: str, answer: Any, info: dict) -> Any:
    """Add the router's block ``{"router": info}`` (selective PD's decision:
    ``pd_decision``, ``prompt_tokens_estimate``, ``decode_cached_share``,
    ``uncached_tokens_estimate``, ``pd_min_prefill_tokens``; ``pd_decision``
    ``decode_fallback`` and its ``pd_fallback`` reason when no prefill/decode pair could
    take the request) to each sample's timing block
    (``return_timing``) in ``answer`` (a full answer or one stream chunk), in place;
    returns ``answer``."""
    for block in timing_blocks(endpoint, answer).values():
        block["router"] = dict(info)
    return answer


def is_final_chunk(endpoint: str, chunk: Any) -> bool:
    """Whether a stream chunk carries the answer's counts: an OpenAI usage chunk (a
    Responses ``response.completed`` event), or a ``/generate`` chunk with a finish reason
    (its counts should be prefill's), or an OpenAI chunk with a sample's timing block
    (prefill's block is merged into it)."""
    if endpoint == "/generate":
        return any(
            (item.get("meta_info") or {}).get("finish_reason") is not None
            for item in _generate_items(chunk)
        )
    return isinstance(chunk, dict) and (
        _usage_of(endpoint, chunk) is not None or bool(timing_blocks(endpoint, chunk))
    )
