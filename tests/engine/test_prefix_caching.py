"""Prefix caching in the engine (tiny random Llama, CPU, fp32): the same greedy tokens,
logprobs and finish reasons with the cache on as off — shared prefixes, hits that end
mid-page, full-prompt hits, prompt logprobs, eviction under pressure, and aborts of
requests that share cached pages — and the cached counts that usage reports."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

SYSTEM = list(range(200, 237))  # 37 tokens: 9 full pages of 4, and one token more
PROMPTS = [
    SYSTEM + [5, 6, 7],  # a hit of 9 pages, ending mid-page of the shared part
    SYSTEM + [8, 9, 10, 11, 12, 13],
    SYSTEM[:32],  # exactly 8 pages: a full-prompt hit computes the last token again
    SYSTEM + [5, 6, 7],  # the whole prompt seen before
    list(range(400, 420)),  # nothing shared
]


def params(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 12, "logprobs": 2, **kw})


def outputs(llm, prompts, p=None):
    outs = []
    for prompt in prompts:  # one by one, so every later request can hit the earlier ones
        outs += llm.generate([prompt], p or params())
    return outs


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        a, b = g.outputs[0], w.outputs[0]
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    folder = tiny_model_dir("llama")
    off = LLM(folder, device="cpu", num_pages=128, page_size=4, enable_prefix_caching=False)
    on = LLM(folder, device="cpu", num_pages=128, page_size=4)
    return off, on


def test_cache_on_gives_the_same_outputs_as_cache_off(engines):
    off, on = engines
    on.engine.kv.reset_cache()
    want = outputs(off, PROMPTS)
    got = outputs(on, PROMPTS)
    assert_same(got, want)
    cached = [o.num_cached_tokens for o in got]
    assert cached == [0, 36, 28, 36, 0]  # full pages of all but the last prompt token
    assert [o.num_cached_tokens for o in want] == [0] * 5
    stats = on.engine.stats()
    assert stats["prefix_cache_hit_tokens"] == sum(cached)
    assert stats["prefix_cache_query_tokens"] == sum(len(p) for p in PROMPTS)
    assert on.engine.kv.num_held_pages == 0


def test_prompt_logprobs_are_recomputed_in_full(engines):
    off, on = engines
    p = params(prompt_logprobs=1)
    want = outputs(off, [PROMPTS[0]], p)
    on.generate([PROMPTS[0]], params())  # now cached
    got = outputs(on, [PROMPTS[0]], p)
    assert_same(got, want)
    assert got[0].num_cached_tokens == 0  # bypassed the cache
    assert len(got[0].prompt_logprobs) == len(PROMPTS[0])
    for x, y in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4


def test_same_outputs_under_eviction_pressure(tiny_model_dir, engines):
    off, _ = engines
    # 24 pages of 4 tokens: the cache must evict to make room, and requests get preempted
    tight = LLM(tiny_model_dir("llama"), device="cpu", num_pages=24, page_size=4)
    prompts = [SYSTEM + [i, i + 1] for i in range(6)] + [
        list(range(300 + 40 * i, 330 + 40 * i)) for i in range(3)
    ]
    want = off.generate(prompts, params())
    got = tight.generate(prompts, params())  # all at once: sharing, eviction, preemption
    assert_same(got, want)
    again = outputs(tight, prompts[:2] + prompts[-1:])
    assert_same(again, [want[0], want[1], want[-1]])
    stats = tight.engine.stats()
    assert stats["prefix_cache_evicted_pages"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert tight.engine.kv.num_held_pages == 0 and tight.engine.num_free_pages == 24


def test_aborting_a_request_that_shares_cached_pages_leaves_the_others_intact(engines):
    off, on = engines
    want = off.generate([PROMPTS[1]], params())[0]
    on.generate([SYSTEM], params(max_tokens=1))  # the shared pages are cached now
    core = on.engine
    for rid in ("a", "b", "c"):
        core.add_request(rid, list(PROMPTS[1]), params())
    done = {}
    for step in range(200):
        for out in core.step():
            if out.finished:
                done[out.request_id] = out
        if step == 1:
            assert core.kv.refcount(core.scheduler.running[0].pages[0]) == 3
            core.abort_request("b")
        if not core.has_unfinished_requests():
            break
    assert set(done) == {"a", "c"}  # b ended by the abort (the caller reports it)
    assert_same([done["a"], done["c"]], [want, want])
    assert core.kv.num_held_pages == 0
