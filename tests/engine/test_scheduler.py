"""Scheduler alone (no model): token budget, chunked prefill, FCFS, max_running_requests,
preemption by recompute, aborts; random workloads never deadlock and free every page."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.request import Request, Status
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler


def make(num_pages=64, page_size=4, budget=32, max_running=8):
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
        pool,
        lambda r: (),
    )


def req(rid, prompt_len, max_tokens, arrival, prompt_logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Request(
        str(rid),
        list(range(1, prompt_len + 1)),
        params,
        arrival=arrival,
        detokenizer=None,
        generator=None,
    )


def check_invariants(s: Scheduler, plan):
    assert plan.num_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_running_requests
    held = [p for r in s.running + s.waiting for p in r.pages]
    assert len(held) == len(set(held))
    assert len(held) + s.pool.num_free_pages == s.pool.num_pages
    for seq in plan.seqs:
        assert len(seq.pages) * s.pool.page_size >= seq.start_pos + len(seq.token_ids)
    assert [r.arrival for r in s.waiting] == sorted(r.arrival for r in s.waiting)


def run_step(s: Scheduler, by_id: dict, log: list | None = None):
    """Schedule and pretend to execute: sampled tokens are 7; a request ends at max_tokens."""
    plan = s.schedule()
    check_invariants(s, plan)
    for seq in plan.seqs:
        r = by_id[seq.request_id]
        assert seq.token_ids == r.all_token_ids[seq.start_pos : seq.start_pos + len(seq.token_ids)]
        r.num_computed_tokens += len(seq.token_ids)
        if log is not None:
            log.append((seq.request_id, len(seq.token_ids), seq.sample))
        if r.prompt_logprobs is not None and seq.prompt_logprobs_targets:
            assert seq.prompt_logprobs_start == len(r.prompt_logprobs) - 1
            r.prompt_logprobs.extend(seq.prompt_logprobs_targets)
        if seq.sample:
            r.append_token(7, 0.0, ())
            if r.num_output_tokens >= r.params.max_tokens:
                r.finish("length")
                s.remove(r)
    return plan


def test_chunked_prefill_respects_the_budget():
    s = make(budget=4)
    r = req("a", 10, 2, 0)
    s.add_waiting(r)
    log = []
    while s.running or s.waiting:
        run_step(s, {"a": r}, log)
    assert log == [("a", 4, False), ("a", 4, False), ("a", 2, True), ("a", 1, True)]
    assert s.pool.num_free_pages == s.pool.num_pages


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
    assert s.pool.num_free_pages == 6


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


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_and_free_every_page(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 16])
    max_len = 40
    num_pages = rng.randint(-(-max_len // page_size), 3 * (-(-max_len // page_size)))
    s = make(
        num_pages=num_pages,
        page_size=page_size,
        budget=rng.randint(1, 48),
        max_running=rng.randint(1, 6),
    )
    by_id, arrival = {}, 0
    for _step in range(3000):
        if arrival < 30 and rng.random() < 0.3:
            p = rng.randint(1, 25)
            r = req(arrival, p, rng.randint(1, max_len - p), arrival)
            by_id[r.request_id] = r
            s.add_waiting(r)
            arrival += 1
        live = [r for r in by_id.values() if not r.finished]
        if live and rng.random() < 0.05:  # abort at any time
            victim = rng.choice(live)
            s.remove(victim)
            victim.finish("abort")
        run_step(s, by_id)
        if arrival == 30 and all(r.finished for r in by_id.values()):
            break
    assert all(r.finished for r in by_id.values()), "deadlock: requests never finished"
    assert not s.running and not s.waiting
    assert s.pool.num_free_pages == num_pages
    for r in by_id.values():
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.params.max_tokens
            assert r.status is Status.FINISHED
