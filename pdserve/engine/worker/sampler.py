"""Sampling the next token of each sequence, and the logprobs OpenAI/vLLM report.

One call handles the whole batch ``logits[B, V]`` (fp32) with batched tensor ops, in
this order (vLLM v1's order):

1. logprobs: ``log_softmax`` of the raw logits, before anything below (what OpenAI and
   vLLM report);
2. ``logit_bias`` added, ``min_tokens``' banned ids set to ``-inf``;
3. penalties (``engine/worker/penalties.py``): ``repetition_penalty`` over prompt + output
   tokens, then ``frequency_penalty`` / ``presence_penalty`` over the output tokens;
4. :func:`apply_logits_masks`: the per-row allowed-token mask (structured outputs plug
   their grammar in here);
5. greedy rows take the exact argmax; random rows apply temperature, top-k, top-p
   (nucleus), min-p, then draw with the exponential race ``argmax(p / E)``,
   ``E ~ Exp(1)``.  A seeded row draws its ``V`` exponentials from its own
   ``torch.Generator`` (so its tokens depend only on its seed, never on the batch); the
   unseeded rows draw theirs in one batched call from the shared generator.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step import SampledToken
from pdserve.engine.worker.penalties import PenaltyTokens, apply_penalties

logger = logging.getLogger(__name__)


class SampleRequest(NamedTuple):
    """Sampling inputs of one row (a named tuple: one is built per row per step).

    params: the request's sampling params.
    generator: the row's own generator, for seeded random rows only (``params.seed`` set);
        ``None`` for greedy rows and unseeded ones (those use ``sample``'s ``generator``).
    banned_token_ids: ids masked to ``-inf`` (EOS / stop ids before ``min_tokens``).
    penalty_tokens: the request's tokens on the device (``engine/worker/penalties.py``), read
        only when ``params.has_penalties``: the penalty state is a function of them, so a
        decode worker that holds prompt + first token samples as a mixed worker does.
    prompt_token_ids / output_token_ids: the same as plain lists, for callers without
        ``penalty_tokens`` (tests, one-off use; copied to the device on every call).
    logits_mask: optional bool ``[V]`` tensor, True where a token is allowed (see
        :func:`apply_logits_masks`); ``None`` = unconstrained.
    """

    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    logits_mask: torch.Tensor | None = None
    penalty_tokens: PenaltyTokens | None = None


def sample_request_of(seq: Any) -> SampleRequest:
    """The :class:`SampleRequest` of a scheduled sequence (``step.ScheduledSeq``):
    the model runner's one way to build rows, so new sampling inputs need no runner change."""
    return SampleRequest(
        seq.params,
        seq.generator,
        seq.banned_token_ids,
        logits_mask=getattr(seq, "logits_mask", None),
        penalty_tokens=getattr(seq, "penalty_tokens", None),
    )


def plain_greedy(seq: Any) -> bool:
    """Whether a scheduled sequence's token is the exact argmax of its raw logits and needs
    nothing but that token's logprob: greedy, no ``logit_bias``, no banned ids, no
    penalties, no logits mask, no top logprobs. Such rows of a CUDA-graph step take the
    graph's own argmax (``engine/worker/cuda_graph.py``) instead of :func:`sample`."""
    p = seq.params
    return bool(
        p.greedy
        and not p.logprobs
        and not p.logit_bias
        and not p.has_penalties
        and not seq.banned_token_ids
        and getattr(seq, "logits_mask", None) is None
    )


def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[tuple[tuple[int, float], ...]]:
    """Top-``ks[i]`` ``(token_id, logprob)`` pairs of each row of ``logprobs[N, V]``."""
    k_max = max(ks, default=0)
    if k_max == 0:
        return [()] * len(ks)
    vals_t, ids_t = logprobs.topk(k_max, dim=-1)
    vals, ids = vals_t.tolist(), ids_t.tolist()
    return [tuple(zip(ids[r][:k], vals[r][:k])) for r, k in enumerate(ks)]


def skip_draw(generator: torch.Generator, vocab_size: int, device: torch.device) -> None:
    """Advance ``generator`` exactly as one random draw of a seeded row does (used when
    the first token was sampled on another worker, so later tokens match a
    non-disaggregated run)."""
    torch.empty(vocab_size, device=device).exponential_(generator=generator)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, device=like.device, dtype=like.dtype).unsqueeze(1)


