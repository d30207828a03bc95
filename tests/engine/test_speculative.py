"""Speculative decoding in a mixed engine (``engine/spec/``): greedy output with the n-gram
drafter and with the acceptance-controlled replay drafter equals the non-speculative run's
token for token (text, logprobs with top-k, finish and stop reasons, cached tokens), over
chunked prefill, prefix-cache hits, stops cutting inside accepted drafts, ``max_tokens``,
``n`` > 1, aborts, pages running out, penalties, ``logit_bias``, ``min_tokens`` and a
grammar; the page accounting adds up after every step and every page is back at the end
(``overlap_runs.drive``)."""

from __future__ import annotations

import pytest
from overlap_runs import PROMPTS, assert_same, core_of, drive, greedy

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.drafter import DraftInput, NgramDrafter, ReplayDrafter
from pdserve.engine.structured.params import StructuredOutputsParams

K = 4
SPEC = {"speculative_algorithm": "ngram", "num_speculative_tokens": K}
# prompts that repeat themselves, so the n-gram drafter finds matches
COPY = [[5, 6, 7, 8, 9] * 3 + [5, 6], [40, 41, 42, 43] * 4, [9, 8, 7, 9, 8, 7, 9, 8, 7, 9]]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


def _requests(prompts, params):
    return [(f"r{i}", p, params) for i, p in enumerate(prompts)]


def _replay(core, refs, rate, seed=1):
    """Swap the engine's drafter for the replay drafter over ``refs``."""
    d = ReplayDrafter(refs, K, rate, core.vocab_size, seed=seed)
    core.set_drafter(d, K)
    return d


def _refs(requests, finals):
    return [list(p) + list(finals[rid][0]) for rid, p, _ in requests]


def _compare(folder, requests, *, rate=None, refs=None, events=None, min_accepted=1, **kw):
    """Run ``requests`` without and with speculation (n-gram, or replay at ``rate`` over
    ``refs``, default the plain run's outputs); assert the finals equal and that drafts
    were accepted; returns (plain core, spec core, finals)."""
    base = core_of(folder, False, **kw)
    deltas0, f0 = drive(base, requests, events)
    spec = core_of(folder, False, **SPEC, **kw)
    if rate is not None:
        _replay(spec, refs if refs is not None else _refs(requests, f0), rate)
    deltas1, f1 = drive(spec, requests, events)
    assert_same(f1, f0)
    for rid, ds in deltas1.items():  # the streamed deltas add up to the final output
        assert [t for d in ds for t in d[0]] == list(f1[rid][0])
    st = spec.stats()
    assert st["spec_accepted_tokens"] >= min_accepted, st
    assert st["generation_tokens"] == base.stats()["generation_tokens"]
    return base, spec, f0


def test_ngram_greedy_equals_plain(folder):
    params = greedy(max_tokens=40, ignore_eos=True, logprobs=3)
    _, spec, _ = _compare(folder, _requests(COPY + PROMPTS[:2], params))
    st = spec.stats()
    assert st["steps"] < 40 * 1.0  # several tokens per step
    assert st["spec_draft_tokens"] >= st["spec_accepted_tokens"]
    hist = st["spec_acceptance_length"]
    assert hist["count"] == st["spec_verify_rows"] == hist["buckets"][str(K + 1)]
    assert hist["sum"] == st["spec_accepted_tokens"] + st["spec_verify_rows"]


@pytest.mark.parametrize("rate", [0.5, 0.9])
def test_replay_greedy_equals_plain(folder, rate):
    """Every acceptance length 0..k occurs; tokens, logprobs and their top-3 equal."""
    params = greedy(max_tokens=30, ignore_eos=True, logprobs=3)
    _, spec, _ = _compare(folder, _requests(PROMPTS, params), rate=rate, min_accepted=20)
    st = spec.stats()
    if rate == 0.5:
        cum = [st["spec_acceptance_length"]["buckets"][str(n)] for n in range(1, K + 2)]
        rows = [b - a for a, b in zip([0] + cum, cum)]  # verify rows by tokens kept
        assert all(r > 0 for r in rows), rows


