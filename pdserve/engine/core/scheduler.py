"""Continuous batching by tokens, with chunked prefill and preemption by recompute.

Each step the scheduler hands out a token budget (``max_num_batched_tokens``): first to
the running requests in order (one token for a decode, a chunk for an unfinished
prefill), then to waiting requests in arrival order (FCFS) while the running batch has
room (``max_running_requests``).  When a running request needs a page and none is free,
the most recently admitted running request is preempted: its pages are released and it
goes back to the waiting queue to recompute its tokens later.  Because the engine caps
the context length to what the pool can hold, a lone request always fits: no deadlock.

Prefix caching: a request admitted with nothing computed (new, or preempted) first takes
the cached pages of its longest cached prefix (full pages, at most ``num_tokens - 1``
tokens, so the last token is always computed and sampled) and starts computing after
them; a hit is nothing more than a larger ``num_computed_tokens``.  Requests that ask for
prompt logprobs bypass the lookup and recompute their prompt (vLLM does the same): the
logprobs of every prompt position come from this step's logits, never from a cache.
After each step :meth:`Scheduler.update_from_output` advances the requests and indexes
their newly full pages, so the next admission can match them.  Pages come from one
owner, :class:`pdserve.engine.kv.cache.KVCacheManager`.

The result is a :class:`BatchPlan`, plain data that the model runner executes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from pdserve.config import SchedulerConfig
from pdserve.engine.core.request import Request, Status
from pdserve.engine.kv.cache import KVCacheManager
from pdserve.engine.step import BatchPlan, SampledToken, ScheduledSeq

if TYPE_CHECKING:
    from pdserve.engine.step import StepResult


class Scheduler:
    """Owns the waiting queue and running batch; pages come from ``kv`` (the one owner).

    ``banned_before_min(req)`` gives the token ids to mask while ``req`` has fewer than
    ``min_tokens`` outputs (EOS and stop ids; supplied by the engine).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        banned_before_min: Callable[[Request], tuple[int, ...]],
    ) -> None:
        self.config = config
        self.kv = kv
        self.banned_before_min = banned_before_min
        self.waiting: list[Request] = []  # sorted by arrival (FCFS)
        self.running: list[Request] = []  # changed only here, with _running_by_id
        self._running_by_id: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0

    # --- queue changes -----------------------------------------------------------------
    def add_waiting(self, req: Request) -> None:
        req.status = Status.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues and release its pages (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
            del self._running_by_id[req.request_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        self.free_pages(req)

    def take_running(self, req: Request) -> None:
        """Take a running ``req`` out of the batch keeping its pages (a prefill-role request
        whose pages the transfer layer reads next)."""
        self.running.remove(req)
        del self._running_by_id[req.request_id]

    def free_pages(self, req: Request) -> None:
        """Release ``req``'s pages (cached full pages stay in the prefix cache)."""
        if req.pages:
            pages, req.pages = req.pages, []
            self.kv.release(pages)
        req.page_keys = []

    def pages_needed(self, num_tokens: int) -> int:
        return self.kv.pages_needed(num_tokens)

    def need_pages(self, req: Request, num_tokens: int, num_hit: int = 0) -> int:
        """New pages ``req`` takes to hold ``num_tokens`` tokens when ``num_hit`` leading
        pages come from the prefix cache: the pages those tokens fill, less the ones it
        holds and the hits (<= 0: none).  The one rule of admission, of
        :meth:`admits_none` and of a decode request's receive pages."""
        return self.kv.pages_needed(num_tokens) - len(req.pages) - num_hit

    def has_waiting(self) -> bool:
        """Whether a request waits in the queue (admitted work runs before new transfers)."""
        return bool(self.waiting)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        del self._running_by_id[req.request_id]
        self.free_pages(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add_waiting(req)

    # --- one step ------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        """Pick this step's tokens (see the module docstring)."""
        budget = self.config.max_num_batched_tokens
        kv, page_size = self.kv, self.kv.page_size
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            computed = req.num_computed_tokens
            n = min(len(req.all_token_ids) - computed, budget)
            need = -(-(computed + n) // page_size) - len(req.pages)  # pages_needed
            # (most decode rows need no page: the pool is not asked how many it has)
            while need > 0 and need > kv.num_available_pages and req.status is Status.RUNNING:
                # pages handed to a KV sender (chunked sending) are the transfer layer's
                victim = next((r for r in reversed(self.running) if not r.pages_pinned()), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim.request_id)
            if req.status is not Status.RUNNING:
                break  # it was the last one and preempted itself
            if need > 0 and need > kv.num_available_pages:
                i += 1  # only requests whose pages are being sent are left: wait for pages
                continue
            seqs.append(self._schedule(req, n, need))
            budget -= n
            i += 1
        # Admitting new work right after a preemption would only preempt again.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_running
        ):
            req = self.waiting[0]
            hit: list[int] = []
            keys: list[bytes] = []
            if not req.pages and req.num_computed_tokens == 0:
                if not req.needs_prompt_logprobs():
                    hit, keys = self.kv.match_prefix(req.all_token_ids, req.num_tokens - 1)
                start = len(hit) * self.kv.page_size
            else:
                start = req.num_computed_tokens  # decode role: the prompt arrived by transfer
            n = min(req.num_tokens - start, budget)
            need = self.need_pages(req, start + n, len(hit))
            if need > self.kv.num_available_pages - self.kv.num_evictable_among(hit):
                break  # FCFS: the head waits for pages, nobody overtakes it
            self.waiting.pop(0)
            if not req.pages and req.num_computed_tokens == 0:
                self._attach_prefix(req, hit, keys)
            req.status = Status.RUNNING
            self.running.append(req)
            self._running_by_id[req.request_id] = req
            seqs.append(self._schedule(req, n, need))
            budget -= n
        return BatchPlan(tuple(seqs), tuple(preempted))

    def admits_none(
        self,
        min_running: int,
        max_running: int,
        max_available: int,
        cached_soon: Collection[bytes] = (),
    ) -> bool:
        """Whether the next :meth:`schedule` surely admits no waiting request, whatever the
        pending step's unseen outcome (overlap scheduling, ``engine/core/overlap.py``).

        It mirrors the admission loop for the FCFS head (nobody overtakes it) over bounds:
        the running batch then holds between ``min_running`` and ``max_running`` decode
        rows (one token each, scheduled first); at most ``max_available`` pages are
        available (``KVCacheManager.num_available_pages``) once those rows took theirs;
        the prefix cache holds at most its keys now plus ``cached_soon``.  True when no
        request waits, every slot or the token budget is taken even at ``min_running``, or
        the head needs more pages than ``max_available`` even with the largest budget-free
        prefix hit and the smallest chunk.  False means it may admit (the caller drains)."""
        if not self.waiting:
            return True
        cfg = self.config
        if min_running >= cfg.max_running or cfg.max_num_batched_tokens <= min_running:
            return True
        req = self.waiting[0]
        budget = max(1, cfg.max_num_batched_tokens - max_running)  # the smallest chunk
        hit = 0
        if not req.pages and req.num_computed_tokens == 0:
            if not req.needs_prompt_logprobs():
                hit = self.kv.num_matchable(req.all_token_ids, req.num_tokens - 1, cached_soon)
            start = hit * self.kv.page_size
        else:
            start = req.num_computed_tokens
        # schedule admits iff need <= available - evictable hits, need = pages - held - hit;
        # need only falls as the hit grows and rises with the chunk
        need = self.need_pages(req, min(req.num_tokens, start + budget), hit)
        return need > max_available

    def schedule_ahead(
        self, reqs: Sequence[Request], starts: Sequence[int]
    ) -> list[ScheduledSeq] | None:
        """Decode rows of a step launched before the previous step's tokens are known
        (overlap scheduling, ``engine/core/overlap.py``): ``reqs[i]`` computes the token at
        position ``starts[i]`` (unknown to the host: ``token_ids == [-1]``) and samples the
        next one.  Pages for ``starts[i] + 1`` tokens come from the pool's free list only
        (no eviction, no preemption, so the prefix cache and the queues change as a
        synchronous step would change them); ``None``, nothing allocated, when it is short."""
        needs = [self.need_pages(r, s + 1) for r, s in zip(reqs, starts)]
        if sum(n for n in needs if n > 0) > self.kv.num_free_pages:
            return None
        seqs = []
        for req, start, need in zip(reqs, starts, needs):
            if need > 0:
                self._grow(req, need)
            seqs.append(
                ScheduledSeq(
                    request_id=req.request_id,
                    token_ids=[-1],
                    start_pos=start,
                    pages=req.pages,
                    sample=True,
                    prompt_logprobs_start=0,
                    prompt_logprobs_targets=[],
                    params=req.params,
                    generator=req.generator,
                )
            )
        return seqs

    def _attach_prefix(self, req: Request, hit: list[int], keys: list[bytes]) -> None:
        self.kv.share(hit)
        req.pages, req.page_keys = list(hit), list(keys)
        req.num_computed_tokens = len(hit) * self.kv.page_size
        if req.num_preemptions == 0:  # the first admission is what usage and hit rate count
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            self.kv.cache.record_lookup(req.num_prompt_tokens, req.num_cached_tokens)

    def update_from_output(
        self, plan: BatchPlan, result: StepResult
    ) -> list[tuple[Request, SampledToken]]:
        """The bookkeeping of an executed step: each scheduled request's computed tokens
        advance, its newly full pages enter the prefix cache, and its prompt logprobs are
        appended.  Returns ``(request, sampled token)`` of the requests that sampled, in
        batch order: the caller appends the token and applies the stop checks (then
        :meth:`remove` or :meth:`take_running`)."""
        by_id = self._running_by_id
        kv = self.kv
        page_size = kv.page_size if kv.enable_prefix_caching else 0
        prompt_lps = result.prompt_logprobs
        tokens = result.sampled
        sampled: list[tuple[Request, SampledToken]] = []
        for seq in plan.seqs:
            req = by_id[seq.request_id]
            computed = req.num_computed_tokens = req.num_computed_tokens + len(seq.token_ids)
            if seq.start_pos < req.num_prompt_tokens:
                self.num_prompt_tokens_computed += (
                    min(computed, req.num_prompt_tokens) - seq.start_pos
                )
            if page_size and computed // page_size > len(req.page_keys):  # a page filled
                kv.cache_full_pages(req.all_token_ids, req.pages, req.page_keys, computed)
            if prompt_lps:
                lps = prompt_lps.get(seq.request_id)
                if lps:
                    assert req.prompt_logprobs is not None  # only a request that asked
                    req.prompt_logprobs.extend(lps)
            if seq.sample:
                sampled.append((req, tokens[seq.request_id]))
        return sampled

    def _grow(self, req: Request, n: int) -> None:
        """``n`` more pages for ``req``: a new list (a plan holds the old one, unchanged)."""
        req.pages = req.pages + self.kv.allocate(n, req.pages[-1] if req.pages else None)

    def _schedule(self, req: Request, n: int, new_pages: int) -> ScheduledSeq:
        if new_pages > 0:
            self._grow(req, new_pages)
        start = req.num_computed_tokens
        sample = start + n == len(req.all_token_ids)
        lp_start, lp_targets = 0, []
        if req.prompt_logprobs is not None and req.needs_prompt_logprobs():
            lp_start = max(start, req.prompt_logprobs_done - 1)
            end = min(start + n, req.num_prompt_tokens - 1)
            lp_targets = req.prompt_token_ids[lp_start + 1 : end + 1]
        banned: tuple[int, ...] = ()
        min_tokens = req.params.min_tokens
        if sample and min_tokens and len(req.all_token_ids) - req.num_prompt_tokens < min_tokens:
            banned = self.banned_before_min(req)
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + n],
            start_pos=start,
            pages=req.pages,
            sample=sample,
            prompt_logprobs_start=lp_start,
            prompt_logprobs_targets=lp_targets,
            params=req.params,
            generator=req.generator,
            banned_token_ids=banned,
            penalty_tokens=req.penalty_tokens if sample else None,
        )
