"""The acceptance rules of the verify step: which of a row's drafts the target keeps.

A verify row computes the logits of ``k + 1`` positions in one forward: the row's last
token and its ``k`` drafts ``d_1 .. d_k`` (``engine/worker/model_runner.py``).  Position
``i`` (0-based) predicts the token after ``d_i`` (``d_0`` = the last token).  Each position
is processed exactly as a non-speculative row at that point would be (``logit_bias``,
penalties over the tokens before it, the grammar's mask; ``sampler.processed_logits``),
then:

- **greedy**: the target's token ``t_i`` is the argmax at position ``i``; the longest prefix
  with ``d_{i+1} == t_i`` is accepted and ``t_a`` follows it (``a`` accepted drafts, ``a + 1``
  tokens kept).  So the tokens are exactly the non-speculative run's.
- **random** (the standard speculative-sampling rule, Leviathan et al. 2023 / Chen et al.
  2023): with ``p_i`` the target's distribution at position ``i`` (temperature, top-k/p,
  min-p: ``sampler.target_probs``) and ``q_i`` the proposal's, ``d_{i+1}`` is accepted with
  probability ``min(1, p_i(d) / q_i(d))``; the first rejection draws the kept token from
  the normalised residual ``max(0, p_i - q_i)``; when all ``k`` are accepted one more token
  is drawn from ``p_k``.  A deterministic proposal (n-gram, ``q`` one-hot) reduces to
  "accept with probability ``p_i(d)``, else draw from ``p_i`` with ``d`` removed".  The
  kept tokens are then distributed as the target's own samples.

Every kept token's logprob (and top-k) is the raw model's at its position, as without
speculation.

**Benchmark only**: a greedy span with a ``reference`` (``drafter.ReferenceDrafter``)
keeps ``reference[: a + 1]``, ``a`` the drafts equal to the reference's tokens before the
first that is not (a corrupted one), whatever the argmax; the kept positions whose argmax
differs are counted (:class:`Verified` ``.reference_mismatches``).  The drafter's
docstring says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from pdserve.engine.step import SampledToken
from pdserve.engine.worker.sampler import (
    SampleRequest,
    processed_logits,
    sample_request_of,
    target_probs,
    top_logprobs,
)

if TYPE_CHECKING:
    from pdserve.engine.step import ScheduledSeq


class VerifySpan(NamedTuple):
    """One sampling row's positions among the logits rows.

    row0: its first logits row; it covers ``row0 .. row0 + len(drafts)``.
    drafts: the ``k`` proposed ids (may be empty: a plain sampling row).
    q: ``None`` (deterministic proposal) or float32 ``[k, V]`` proposal distributions.
    reference: benchmark only: ``None`` or the ``k + 1`` tokens a greedy span keeps in
        place of the argmax (module docstring).
    """

    row0: int
    drafts: Sequence[int]
    q: torch.Tensor | None = None
    reference: Sequence[int] | None = None


class Verified(list[list[SampledToken]]):
    """:func:`verify`'s answer: per span its kept tokens (a list), and
    ``reference_mismatches`` (benchmark only: kept reference tokens that were not the
    argmax)."""

    reference_mismatches: int = 0


def verify_rows(seq: ScheduledSeq) -> list[SampleRequest]:
    """The sampling inputs of each of a sampling row's ``k + 1`` positions: position ``i``
    is sampled as the row would be after its drafts ``d_1 .. d_i`` were appended (their
    penalties, the grammar's mask after them: ``ScheduledSeq.draft_masks``)."""
    first = sample_request_of(seq)
    drafts = seq.draft_token_ids
    out = [first]
    for i in range(1, len(drafts) + 1):
        mask = seq.draft_masks[i - 1] if seq.draft_masks is not None else None
        pen = first.penalty_tokens
        out.append(
            first._replace(
                logits_mask=mask,
                penalty_tokens=pen.extended(drafts[:i]) if pen is not None else None,
            )
        )
    return out


def _race_argmax(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw from ``probs[V]`` (the exponential race ``argmax(p / E)``)."""
    e = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / e.clamp_(min=torch.finfo(e.dtype).tiny)).argmax())


def verify(
    logits: torch.Tensor,
    rows: Sequence[SampleRequest],
    spans: Sequence[VerifySpan],
    generator: torch.Generator | None = None,
) -> Verified:
    """The kept tokens of each span (module docstring), ``>= 1`` each, in order.

    logits: fp32 ``[R, V]``, the raw logits of every position of every span.
    rows: ``R`` sampling inputs, one per logits row (a span's rows share params and
        generator; penalties / masks / banned ids are each position's own).
    generator: draws of rows without their own (unseeded random rows).
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, V]
    work = processed_logits(logits, rows)
    kept: list[list[tuple[int, int]]] = []  # per span: (logits row, token id)
    greedy_spans = [j for j, s in enumerate(spans) if rows[s.row0].params.greedy]
    targets = work.argmax(dim=-1).tolist() if greedy_spans else []
    random_rows = [
        r
        for s in spans
        if not rows[s.row0].params.greedy
        for r in range(s.row0, s.row0 + len(s.drafts) + 1)
    ]
    probs = target_probs(work[random_rows], [rows[r] for r in random_rows]) if random_rows else None
    # random spans: those with their own generator one by one (a seed's draws never depend
    # on the batch), the others batched by (k, kind of proposal)
    tokens_of: dict[int, list[int]] = {}
    groups: dict[tuple[int, bool], list[tuple[int, int]]] = {}  # -> (span index, probs row)
    p_at = 0
    for j, span in enumerate(spans):
        if rows[span.row0].params.greedy:
            continue
        k = len(span.drafts)
        own = rows[span.row0].generator
        if own is not None:
            assert probs is not None
            tokens_of[j] = _accept_random(
                probs[p_at : p_at + k + 1], list(span.drafts), span.q, own
            )
        else:
            groups.setdefault((k, span.q is None), []).append((j, p_at))
        p_at += k + 1
    for (k, _), members in groups.items():
        assert probs is not None
        idx = torch.tensor([p for _, p in members], device=logits.device)
        P = probs[idx.unsqueeze(1) + torch.arange(k + 1, device=logits.device)]  # [S, k+1, V]
        D = torch.tensor(
            [list(spans[j].drafts) for j, _ in members], dtype=torch.int64, device=logits.device
        )
        qs = [spans[j].q for j, _ in members]
        Q = torch.stack([q for q in qs if q is not None]) if qs[0] is not None else None
        for (j, _), toks in zip(
            members, _accept_random_batch(P, D.view(len(members), k), Q, generator)
        ):
            tokens_of[j] = toks
    mismatches = 0
    for j, span in enumerate(spans):
        k = len(span.drafts)
        if rows[span.row0].params.greedy and span.reference is not None:
            ref = span.reference
            a = 0
            while a < k and span.drafts[a] == ref[a]:
                a += 1
            tokens = list(ref[: a + 1])
            mismatches += sum(t != targets[span.row0 + i] for i, t in enumerate(tokens))
        elif rows[span.row0].params.greedy:
            a = 0
            while a < k and span.drafts[a] == targets[span.row0 + a]:
                a += 1
            tokens = list(span.drafts[:a]) + [targets[span.row0 + a]]
        else:
            tokens = tokens_of[j]
        kept.append([(span.row0 + i, t) for i, t in enumerate(tokens)])
    flat = [rt for span_kept in kept for rt in span_kept]
    row_t = torch.tensor([r for r, _ in flat], device=logits.device)
    tok_t = torch.tensor([t for _, t in flat], device=logits.device)
    lp_rows = logprobs[row_t]  # [N, V]
    chosen = lp_rows.gather(1, tok_t.unsqueeze(1)).squeeze(1).tolist()
    tops = top_logprobs(lp_rows, [rows[r].params.logprobs or 0 for r, _ in flat])
    out = Verified()
    out.reference_mismatches = mismatches
    i = 0
    for span_kept in kept:
        out.append(
            [SampledToken(t, chosen[i + j], tops[i + j]) for j, (_, t) in enumerate(span_kept)]
        )
        i += len(span_kept)
    return out


def _accept_random_batch(
    P: torch.Tensor,
    D: torch.Tensor,
    Q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """:func:`_accept_random` for ``S`` rows at once, their draws from ``generator``:
    ``P[S, k + 1, V]``, ``D[S, k]`` int64, ``Q[S, k, V]`` or ``None``."""
    S, k1, _ = P.shape
    k = k1 - 1
    ar = torch.arange(S, device=P.device)
    if k:
        ratio = P[:, :k].gather(2, D.unsqueeze(2)).squeeze(2)  # [S, k]
        if Q is not None:
            ratio = ratio / Q.gather(2, D.unsqueeze(2)).squeeze(2).clamp(
                min=torch.finfo(Q.dtype).tiny
            )
        u = torch.rand(S, k, device=P.device, generator=generator)
        acc = u < ratio
        a = torch.where(acc.all(dim=1), k, (~acc).to(torch.int64).argmax(dim=1))  # [S]
    else:
        a = torch.zeros(S, dtype=torch.int64, device=P.device)
    dist = P[ar, a].clone()  # [S, V]
    rej = a < k
    if k and bool(rej.any()):
        r = ar[rej]
        ar_k = a[rej]
        if Q is None:
            dist[r, D[r, ar_k]] = 0.0
        else:
            dist[r] = (dist[r] - Q[r, ar_k]).clamp_(min=0.0)
        empty = dist.sum(dim=1) <= 0.0  # p == q: never rejected in exact arithmetic
        if bool(empty.any()):
            dist[empty] = P[ar, a][empty]
    dist = dist / dist.sum(dim=1, keepdim=True)
    e = torch.empty_like(dist).exponential_(generator=generator)
    drawn = (dist / e.clamp_(min=torch.finfo(e.dtype).tiny)).argmax(dim=1)
    a_host, drawn_host, d_host = a.tolist(), drawn.tolist(), D.tolist()
    return [d_host[i][: a_host[i]] + [drawn_host[i]] for i in range(S)]


def _accept_random(
    P: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """The speculative-sampling rule for one row: ``P[k + 1, V]`` the target's
    distributions, ``drafts`` its ``k`` proposed ids, ``q[k, V]`` their proposal (or
    ``None``: one-hot).  Returns the kept ids (accepted drafts, then one drawn id)."""
    k = len(drafts)
    if k:
        d = torch.tensor(drafts, device=P.device)
        ar = torch.arange(k, device=P.device)
        ratio = P[ar, d]
        if q is not None:
            ratio = ratio / q[ar, d].clamp(min=torch.finfo(q.dtype).tiny)
        u = torch.rand(k, device=P.device, generator=generator)
        accepted = (u < ratio).tolist()
        a = accepted.index(False) if False in accepted else k
    else:
        a = 0
    if a == k:
        return drafts + [_race_argmax(P[k], generator)]
    if q is None:
        residual = P[a].clone()
        residual[drafts[a]] = 0.0
    else:
        residual = (P[a] - q[a]).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q: never rejected in exact arithmetic
        residual = P[a]
    return drafts[:a] + [_race_argmax(residual / residual.sum(), generator)]


def verify_greedy_packed(
    packed: torch.Tensor, logits: torch.Tensor, spans: Sequence[VerifySpan]
) -> Verified:
    """:func:`verify` for spans whose rows are all plain greedy (``sampler.plain_greedy``,
    no grammar masks) from a verify graph's own greedy pick: ``packed [R, 2]`` float64
    (argmax id, its raw logprob) of every position (one device-to-host copy), the same
    numbers :func:`verify` computes from ``logits [R, V]`` fp32, which is read only for a
    kept token that is not the argmax (a benchmark reference override).  The kept tokens
    carry no top logprobs (none asked)."""
    rows = packed.tolist()
    out = Verified()
    for span in spans:
        k, r0 = len(span.drafts), span.row0
        targets = [int(rows[r0 + i][0]) for i in range(k + 1)]
        if span.reference is not None:
            a = 0
            while a < k and span.drafts[a] == span.reference[a]:
                a += 1
            tokens = [int(t) for t in span.reference[: a + 1]]
        else:
            a = 0
            while a < k and span.drafts[a] == targets[a]:
                a += 1
            tokens = list(span.drafts[:a]) + [targets[a]]
        kept = []
        for i, t in enumerate(tokens):
            if t == targets[i]:
                kept.append(SampledToken(t, rows[r0 + i][1], ()))
            else:
                out.reference_mismatches += 1
                lp = float(torch.log_softmax(logits[r0 + i], dim=-1)[t])
                kept.append(SampledToken(t, lp, ()))
        out.append(kept)
    return out
