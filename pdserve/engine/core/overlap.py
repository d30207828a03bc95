"""Overlap scheduling of greedy decode steps: the host prepares and launches step N+1 while
the GPU still runs step N, then processes N's results. The contract, step by step, is
docs/architecture.md's "The life of a decode step, with overlap scheduling"; here, who
does what:

- **When it engages**: the executor supports it (TP = 1), the switch is on
  (``SchedulerConfig.overlap_schedule``) and ``ModelRunner.can_launch`` accepts the plan
  (every row one plain-greedy decode token, no prompt logprobs, within a captured graph on
  CUDA) and no row is a prefill-role request; else the step runs synchronously.
- :meth:`OverlapScheduler.launch_ahead` launches N+1 before N's results only when the
  synchronous scheduler would schedule exactly those rows (``Scheduler.admits_none``; rows
  N may end by EOS or a stop count as freeing their slot and pages); otherwise the pipeline
  drains and a waiting request is admitted in the very step a synchronous run admits it.
  Row b's input id is row ``input_rows[b]`` of N's sampled ids, gathered on the device.
- :meth:`collect` reads N's tokens after N+1 is launched; rows of requests finished or
  aborted meanwhile are dropped, and so is N+1's row of a request N finished.
- :meth:`remove` frees a request's pages only after the last launched step that writes
  them is collected (a reused page could be a NIXL receive's), in order, so the prefix
  cache evicts as a synchronous run does; :meth:`retire_idle` collects a step with no live
  row at once, so an idle engine holds no page.
- Outputs equal a synchronous run's: tokens, logprobs, text, finish reasons, usage and
  each request's streaming deltas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pdserve.engine.core.request import Request, Status
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.step import BatchPlan, InFlightTokens, StepResult

if TYPE_CHECKING:
    from pdserve.engine.worker.executor import Executor

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step queued on the device: its plan, each row's request, its tokens (not waited
    for), the page lists released once it is collected, and the rows of aborted requests
    whose full pages are cached then (``(token ids, pages, page keys, computed tokens)``, as
    ``KVCacheManager.cache_full_pages`` takes them)."""

    plan: BatchPlan
    reqs: list[Request]
    tokens: InFlightTokens
    deferred: list[list[int]] = field(default_factory=list)
    to_cache: list[tuple[list[int], list[int], list[bytes], int]] = field(default_factory=list)
    _ids: set[int] = field(default_factory=set)  # id() of each row's request (alive in reqs)

    def __post_init__(self) -> None:
        self._ids = {id(r) for r in self.reqs}

    def holds(self, req: Request) -> bool:
        return id(req) in self._ids