def test_chunked_prefill_and_max_tokens(folder):
    reqs = [
        (f"r{i}", p, greedy(max_tokens=m, ignore_eos=True))
        for i, (p, m) in enumerate(zip(PROMPTS, [1, 2, 3, 7, 12, 25]))
    ]
    _compare(folder, reqs, rate=0.8, max_num_batched_tokens=7)


def test_prefix_cache_hits(folder):
    """The same prompts again once the first ones finished: cached pages hold only
    verified tokens, so the second round (hits) equals the plain run too."""
    params = greedy(max_tokens=20, ignore_eos=True)
    first = _requests(PROMPTS[3:], params)

    def again(core):
        for rid, p, prm in first:
            core.add_request(rid + "-again", p + [3, 4, 5, 6, 7, 8, 9, 10], prm)

    base, spec, _ = _compare(folder, first, rate=0.8, events={60: again})
    assert spec.stats()["prefix_cache_hit_tokens"] > 0
    # the second round asked for prompt + previous output's pages? hits on the prompts
    assert spec.stats()["prefix_cache_hit_tokens"] == base.stats()["prefix_cache_hit_tokens"]


def test_stop_inside_accepted_drafts(folder):
    """A stop token / stop string / EOS met among accepted drafts ends the output there."""
    long = greedy(max_tokens=30, ignore_eos=True)
    base = core_of(folder, False)
    reqs = _requests(PROMPTS, long)
    _, full = drive(base, reqs)
    refs = _refs(reqs, full)
    stops = []
    for i, (rid, p, _) in enumerate(reqs):
        out = full[rid][0]
        if i % 3 == 0:
            stops.append((rid, p, greedy(max_tokens=30, stop_token_ids=[out[9]])))
        elif i % 3 == 1:
            text = full[rid][1]
            stops.append((rid, p, greedy(max_tokens=30, ignore_eos=True, stop=[text[12:15]])))
        else:
            stops.append((rid, p, greedy(max_tokens=30, stop_token_ids=[out[6]], min_tokens=4)))
    _, spec, f0 = _compare(folder, stops, rate=1.0, refs=refs)
    assert all(f[4] == "stop" for f in f0.values()), f0
    # the verify that met the stop had accepted drafts past it: more drafted than output
    assert spec.stats()["spec_verify_rows"] > 0


def test_n_samples_aborts_and_pages_running_out(folder):
    params = greedy(max_tokens=24, ignore_eos=True, logprobs=1)
    reqs = []
    for i, p in enumerate(PROMPTS[:4]):
        reqs += [
            (rid, p, prm)
            for rid, prm in SamplingParams(
                temperature=0, n=2, max_tokens=24, ignore_eos=True, logprobs=1
            ).fan_out(f"n{i}")
        ]
    reqs.append(("gone", PROMPTS[5], params))
    base = core_of(folder, False, num_pages=22)
    _, f0 = drive(base, [r for r in reqs if r[0] != "gone"])
    refs = _refs([r for r in reqs if r[0] != "gone"], f0)
    spec = core_of(folder, False, num_pages=22, **SPEC)
    _replay(spec, refs, 0.8)
    _, f1 = drive(spec, reqs, events={4: lambda c: c.abort_request("gone")})
    assert "gone" not in f1  # aborted: no final output (its pages are back: drive checks)
    assert_same(f1, f0)
    assert spec.stats()["num_preemptions"] > 0  # the pool ran out
    assert spec.stats()["spec_accepted_tokens"] > 0


def test_penalties_bias_min_tokens_grammar(folder, eos_model):
    """Each verify position is sampled with the penalties of the drafts before it, the
    bias and, once min_tokens is reached, no bans; grammar rows do not speculate."""
    eos_folder, full = eos_model
    pen = greedy(
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        logprobs=2,
    )
    bias = greedy(max_tokens=24, ignore_eos=True, logit_bias={full[3]: 3.0, 77: 1.5})
    min_t = greedy(max_tokens=24, min_tokens=9)
    regex = greedy(max_tokens=12, structured_outputs=StructuredOutputsParams(regex="(ab|cd)+e"))
    reqs = [("pen", PROMPTS[0], pen), ("bias", PROMPTS[1], bias), ("min", PROMPTS[0], min_t)]
    reqs.append(("regex", PROMPTS[2], regex))
    _compare(eos_folder, reqs, rate=0.9)


