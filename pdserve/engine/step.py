"""The step boundary: the plain data that crosses between the engine thread and the ranks.

The scheduler (``engine/core/scheduler.py``) builds a :class:`BatchPlan` of
:class:`ScheduledSeq` rows; the executor's ranks (``engine/worker/model_runner.py``) run it and
return a :class:`StepResult` of :class:`SampledToken` per sampling row and
:class:`TokenLogprob` per prompt position asked for; an overlapped step's greedy tokens
come back as :class:`InFlightTokens`.  Both sides import this module and it imports
neither, so the step's types have no producer to depend on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # annotations only: importing this module imports no torch
    import torch

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.worker.penalties import PenaltyTokens


class TokenLogprob(NamedTuple):
    """Logprob of one token at one position (a named tuple: one is built per token, and
    a frozen dataclass's ``__init__`` costs several times a tuple's).

    token_id / logprob: the chosen token (sampled, or the actual prompt token) and its
        log-probability under the model's raw distribution (log_softmax of the logits,
        before temperature / top-k / top-p, as OpenAI and vLLM report it).
    top: the ``k`` most likely tokens at that position as ``(token_id, logprob)``, best first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class SampledToken(NamedTuple):
    """One row's result: the token, its logprob and its top-k ``(id, logprob)``.

    A named tuple (immutable, typed) rather than a frozen dataclass: one is built per row
    per step, and a frozen dataclass's ``__init__`` costs several times a tuple's."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class ScheduledSeq(NamedTuple):
    """One request's share of a step: immutable plain data (a NamedTuple: one is built per
    row per step, at a fraction of a frozen dataclass's cost; ``_replace`` derives one).

    token_ids: the ``n`` tokens whose KV this step computes (positions
        ``start_pos .. start_pos + n - 1``).
    pages: the request's page table, covering at least ``start_pos + n`` tokens (the
        request's own list, shared, never changed in place: the scheduler grows a page
        table by replacing the list).
    sample: the last position's logits are sampled (the request is fully computed).
    prompt_logprobs_start/prompt_logprobs_targets: the logits of positions
        ``start .. start + len(targets) - 1`` give the logprobs of the prompt tokens
        ``targets`` (those at positions ``start + 1 ..``); empty when not asked or done.
    params/generator/banned_token_ids: how to sample (``banned`` = masked ids while
        ``min_tokens`` is not reached).
    penalty_tokens: the request's tokens on the device, for the sampler's penalties
        (``None`` unless ``sample`` and ``params.has_penalties``).
    logits_mask: bool ``[V]`` allowed tokens of a structured-output row (True = allowed),
        set by the engine after scheduling; ``None`` = unconstrained.
    draft_token_ids: a verify row's ``k`` drafts (speculative decoding, ``engine/spec/``):
        ``token_ids`` is then the last token followed by them, every one of the ``k + 1``
        positions gives logits, and the runner keeps the accepted prefix plus one token
        (``StepResult.verified``); empty for every other row.
    draft_q: ``None`` (a deterministic proposal) or float32 ``[k, V]``, the drafts'
        proposal distributions.
    draft_masks: a structured-output verify row's allowed-token masks of positions
        ``1 .. k`` (position 0 uses ``logits_mask``); ``None`` = unconstrained.
    draft_reference: benchmark only (``engine/spec/drafter.py``'s ``ReferenceDrafter``):
        ``None``, or the ``k + 1`` tokens a greedy verify of this row keeps in place of the
        target's argmax.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    pages: list[int]
    sample: bool
    prompt_logprobs_start: int
    prompt_logprobs_targets: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()
    penalty_tokens: PenaltyTokens | None = None
    logits_mask: torch.Tensor | None = None
    draft_token_ids: tuple[int, ...] = ()
    draft_q: torch.Tensor | None = None
    draft_masks: tuple[torch.Tensor, ...] | None = None
    draft_reference: tuple[int, ...] | None = None

    @classmethod
    def greedy(
        cls,
        request_id: str,
        token_ids: list[int],
        start_pos: int,
        pages: list[int],
        *,
        sample: bool = True,
    ) -> ScheduledSeq:
        """A row outside the scheduler (start-up warm-up, a draft model's own steps):
        greedy sampling, no logprobs, no penalties, no structured output, no drafts.
        ``token_ids``/``start_pos``/``pages``/``sample`` as on the class."""
        return cls(
            request_id=request_id,
            token_ids=token_ids,
            start_pos=start_pos,
            pages=pages,
            sample=sample,
            prompt_logprobs_start=0,
            prompt_logprobs_targets=[],
            params=_greedy_params(),
            generator=None,
        )


@functools.cache
def _greedy_params() -> SamplingParams:
    """The one greedy :class:`SamplingParams` of :meth:`ScheduledSeq.greedy` (built once)."""
    from pdserve.engine.sampling_params import SamplingParams  # at first use: keeps imports light

    return SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(frozen=True)
class BatchPlan:
    """What one step computes: the sequences in batch order, and who was preempted.

    input_rows: ``None``, or (overlap scheduling, ``engine/core/overlap.py``) for each sequence
    the row of the step launched just before whose sampled token is its input: its
    ``token_ids`` is then ``[-1]``, the token not being known on the host yet.
    """

    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[str, ...] = ()
    input_rows: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class StepResult:
    """What a step produced: a sampled token per sampling sequence, and prompt logprobs
    (one ``TokenLogprob`` per target token of the plan) per request that asked for them.

    verified: per verify row (``ScheduledSeq.draft_token_ids`` not empty) every token it
        keeps, in order: its accepted drafts, then the target's token (``sampled`` holds
        the first of them).  ``len(verified[id]) - 1`` drafts were accepted.
    reference_mismatches: benchmark only: kept tokens of ``draft_reference`` rows where
        the target's argmax was another token (``engine/spec/verify.py``).
    """

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    verified: dict[str, list[SampledToken]] = field(default_factory=dict)
    reference_mismatches: int = 0


@dataclass
class InFlightTokens:
    """The greedy tokens of a launched step, not yet waited for (overlap scheduling).

    device: ``[B, 2]`` float64 (argmax id, its raw logprob) per row on the device; the next
        step gathers its input ids from it (valid until that step is launched).
    host: the same, on the host (pinned on CUDA), filled by a copy queued after the step.
    ready: the event after that copy (``None`` on CPU: the step ran synchronously).
    """

    device: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    def tokens(self) -> list[SampledToken]:
        """Wait for the step and return each row's token (what ``sampler.sample`` returns
        for a plain greedy row: the argmax, its logprob, no top logprobs)."""
        if self.ready is not None:
            self.ready.synchronize()
        return [SampledToken(int(t), lp, ()) for t, lp in self.host.tolist()]
