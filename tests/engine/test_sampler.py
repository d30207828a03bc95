"""Sampler: exact greedy, the support of top-k/top-p/min-p, per-request seeds, raw logprobs."""

from __future__ import annotations

import collections

import torch

from pdserve import SamplingParams
from pdserve.engine.worker.sampler import SampleRequest, sample, skip_draw


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


def test_penalties_match_transformers_and_openai_definitions():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    vocab = 40
    logits = torch.randn(2, vocab)
    prompt, output = [3, 5, 5, 7], [7, 9, 9, 9, 11]
    # repetition: transformers' processor over prompt + output
    p = SamplingParams(temperature=0, repetition_penalty=1.7)
    rows = [SampleRequest(p, None, prompt_token_ids=prompt, output_token_ids=output)] * 2
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output] * 2), logits.clone())
    out = sample(logits, rows)
    assert [o.token_id for o in out] == ref.argmax(-1).tolist()
    # frequency / presence: OpenAI's logit - count * freq - (count > 0) * presence, output only
    counts = torch.bincount(torch.tensor(output), minlength=vocab).float()
    for freq, pres in ((2.0, 0.0), (0.0, 2.0), (1.3, -0.4), (-2.0, 0.5)):
        p = SamplingParams(temperature=0, frequency_penalty=freq, presence_penalty=pres)
        expect = logits - freq * counts - pres * (counts > 0).float()
        row = SampleRequest(p, None, prompt_token_ids=prompt, output_token_ids=output)
        got = sample(logits, [row] * 2)
        assert [o.token_id for o in got] == expect.argmax(-1).tolist()
    # a strong presence penalty never repeats an output token; raw logprobs are reported
    logits = torch.zeros(1, vocab)
    logits[0, 9] = 1.5
    p = SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1)
    o = sample(logits, [SampleRequest(p, None, output_token_ids=[9])])[0]
    assert o.token_id != 9 and o.top[0][0] == 9
    assert abs(o.logprob - torch.log_softmax(logits, -1)[0, o.token_id].item()) < 1e-6


def test_penalised_rows_do_not_change_other_rows():
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    plain = SampleRequest(SamplingParams(temperature=0), None)
    pen = SampleRequest(
        SamplingParams(temperature=0, frequency_penalty=2.0), None, output_token_ids=[0] * 5
    )
    out = sample(logits, [plain, pen, plain])
    assert out[0].token_id == int(logits[0].argmax()) and out[2].token_id == int(logits[2].argmax())


def test_logit_bias_forces_and_forbids_tokens():
    torch.manual_seed(3)
    logits = torch.randn(2, 50)
    best = logits.argmax(-1).tolist()
    force = SampleRequest(SamplingParams(temperature=0, logit_bias={"17": 100}), None)
    forbid = SampleRequest(SamplingParams(temperature=0, logit_bias={best[1]: -100}), None)
    out = sample(logits, [force, forbid])
    assert out[0].token_id == 17 and out[1].token_id != best[1]
    # sampled rows too (seeded and unseeded)
    seeded = SampleRequest(SamplingParams(temperature=1.0, seed=1, logit_bias=[(4, 100)]), gen(1))
    unseeded = SampleRequest(SamplingParams(temperature=1.0, logit_bias={4: 100.0}), None)
    for _ in range(20):
        assert [o.token_id for o in sample(logits, [seeded, unseeded], gen(9))] == [4, 4]


def test_unseeded_rows_use_one_shared_draw_and_seeded_rows_keep_their_stream():
    torch.manual_seed(4)
    logits = torch.randn(5, 200)
    p_seeded = SamplingParams(temperature=1.0, seed=11)
    p_free = SamplingParams(temperature=1.0)
    g = gen(11)
    alone = [sample(logits[2:3], [SampleRequest(p_seeded, g)])[0].token_id for _ in range(6)]
    g, shared = gen(11), gen(0)
    rows = [SampleRequest(p_free, None)] * 2 + [SampleRequest(p_seeded, g)]
    rows += [SampleRequest(p_free, None)] * 2
    mixed = [sample(logits, rows, shared) for _ in range(6)]
    assert [m[2].token_id for m in mixed] == alone
    # the shared generator drives the unseeded rows: same generator state, same tokens
    a = [o.token_id for o in sample(logits, [SampleRequest(p_free, None)] * 5, gen(7))]
    b = [o.token_id for o in sample(logits, [SampleRequest(p_free, None)] * 5, gen(7))]
    assert a == b
    draws = {
        tuple(o.token_id for o in sample(logits, [SampleRequest(p_free, None)] * 5, shared))
        for _ in range(10)
    }
    assert len(draws) > 1  # really random


