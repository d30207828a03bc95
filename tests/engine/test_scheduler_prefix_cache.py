"""Scheduler alone (no model) with the prefix cache on: a shared prefix is computed once
(a hit may end mid-page, a full-prompt hit still computes the last token), prompt-logprob
requests recompute their prompt, unreferenced cached pages are evicted LRU, an abort keeps
pages another request shares, a preempted request matches its cached pages again (the
simulation: scheduler_sim.py)."""

from __future__ import annotations

import pytest
from scheduler_sim import FakeKV, a_pages_of, finish_all, make, req, run_step


def test_a_shared_prefix_is_computed_once_and_a_hit_can_end_mid_page():
    s = make(page_size=4, budget=64, prefix_caching=True)
    kv = FakeKV(s)
    a = req("a", 0, 2, 0, prompt=list(range(1, 11)))  # 10 tokens: 2 full pages + 2
    finish_all(s, {"a": a}, kv)
    # b shares 9 tokens with a: the hit is the 2 full pages (8 tokens), ending mid-page
    b = req("b", 0, 2, 1, prompt=list(range(1, 10)) + [40, 41])
    s.add_waiting(b)
    plan = run_step(s, {"b": b}, kv=kv)
    assert plan.seqs[0].start_pos == 8 and plan.seqs[0].token_ids == [9, 40, 41]
    assert b.num_cached_tokens == 8
    assert plan.seqs[0].pages[:2] == a_pages_of(s, list(range(1, 9)))
    finish_all(s, {"b": b}, kv)
    assert s.kv.cache.num_query_tokens == 10 + 11 and s.kv.cache.num_hit_tokens == 8


@pytest.mark.parametrize("prompt_len", [8, 9, 12])
def test_a_full_prompt_hit_still_computes_the_last_token(prompt_len):
    s = make(page_size=4, budget=64, prefix_caching=True)
    kv = FakeKV(s)
    prompt = list(range(1, prompt_len + 1))
    a = req("a", 0, 1, 0, prompt=prompt)
    finish_all(s, {"a": a}, kv)
    b = req("b", 0, 1, 1, prompt=prompt)
    s.add_waiting(b)
    plan = run_step(s, {"b": b}, kv=kv)
    (seq,) = plan.seqs
    cached = (prompt_len - 1) // 4 * 4  # full pages of all but the last token
    assert seq.start_pos == cached and seq.sample
    assert seq.token_ids == prompt[cached:]
    assert b.num_cached_tokens == cached and b.output_token_ids == [7]


def test_prompt_logprob_requests_recompute_their_whole_prompt():
    s = make(page_size=4, budget=64, prefix_caching=True)
    a = req("a", 12, 1, 0)
    finish_all(s, {"a": a})
    b = req("b", 12, 1, 1, prompt_logprobs=0)
    s.add_waiting(b)
    plan = run_step(s, {"b": b})
    assert plan.seqs[0].start_pos == 0 and b.num_cached_tokens == 0
    assert b.prompt_logprobs == [None] + b.prompt_token_ids[1:]


def test_unreferenced_cached_pages_are_evicted_lru_when_pages_run_out():
    s = make(num_pages=6, page_size=4, budget=64, prefix_caching=True)
    kv = FakeKV(s)
    old = req("old", 0, 1, 0, prompt=[1] * 8)
    finish_all(s, {"old": old}, kv)
    new = req("new", 0, 1, 1, prompt=[2] * 8)
    finish_all(s, {"new": new}, kv)
    assert s.kv.num_cached_pages == 4 and s.kv.num_free_pages == 2
    big = req("big", 0, 2, 2, prompt=[3] * 15)  # 4 pages: 2 free + the 2 oldest cached
    finish_all(s, {"big": big}, kv)
    assert s.kv.cache.num_evicted >= 2
    assert a_pages_of(s, [1] * 8) == []  # "old" went first
    again = req("again", 0, 1, 3, prompt=[2] * 4 + [5])
    s.add_waiting(again)
    run_step(s, {"again": again}, kv=kv)
    assert again.num_cached_tokens == 4  # "new"'s head page survived


def test_aborting_one_of_two_requests_that_share_pages_keeps_the_pages_for_the_other():
    s = make(page_size=4, budget=64, prefix_caching=True)
    kv = FakeKV(s)
    a = req("a", 12, 1, 0)
    finish_all(s, {"a": a}, kv)
    b, c = req("b", 12, 5, 1), req("c", 12, 5, 2)
    by_id = {"b": b, "c": c}
    s.add_waiting(b)
    s.add_waiting(c)
    run_step(s, by_id, kv=kv)
    shared = b.pages[:2]
    assert c.pages[:2] == shared and all(s.kv.refcount(p) == 2 for p in shared)
    s.remove(b)
    b.finish("abort")
    assert all(s.kv.refcount(p) == 1 for p in shared)
    finish_all(s, by_id, kv)
    assert c.output_token_ids == [7] * 5 and s.kv.num_held_pages == 0


def test_a_preempted_request_matches_its_cached_pages_again():
    s = make(num_pages=8, page_size=4, budget=64, prefix_caching=True)
    kv = FakeKV(s)
    a, b = req("a", 12, 12, 0), req("b", 0, 12, 1, prompt=[9] * 12)
    by_id = {"a": a, "b": b}
    s.add_waiting(a)
    s.add_waiting(b)
    preempted, restarts = [], []
    while s.running or s.waiting:
        was_waiting = b in s.waiting and b.num_preemptions > 0
        plan = run_step(s, by_id, kv=kv)
        preempted += plan.preempted
        restarts += [q.start_pos for q in plan.seqs if q.request_id == "b" and was_waiting]
    assert "b" in preempted and restarts and restarts[0] > 0  # it did not start from 0
    assert b.output_token_ids == [7] * 12
    assert b.num_cached_tokens == 0  # usage counts the first admission only
