"""The stop conditions of one request, checked after each sampled token: token-level
(:class:`TokenStop`: EOS, stop token ids, length), a complete grammar, stop strings
(``request.check_stops`` combines them, in ``engine/core/request.py`` beside the
``Request`` it reads)."""

from __future__ import annotations

from collections.abc import Collection

from pdserve.engine.sampling_params import SamplingParams

_LENGTH = ("length", None)
_MISS = object()


class TokenStop:
    """Token-level stop conditions of one request, precomputed once so each sampled
    token costs a dict lookup and a comparison.

    params: the request's sampling params; eos_token_ids: the model's EOS ids;
    max_model_len: the engine's context limit (prompt + output tokens); num_prompt: the
    request's prompt length.
    """

    __slots__ = ("min_tokens", "max_output", "_stops")

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        max_model_len: int,
        num_prompt: int,
    ) -> None:
        self.min_tokens = params.min_tokens
        # output tokens at which "length" ends it: max_tokens, or the context limit
        limit = max_model_len - num_prompt
        self.max_output = limit if params.max_tokens is None else min(params.max_tokens, limit)
        # token id -> stop_reason; a stop_token_ids hit names the id, even for an EOS id
        stops: dict[int, int | None] = {}
        if not params.ignore_eos:
            stops.update(dict.fromkeys(eos_token_ids))
        stops.update((t, t) for t in params.stop_token_ids or ())
        self._stops = stops

    def may_stop_on_token(self, num_output_tokens: int) -> bool:
        """Whether some token id would end the request as its ``num_output_tokens``-th
        output token (an EOS or stop token past ``min_tokens``), i.e. whether its end can
        depend on a token the host has not seen (overlap scheduling, ``engine/core/overlap.py``)."""
        return num_output_tokens > self.min_tokens and bool(self._stops)

    def check(self, token_id: int, num_output_tokens: int) -> tuple[str, int | None] | None:
        """Whether the request ends with ``token_id``, its ``num_output_tokens``-th output
        token (just appended).

        Returns ``("stop", token_id)`` for a ``stop_token_ids`` hit, ``("stop", None)`` for
        an EOS (unless ``ignore_eos``), ``("length", None)`` at ``max_tokens`` output tokens
        or ``max_model_len`` tokens in all, else ``None``.  EOS and stop tokens count only
        once more than ``min_tokens`` tokens exist (the sampler also masks them before
        that), and take precedence over length, so a request that emits EOS as its last
        allowed token reports ``"stop"`` (vLLM's semantics).
        """
        if num_output_tokens > self.min_tokens:
            reason = self._stops.get(token_id, _MISS)
            if reason is not _MISS:
                return "stop", reason  # type: ignore[return-value]
        if num_output_tokens >= self.max_output:
            return _LENGTH
        return None


def tokens_banned_before_min(
    params: SamplingParams, eos_token_ids: Collection[int]
) -> tuple[int, ...]:
    """Token ids the sampler masks while fewer than ``min_tokens`` tokens were generated."""
    banned = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return tuple(sorted(banned))
