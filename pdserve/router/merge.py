"""Merging the prefill leg's prompt logprobs into the decode leg's answer.

The decode worker never ran the prompt, so its answer has no prompt logprobs; the
prefill worker's answer has them (when asked for). Field names, per endpoint:
``/generate``: ``meta_info.input_token_logprobs`` and ``meta_info.input_top_logprobs``;
OpenAI endpoints: ``choices[i].prompt_logprobs`` (a vLLM-style extension).
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


def _prefill_openai(prefill: Any) -> dict[int, Any]:
    out: dict[int, Any] = {}
    if isinstance(prefill, dict):
        for choice in prefill.get("choices") or []:
            if isinstance(choice, dict) and choice.get(OPENAI_PROMPT_KEY) is not None:
                out[int(choice.get("index", 0))] = choice[OPENAI_PROMPT_KEY]
    return out


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
        source = _prefill_openai(prefill)
        if isinstance(decode, dict):
            for choice in decode.get("choices") or []:
                index = int(choice.get("index", 0)) if isinstance(choice, dict) else -1
                if index in done or index not in source:
                    continue
                choice[OPENAI_PROMPT_KEY] = source[index]
                done.add(index)
    return decode
