"""What the engine returns: ``RequestOutput`` holding ``CompletionOutput`` samples.

``EngineCore.step`` returns one ``RequestOutput`` per engine request that advanced; each
carries the cumulative state (``text``, ``token_ids``, ...) and the delta of this step
(``delta_text``, ``delta_token_ids``, ``delta_logprobs``) for streaming.  ``LLM.generate``
merges the single-sample engine requests of an ``n > 1`` request into one output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.step import TokenLogprob

_LAZY: Any = object()  # a field not materialized yet (``None`` is a value of logprobs)


class CompletionOutput:
    """One sample of a request.

    index: the sample's index among the request's ``n``.
    text: output text so far; a stop string, or the text of a stopping EOS / stop token
        id, is not part of it.  token_ids: output tokens so far (a stopping EOS or stop
        token id included, as vLLM does).
    logprobs: one ``TokenLogprob`` per output token when ``logprobs`` was asked, else None.
    cumulative_logprob: sum of the output tokens' logprobs.
    finish_reason: ``None`` while running, then ``"stop"``, ``"length"``, ``"abort"`` or
        ``"error"`` (see ``RequestOutput.error``).
    stop_reason: the stop string or stop token id that ended it, if any.
    delta_*: what this step added (for streaming; the deltas concatenate to the totals).

    Every field reads and assigns like a plain attribute (the constructor takes them as a
    dataclass would).  The engine builds its outputs with :meth:`snapshot`, which copies
    nothing: the four token lists are slices of the request's append-only lists, cut on
    first read (then kept), so a step costs O(1) per request whatever its length, and a
    stream that reads only the deltas never copies the totals.
    """

    __slots__ = (
        "index",
        "text",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
        "delta_text",
        "_token_ids",
        "_logprobs",
        "_delta_token_ids",
        "_delta_logprobs",
        "_ids",
        "_lps",
        "_start",
        "_reported",
        "_end",
        "_lp_end",
    )
    index: int
    text: str
    cumulative_logprob: float
    finish_reason: str | None
    stop_reason: str | int | None
    delta_text: str
    # a field's value, or _LAZY until first read (snapshots only)
    _token_ids: Any
    _logprobs: Any
    _delta_token_ids: Any
    _delta_logprobs: Any
    # a snapshot's sources: the request's lists and where this output's slices lie
    _ids: list[int]
    _lps: list[TokenLogprob]
    _start: int
    _reported: int
    _end: int
    _lp_end: int

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        cumulative_logprob: float,
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        delta_text: str = "",
        delta_token_ids: list[int] | None = None,
        delta_logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        self.index = index
        self.text = text
        self.cumulative_logprob = cumulative_logprob
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.delta_text = delta_text
        self._token_ids = token_ids
        self._logprobs = logprobs
        self._delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self._delta_logprobs = delta_logprobs

    @classmethod
    def snapshot(
        cls,
        all_token_ids: list[int],
        num_prompt: int,
        num_reported: int,
        logprobs: list[TokenLogprob] | None,
        *,
        text: str,
        delta_text: str,
        cumulative_logprob: float,
        finish_reason: str | None,
        stop_reason: str | int | None,
    ) -> CompletionOutput:
        """Sample 0 of a request as it stands now, copying nothing.

        all_token_ids: the request's prompt + output ids (append-only: what is there now
        never changes); num_prompt: how many are the prompt; num_reported: output tokens
        already reported (the delta is the rest); logprobs: its per-output-token list
        (append-only) or None.  ``token_ids = all_token_ids[num_prompt:]``, ``delta_*``
        from ``num_reported`` on, all as of this call.
        """
        self = cls.__new__(cls)
        self.index = 0
        self.text = text
        self.cumulative_logprob = cumulative_logprob
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.delta_text = delta_text
        self._token_ids = self._delta_token_ids = _LAZY
        self._logprobs = self._delta_logprobs = _LAZY if logprobs is not None else None
        self._ids = all_token_ids
        self._lps = logprobs if logprobs is not None else []
        self._start = num_prompt
        self._reported = num_reported
        self._end = len(all_token_ids)
        self._lp_end = 0 if logprobs is None else len(logprobs)
        return self

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is _LAZY:
            self._token_ids = self._ids[self._start : self._end]
        return self._token_ids  # type: ignore[no-any-return]

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def delta_token_ids(self) -> list[int]:
        if self._delta_token_ids is _LAZY:
            self._delta_token_ids = self._ids[self._start + self._reported : self._end]
        return self._delta_token_ids  # type: ignore[no-any-return]

    @delta_token_ids.setter
    def delta_token_ids(self, value: list[int]) -> None:
        self._delta_token_ids = value

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        if self._logprobs is _LAZY:
            self._logprobs = self._lps[: self._lp_end]
        return self._logprobs  # type: ignore[no-any-return]

    @logprobs.setter
    def logprobs(self, value: list[TokenLogprob] | None) -> None:
        self._logprobs = value

    @property
    def delta_logprobs(self) -> list[TokenLogprob] | None:
        if self._delta_logprobs is _LAZY:
            self._delta_logprobs = self._lps[self._reported : self._lp_end]
        return self._delta_logprobs  # type: ignore[no-any-return]

    @delta_logprobs.setter
    def delta_logprobs(self, value: list[TokenLogprob] | None) -> None:
        self._delta_logprobs = value

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _COMPLETION_FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, like a dataclass with eq

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in _COMPLETION_FIELDS)
        return f"CompletionOutput({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (CompletionOutput, self._fields())


# The public fields, in constructor order (equality, repr, pickling).
_COMPLETION_FIELDS = (
    "index",
    "text",
    "token_ids",
    "cumulative_logprob",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "delta_text",
    "delta_token_ids",
    "delta_logprobs",
)


@dataclass
class RequestOutput:
    """State of one request after a step.

    prompt_logprobs: ``None`` for the first prompt token, then one ``TokenLogprob`` per
        prompt token, once the prompt has been computed (if asked).
    finished: every sample has a ``finish_reason``.
    error: why the request failed (``finish_reason == "error"``), e.g. a KV transfer
        failure; ``None`` otherwise.
    num_cached_tokens: prompt tokens whose KV was not computed for this request: found in
        the prefix cache at admission (full pages; a disaggregated decode worker counts the
        leading pages it already held and did not receive).  Never above the prompt length.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    num_cached_tokens: int = 0