def test_logits_mask_restricts_greedy_and_sampled_rows():
    torch.manual_seed(5)
    logits = torch.randn(3, 64)
    allowed = torch.zeros(64, dtype=torch.bool)
    allowed[[3, 30, 40]] = True
    masked = [
        SampleRequest(SamplingParams(temperature=0), None, logits_mask=allowed),
        SampleRequest(SamplingParams(temperature=1.5, top_p=0.9), None, logits_mask=allowed),
    ]
    free = SampleRequest(SamplingParams(temperature=0, logprobs=2), None)
    for _ in range(20):
        out = sample(logits, [masked[0], masked[1], free], gen(0))
        assert out[0].token_id == max((3, 30, 40), key=lambda t: logits[0, t].item())
        assert out[1].token_id in (3, 30, 40)
        assert out[2].token_id == int(logits[2].argmax())
    # a mask allowing nothing (a grammar bug) leaves the row unconstrained, the step goes on
    nothing = torch.zeros(64, dtype=torch.bool)
    rows = [SampleRequest(SamplingParams(temperature=0), None, logits_mask=nothing), free]
    out = sample(logits[:2], rows)
    assert out[0].token_id == int(logits[0].argmax()) and out[1].token_id == int(logits[1].argmax())


def test_penalty_tokens_follow_the_request_and_sample_as_plain_lists():
    from pdserve.engine.worker.penalties import PenaltyTokens

    torch.manual_seed(6)
    logits = torch.randn(2, 80)
    ids = [3, 5, 5, 7]
    pt = PenaltyTokens(ids, num_prompt=2)
    assert pt.tensor(torch.device("cpu")).tolist() == ids and pt.output("cpu").tolist() == [5, 7]
    p = SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.6)
    for new in (9, 9, 11, 5):
        ids.append(new)  # the request appends a sampled token in place
        via_state = sample(logits, [SampleRequest(p, None, penalty_tokens=pt)] * 2)
        via_lists = sample(
            logits, [SampleRequest(p, None, prompt_token_ids=ids[:2], output_token_ids=ids[2:])] * 2
        )
        assert via_state == via_lists
        assert pt.tensor(torch.device("cpu")).tolist() == ids
    # several tokens at once, and past the buffer's capacity: earlier views keep their ids
    before = pt.tensor(torch.device("cpu"))
    snapshot = before.tolist()
    ids.extend([13, 2, 2])
    assert pt.tensor(torch.device("cpu")).tolist() == ids
    ids.extend(range(40))
    assert pt.tensor(torch.device("cpu")).tolist() == ids and pt.output("cpu").tolist() == ids[2:]
    assert before.tolist() == snapshot


def test_extreme_temperatures_keep_masked_tokens_out_and_their_limits():
    """A temperature fp32 cannot hold (1e308 is inf there) or that underflows to 0 (1e-300)
    used to make ``-inf / inf`` and ``x / 0`` NaN (the draw: token 0, a banned one here);
    clamped, the huge one draws every allowed token alike and the tiny one the argmax."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.1, 0.05]]))

    def draws(temperature, n=400):
        g = gen(1)
        row = SampleRequest(SamplingParams(temperature=temperature), g, banned_token_ids=(0,))
        return collections.Counter(sample(logits, [row])[0].token_id for _ in range(n))

    for temperature in (1e308, 1e39, 1e30):
        counts = draws(temperature)
        assert set(counts) == {1, 2, 3, 4}, counts  # 0 is banned: never drawn
        assert max(counts.values()) < 2 * min(counts.values()), counts  # uniform, ~100 each
    for temperature in (1e-300, 1e-40, 1e-30):
        assert set(draws(temperature, n=50)) == {1}


def test_plain_greedy_eager_rows_equal_the_samplers_numbers():
    """An eager step whose sampling rows are all plain greedy skips the per-row sample
    requests (``ModelRunner.execute``'s greedy fast path): its tokens and raw logprobs are
    the sampler's bit for bit, as a row asking a top logprob (the sampler's path) gets."""
    from pdserve.engine.llm import LLM

    llm = LLM("random:tiny", device="cpu", num_pages=64, enable_prefix_caching=False)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
    fast = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    slow = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=1))
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
        assert b.outputs[0].logprobs[0].logprob == b.outputs[0].cumulative_logprob
    llm.shutdown()