def test_ngram_lookup():
    d = NgramDrafter(3, min_n=1, max_n=2)
    assert d.lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert d.lookup([1, 2, 3, 4, 1, 2], 1) == [3]
    assert d.lookup([1, 2, 3], 3) == []  # no earlier occurrence
    assert d.lookup([7, 7, 7, 7, 7, 7], 3) == [7, 7, 7]  # a run: an occurrence with k after it
    assert d.lookup([5, 1, 9, 5, 2, 9], 2) == [5, 2]  # the 1-gram 9, most recent full match
    out = d.propose([DraftInput("a", [1, 2, 1], 1), DraftInput("b", [4], 3)])
    assert [o.token_ids for o in out] == [[2], []]
    for bad in ({"num_speculative_tokens": 0}, {"min_n": 0}, {"min_n": 3, "max_n": 2}):
        kw = {"num_speculative_tokens": 2, **bad}
        with pytest.raises(ValueError):
            NgramDrafter(**kw)


def test_pd_decode_speculates_and_equals_mixed(folder):
    """Prefill and decode engines over the fake backend, both configured for speculation:
    decode's verify steps give the plain mixed worker's tokens; the layouts the peers
    compare carry the speculative configuration."""
    from disagg_pairs import drive as pd_drive
    from disagg_pairs import info, pd_pair, rooms

    from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    def cfg(**spec):
        return EngineConfig(
            model=ModelConfig(model=folder, device="cpu"),
            cache=CacheConfig(page_size=4, num_pages=64),
            scheduler=SchedulerConfig(**spec),
        )

    plain = core_of(folder, False, num_pages=64)
    params = greedy(max_tokens=30, ignore_eos=True, logprobs=2)
    reqs = [(f"m{i}", p, params) for i, p in enumerate(COPY[:2] + PROMPTS[:1])]
    _, want = drive(plain, reqs)
    prefill, decode, m = pd_pair(cfg(**SPEC))
    _replay(decode, _refs(reqs, want), 0.8)
    assert decode.executor.kv_args().layout.speculative == "ngram k=4 n=1-3"
    for rid, p, prm in reqs:
        room = next(rooms)
        decode.add_request(rid, p, prm, info("decode", room))
        prefill.add_request(rid + "-p", p, prm, info("prefill", room))
    got = pd_drive(prefill, decode)
    for rid, _, _ in reqs:
        c = got[rid].outputs[0]
        lps = [(t.token_id, t.logprob, t.top) for t in c.logprobs]
        assert_same(
            (c.token_ids, c.text, lps, c.finish_reason),
            (want[rid][0], want[rid][1], want[rid][2], want[rid][4]),
        )
    assert decode.stats()["spec_accepted_tokens"] > 0
    assert prefill.stats()["spec_verify_rows"] == 0  # prefill computes prompts only
    for core in (prefill, decode):
        assert core.kv.num_held_pages == 0
        core.kv.check_integrity([])
    plain_pair = pd_pair(cfg())
    assert plain_pair[1].executor.kv_args().layout.speculative == ""
    # seeded sampling: decode skips prefill's draw, then its verify steps draw as the
    # speculating mixed engine's do (the n-gram proposals are the same): equal outputs
    seeded = SamplingParams(temperature=0.1, seed=5, max_tokens=20, ignore_eos=True)
    mixed = core_of(folder, False, num_pages=64, **SPEC)
    sreqs = [(f"s{i}", p, seeded) for i, p in enumerate(COPY[:2])]
    _, want = drive(mixed, sreqs)
    prefill, decode, _ = pd_pair(cfg(**SPEC))
    for rid, p, prm in sreqs:
        room = next(rooms)
        decode.add_request(rid, p, prm, info("decode", room))
        prefill.add_request(rid + "-p", p, prm, info("prefill", room))
    got = pd_drive(prefill, decode)
    for rid, _, _ in sreqs:
        assert got[rid].outputs[0].token_ids == want[rid][0]
    assert decode.stats()["spec_accepted_tokens"] > 0


# --- the draft-model drafter ---------------------------------------------------------------


def _draft_spec(draft):
    return {
        "speculative_algorithm": "draft",
        "speculative_model": draft,
        "num_speculative_tokens": K,
    }


