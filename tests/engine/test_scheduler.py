"""Scheduler alone (no model): token budget, chunked prefill, FCFS, max_running_requests,
preemption by recompute, prompt logprob targets, overlap scheduling's ``admits_none``;
random workloads with aborts never deadlock and free every page, with the prefix cache off
and on (page accounting checked every step, and a simulated KV store checks that every
page a request reads holds that request's tokens).  With the prefix cache:
test_scheduler_prefix_cache.py; the simulation: scheduler_sim.py."""

from __future__ import annotations

import random

import pytest
from scheduler_sim import FakeKV, make, req, run_step

from pdserve.engine.core.request import Status


def test_chunked_prefill_respects_the_budget():
    s = make(budget=4)
    r = req("a", 10, 2, 0)
    s.add_waiting(r)
    log = []
    while s.running or s.waiting:
        run_step(s, {"a": r}, log)
    assert log == [("a", 4, False), ("a", 4, False), ("a", 2, True), ("a", 1, True)]
    assert s.kv.num_free_pages == s.kv.num_pages


def test_fcfs_and_max_running_requests():
    s = make(budget=100, max_running=2)
    reqs = [req(i, 3, 2, i) for i in range(4)]
    for r in reversed(reqs):  # queue order is arrival order, whatever the add order
        s.add_waiting(r)
    plan = s.schedule()
    assert [q.request_id for q in plan.seqs] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2", "3"]


def test_decodes_come_before_new_prefills():
    s = make(budget=5)
    a, b = req("a", 4, 5, 0), req("b", 8, 5, 1)
    by_id = {"a": a, "b": b}
    s.add_waiting(a)
    run_step(s, by_id)  # a prefilled
    s.add_waiting(b)
    plan = run_step(s, by_id)
    assert [(q.request_id, len(q.token_ids)) for q in plan.seqs] == [("a", 1), ("b", 4)]


def test_preemption_by_recompute_when_pages_run_out():
    s = make(num_pages=6, page_size=4, budget=64)
    a, b = req("a", 8, 8, 0), req("b", 8, 8, 1)
    by_id = {"a": a, "b": b}
    s.add_waiting(a)
    s.add_waiting(b)
    preempted = []
    while s.running or s.waiting:
        preempted += run_step(s, by_id).preempted
    assert "b" in preempted and "a" not in preempted  # the newest is the victim
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert s.kv.num_free_pages == 6