# The temperatures the logits are divided by, in fp32: any finite temperature > 0 is
# accepted (as vLLM and SGLang), but one that fp32 cannot hold, or that makes the quotient
# overflow, would turn a row into NaN (``-inf / inf``: a masked or banned token; ``x / 0``
# or ``+inf`` logits: a temperature that underflows to 0), and the draw into token 0.
# Clamped to this range the quotient stays finite for logits up to ~3e8 in magnitude, and
# the distribution is what the temperature's limit is: below 1e-30 every token but the
# largest logit(s) has probability exp(-gap * 1e30) = 0 (argmax), above 1e30 every
# allowed token has exp(logit * 1e-30) = 1 (uniform). Inside it nothing changes.
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 1e30


def _apply_bias_and_bans(work: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """``logit_bias`` added and banned ids set to ``-inf``, each one ``index_put_``."""
    b_rows: list[int] = []
    b_ids: list[int] = []
    b_vals: list[float] = []
    x_rows: list[int] = []
    x_ids: list[int] = []
    for i, r in enumerate(rows):
        for tid, bias in r.params.logit_bias_items:
            b_rows.append(i)
            b_ids.append(tid)
            b_vals.append(bias)
        x_rows += [i] * len(r.banned_token_ids)
        x_ids += r.banned_token_ids
    dev = work.device
    if b_rows:
        work.index_put_(
            (torch.tensor(b_rows, device=dev), torch.tensor(b_ids, device=dev)),
            torch.tensor(b_vals, device=dev, dtype=work.dtype),
            accumulate=True,
        )
    if x_rows:
        work[torch.tensor(x_rows, device=dev), torch.tensor(x_ids, device=dev)] = float("-inf")
    return work


def _apply_penalties(work: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """The penalties of the rows that have any (``engine/worker/penalties.py``); a row without
    ``penalty_tokens`` (a direct caller) gets them built from its token lists."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    tokens = []
    for i in idx:
        r = rows[i]
        tokens.append(
            r.penalty_tokens
            or PenaltyTokens(
                list(r.prompt_token_ids) + list(r.output_token_ids), len(r.prompt_token_ids)
            )
        )
    return apply_penalties(work, idx, [rows[i].params for i in idx], tokens)


def apply_logits_masks(work: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """The one place where a per-row allowed-token mask applies, after bias/penalties and
    before greedy argmax / temperature / top-k / top-p (so a constrained row never picks a
    disallowed token, and top-p renormalises over the allowed ones).

    ``work[B, V]`` fp32, modified in place and returned; ``rows[i].logits_mask`` is
    ``None`` (row unconstrained) or a bool tensor ``[V]`` on ``work``'s device, True =
    allowed.  Disallowed entries become ``-inf``.  A mask allowing nothing (a grammar bug:
    a matcher always allows EOS or some token) leaves its row unconstrained, with a
    warning, rather than failing the step and with it every request of the batch.
    Structured outputs (``engine/structured/``) fill ``logits_mask``; reported logprobs
    stay the raw model's.
    """
    masked = [i for i, r in enumerate(rows) if r.logits_mask is not None]
    if not masked:
        return work
    allowed = torch.stack([m for m in (rows[i].logits_mask for i in masked) if m is not None])
    empty = ~allowed.any(dim=-1)  # [M]
    if bool(empty.any()):
        logger.warning("a logits_mask allows no token; its row is sampled unconstrained")
        allowed[empty] = True
    work[masked] = work[masked].masked_fill(~allowed, float("-inf"))
    return work


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p to ``logits[B, V]`` (already temperature-scaled);
    masked entries become ``-inf``."""
    vocab = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        rank = torch.arange(vocab, device=logits.device)
        k_t = torch.tensor(ks, device=logits.device).unsqueeze(1)
        mask = rank >= k_t
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        # Nucleus: drop a token once the mass before it reaches top_p (the best one stays).
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        p_t = torch.tensor(ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= p_t, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(
            min_ps, device=logits.device, dtype=probs.dtype
        ).unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _race(
    probs: torch.Tensor, rows: Sequence[SampleRequest], generator: torch.Generator | None
) -> torch.Tensor:
    """``E ~ Exp(1)`` of shape ``probs[R, V]``: a seeded row's from its own generator (one
    ``[V]`` draw, the same whatever the batch), the unseeded rows' in one batched draw."""
    race = torch.empty_like(probs)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        if len(unseeded) == len(rows):
            race.exponential_(generator=generator)
        else:
            race[unseeded] = torch.empty(
                len(unseeded), probs.shape[-1], device=probs.device, dtype=probs.dtype
            ).exponential_(generator=generator)
    for j, r in enumerate(rows):
        if r.generator is not None:
            race[j].exponential_(generator=r.generator)
    return race.clamp_(min=torch.finfo(race.dtype).tiny)  # an exact 0 would give 0/0 = nan


def processed_logits(logits: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """Steps 2-4 of the module docstring (``logit_bias``, banned ids, penalties, masks)
    applied to ``logits[B, V]`` fp32: a new tensor when any row needs one, else ``logits``
    itself.  A greedy row's token is this tensor's argmax."""
    needs_work = any(
        r.banned_token_ids
        or r.params.logit_bias
        or r.params.has_penalties
        or r.logits_mask is not None
        for r in rows
    )
    if not needs_work:
        return logits
    work = logits.clone()
    _apply_bias_and_bans(work, rows)
    _apply_penalties(work, rows)
    apply_logits_masks(work, rows)
    return work


def target_probs(work: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
    """The distribution random rows draw from: ``work[R, V]`` (from :func:`processed_logits`)
    over each row's temperature, top-k / top-p / min-p filtered, softmaxed (fp32 ``[R, V]``,
    rows sum to 1).  Every row of ``rows`` must be a random (non-greedy) one; its
    temperature counts as within [``MIN_TEMPERATURE``, ``MAX_TEMPERATURE``]."""
    temps = _column([r.params.temperature for r in rows], work)
    temps.clamp_(MIN_TEMPERATURE, MAX_TEMPERATURE)  # [R, 1]: finite, > 0 (see above)
    scaled = _filter(work / temps, [r.params for r in rows])
    return scaled.softmax(dim=-1)


def sample(
    logits: torch.Tensor,
    rows: Sequence[SampleRequest],
    generator: torch.Generator | None = None,
) -> list[SampledToken]:
    """Sample one token per row of ``logits[B, V]`` (fp32); see the module docstring.

    generator: draws of the unseeded random rows (``None``: torch's default generator).
    Returns, per row, the token, its raw logprob and the top-``params.logprobs``
    alternatives (empty when logprobs were not asked); results cross to the host once.
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    work = processed_logits(logits, rows)
    chosen = work.argmax(dim=-1)  # greedy rows keep this
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sub_rows = [rows[i] for i in random_rows]
        probs = target_probs(work[random_rows], sub_rows)
        chosen[random_rows] = (probs / _race(probs, sub_rows, generator)).argmax(dim=-1)
    ks = [r.params.logprobs or 0 for r in rows]
    k_max = max(ks, default=0)
    # One device->host copy: [B, 2 + 2k] = token id, its logprob, top-k ids, top-k logprobs
    # (ids are exact in float64).
    packed = [chosen.unsqueeze(1).double(), logprobs.gather(1, chosen.unsqueeze(1)).double()]
    if k_max:
        vals, ids = logprobs.topk(k_max, dim=-1)
        packed += [ids.double(), vals.double()]
    host = torch.cat(packed, dim=1).tolist()
    if not k_max:  # no row asked for alternatives: no per-row slicing
        return [SampledToken(int(t), lp, ()) for t, lp in host]
    out = []
    for row, k in zip(host, ks):
        top = tuple(zip((int(t) for t in row[2 : 2 + k]), row[2 + k_max : 2 + k_max + k]))
        out.append(SampledToken(int(row[0]), row[1], top))
    return out
