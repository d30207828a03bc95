"""Drafters: what proposes the ``k`` tokens a verify step checks.

The scheduler (``engine/core/scheduler.py``) asks its drafter once per step for every
running decode row that may speculate, with the row's tokens so far (prompt + output) and
the most tokens it may propose (bounded by ``num_speculative_tokens``, ``max_tokens``, the
context limit and the step's token budget).  The drafter answers with a :class:`Draft`
per row: the proposed ids and, for a drafter that samples its proposal, the proposal's
probabilities (``q``) that the speculative-sampling rule (``verify.py``) needs; a
deterministic proposal (n-gram) leaves ``q`` ``None`` (a one-hot proposal).

A drafter that holds per-request state (a draft model's KV) learns how many of its tokens
were accepted (:meth:`Drafter.on_verified`) and when a request leaves (:meth:`Drafter.release`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch


class DraftInput(NamedTuple):
    """One row to draft for: its request id, its tokens so far (prompt + output; the
    request's own list, read only) and the most tokens to propose (>= 1)."""

    request_id: str
    token_ids: Sequence[int]
    max_k: int


class Draft(NamedTuple):
    """A drafter's proposal for one row.

    token_ids: the proposed ids, at most ``max_k`` (may be empty: nothing to propose).
    q: ``None`` for a deterministic proposal, else float32 ``[len(token_ids), V]``: the
        distribution each token was drawn from (rows sum to 1).
    reference: **benchmark only** (:class:`ReferenceDrafter`): ``None``, or the
        ``len(token_ids) + 1`` tokens a greedy verify of this row keeps in place of the
        target's argmax (``verify.py``); every other drafter leaves it ``None``.
    """

    token_ids: list[int]
    q: torch.Tensor | None = None
    reference: tuple[int, ...] | None = None


class Drafter:
    """The interface.  ``propose`` is required; the hooks default to no-ops."""

    name = "none"

    def propose(self, rows: Sequence[DraftInput]) -> list[Draft]:
        """One :class:`Draft` per row, in order."""
        raise NotImplementedError

    def on_verified(self, request_id: str, num_accepted: int) -> None:
        """``num_accepted`` of the request's last proposal were accepted (the rest are gone)."""

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted or preempted)."""


class NgramDrafter(Drafter):
    """Prompt lookup: the longest suffix of the row's tokens (``max_n`` down to ``min_n``
    tokens) that occurred earlier in them; the tokens that followed its most recent earlier
    occurrence with ``k`` tokens after it (else its earliest) are the proposal (at most
    ``max_k``).  Deterministic (``q`` is ``None``).

    num_speculative_tokens: the most tokens proposed per row (k).  min_n/max_n: the n-gram
    sizes tried, longest first.  ValueError naming the field for k < 1, min_n < 1 or
    max_n < min_n.  Cost: O(L * n) numpy work per row and size, L the row's length.
    """

    name = "ngram"

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if min_n < 1:
            raise ValueError(f"speculative_ngram_min must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(
                f"speculative_ngram_max ({max_n}) must be >= speculative_ngram_min ({min_n})"
            )
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, rows: Sequence[DraftInput]) -> list[Draft]:
        return [Draft(self.lookup(r.token_ids, min(r.max_k, self.k))) for r in rows]

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The proposal for one sequence of ``token_ids`` (at most ``k`` ids; may be empty)."""
        L = len(token_ids)
        if k < 1 or self.min_n + 1 > L:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = ids[L - n :]
            # windows starting at 0 .. L-n-1 (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(ids[: L - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # what followed the most recent occurrence with k tokens after it (a run of
                # one token matches itself one place back), else the earliest one
                full = hits[hits + n + k <= L]
                start = int(full[-1] if full.size else hits[0]) + n
                out: list[int] = ids[start : start + k].tolist()
                return out
        return []