def test_prompt_logprob_targets_cover_the_prompt_once_despite_chunks_and_preemption():
    s = make(num_pages=5, page_size=4, budget=3)
    a, b = req("a", 9, 6, 0, prompt_logprobs=1), req("b", 9, 6, 1, prompt_logprobs=1)
    by_id = {"a": a, "b": b}
    s.add_waiting(a)
    s.add_waiting(b)
    preempted = []
    while s.running or s.waiting:
        preempted += run_step(s, by_id).preempted
    assert preempted
    for r in (a, b):
        assert r.prompt_logprobs == [None] + r.prompt_token_ids[1:]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_and_free_every_page(seed, prefix_caching):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 16])
    max_len = 40
    num_pages = rng.randint(-(-max_len // page_size), 3 * (-(-max_len // page_size)))
    s = make(
        num_pages=num_pages,
        page_size=page_size,
        budget=rng.randint(1, 48),
        max_running=rng.randint(1, 6),
        prefix_caching=prefix_caching,
    )
    kv = FakeKV(s)
    prefixes = [[rng.randint(1, 50) for _ in range(20)] for _ in range(3)]
    by_id, arrival = {}, 0
    for _step in range(3000):
        if arrival < 30 and rng.random() < 0.3:
            p = rng.randint(1, 25)
            # shared prefixes of any length (hits end mid-page too), some fresh prompts
            base = rng.choice(prefixes)[: rng.randint(0, 20)]
            prompt = (base + [rng.randint(1, 50) for _ in range(p)])[:p]
            lp = 1 if rng.random() < 0.15 else None
            r = req(arrival, p, rng.randint(1, max_len - p), arrival, lp, prompt=prompt)
            by_id[r.request_id] = r
            s.add_waiting(r)
            arrival += 1
        live = [r for r in by_id.values() if not r.finished]
        if live and rng.random() < 0.05:  # abort at any time
            victim = rng.choice(live)
            s.remove(victim)
            victim.finish("abort")
        run_step(s, by_id, kv=kv)
        if arrival == 30 and all(r.finished for r in by_id.values()):
            break
    assert all(r.finished for r in by_id.values()), "deadlock: requests never finished"
    assert not s.running and not s.waiting
    assert s.kv.num_held_pages == 0 and s.kv.num_available_pages == num_pages
    if not prefix_caching:
        assert s.kv.num_free_pages == num_pages
    else:
        if page_size <= 4:  # the workload shares prefixes of up to 20 tokens: some hit
            assert s.kv.cache.num_hit_tokens > 0
        s.kv.reset_cache()
        assert s.kv.num_free_pages == num_pages
    for r in by_id.values():
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.params.max_tokens
            assert r.status is Status.FINISHED


def test_admits_none_bounds_the_next_admission():
    """``admits_none`` (overlap scheduling's check) over the running-count and page bounds:
    slots or budget taken at the smallest count, the FCFS head's pages against the most
    that could be available, a prefix hit (cached now or by the pending step) lowering its
    need (at most the full pages of all but its last token)."""
    from pdserve.engine.kv.cache import page_keys

    s = make(num_pages=16, page_size=4, budget=32, max_running=2, prefix_caching=True)
    assert s.admits_none(0, 0, 0)  # nothing waits
    head = req("head", 20, 4, arrival=0)  # 5 pages
    s.add_waiting(head)
    assert s.admits_none(2, 2, 16)  # both slots stay taken
    assert not s.admits_none(1, 2, 16)  # one may free: it fits
    assert s.admits_none(1, 2, 4)  # it needs 5 pages
    assert not s.admits_none(1, 2, 5)
    # with 28 rows the budget leaves its chunk 4 tokens (1 page) at least
    assert not s.admits_none(1, 28, 1) and s.admits_none(1, 28, 0)
    keys = page_keys(head.all_token_ids, 4)  # 5 keys; 19 tokens hold 4 full pages
    assert not s.admits_none(1, 2, 3, cached_soon=keys[:2])  # 2 hit: 3 to find
    assert s.admits_none(1, 2, 2, cached_soon=keys[:2])
    assert not s.admits_none(1, 2, 1, cached_soon=keys) and s.admits_none(1, 2, 0, keys)
    s = make(num_pages=16, page_size=4, budget=8, max_running=64)
    s.add_waiting(req("head", 20, 4, arrival=0))
    assert s.admits_none(8, 8, 16) and not s.admits_none(7, 8, 16)  # the token budget


@pytest.mark.parametrize("seed", range(4))
def test_admits_none_agrees_with_schedule(seed):
    """Whenever ``admits_none`` says the next step admits nobody (exact running count, the
    pages available now), ``schedule`` admits nobody: random workloads on a small pool and
    few slots, prefix caching on (shared prefixes); both outcomes occur."""
    rng = random.Random(seed)
    s = make(
        num_pages=24, page_size=4, budget=rng.choice([8, 32]), max_running=3, prefix_caching=True
    )
    shared = list(range(50, 62))
    by_id = {}
    for i in range(12):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(1, 40) for _ in range(rng.randrange(2, 20))
        ]
        by_id[str(i)] = r = req(i, 0, rng.randrange(1, 12), arrival=i, prompt=prompt)
        s.add_waiting(r)
    blocked = admitted = 0
    while s.running or s.waiting:
        none = s.admits_none(len(s.running), len(s.running), s.kv.num_available_pages)
        waiting = [r.request_id for r in s.waiting]
        run_step(s, by_id)
        if none:
            blocked += 1
            assert all(by_id[w] in s.waiting for w in waiting), waiting
        elif any(by_id[w] not in s.waiting for w in waiting):
            admitted += 1
    assert blocked and admitted
