"""Engine outputs -> JSON pieces of the HTTP answers (logprobs, usage, finish reasons).

Token strings are the tokenizer's decoding of the single token (as OpenAI reports them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.engine.core.request import CompletionOutput, RequestOutput
from pdserve.engine.step import TokenLogprob


class TokenText:
    """Decodes single token ids, memoised (the same ids recur in logprob answers)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tok.decode([token_id])
            if len(self._cache) > 200_000:
                self._cache.clear()
        return text


def usage(
    prompt_tokens: int,
    outputs: Sequence[CompletionOutput],
    *,
    scoring: bool = False,
    cached_tokens: int = 0,
) -> dict:
    """OpenAI ``usage``: prompt counted once, completion tokens summed over samples
    (none when ``scoring``: a ``max_tokens`` 0 request, whose one engine token is dropped);
    ``prompt_tokens_details.cached_tokens``: prompt tokens found in the prefix cache
    (:func:`cached_tokens`), never above ``prompt_tokens``."""
    completion = 0 if scoring else sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)},
    }


def cached_tokens(outs: Sequence[RequestOutput]) -> int:
    """Cached prompt tokens of a request whose samples are ``outs``: the fewest any sample
    found (the prompt is counted once, like ``prompt_tokens``)."""
    return min((o.num_cached_tokens for o in outs), default=0)


def openai_finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def completion_top(entry: TokenLogprob, tt: TokenText, k: int | None = None) -> dict[str, float]:
    """One ``top_logprobs`` dict of the legacy completions layout: the ``k`` best tokens
    (all of ``entry.top`` when ``k`` is None) plus the chosen token itself, so up to
    ``k + 1`` entries (OpenAI's API reference: "the API will always return the logprob of
    the sampled token, so there may be up to logprobs+1 elements"; vLLM does the same)."""
    top = {tt(i): lp for i, lp in entry.top[:k]}
    top.setdefault(tt(entry.token_id), entry.logprob)
    return top


def completion_logprobs(entries: Sequence[TokenLogprob], tt: TokenText, offset: int) -> dict:
    """Legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs,
    text_offset), text offsets counted from ``offset``; each top dict holds the sampled
    token too (:func:`completion_top`)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(tt(e.token_id))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [completion_top(e, tt) for e in entries],
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None] | None,
    tt: TokenText,
    k: int,
) -> dict:
    """Completions ``logprobs`` object of an echoed prompt (OpenAI's layout): the first
    token's logprob and top are null; each other top dict holds the prompt token too
    (:func:`completion_top`); text offsets from 0. ``entries`` is the engine's
    prompt logprobs, or ``None`` on a decode worker (which never ran the prompt): then
    every logprob and top is null and the router fills them in from the prefill leg's
    answer (``router/merge.py``)."""
    tokens, offsets, offset = [], [], 0
    for t in prompt_ids:
        offsets.append(offset)
        tokens.append(tt(t))
        offset += len(tokens[-1])
    rows = list(entries) if entries is not None else [None] * len(prompt_ids)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in rows],
        "top_logprobs": [None if e is None else completion_top(e, tt, k) for e in rows],
        "text_offset": offsets,
    }


def join_logprobs(first: dict, second: dict) -> dict:
    """Two completions ``logprobs`` objects one after the other (lists concatenated)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(entries: Sequence[TokenLogprob], tt: TokenText) -> dict:
    """Chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(token_id: int, logprob: float) -> dict:
        text = tt(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            dict(one(e.token_id, e.logprob), top_logprobs=[one(i, lp) for i, lp in e.top])
            for e in entries
        ]
    }


def prompt_logprobs_json(
    entries: Sequence[TokenLogprob | None] | None, tt: TokenText, k: int | None = None
) -> list | None:
    """Extension ``prompt_logprobs``: ``None`` for the first prompt token, then per token
    ``{token_id, token, logprob, top_logprobs: [{token_id, token, logprob}]}`` (the first
    ``k`` alternatives; all when ``k`` is None)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            "token_id": e.token_id,
            "token": tt(e.token_id),
            "logprob": e.logprob,
            "top_logprobs": [{"token_id": i, "token": tt(i), "logprob": lp} for i, lp in e.top[:k]],
        }
        for e in entries
    ]


def generate_meta(
    out: RequestOutput,
    sample: CompletionOutput,
    *,
    return_logprob: bool,
    top_logprobs_num: int,
    logprob_start_len: int,
    latency: float,
) -> dict:
    """``meta_info`` of a native ``/generate`` answer (SGLang's shape: logprob entries are
    ``[logprob, token_id, null]``; the first prompt token's logprob is null)."""
    if sample.finish_reason is None:
        finish = None
    elif sample.finish_reason == "length":
        finish = {"type": "length", "length": len(sample.token_ids)}
    else:
        finish = {"type": sample.finish_reason, "matched": sample.stop_reason}
    meta: dict[str, Any] = {
        "id": out.request_id,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(sample.token_ids),
        "cached_tokens": out.num_cached_tokens,
        "finish_reason": finish,
        "e2e_latency": latency,
    }
    if not return_logprob:
        return meta
    outs = sample.logprobs or []
    meta["output_token_logprobs"] = [[e.logprob, e.token_id, None] for e in outs]
    if top_logprobs_num:
        meta["output_top_logprobs"] = [[[lp, i, None] for i, lp in e.top] for e in outs]
    if logprob_start_len >= 0:
        prompt = out.prompt_logprobs
        if prompt is None:  # decode role: the router merges the prefill leg's
            meta["input_token_logprobs"] = None
            if top_logprobs_num:
                meta["input_top_logprobs"] = None
        else:
            ids = out.prompt_token_ids
            rows = list(zip(ids, prompt))[logprob_start_len:]
            meta["input_token_logprobs"] = [
                [None if e is None else e.logprob, t, None] for t, e in rows
            ]
            if top_logprobs_num:
                meta["input_top_logprobs"] = [
                    None if e is None else [[lp, i, None] for i, lp in e.top] for _, e in rows
                ]
    return meta
