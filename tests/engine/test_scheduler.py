"""Scheduler alone (no model): token budget, chunked prefill, FCFS, max_running_requests,
preemption by recompute, aborts; random workloads never deadlock and free every page, with
the prefix cache off and on (page accounting checked every step, and a simulated KV store
checks that every page a request reads holds that request's tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.model_runner import StepResult
from pdserve.engine.request import Request, Status
from pdserve.engine.sampler import SampledToken
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import BatchPlan, Scheduler

EMPTY_PLAN = BatchPlan(())


def make(num_pages=64, page_size=4, budget=32, max_running=8, prefix_caching=False):
    pool = KVPool(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        page_size=page_size,
        num_pages=num_pages,
        num_aux_slots=1,
        model_fingerprint="x",
    )
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_running_requests=max_running),
        KVCacheManager(pool, enable_prefix_caching=prefix_caching),
        lambda r: (),
    )


def req(rid, prompt_len, max_tokens, arrival, prompt_logprobs=None, prompt=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Request(
        str(rid),
        list(prompt) if prompt is not None else list(range(1, prompt_len + 1)),
        params,
        arrival=arrival,
        detokenizer=None,
        generator=None,
    )


def check_invariants(s: Scheduler, plan):
    """Every step: budget and batch limits; page accounting (each page's refcount equals
    how many requests list it, none lists a page twice, held + cached + free == total);
    every sequence's pages cover what it computes; the queue is FCFS."""
    assert plan.num_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_running_requests
    s.kv.check_integrity(r.pages for r in s.running + s.waiting)
    if not s.kv.enable_prefix_caching:  # without a cache no page is ever shared
        held = [p for r in s.running + s.waiting for p in r.pages]
        assert len(held) == len(set(held))
        assert len(held) + s.kv.num_free_pages == s.kv.num_pages
    for seq in plan.seqs:
        assert len(seq.pages) * s.kv.page_size >= seq.start_pos + len(seq.token_ids)
    assert [r.arrival for r in s.waiting] == sorted(r.arrival for r in s.waiting)


class FakeKV:
    """What each page slot holds: ``(token id, position)`` written by the last step that
    computed it.  A step reading positions ``< start_pos`` must find its own tokens there,
    and no step may write into a page the prefix cache indexes."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}

    def execute(self, seq, r) -> None:
        ps = self.s.kv.page_size
        for pos in range(seq.start_pos):  # the context this step attends to
            page = seq.pages[pos // ps]
            assert self.slots.get((page, pos % ps)) == (r.all_token_ids[pos], pos), (
                f"request {r.request_id} reads position {pos} from page {page}: wrong KV"
            )
        for i, tok in enumerate(seq.token_ids):
            pos = seq.start_pos + i
            page = seq.pages[pos // ps]
            assert not self.s.kv.cache.is_cached(page) or self.slots.get((page, pos % ps)) == (
                tok,
                pos,
            ), f"write into cached page {page}"
            self.slots[(page, pos % ps)] = (tok, pos)


def run_step(s: Scheduler, by_id: dict, log: list | None = None, kv: FakeKV | None = None):
    """Schedule and pretend to execute: sampled tokens are 7; a request ends at max_tokens."""
    plan = s.schedule()
    check_invariants(s, plan)
    result = StepResult()
    for seq in plan.seqs:
        r = by_id[seq.request_id]
        assert seq.token_ids == r.all_token_ids[seq.start_pos : seq.start_pos + len(seq.token_ids)]
        if kv is not None:
            kv.execute(seq, r)
        if log is not None:
            log.append((seq.request_id, len(seq.token_ids), seq.sample))
        if r.prompt_logprobs is not None and seq.prompt_logprobs_targets:
            assert seq.prompt_logprobs_start == len(r.prompt_logprobs) - 1
            result.prompt_logprobs[seq.request_id] = list(seq.prompt_logprobs_targets)
        if seq.sample:
            result.sampled[seq.request_id] = SampledToken(7, 0.0, ())
    for r, tok in s.update_from_output(plan, result):
        r.append_token(tok.token_id, tok.logprob, tok.top)
        if r.num_output_tokens >= r.params.max_tokens:
            r.finish("length")
            s.remove(r)
    check_invariants(s, EMPTY_PLAN)
    return plan


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


def finish_all(s, by_id, kv=None):
    """Queue the requests of ``by_id`` not queued yet, and run until all are done."""
    for r in by_id.values():
        if r not in s.waiting and r not in s.running and not r.finished:
            s.add_waiting(r)
    while s.running or s.waiting:
        run_step(s, by_id, kv=kv)


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


def a_pages_of(s, tokens):
    pages, _ = s.kv.match_prefix(tokens, len(tokens))
    return pages


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


def test_admits_none_bounds_the_next_admission():
    """``admits_none`` (overlap scheduling's check) over the running-count and page bounds:
    slots or budget taken at the smallest count, the FCFS head's pages against the most
    that could be available, a prefix hit (cached now or by the pending step) lowering its
    need (at most the full pages of all but its last token)."""
    from pdserve.engine.prefix_cache import page_keys

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
