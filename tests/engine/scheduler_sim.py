"""The scheduler driven without a model (tests/engine/test_scheduler*.py): a scheduler over
a tiny CPU pool, requests, the invariants checked every step, a simulated KV store, and a
step that pretends to execute a plan (every sampled token is 7)."""

from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.kv.cache import KVCacheManager, PageIds
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step import BatchPlan, SampledToken, StepResult

EMPTY_PLAN = BatchPlan(())


def make(num_pages=64, page_size=4, budget=32, max_running=8, prefix_caching=False):
    page_ids = PageIds(num_pages, page_size, num_aux_slots=1)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_running_requests=max_running),
        KVCacheManager(page_ids, enable_prefix_caching=prefix_caching),
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


def finish_all(s, by_id, kv=None):
    """Queue the requests of ``by_id`` not queued yet, and run until all are done."""
    for r in by_id.values():
        if r not in s.waiting and r not in s.running and not r.finished:
            s.add_waiting(r)
    while s.running or s.waiting:
        run_step(s, by_id, kv=kv)


def a_pages_of(s, tokens):
    pages, _ = s.kv.match_prefix(tokens, len(tokens))
    return pages