def _draft_pages_back(core):
    d = core.drafter
    d.check_integrity()
    assert d.num_held_pages == 0


def test_draft_model_equal_to_target_accepts_everything(folder):
    """Draft == target: every draft is the target's own greedy token, so every one is
    accepted (the draft KV's catch-up and rollback are right), and the output equals the
    plain run's; the draft pool's pages are all back."""
    params = greedy(max_tokens=21, ignore_eos=True, logprobs=1)
    reqs = _requests(PROMPTS[:4], params)
    _, f0 = drive(core_of(folder, False), reqs)
    spec = core_of(folder, False, **_draft_spec(folder))
    _, f1 = drive(spec, reqs)
    assert_same(f1, f0)
    st = spec.stats()
    assert st["spec_accepted_tokens"] == st["spec_draft_tokens"] > 0, st
    assert st["spec_acceptance_length"]["buckets"][str(K + 1)] > 0
    _draft_pages_back(spec)


def test_draft_model_greedy_parity_under_preemption_and_stops(folder, tiny_model_dir, tmp_path):
    """Another draft model (same tokenizer): output equals plain under a pool that runs
    out, stop tokens and chunked prefill; both pools' pages back."""
    import transformers

    from tiny_models import random_tiny_model

    other = tmp_path / "draft"  # the target's shapes and tokenizer, other random weights
    random_tiny_model(transformers.AutoConfig.from_pretrained(folder), seed=1).save_pretrained(
        other
    )
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(other)
    base = core_of(folder, False)
    long = _requests(PROMPTS, greedy(max_tokens=24, ignore_eos=True))
    _, full = drive(base, long)
    reqs = [
        (rid, p, greedy(max_tokens=24, stop_token_ids=[full[rid][0][10]]) if i % 2 else prm)
        for i, (rid, p, prm) in enumerate(long)
    ]
    kw = {"num_pages": 16, "max_num_batched_tokens": 9}
    _, f0 = drive(core_of(folder, False, **kw), reqs)
    spec = core_of(folder, False, **kw, **_draft_spec(str(other)))
    _, f1 = drive(spec, reqs)
    assert_same(f1, f0)
    assert spec.stats()["num_preemptions"] > 0
    assert spec.stats()["spec_verify_rows"] > 0  # the draft model proposed
    _draft_pages_back(spec)


def test_draft_model_with_another_tokenizer_is_refused(folder, tmp_path):
    import shutil

    import transformers

    other = tmp_path / "other-tok"
    shutil.copytree(folder, other)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<a-token-the-target-lacks>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="speculative_model"):
        core_of(folder, False, **_draft_spec(str(other)))


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_grammar_checks_each_draft(folder, rate):
    """A structured-output row speculates: its drafts are walked through its grammar (a
    corrupted draft the grammar rejects cuts the row there) and every position is masked
    as the plain run's would be; the output equals the plain run's and is valid."""
    import re

    specs = ["(ab|cd)+e", "[0-9]{3}-[a-z]{4}-(yes|no)"]
    reqs = [
        (
            f"g{i}",
            PROMPTS[i],
            greedy(max_tokens=14, structured_outputs=StructuredOutputsParams(regex=r)),
        )
        for i, r in enumerate(specs)
    ]
    _, spec, f0 = _compare(folder, reqs, rate=rate)
    for (rid, _, _), r in zip(reqs, specs):
        text = f0[rid][1]
        assert re.fullmatch(r, text) or f0[rid][4] == "length", (rid, text)
    assert spec.stats()["spec_accepted_tokens"] > 0


@pytest.mark.timeout(600)
def test_tensor_parallel_verify_steps(folder):
    """TP = 2 (gloo): rank 1 runs the verify step's forward from the staged inputs rank 0
    sends (every position a sampling row); the output equals TP = 1 without speculation."""
    from pdserve import LLM

    params = greedy(max_tokens=20, ignore_eos=True, logprobs=1)
    kw = dict(device="cpu", dtype="float32", num_pages=128)
    ref = LLM(folder, **kw).generate(COPY, params)
    with LLM(folder, tensor_parallel_size=2, **kw, **SPEC) as llm:
        outs = llm.generate(COPY, params)
        assert llm.engine.stats()["spec_accepted_tokens"] > 0
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
