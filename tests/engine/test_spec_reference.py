"""The benchmark-only acceptance-controlled mode that holds its rate in any dtype
(``engine/spec/drafter.py``: ``ReferenceDrafter``; ``engine/spec/verify.py``): in fp32 its
output equals the plain greedy run's token for token with no position overridden; the
acceptance length per verify row follows ``1 + r + ... + r^k`` within statistical bounds,
also when the reference is *not* what the target would choose (the bf16 case, simulated
by a reference that departs from the plain run), where the output is then the reference
and the overridden positions are counted; every page is back at the end of each run
(``overlap_runs.drive`` checks the accounting after every step)."""

from __future__ import annotations

import math

import pytest
import torch
from overlap_runs import PROMPTS, assert_same, core_of, drive, greedy

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.drafter import DraftInput, ReferenceDrafter
from pdserve.engine.spec.verify import VerifySpan, verify
from pdserve.engine.worker.sampler import SampleRequest

K = 4
SPEC = {"speculative_algorithm": "ngram", "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


class _Recorded(ReferenceDrafter):
    """A ReferenceDrafter that records each verify row's drafts and accepted count."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.proposed: dict[str, int] = {}
        self.rows: list[tuple[int, int]] = []  # (drafts proposed, accepted)

    def propose(self, rows):
        out = super().propose(rows)
        for row, d in zip(rows, out):
            self.proposed[row.request_id] = len(d.token_ids)
        return out

    def on_verified(self, request_id, num_accepted):
        self.rows.append((self.proposed[request_id], num_accepted))


def _expected_accepted(rate: float, k: int) -> tuple[float, float]:
    """Mean and variance of the accepted drafts of a row of ``k`` drafts, each accepted
    with probability ``rate`` up to the first rejection."""
    p = [rate**i * (1 - rate) for i in range(k)] + [rate**k]  # P(a = i), i = 0..k
    mean = sum(i * pi for i, pi in enumerate(p))
    return mean, sum((i - mean) ** 2 * pi for i, pi in enumerate(p))


def _assert_rate(rows: list[tuple[int, int]], rate: float) -> None:
    """The accepted drafts of ``rows`` sum to their expectation within 3 standard
    deviations, and the mean acceptance length of full rows (k drafts) is near
    ``1 + r + ... + r^k``."""
    mean = var = 0.0
    for k, _ in rows:
        m, v = _expected_accepted(rate, k)
        mean, var = mean + m, var + v
    got = sum(a for _, a in rows)
    assert abs(got - mean) <= 3 * math.sqrt(var) + 1e-9, (got, mean, var, len(rows))
    full = [a for k, a in rows if k == K]
    assert len(full) >= 40, len(full)
    want = sum(rate**i for i in range(K + 1))
    _, v = _expected_accepted(rate, K)
    assert abs(1 + sum(full) / len(full) - want) <= 3 * math.sqrt(v / len(full))


def _run(folder, refs, rate, params, seed=3):
    """Plain and speculative runs of PROMPTS; the speculative one with a recorded
    ReferenceDrafter over ``refs`` (None: the plain run's outputs)."""
    reqs = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    base = core_of(folder, False)
    _, f0 = drive(base, reqs)
    if refs is None:
        refs = [list(p) + list(f0[rid][0]) for rid, p, _ in reqs]
    spec = core_of(folder, False, **SPEC)
    d = _Recorded(refs, K, rate, spec.vocab_size, seed=seed)
    spec.set_drafter(d, K)
    _, f1 = drive(spec, reqs)
    return reqs, f0, f1, spec, d


@pytest.mark.parametrize("rate", [0.5, 0.8])
def test_reference_mode_equals_plain_greedy_in_fp32(folder, rate):
    """fp32: the verify forward's argmax is the reference at every kept position (no
    override), the output (tokens, logprobs, top-3) equals the plain run's, and the rate
    holds."""
    params = greedy(max_tokens=80, ignore_eos=True, logprobs=3)
    _, f0, f1, spec, d = _run(folder, None, rate, params)
    assert_same(f1, f0)
    assert spec.scheduler.num_reference_mismatches == 0
    st = spec.stats()
    assert st["spec_verify_rows"] == len(d.rows)
    assert st["spec_accepted_tokens"] == sum(a for _, a in d.rows)
    _assert_rate(d.rows, rate)


def test_reference_mode_holds_its_rate_when_the_target_disagrees(folder):
    """A reference the target does not follow (what the verify step's rounding does in
    bf16 at a near tie; here: the plain outputs with one token changed early, after which
    the reference is no continuation the target would choose): the rate still holds, the
    output is the reference (all but the last token, decoded plainly: no room for a
    draft), and the overridden positions are counted."""
    params = greedy(max_tokens=80, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    base = core_of(folder, False)
    _, f0 = drive(base, reqs)
    refs = []
    for rid, p, _ in reqs:
        out = list(f0[rid][0])
        out[2] = (out[2] + 17) % base.vocab_size
        refs.append(list(p) + out)
    _, _, f1, spec, d = _run(folder, refs, 0.8, params)
    for (_, p, _), ref in zip(reqs, refs):
        got = list(f1[f"r{PROMPTS.index(p)}"][0])
        assert got[:-1] == ref[len(p) : len(p) + 79]
    assert spec.scheduler.num_reference_mismatches >= len(PROMPTS)
    _assert_rate(d.rows, 0.8)


def test_reference_drafter_proposals():
    """Each draft is the reference's token or (corrupted) the next id; the reference
    carried is the drafts' positions and the one after; no draft without room for it."""
    ref = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    d = ReferenceDrafter([ref], K, 0.5, vocab_size=100, seed=0)
    seen_bad = False
    for n in range(3, 8):
        (draft,) = d.propose([DraftInput(f"x{n}", ref[:n], K)])
        k = min(K, len(ref) - n - 1)
        assert draft.reference == tuple(ref[n : n + k + 1])
        assert len(draft.token_ids) == k
        for t, r in zip(draft.token_ids, ref[n:]):
            assert t in (r, r + 1)
            seen_bad |= t != r
    assert seen_bad
    (none,) = d.propose([DraftInput("y", ref[:8], K)])  # one token left: no room
    assert none.token_ids == [] and none.reference is None
    (other,) = d.propose([DraftInput("z", [9, 9], K)])
    assert other.token_ids == []


def test_verify_keeps_the_reference_and_counts_overrides():
    """A greedy span with a reference keeps it up to the first draft that differs from it
    (plus that position's reference token), whatever the argmax; a sampled span ignores
    it; logprobs are the kept tokens' own."""
    V = 8
    logits = torch.full((8, V), -5.0)
    logits[torch.arange(4), torch.tensor([3, 3, 3, 3])] = 5.0  # argmax 3 at rows 0..3
    logits[4:, 0] = 5.0
    g = SampleRequest(SamplingParams(temperature=0.0), None)
    r = SampleRequest(SamplingParams(temperature=1.0, seed=1), torch.Generator().manual_seed(1))
    # drafts 3, 5 (equal to the reference), 7 (not: reference says 6)
    spans = [VerifySpan(0, (3, 5, 7), None, (3, 5, 6, 1)), VerifySpan(4, (0, 0, 0), None, (1,) * 4)]
    kept = verify(logits, [g] * 4 + [r] * 4, spans)
    assert [t.token_id for t in kept[0]] == [3, 5, 6]
    assert kept.reference_mismatches == 2  # 5 and 6 where the argmax was 3
    lp = torch.log_softmax(logits, -1)
    assert [t.logprob for t in kept[0]] == pytest.approx(
        [lp[0, 3].item(), lp[1, 5].item(), lp[2, 6].item()]
    )
    assert all(t.token_id != 1 for t in kept[1])  # the sampled span: the normal rule
