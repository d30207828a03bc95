"""Sampler: exact greedy, the support of top-k/top-p/min-p, per-request seeds, raw logprobs."""

from __future__ import annotations

import collections

import torch

from pdserve import SamplingParams
from pdserve.engine.sampler import SampleRequest, sample, skip_draw


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(3, 50, generator=gen(0))
    rows = [SampleRequest(SamplingParams(temperature=0, logprobs=3), None)] * 3
    out = sample(logits, rows)
    lp = torch.log_softmax(logits, -1)
    for i, o in enumerate(out):
        assert o.token_id == int(logits[i].argmax())
        assert abs(o.logprob - lp[i, o.token_id].item()) < 1e-6
        ids = [t for t, _ in o.top]
        assert ids == lp[i].topk(3).indices.tolist()


def test_banned_tokens_are_never_chosen_but_logprobs_stay_raw():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 5.0
    out = sample(
        logits, [SampleRequest(SamplingParams(temperature=0), None, banned_token_ids=(4,))]
    )[0]
    assert out.token_id != 4
    assert abs(out.logprob - torch.log_softmax(logits, -1)[0, out.token_id].item()) < 1e-6


def _draws(params, logits, n=300, seed=0):
    g = gen(seed)
    return collections.Counter(
        sample(logits, [SampleRequest(params, g)])[0].token_id for _ in range(n)
    )


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    assert set(_draws(SamplingParams(top_k=2), logits)) == {0, 1}
    assert set(_draws(SamplingParams(top_p=0.7), logits)) == {0, 1}  # 0.4 + 0.3 reaches 0.7
    assert set(_draws(SamplingParams(top_p=0.71), logits)) == {0, 1, 2}
    assert set(_draws(SamplingParams(min_p=0.5), logits)) == {0, 1}  # >= 0.2 = 0.5 * 0.4
    assert set(_draws(SamplingParams(temperature=1.0), logits)) == {0, 1, 2, 3, 4}
    # a tiny temperature is as good as greedy
    assert set(_draws(SamplingParams(temperature=1e-4), logits)) == {0}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = _draws(SamplingParams(temperature=1.0), logits, n=2000)
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[2] / 2000 - 0.1) < 0.03


def test_seed_gives_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    p = SamplingParams(temperature=1.0, seed=5)

    def run(g, rows=slice(1, 2), n=5):
        return [sample(logits[rows], [SampleRequest(p, g)])[0].token_id for _ in range(n)]

    alone = run(gen(5))
    assert alone == run(gen(5)) and len(set(alone)) > 1  # reproducible, and really random
    others = [SampleRequest(SamplingParams(temperature=0.8), gen(100 + i)) for i in range(3)]
    g = gen(5)
    batched = [
        sample(logits, [others[0], SampleRequest(p, g), others[1], others[2]])[1].token_id
        for _ in range(5)
    ]
    assert batched == alone
    g = gen(5)
    skip_draw(g, 1000, torch.device("cpu"))  # as a decode worker does after prefill's draw
    assert run(g, n=4) == alone[1:]