class OverlapScheduler:
    """The launched steps of one engine (at most one between ``EngineCore.step`` calls, two
    inside one) and the pages they keep (see the module docstring).

    scheduler: the engine's scheduler (queues, pages).  executor: runs launches
    (``Executor.supports_overlap``).  max_model_len: the engine's context limit.
    enabled: the switch, already resolved for the device.
    """

    def __init__(
        self, scheduler: Scheduler, executor: Executor, max_model_len: int, enabled: bool
    ) -> None:
        self._scheduler = scheduler
        self._executor = executor
        self._max_model_len = max_model_len
        self.enabled = enabled and executor.supports_overlap
        if enabled and not self.enabled:
            logger.warning("overlap scheduling is off: tensor parallelism runs steps in sync")
        self._launched: list[_Launched] = []  # oldest first
        self.num_launched = 0  # steps launched without waiting
        self.num_ahead = 0  # of those, launched before the previous step's results

    @property
    def pending(self) -> bool:
        """Whether a launched step waits to be collected."""
        return bool(self._launched)

    # --- launching ------------------------------------------------------------------------
    def try_launch(self, plan: BatchPlan, requests: Mapping[str, Request]) -> bool:
        """Launch ``plan`` without waiting when overlap applies to it (the first step of a
        run of overlapped ones; ``requests``: the engine's live requests by id; its rows'
        outputs come with its results); False: execute it synchronously."""
        if not self.enabled or self._launched:
            return False
        reqs = [requests[s.request_id] for s in plan.seqs]
        if any(
            r.pd is not None and r.pd.sender is not None for r in reqs
        ):  # prefill role: its step sends KV after
            return False
        if not self._executor.can_launch(plan):
            return False
        self._push(plan, reqs, None)
        return True

    def launch_ahead(self) -> bool:
        """Launch step N+1 from the pending step N's device tokens when the synchronous
        scheduler would schedule exactly its rows (module docstring); False: drain instead."""
        if not self.enabled or len(self._launched) != 1:
            return False
        sched = self._scheduler
        prev = self._launched[0]
        live = [(i, r) for i, r in enumerate(prev.reqs) if r.status is Status.RUNNING]
        if len(live) != len(sched.running):
            return False
        if any(r is not q for (_, r), q in zip(live, sched.running)):
            return False
        waiting = bool(sched.waiting)
        rows, reqs, starts, ended, may_end = [], [], [], [], []
        for i, req in live:
            p = req.params
            n_out = req.num_output_tokens + 1  # after N's token
            if (p.max_tokens is not None and n_out >= p.max_tokens) or (
                req.num_tokens + 1 >= self._max_model_len
            ):
                ended.append(req)
                continue  # N ends it: not scheduled into N+1
            if req.grammar is not None or (n_out < p.min_tokens and sched.banned_before_min(req)):
                return False  # its next row is not plain greedy
            rows.append(i)
            reqs.append(req)
            starts.append(prev.plan.seqs[i].start_pos + 1)
            if waiting:  # whether N's unseen token may end it (only an admission asks)
                stop = req.token_stop
                may_end.append(
                    stop is None
                    or stop.may_stop_on_token(n_out)
                    or bool(p.stop and n_out > stop.min_tokens)
                )
        if not rows or len(rows) > sched.config.max_num_batched_tokens:
            return False
        if waiting and not self._admits_none(prev, reqs, starts, ended, may_end):
            return False  # the synchronous step may admit one: drain, schedule it normally
        had = [len(r.pages) for r in reqs]
        seqs = sched.schedule_ahead(reqs, starts)
        if seqs is None:
            return False
        plan = BatchPlan(tuple(seqs), input_rows=tuple(rows))
        if not self._executor.can_launch(plan, rows_checked=True):  # outgrew the graph: undo
            for req, n in zip(reqs, had):
                new, req.pages = req.pages[n:], req.pages[:n]
                sched.kv.release(new)
            return False
        self._push(plan, reqs, prev.tokens)
        self.num_ahead += 1
        return True

    def _admits_none(
        self,
        prev: _Launched,
        reqs: list[Request],
        starts: list[int],
        ended: list[Request],
        may_end: list[bool],
    ) -> bool:
        """Whether the synchronous scheduler, after step ``prev``'s results, would admit no
        waiting request into the next step (``Scheduler.admits_none``).  ``reqs`` (at
        ``starts``) are the rows of the next step, ``ended`` the rows ``prev`` ends for sure
        (their pages come back before that admission), ``may_end[j]``: ``prev``'s token may
        end ``reqs[j]`` (EOS, stop), unseen here, so its slot and pages are counted as
        possibly free.  Pages a finished request left to ``prev`` are free by then too."""
        sched, kv = self._scheduler, self._scheduler.kv
        sure = [r for r, m in zip(reqs, may_end) if not m]
        taken = sum(
            max(0, sched.need_pages(r, s + 1)) for r, s, m in zip(reqs, starts, may_end) if not m
        )
        # pages whose last reference may be dropped before the admission (free or cached)
        drops: dict[int, int] = {}
        freed = [r.pages for r, m in zip(reqs, may_end) if m] + [r.pages for r in ended]
        for pages in freed + prev.deferred:
            for page in pages:
                drops[page] = drops.get(page, 0) + 1
        back = sum(1 for page, n in drops.items() if kv.refcount(page) <= n)
        soon: set[bytes] = set()
        if kv.enable_prefix_caching:  # what prev's bookkeeping indexes (every row it keeps)
            for seq, req in zip(prev.plan.seqs, prev.reqs):
                if req.status is Status.RUNNING:
                    soon.update(
                        kv.keys_to_cache(req.all_token_ids, req.page_keys, seq.start_pos + 1)
                    )
            for token_ids, _, keys, computed in prev.to_cache:  # and its aborted rows
                soon.update(kv.keys_to_cache(token_ids, keys, computed))
        return sched.admits_none(len(sure), len(reqs), kv.num_available_pages - taken + back, soon)

    def _push(self, plan: BatchPlan, reqs: list[Request], prev: InFlightTokens | None) -> None:
        tokens = self._executor.launch_greedy(plan, prev)
        self._launched.append(_Launched(plan, reqs, tokens))
        self.num_launched += 1

    # --- results --------------------------------------------------------------------------
    def advance(
        self, apply: Callable[[BatchPlan, StepResult, dict[str, Request]], None]
    ) -> tuple[bool, dict[str, Request]]:
        """With a step pending: launch the next one ahead when possible, then collect the
        pending one and ``apply`` it (the engine's bookkeeping, filling the touched requests).
        Returns (launched ahead, touched); not ahead = drained, nothing launched."""
        ahead = self.launch_ahead()
        touched: dict[str, Request] = {}
        apply(*self.collect(), touched)
        self.retire_idle()
        return ahead, touched

    def collect(self) -> tuple[BatchPlan, StepResult]:
        """Wait for the oldest launched step, release the pages deferred to it, and return
        its plan and result restricted to the rows whose request still runs."""
        step = self._launched.pop(0)
        tokens = step.tokens.tokens()
        kv = self._scheduler.kv
        for token_ids, pages, keys, computed in step.to_cache:  # before release: they stay
            kv.cache_full_pages(token_ids, pages, keys, computed)
        for pages in step.deferred:
            kv.release(pages)
        keep = [i for i, r in enumerate(step.reqs) if r.status is Status.RUNNING]
        seqs = tuple(step.plan.seqs[i] for i in keep)
        result = StepResult(sampled={seqs[j].request_id: tokens[i] for j, i in enumerate(keep)})
        return replace(step.plan, seqs=seqs, input_rows=None), result

    def retire_idle(self) -> None:
        """Collect (and discard) a launched step none of whose rows still runs, so its
        deferred pages are freed now rather than at the next request."""
        while self._launched and not any(
            r.status is Status.RUNNING for r in self._launched[0].reqs
        ):
            self.collect()

    def remove(self, req: Request, between_steps: bool = False) -> None:
        """Take a finished or aborted ``req`` out of the queues and release its pages: now,
        or, when a launched step holds its row, once that step is collected.

        between_steps: ``req`` ends between step calls (an abort), after the launched step
        in a synchronous run, so that step's row counts: its full pages enter the prefix
        cache when the step is collected.  Otherwise ``req`` ended with the results of the
        step before (EOS, stop, length), and its row in the launched one was computed in
        vain."""
        step = next((s for s in reversed(self._launched) if s.holds(req)), None)
        if step is None:
            self._scheduler.remove(req)
            return
        if req in self._scheduler.running:
            self._scheduler.take_running(req)
        pages, keys, req.pages, req.page_keys = req.pages, req.page_keys, [], []
        if between_steps and pages and self._scheduler.kv.enable_prefix_caching:
            seq = next(q for q, r in zip(step.plan.seqs, step.reqs) if r is req)
            computed = seq.start_pos + len(seq.token_ids)
            step.to_cache.append((req.all_token_ids, pages, keys, computed))
        if pages:
            step.deferred.append(pages)
