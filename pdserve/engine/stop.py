"""Token-level stop conditions of one request, checked after each sampled token."""

from __future__ import annotations

from collections.abc import Collection

from pdserve.engine.sampling_params import SamplingParams


def check_token_stop(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[str, int | None] | None:
    """Whether the request ends with the token just appended.

    Returns ``("stop", token_id)`` for an EOS (unless ``ignore_eos``; stop_reason ``None``)
    or a ``stop_token_ids`` hit, ``("length", None)`` at ``max_tokens`` output tokens or
    ``max_model_len`` tokens in all, else ``None``.  EOS and stop tokens count only once
    more than ``min_tokens`` tokens exist (the sampler also masks them before that), and
    take precedence over length, so a request that emits EOS as its last allowed token
    reports ``"stop"``.
    """
    if num_output_tokens > params.min_tokens:
        if token_id in (params.stop_token_ids or ()):
            return "stop", token_id
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
    if (
        params.max_tokens is not None and num_output_tokens >= params.max_tokens
    ) or num_tokens >= max_model_len:
        return "length", None
    return None


def tokens_banned_before_min(
    params: SamplingParams, eos_token_ids: Collection[int]
) -> tuple[int, ...]:
    """Token ids the sampler masks while fewer than ``min_tokens`` tokens were generated."""
    banned = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return tuple(sorted(banned))
