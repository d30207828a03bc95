"""Sampling the next token of each sequence, and the logprobs OpenAI/vLLM report.

Greedy rows take the exact argmax.  Random rows apply, in order: temperature, top-k,
top-p (nucleus), min-p, then draw with the request's own ``torch.Generator`` using the
exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` (one draw of ``V`` exponentials per
token, so the result depends only on the request's seed, never on the batch).
Logprobs are ``log_softmax`` of the raw logits (before any of the above).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleRequest:
    """Sampling inputs of one row: params, its generator (None for greedy), masked ids."""

    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampledToken:
    """One row's result: the token, its logprob and its top-k ``(id, logprob)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[tuple[tuple[int, float], ...]]:
    """Top-``ks[i]`` ``(token_id, logprob)`` pairs of each row of ``logprobs[N, V]``."""
    k_max = max(ks, default=0)
    if k_max == 0:
        return [()] * len(ks)
    vals, ids = logprobs.topk(k_max, dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [tuple(zip(ids[r][:k], vals[r][:k])) for r, k in enumerate(ks)]


def skip_draw(generator: torch.Generator, vocab_size: int, device: torch.device) -> None:
    """Advance ``generator`` exactly as one random draw does (used when the first token
    was sampled on another worker, so later tokens match a non-disaggregated run)."""
    torch.empty(vocab_size, device=device).exponential_(generator=generator)


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


def sample(logits: torch.Tensor, rows: Sequence[SampleRequest]) -> list[SampledToken]:
    """Sample one token per row of ``logits[B, V]`` (fp32).

    Returns, per row, the token, its raw logprob and the top-``params.logprobs``
    alternatives (empty when logprobs were not asked).
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    work = logits
    if any(r.banned_token_ids for r in rows):
        work = logits.clone()
        for i, r in enumerate(rows):
            if r.banned_token_ids:
                work[i, list(r.banned_token_ids)] = float("-inf")
    chosen = work.argmax(dim=-1)  # greedy rows keep this
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor(
            [rows[i].params.temperature for i in random_rows],
            device=logits.device,
            dtype=work.dtype,
        ).unsqueeze(1)
        scaled = _filter(work[idx] / temps, [rows[i].params for i in random_rows])
        probs = scaled.softmax(dim=-1)
        for j, i in enumerate(random_rows):
            race = torch.empty_like(probs[j]).exponential_(generator=rows[i].generator)
            race.clamp_(min=torch.finfo(race.dtype).tiny)  # an exact 0 would give 0/0 = nan
            chosen[i] = (probs[j] / race).argmax()
    token_ids = chosen.tolist()
    token_lps = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    tops = top_logprobs(logprobs, [r.params.logprobs or 0 for r in rows])
    return [SampledToken(t, lp, top) for t, lp, top in zip(token_ids, token_lps, tops)]
