"""Continuous batching by tokens, with chunked prefill and preemption by recompute.

Each step the scheduler hands out a token budget (``max_num_batched_tokens``): first to
the running requests in order (one token for a decode, a chunk for an unfinished
prefill), then to waiting requests in arrival order (FCFS) while the running batch has
room (``max_running_requests``).  When a running request needs a page and none is free,
the most recently admitted running request is preempted: its pages are released and it
goes back to the waiting queue to recompute its tokens later.  Because the engine caps
the context length to what the pool can hold, a lone request always fits: no deadlock.
A request's tokens are computed up to ``Request.compute_end`` (all of them; a PD prefill
request's prompt), and its last position is sampled only when that is its last token (a
PD prefill request that gave its computed prompt's pages back computes them again without
sampling: ``engine/core/pd_flow.py``).

Prefix caching: a request admitted with nothing computed (new, or preempted) first takes
the cached pages of its longest cached prefix (full pages, at most ``compute_end - 1``
tokens, so the last token is always computed) and starts computing after them; a hit
is nothing more than a larger ``num_computed_tokens``.  Requests that ask for prompt
logprobs bypass the lookup and recompute their prompt (vLLM does the same): the
logprobs of every prompt position come from this step's logits, never from a cache.
After each step :meth:`Scheduler.update_from_output` advances the requests and indexes
their newly full pages, so the next admission can match them.  Pages come from one
owner, :class:`pdserve.engine.kv.cache.KVCacheManager`.

The result is a :class:`BatchPlan`, plain data that the model runner executes.

Speculative decoding (a ``drafter``, ``engine/spec/``): each step the drafter proposes up
to ``k`` tokens for every running decode row that may speculate (it has an output token,
``min_tokens`` is reached, ``max_tokens`` and the context limit leave room for a draft and
one more token; the engine then checks a structured-output row's drafts against its
grammar); the row becomes a *verify row* of ``1 + k`` tokens (its last
token and the drafts) when the budget and free pages allow (a draft never preempts: pages
for drafts come from what is available beyond one page per later running row).  After the
step only the kept tokens count as computed (the last token and the accepted drafts), the
prefix cache indexes full pages of those only, and pages past them (the rejected drafts'
KV) are released at once.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.config import SchedulerConfig
from pdserve.engine.core.request import Request, Status
from pdserve.engine.kv.cache import KVCacheManager
from pdserve.engine.spec.drafter import Draft, Drafter, DraftInput
from pdserve.engine.step import BatchPlan, SampledToken, ScheduledSeq

if TYPE_CHECKING:
    from pdserve.engine.step import StepResult


class Scheduler:
    """Owns the waiting queue and running batch; pages come from ``kv`` (the one owner).

    ``banned_before_min(req)`` gives the token ids to mask while ``req`` has fewer than
    ``min_tokens`` outputs (EOS and stop ids; supplied by the engine).
    ``drafter``: speculative decoding's proposer (module docstring), ``None`` = off;
    ``max_model_len``: the context limit drafts stay within.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        banned_before_min: Callable[[Request], tuple[int, ...]],
        *,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.banned_before_min = banned_before_min
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of those, accepted
        # benchmark only (ReferenceDrafter): kept reference tokens the target's argmax
        # disagreed with (StepResult.reference_mismatches)
        self.num_reference_mismatches = 0
        # verify rows by accepted drafts (index 0 .. k)
        self.accepted_histogram = [0] * (num_speculative_tokens + 1)
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
        if self.drafter is not None:
            self.drafter.release(req.request_id)

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
        if self.drafter is not None:
            self.drafter.release(req.request_id)
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
        drafts = self._propose() if self.drafter is not None else {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            computed = req.num_computed_tokens
            n = min(req.compute_end - computed, budget)
            need = -(-(computed + n) // page_size) - len(req.pages)  # pages_needed
            draft = drafts.get(req.request_id) if drafts else None
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
            if draft is not None and n == 1:
                seq = self._schedule_verify(req, draft, need, budget, len(self.running) - i - 1)
            else:
                seq = self._schedule(req, n, need)
            seqs.append(seq)
            budget -= len(seq.token_ids)
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
            end = req.compute_end
            if not req.pages and req.num_computed_tokens == 0:
                if not req.needs_prompt_logprobs():
                    # every full page's key (the hits' first), kept on the request: its
                    # pages are hashed once, not again at the next try or when they fill
                    hit, keys = self.kv.match_prefix_keys(
                        req.all_token_ids, end - 1, req.known_keys
                    )
                    if len(keys) > len(req.known_keys):
                        req.known_keys = keys
                start = len(hit) * self.kv.page_size
            else:
                start = req.num_computed_tokens  # decode role: the prompt arrived by transfer
            n = min(end - start, budget)
            need = self.need_pages(req, start + n, len(hit))
            if need > self.kv.num_available_pages - self.kv.num_evictable_among(hit):
                break  # FCFS: the head waits for pages, nobody overtakes it
            self.waiting.pop(0)
            if not req.pages and req.num_computed_tokens == 0:
                self._attach_prefix(req, hit, keys)
            req.status = Status.RUNNING
            if not req.times.scheduled:
                req.times.scheduled = time.perf_counter()
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
        end = req.compute_end
        if not req.pages and req.num_computed_tokens == 0:
            if not req.needs_prompt_logprobs():
                hit = self.kv.num_matchable(req.all_token_ids, end - 1, cached_soon)
            start = hit * self.kv.page_size
        else:
            start = req.num_computed_tokens
        # schedule admits iff need <= available - evictable hits, need = pages - held - hit;
        # need only falls as the hit grows and rises with the chunk
        need = self.need_pages(req, min(end, start + budget), hit)
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
        """``keys``: the keys of ``req``'s full pages (``match_prefix_keys``), ``hit``'s first."""
        self.kv.share(hit)
        req.pages, req.page_keys = list(hit), keys[: len(hit)]
        req.num_computed_tokens = len(hit) * self.kv.page_size
        if not req.times.scheduled:  # the first admission is what usage and hit rate count
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            self.kv.cache.record_lookup(req.num_prompt_tokens, req.num_cached_tokens)

    # --- speculative decoding ---------------------------------------------------------------
    def set_drafter(self, drafter: Drafter | None, num_speculative_tokens: int) -> None:
        """Swap the drafter (no request running; ``EngineCore.set_drafter``); the counters
        go on, the histogram grows to ``k + 1`` buckets."""
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        grow = num_speculative_tokens + 1 - len(self.accepted_histogram)
        if grow > 0:
            self.accepted_histogram += [0] * grow

    def _max_drafts(self, req: Request) -> int:
        """The most drafts ``req`` may verify this step (0: it does not speculate)."""
        if (
            req.status is not Status.RUNNING
            or req.num_computed_tokens != len(req.all_token_ids) - 1
            or req.pages_pinned()
        ):
            return 0
        n_out = req.num_output_tokens
        params = req.params
        if n_out < max(1, params.min_tokens):
            return 0
        k = self.num_speculative_tokens
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - n_out - 1)  # room for one more token after them
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - len(req.all_token_ids) - 1)
        return max(0, k)

    def _propose(self) -> dict[str, Draft]:
        """The drafter's proposals for this step's running rows that may speculate."""
        assert self.drafter is not None
        rows = []
        for req in self.running:
            k = self._max_drafts(req)
            if k > 0:
                rows.append(DraftInput(req.request_id, req.all_token_ids, k))
        if not rows:
            return {}
        return {
            row.request_id: d for row, d in zip(rows, self.drafter.propose(rows)) if d.token_ids
        }

    def _schedule_verify(
        self, req: Request, draft: Draft, need: int, budget: int, later_rows: int
    ) -> ScheduledSeq:
        """``req``'s verify row: its last token and as many of ``draft``'s tokens as the
        budget and the pages (beyond ``need`` for its last token, keeping one page per
        ``later_rows``) allow; a plain decode row when none fits."""
        page_size = self.kv.page_size
        computed = req.num_computed_tokens
        held = len(req.pages) + max(need, 0)
        spare = self.kv.num_available_pages - max(need, 0) - later_rows
        room = (held + max(spare, 0)) * page_size - computed - 1
        k = min(len(draft.token_ids), budget - 1, room)
        if k <= 0:
            return self._schedule(req, 1, need)
        seq = self._schedule(req, 1, self.kv.pages_needed(computed + 1 + k) - len(req.pages))
        drafts = tuple(draft.token_ids[:k])
        return seq._replace(
            token_ids=seq.token_ids + list(drafts),
            draft_token_ids=drafts,
            draft_q=draft.q[:k] if draft.q is not None else None,
            draft_reference=draft.reference[: k + 1] if draft.reference is not None else None,
        )

    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding's counters: drafts verified (``spec_draft_tokens``), drafts
        accepted (``spec_accepted_tokens``), verify rows (``spec_verify_rows``), and the
        acceptance length (tokens a verify row kept: accepted drafts + 1) as a histogram
        ``{sum, count, buckets}`` with cumulative buckets ``1 .. k + 1``
        (``spec_acceptance_length``; ``server/metrics.py`` exports it as one)."""
        hist = self.accepted_histogram
        buckets: dict[str, int] = {}
        running = 0
        for a, n in enumerate(hist):
            running += n
            buckets[str(a + 1)] = running
        return {
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_verify_rows": running,
            "spec_acceptance_length": {
                "sum": self.num_accepted_tokens + running,
                "count": running,
                "buckets": buckets,
            },
        }

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
        verified = result.verified
        self.num_reference_mismatches += result.reference_mismatches
        for seq in plan.seqs:
            req = by_id[seq.request_id]
            if seq.draft_token_ids:
                self._verified(req, seq, verified[seq.request_id], page_size)
                sampled.append((req, tokens[seq.request_id]))
                continue
            computed = req.num_computed_tokens = req.num_computed_tokens + len(seq.token_ids)
            if seq.start_pos < req.num_prompt_tokens:
                self.num_prompt_tokens_computed += (
                    min(computed, req.num_prompt_tokens) - seq.start_pos
                )
            if page_size and computed // page_size > len(req.page_keys):  # a page filled
                kv.cache_full_pages(
                    req.all_token_ids, req.pages, req.page_keys, computed, req.known_keys
                )
            if self.drafter is not None and seq.sample and not req.pages_pinned():
                # a row whose drafts the grammar cut (engine) holds their pages: release
                keep = kv.pages_needed(computed)
                if len(req.pages) > keep:
                    tail, req.pages = req.pages[keep:], req.pages[:keep]
                    kv.release(tail)
            if prompt_lps:
                lps = prompt_lps.get(seq.request_id)
                if lps:
                    assert req.prompt_logprobs is not None  # only a request that asked
                    req.prompt_logprobs.extend(lps)
            if seq.sample:
                sampled.append((req, tokens[seq.request_id]))
        return sampled

    def _verified(
        self, req: Request, seq: ScheduledSeq, kept: list[SampledToken], page_size: int
    ) -> None:
        """A verify row's bookkeeping: its last token and the ``len(kept) - 1`` accepted
        drafts are computed; full pages of those enter the prefix cache (``page_size`` 0:
        caching off); pages holding only rejected drafts' KV are released."""
        accepted = len(kept) - 1
        computed = req.num_computed_tokens = req.num_computed_tokens + 1 + accepted
        if page_size and computed // page_size > len(req.page_keys):
            tokens = req.all_token_ids + list(seq.draft_token_ids[:accepted])
            self.kv.cache_full_pages(tokens, req.pages, req.page_keys, computed)
        keep = self.kv.pages_needed(computed)
        if len(req.pages) > keep:
            tail, req.pages = req.pages[keep:], req.pages[:keep]
            self.kv.release(tail)
        self.num_draft_tokens += len(seq.draft_token_ids)
        self.num_accepted_tokens += accepted
        self.accepted_histogram[accepted] += 1
        if self.drafter is not None:
            self.drafter.on_verified(req.request_id, accepted)

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
