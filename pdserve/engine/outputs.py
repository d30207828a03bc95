"""What the engine returns: ``RequestOutput`` holding ``CompletionOutput`` samples.

``EngineCore.step`` returns one ``RequestOutput`` per engine request that advanced; each
carries the cumulative state (``text``, ``token_ids``, ...) and the delta of this step
(``delta_text``, ``delta_token_ids``, ``delta_logprobs``) for streaming.  ``LLM.generate``
merges the single-sample engine requests of an ``n > 1`` request into one output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one token at one position.

    token_id / logprob: the chosen token (sampled, or the actual prompt token) and its
        log-probability under the model's raw distribution (log_softmax of the logits,
        before temperature / top-k / top-p, as OpenAI and vLLM report it).
    top: the ``k`` most likely tokens at that position as ``(token_id, logprob)``, best first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
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
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
