"""Where one request's output ends, checked after each sampled token: token-level stops
(:class:`TokenStop`: EOS, stop token ids, length) and stop strings, which are matched in
the request's output text as :class:`IncrementalDetokenizer` builds it token by token
(``request.check_stops`` combines them with a complete grammar, in
``engine/core/request.py`` beside the ``Request`` it reads).  The detokenizer lives here
because a stop string is an output-text rule: it cuts the text and holds back what could
still become one.

Text is produced with ``tokenizers``' ``DecodeStream`` (it buffers tokens until they form
valid UTF-8, so a delta never holds half a character), primed with the last prompt
tokens so the first output token's leading space decodes as it does in context.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


# Prompt tokens used as decoding context for the first output tokens (vLLM uses 5 too).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Accumulates one request's output text token by token and detects stop strings.

    tokenizer: a ``transformers`` fast tokenizer (``backend_tokenizer`` is used).
    stop: stop strings; when one appears in the text, the text is cut just before it.
    The streamable text holds back ``max(len(stop)) - 1`` characters until the request
    finishes, so a stop string split across tokens never leaks into a delta.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool,
        stop: Sequence[str] = (),
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT:]), skip_special_tokens=skip_special_tokens
        )
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._emitted = 0

    def add_token(self, token_id: int, *, check_stop: bool) -> str | None:
        """Append one output token's text.  Returns the stop string that now ends the
        text (the text is cut before it) if ``check_stop`` and one matched, else None."""
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return None
        if not check_stop or not self._stop:
            self.text += piece
            return None
        # a stop string may start in the held-back tail of the text before this piece
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out that is safe to show (all of it once finished)."""
        text = self.text
        end = len(text)
        if not finished and self._hold:
            end = max(self._emitted, end - self._hold)
        if end == self._emitted:
            return ""
        delta = text[self._emitted : end]
        self._emitted = end
        return delta
