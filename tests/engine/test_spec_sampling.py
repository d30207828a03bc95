"""Speculative sampling is faithful: the kept tokens of ``engine/spec/verify.py``'s rule
are distributed as the target's own samples (chi-square over >= 20,000 draws, fixed seeds,
on a tiny random model's real distributions), for a deterministic proposal (n-gram: ``q``
one-hot) and a sampled one (a draft model's ``q``); and a sampled request through a
speculating engine is reproducible by seed with its pages all back."""

from __future__ import annotations

import pytest
import torch
import transformers
from overlap_runs import PROMPTS, core_of, drive

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.verify import VerifySpan, verify
from pdserve.engine.worker.sampler import SampleRequest, target_probs
from tiny_models import random_tiny_model

V = 32
N = 24_000  # draws per case
BATCH = 6_000
CONTEXT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return random_tiny_model(cfg, seed=3)


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [L, V]


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of ``counts[V]`` to ``probs[V]``; cells with an
    expected count under 5 pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def _run(params, logits_of, drafts_of, q_of=None, seed=0, own=False):
    """``N`` spans in batches; returns the kept token lists.  own: every row carries the
    generator as its own (the one-row-at-a-time path of seeded rows), else the batched
    path of unseeded rows."""
    gen = torch.Generator().manual_seed(seed)
    kept: list[list[int]] = []
    for b in range(0, N, BATCH):
        logits, rows, spans = [], [], []
        for i in range(b, b + BATCH):
            drafts = drafts_of(i, gen)
            ls = logits_of(drafts)
            spans.append(VerifySpan(len(rows), drafts, q_of(drafts) if q_of else None))
            logits.append(ls)
            rows += [SampleRequest(params, gen if own else None)] * ls.shape[0]
        out = verify(torch.cat(logits), rows, spans, gen)
        kept += [[t.token_id for t in toks] for toks in out]
    return kept


def _probs(params, logits):
    return target_probs(logits, [SampleRequest(params, None)] * logits.shape[0])


@pytest.mark.parametrize("top_p,own", [(1.0, False), (0.9, False), (1.0, True)])
def test_ngram_proposal_keeps_the_target_distribution(model, top_p, own):
    """q one-hot: accept d with p(d), else draw from p without d.  First kept token ~ p0;
    after an accepted first draft the second kept token ~ p1 (accepted d2 or a residual
    draw)."""
    params = SamplingParams(temperature=0.9, top_p=top_p)
    l0 = _logits(model, CONTEXT)[-1]
    d1 = int(l0.argmax())
    seq = _logits(model, CONTEXT + [d1, 7])[-3:]  # positions: after context, d1, 7
    p = _probs(params, seq)
    drafts = (d1, 7)
    kept = _run(params, lambda d: seq, lambda i, g: drafts, own=own)
    first = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=V)
    assert _p_value(first, p[0]) > 1e-3
    second = [k[1] for k in kept if len(k) > 1]
    assert len(second) > 0.1 * N
    assert _p_value(torch.bincount(torch.tensor(second), minlength=V), p[1]) > 1e-3
    # the wrong distributions are rejected (the test can fail)
    assert _p_value(first, torch.full((V,), 1.0 / V)) < 1e-6


@pytest.mark.parametrize("own", [False, True])
def test_draft_model_proposal_keeps_the_target_distribution(model, own):
    """q sampled (a draft model): accept with min(1, p/q), else draw from the normalised
    residual max(0, p - q).  Drafts drawn from q; the target's position-1 logits follow
    each drawn draft."""
    params = SamplingParams(temperature=1.0)
    l0 = _logits(model, CONTEXT)[-1]
    after = {d: _logits(model, CONTEXT + [d])[-1] for d in range(V)}  # p1 given d1
    q0 = torch.softmax(l0 * 0.3 + torch.linspace(-1, 1, V), dim=-1)  # a different proposal
    p0 = _probs(params, l0.unsqueeze(0))[0]

    def drafts_of(i, gen):
        return (int(torch.multinomial(q0, 1, generator=gen)),)

    kept = _run(
        params,
        lambda d: torch.stack([l0, after[d[0]]]),
        drafts_of,
        q_of=lambda d: q0.unsqueeze(0),
        seed=5,
        own=own,
    )
    first = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=V)
    assert _p_value(first, p0) > 1e-3
    assert _p_value(first, q0) < 1e-6  # not the proposal's distribution


def test_seeded_sampling_through_a_speculating_engine(tiny_model_dir):
    folder = tiny_model_dir("llama")
    params = SamplingParams(temperature=0.1, seed=7, max_tokens=24, ignore_eos=True, logprobs=1)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:3] + [[5, 6, 7, 8] * 4])]
    runs = []
    for _ in range(2):
        core = core_of(folder, False, speculative_algorithm="ngram", num_speculative_tokens=3)
        _, finals = drive(core, reqs)
        runs.append(finals)
        assert core.stats()["spec_accepted_tokens"] > 0
    assert runs[0] == runs[1]
    assert all(len(f[0]) == 24 for f in runs[0].values())