class ReplayDrafter(Drafter):
    """The acceptance-controlled drafter of benchmarks and tests: it proposes a known
    continuation of each sequence (the target's own greedy output, recorded beforehand)
    with each draft token independently corrupted (replaced by the next id) with
    probability ``1 - accept_rate``, so a greedy verify accepts each draft with probability
    ``accept_rate`` until the first corrupted one.  For random weights, where no real
    drafter can guess.

    references: the full token lists (prompt + recorded output) of the sequences to draft
        for; a row whose tokens are a prefix of none gets no draft.
    num_speculative_tokens: k.  accept_rate: in [0, 1].  vocab_size: ids wrap below it.
    seed: the corruption draws (a numpy generator).
    """

    name = "replay"

    def __init__(
        self,
        references: Sequence[Sequence[int]],
        num_speculative_tokens: int,
        accept_rate: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        self.k = num_speculative_tokens
        self.accept_rate = accept_rate
        self.vocab_size = vocab_size
        self._refs = [list(r) for r in references]
        self._rng = np.random.default_rng(seed)
        # request id -> [index of its reference (-1: none), tokens checked against it]
        self._of: dict[str, list[int]] = {}

    def _reference(self, row: DraftInput) -> list[int] | None:
        """The reference ``row``'s tokens are a prefix of, or None (none, or they left it:
        a row's tokens only grow, so it never comes back).  Only the tokens added since
        the last call are compared (a row's tokens are checked once)."""
        ids = row.token_ids
        n = len(ids)
        state = self._of.get(row.request_id)
        if state is None:
            head = list(ids)
            idx = next((i for i, r in enumerate(self._refs) if len(r) > n and r[:n] == head), -1)
            state = self._of[row.request_id] = [idx, n]
        idx, checked = state
        if idx < 0:
            return None
        ref = self._refs[idx]
        if n > checked:
            if len(ref) < n or ref[checked:n] != list(ids[checked:n]):
                state[0] = -1
                return None
            state[1] = n
        return ref

    def propose(self, rows: Sequence[DraftInput]) -> list[Draft]:
        out = []
        for row in rows:
            ref = self._reference(row)
            n = len(row.token_ids)
            if ref is None or len(ref) <= n:
                out.append(Draft([]))
                continue
            tokens = ref[n : n + min(row.max_k, self.k)]
            bad = self._rng.random(len(tokens)) >= self.accept_rate
            out.append(Draft([(t + 1) % self.vocab_size if b else t for t, b in zip(tokens, bad)]))
        return out

    def release(self, request_id: str) -> None:
        self._of.pop(request_id, None)


class ReferenceDrafter(ReplayDrafter):
    """**Benchmark only.**  Acceptance-controlled speculation that holds its rate in any
    dtype: :class:`ReplayDrafter`'s proposals (a recorded plain greedy run's continuation,
    each draft corrupted with probability ``1 - accept_rate``), plus, per row, that
    reference continuation itself (``Draft.reference``: the drafts' ``k`` positions and
    the one after).  A greedy verify of such a row (``verify.py``) keeps the reference's
    tokens up to and including the first corrupted position — ``a`` accepted drafts and
    the reference's next token — whatever the target's argmax there, and counts every kept
    position where the argmax differed (``Scheduler.num_reference_mismatches``; ``bench
    offline`` reports it as ``reference_mismatches``).

    Why not the plain :class:`ReplayDrafter`: its acceptance relies on the verify forward
    choosing exactly the plain run's tokens.  In bf16 the verify forward (``k + 1`` query
    rows, the extend attention kernel, GEMMs of another M) rounds differently from the
    decode step, so at a near tie of a random model's logits the speculative run takes
    another token; from there the recorded continuation is no continuation of the row at
    all, the row gets no drafts, and the measured acceptance collapses (the H200 run:
    1.60 tokens a verify row at rate 0.8, k = 4, where ~3.4 was set).  A drafter cannot
    re-synchronise for free: a verify forward reveals only one new greedy token per row
    (the one after the accepted prefix); proposing the target's continuation of a new
    prefix takes one forward per token, the cost speculation exists to avoid.

    What this mode guarantees instead:

    (a) **the same GPU work as real speculation at rate r**: every step is a real verify
        forward over the row's last token and its ``k`` drafts (the drafts are the
        reference's tokens, corrupted ones included, so the KV written and attended is
        that of real drafts), the rejected drafts' KV is rolled back by the same
        scheduler code, and the acceptance length per verify row is ``1 + r + ... + r^k``
        in expectation, in every dtype;
    (b) **no token the target did not choose given the emitted prefix**, with "the target"
        being the plain greedy run whose output is the reference: the output is that run's
        output token for token (but for a request's last token, which leaves no room for
        a draft and is decoded plainly: in bf16 it may differ).  In exact arithmetic (fp32
        on CPU) the verify forward's argmax equals the reference at every kept position,
        so nothing is overridden (the tests assert no override and the parity); in bf16
        the count of overridden positions is reported beside the figures (the near ties
        where the verify step's rounding picks another token), so the reader sees how far
        the verify forward departs from the decode step's numerics;
    (c) it is never built by a server or a flag: only ``pdserve bench offline
        --speculative reference:RATE`` and the tests make one.

    Rows with sampling parameters other than greedy ignore the reference (the normal
    acceptance rule applies); a row with no reference gets no draft.
    """

    name = "reference"

    def propose(self, rows: Sequence[DraftInput]) -> list[Draft]:
        out = []
        for row in rows:
            ref = self._reference(row)
            n = len(row.token_ids)
            # the drafts' k positions and the bonus one after them
            k = min(row.max_k, self.k, len(ref) - n - 1) if ref is not None else 0
            if ref is None or k < 1:
                out.append(Draft([]))
                continue
            cont = ref[n : n + k + 1]
            bad = self._rng.random(k) >= self.accept_rate
            drafts = [(t + 1) % self.vocab_size if b else t for t, b in zip(cont, bad)]
            out.append(Draft(drafts, reference=tuple(cont)))
        return out
