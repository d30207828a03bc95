"""``EngineCore``: one worker's engine thread — scheduler, page ids, PD flow, outputs; the
ranks (model, KV storage, runner) behind its executor.

Not thread-safe: one thread (the server's engine thread, or ``LLM.generate``) calls
``add_request`` / ``abort_request`` / ``step``.  ``step`` never blocks on the network;
when only transfers are pending it returns ``[]`` quickly (the caller may sleep).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pdserve.config import EngineConfig, default_max_running_requests
from pdserve.disagg.base import KVLayout, KVManager
from pdserve.engine.core.overlap import OverlapScheduler
from pdserve.engine.core.pd_flow import PDFlow
from pdserve.engine.core.request import (
    DisaggRequestInfo,
    Request,
    RequestOutput,
    Status,
    check_prompt,
    check_stops,
)
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.stop import IncrementalDetokenizer, tokens_banned_before_min
from pdserve.engine.kv.cache import KVCacheManager, PageIds
from pdserve.engine.sampling_params import SamplingParams, generator_seed
from pdserve.engine.spec.drafter import Drafter
from pdserve.engine.spec.factory import make_drafter
from pdserve.engine.step import BatchPlan, SampledToken, StepResult
from pdserve.engine.structured.manager import GrammarState, StructuredOutputManager
from pdserve.engine.worker.device import resolve_dtype, resolve_rank_device
from pdserve.engine.worker.executor import RankFailedError
from pdserve.engine.worker.executor_factory import create_executor
from pdserve.engine.worker.rank_worker import prepare_verify_graphs
from pdserve.model.attention import default_backend
from pdserve.model.loader import load_model_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class EngineCore:
    """Continuous-batching engine over a paged KV pool.

    config: model, cache and scheduler settings.  kv_managers: transfer managers by
    backend name (``"nixl"``, ``"fake"``), needed only for disaggregated requests;
    transfer_backend: the key used by non-fake disaggregated requests.
    Raises ValueError naming the field for a bad model, device, dtype or context limit.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_managers: Mapping[str, KVManager] | None = None,
        *,
        transfer_backend: str = "nixl",
    ) -> None:
        mc, sc = config.model, config.scheduler
        self.device = resolve_rank_device(mc, 0)
        if sc.max_running_requests is None:  # the device's default, for every rank
            sc = replace(sc, max_running_requests=default_max_running_requests(self.device.type))
            config = replace(config, scheduler=sc)
        self.config = config
        if self.device.type == "cpu" and mc.gpu_ids is not None:
            logger.warning("gpu_ids %s ignored: this worker runs on the CPU", list(mc.gpu_ids))
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.source = load_model_source(mc.model, seed=mc.seed)
        if not hasattr(self.source.tokenizer, "backend_tokenizer"):
            raise ValueError(
                f"model {mc.model!r}: its tokenizer is not a fast (tokenizers) one, "
                "which incremental detokenization needs"
            )
        self.attention_backend = (
            default_backend(self.device) if mc.attention_backend == "auto" else mc.attention_backend
        )
        # Unseeded random rows share one generator (one batched draw a step); seeded rows
        # get their own in add_request, so a seed gives the same tokens whatever the batch.
        self._unseeded = torch.Generator(device=self.device)
        self._unseeded.manual_seed(mc.seed)
        # The ranks: TP=1 in this process; TP=N rank 0 here, the others processes.
        self.executor = create_executor(
            config, self.source, self.dtype, self.attention_backend, self._unseeded
        )
        # What the ranks agree on (pages, aux slots, layout, vocabulary, context limit);
        # the ids of those pages and slots live here, on the engine thread.
        geo = self.executor.geometry
        self._layout = geo.layout
        self.vocab_size = geo.vocab_size
        max_len = geo.max_model_len
        capacity = geo.num_pages * geo.page_size
        if capacity < max_len:
            logger.warning(
                "KV pool holds %d tokens; max_model_len lowered from %d", capacity, max_len
            )
        self.max_model_len = min(max_len, capacity)  # so a lone request always fits
        self.eos_token_ids = frozenset(self.source.eos_token_ids)
        self.page_ids = PageIds(geo.num_pages, geo.page_size, geo.num_aux_slots)
        self.kv = KVCacheManager(
            self.page_ids, enable_prefix_caching=config.cache.enable_prefix_caching
        )
        self.drafter = make_drafter(
            config,
            self.source,
            self.dtype,
            self.attention_backend,
            self.max_model_len,
            geo.num_pages,
            geo.page_size,
        )
        self.scheduler = Scheduler(
            sc,
            self.kv,
            lambda r: tokens_banned_before_min(r.params, self.eos_token_ids),
            drafter=self.drafter,
            num_speculative_tokens=sc.num_speculative_tokens if self.drafter else 0,
            max_model_len=self.max_model_len,
        )
        # Grammars of structured outputs: compiled on first use, cached (engine/structured/).
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        # Prefill/decode disaggregation: the rooms and Request.pd (engine/core/pd_flow.py).
        self.pd = PDFlow(
            self.page_ids,
            self.kv,
            self.scheduler,
            kv_managers or {},
            transfer_backend,
            self.vocab_size,
            ahead_pages=int(sc.pd_compute_ahead_fraction * geo.num_pages),
            ahead_timeout_s=sc.pd_compute_ahead_timeout_s,
        )
        self._managers_bound = bool(kv_managers)
        overlap = sc.overlap_schedule
        self._overlap_wanted = self.device.type == "cuda" if overlap is None else overlap
        self.overlap = OverlapScheduler(
            self.scheduler, self.executor, self.max_model_len, self._overlap_wanted
        )
        if self.drafter is not None:  # a verify step is synchronous: no overlap
            self.overlap.enabled = False
        self._requests: dict[str, Request] = {}
        self._arrivals = 0
        self._counters = {
            "steps": 0,
            "generation_tokens": 0,
            "finished_requests": 0,
        }

    # --- public API -----------------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.source.tokenizer

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds: free in the pool, or cached and evictable."""
        return self.kv.num_available_pages

    @property
    def num_steps(self) -> int:
        """Steps run or launched so far (``stats()["steps"]``, without building the dict)."""
        return self._counters["steps"]

    def bind_kv_managers(self, managers: Mapping[str, KVManager]) -> None:
        """Give the engine its KV transfer managers by backend name after construction (a
        manager needs ``self.executor.kv_args()``, which exists only once the engine does).
        Valid once, before the first request; ValueError naming ``kv_managers`` when
        managers were given already (here or to the constructor), a request was added,
        or ``managers`` is empty or holds something that is not a KVManager."""
        if self._managers_bound:
            raise ValueError("kv_managers: this engine's KV managers are bound already")
        if self._arrivals:
            raise ValueError("kv_managers: must be bound before the first request")
        if not managers or not all(isinstance(m, KVManager) for m in managers.values()):
            raise ValueError("kv_managers must be a non-empty mapping of backend name to KVManager")
        self.pd.set_managers(managers)
        self._managers_bound = True

    def set_kv_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Have every bound KV manager call ``wakeup`` (from its own threads) when a room
        moves to a state a step acts on (:meth:`KVManager.set_wakeup`): the serving thread,
        waiting between polls while only rooms are pending, steps at once."""
        self.pd.set_wakeup(wakeup)

    def set_drafter(self, drafter: Drafter | None, num_speculative_tokens: int = 0) -> None:
        """Swap the speculative drafter (``None``: speculation off) between runs, with no
        live request (benchmarks compare one engine with and without speculation; tests
        install the replay drafter).  Overlap scheduling follows: on as configured when
        speculation is off, off while it is on.  ValueError naming ``drafter`` while
        requests are live, ``num_speculative_tokens`` when < 1 with a drafter, or when
        it differs from the ``k`` this engine's verify graphs were captured for."""
        if self.has_unfinished_requests():
            raise ValueError("drafter: cannot be swapped while requests are live")
        if drafter is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if drafter is not None:  # verify graphs of this k (made once; TP=1 on CUDA only)
            self.executor.call_rank(0, prepare_verify_graphs, num_speculative_tokens)
        self.drafter = drafter
        self.scheduler.set_drafter(drafter, num_speculative_tokens if drafter else 0)
        self.overlap.enabled = (
            drafter is None and self._overlap_wanted and self.executor.supports_overlap
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        disagg: DisaggRequestInfo | None = None,
    ) -> None:
        """Queue a single-sample request (``params.n`` must be 1; see ``fan_out``).

        Raises ValueError naming the field: ``request_id`` already live, ``n`` > 1, a prompt
        :func:`check_prompt` rejects (``PromptError``: empty, out of the vocabulary, no room
        for one output token under ``max_model_len``), or a ``disagg`` this engine cannot
        serve (also ``DuplicateRoomError``, a ValueError, for a live room).
        """
        if self.executor.failure is not None:
            raise RankFailedError(f"the engine cannot serve: {self.executor.failure}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError(
                "n must be 1 for an engine request; split it with SamplingParams.fan_out"
            )
        check_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        manager = self.pd.manager_for(disagg) if disagg is not None else None
        so = params.structured_outputs
        grammar = self.structured.new_state(so) if so is not None else None
        generator = None
        if not params.greedy and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(generator_seed(params.seed))  # all 64 bits mixed
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop or (),
        )
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            arrival=self._arrivals,
            detokenizer=detok,
            generator=generator,
            disagg=disagg,
        )
        req.grammar = grammar
        self._arrivals += 1
        if manager is not None:
            self.pd.add(req, manager)
        else:
            self.scheduler.add_waiting(req)
        self._requests[request_id] = req

    def abort_request(self, request_id: str) -> None:
        """End a request now (``finish_reason="abort"``); unknown or finished ids are
        ignored.  Its pages are freed exactly once (disaggregated ones after the room's
        terminal poll), its full computed pages staying in the prefix cache as a finished
        request's do."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if self.pd.holds_room(req):
            self.pd.abort(req)
        else:
            req.finish("abort")
            # Pages: after a launched step that writes them, its row cached as in sync; that
            # step is waited for now when it holds no live row (pages back at once).
            self.overlap.remove(req, between_steps=True)
            self.overlap.retire_idle()

    def has_unfinished_requests(self) -> bool:
        """True while a request is live, an aborted room drains, or a launched step waits."""
        return bool(self._requests) or self.pd.num_draining > 0 or self.overlap.pending

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that advanced.
        Overlap scheduling (``engine/core/overlap.py``): a launched step's results come in the
        next call, after the step that follows it was launched.  A decode request whose KV
        arrived is returned at once with prefill's first token alone, before any step runs
        (the step that follows schedules it)."""
        touched: dict[str, Request] = {}
        for req, first in self.pd.poll():
            if first is not None:  # decode: joined with prefill's first token
                self._append_token(req, first)
                self.pd.join(req)
            touched[req.request_id] = req
        if any(not r.finished for r in touched.values()):
            # A decode request joined with prefill's first token: out now, not after a step
            # (the client's TTFT); its next token comes with the next step, as when mixed.
            return self._outputs(touched)
        outputs: list[RequestOutput] = []
        ahead = False
        if self.overlap.pending:
            ahead, lagged = self.overlap.advance(self._apply)
            self._counters["steps"] += ahead
            if ahead:  # disjoint from the polled requests (none of those is in the batch)
                touched.update(lagged)
            else:  # drained: its outputs first, so every delta is one step's, as in sync
                outputs = self._outputs(lagged)
        plan = BatchPlan(()) if ahead else self.scheduler.schedule()
        if plan.seqs:
            plan = self._attach_grammar_masks(plan)
            self.pd.expect_sends(plan)  # prefill: the last send's WRITE made ahead
            self._counters["steps"] += 1
            # touched holds only finished polled requests here (a joined one returned
            # above), none of them in plan: a launched step's outputs are its rows alone.
            if not self.overlap.try_launch(plan, self._requests):
                try:
                    result = self.executor.execute(plan)
                except RankFailedError as exc:
                    return outputs + self._fail_all(str(exc), touched)
                self._apply(plan, result, touched)
        touched.update((r.request_id, r) for r in self.pd.admit_receivers())
        return outputs + self._outputs(touched)

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """An output per touched request; finished ones leave the engine."""
        outputs = [self._make_output(r) for r in touched.values()]
        for r in touched.values():
            if r.finished:
                self._requests.pop(r.request_id, None)
                self._counters["finished_requests"] += 1
        return outputs

    @property
    def failure(self) -> str | None:
        """Why this engine cannot run steps any more (a tensor-parallel rank died; the text
        names it), or None while it serves."""
        return self.executor.failure

    def shutdown(self) -> None:
        """Stop the rank processes of a tensor-parallel engine (no-op for TP=1; idempotent).
        The engine serves no step afterwards."""
        self.executor.shutdown()

    def stats(self) -> dict[str, Any]:
        """Gauges and counters for metrics (plain ints), and speculative decoding's
        acceptance-length histogram (``spec_acceptance_length``: ``{sum, count, buckets}``,
        ``Scheduler.spec_stats``)."""
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_for_peer": self.pd.num_waiting_for_peer,
            "num_transferring": self.pd.count(Status.TRANSFERRING),
            "num_draining": self.pd.num_draining,
            "num_quarantined_pages": self.pd.num_quarantined_pages,
            "pd_ahead_pages": self.pd.num_ahead_pages,
            "pd_ahead_capped": self.pd.num_ahead_capped,
            "pd_ahead_expired": self.pd.num_ahead_expired,
            "num_free_pages": self.kv.num_available_pages,
            "num_total_pages": self.kv.num_pages,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            **self._counters,
            "overlap_launched_steps": self.overlap.num_launched,
            "overlap_ahead_steps": self.overlap.num_ahead,
            **self.kv.stats(),
            **self.scheduler.spec_stats(),
        }

    # --- internals --------------------------------------------------------------------
    def _fail_all(self, error: str, touched: dict[str, Request]) -> list[RequestOutput]:
        """A rank is gone: end every live request with ``finish_reason="error"`` naming it
        (pages released, rooms aborted), and return their outputs."""
        for req in list(self._requests.values()):
            if self.pd.holds_room(req):
                self.pd.abort(req, "error", error=error)
            else:
                req.finish("error", error=error)
                self.overlap.remove(req)
            touched[req.request_id] = req
        return self._outputs(touched)

    def _apply(self, plan: BatchPlan, result: StepResult, touched: dict[str, Request]) -> None:
        sampled = self.scheduler.update_from_output(plan, result)
        self.pd.send_chunks(plan)  # prefill: full pages of finished chunks move now
        verified = result.verified
        for req, tok in sampled:
            touched[req.request_id] = req
            if self.pd.sends_first_token(req):  # prefill: the token goes to decode with the KV
                self.pd.send_prefill(req, tok, self._stop_verdict(req, tok) or ("length", None))
            elif verified and req.request_id in verified:
                for kept in verified[req.request_id]:  # a finish among them cuts there
                    self._append_token(req, kept)
                    if req.finished:
                        break
            else:
                self._append_token(req, tok)
            if req.finished:
                self.overlap.remove(req)  # pages: after a launched step that writes them

    def _attach_grammar_masks(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` with the allowed-token masks of its live grammars (a separate method:
        ``bench host`` times it); verify rows first get theirs per position
        (:meth:`_check_drafts`)."""
        if self.drafter is not None and any(s.draft_token_ids for s in plan.seqs):
            plan = self._check_drafts(plan)
        return self.structured.attach_masks(plan, self._grammar_of, self.device)

    def _check_drafts(self, plan: BatchPlan) -> BatchPlan:
        """Structured outputs under speculation: each verify row with a live grammar has its
        drafts walked through its matcher, cut at the first one the grammar rejects, and
        gets the allowed-token mask of every position (``logits_mask`` for the first,
        ``draft_masks`` for the others; none after the grammar terminated); the matcher is
        rolled back, so it advances only by the tokens ``_append_token`` keeps."""
        seqs = list(plan.seqs)
        changed = False
        for i, seq in enumerate(seqs):
            g = self._requests[seq.request_id].grammar if seq.draft_token_ids else None
            if g is None or g.failed or g.is_terminated:
                continue
            masks: list[torch.Tensor] = []
            ok = steps = 0  # drafts kept; tokens the matcher advanced by
            for d in seq.draft_token_ids:
                if g.matcher.is_terminated():  # after the end: any token (ignore_eos)
                    masks.append(torch.ones_like(masks[0]))
                else:
                    masks.append(self.structured.masks([g], self.device)[0])
                    if not bool(masks[-1][d]) or not g.matcher.accept_token(d):
                        break
                    steps += 1
                ok += 1
            if len(masks) == ok:  # every draft accepted: the last position's mask
                done = g.matcher.is_terminated()
                masks.append(
                    torch.ones_like(masks[0])
                    if done
                    else self.structured.masks([g], self.device)[0]
                )
            if steps:
                g.matcher.rollback(steps)
            drafts = seq.draft_token_ids[:ok]
            seqs[i] = seq._replace(
                token_ids=seq.token_ids[:1] + list(drafts),
                draft_token_ids=drafts,
                draft_q=seq.draft_q[:ok] if seq.draft_q is not None and ok else None,
                logits_mask=masks[0],
                draft_masks=tuple(masks[1 : ok + 1]) if ok else None,
            )
            changed = True
        return replace(plan, seqs=tuple(seqs)) if changed else plan

    def _grammar_of(self, request_id: str) -> GrammarState | None:
        return self._requests[request_id].grammar

    def _append_token(self, req: Request, tok: SampledToken) -> None:
        """Append a sampled token, update text, and apply the stop checks (finishing
        ``req`` in place).  A request with a grammar advances its matcher here, on every
        worker: decode's matcher thereby resumes from the prompt plus the first token that
        prefill sampled."""
        token_id = tok.token_id
        req.append_token(token_id, tok.logprob, tok.top)
        if req.grammar is not None and not req.grammar.accept(token_id):
            # Only a token sampled without this grammar's mask gets here (e.g. a prefill
            # worker of another version): say so instead of producing invalid output.
            req.finish("error", error=f"the structured-output grammar rejected token {token_id}")
            return
        # decode counts the first token too; count it once per request
        self._counters["generation_tokens"] += 1
        verdict = check_stops(req, token_id, self.eos_token_ids, self.max_model_len)
        if verdict is not None:
            req.finish(*verdict)

    def _stop_verdict(self, req: Request, tok: SampledToken) -> tuple[str, str | int | None] | None:
        """A prefill-role request's sampled token: appended (text, grammar matcher) and
        checked, finishing nothing; returns the stop verdict that decode's request ends
        with when it stops on this token (``None``: it goes on).  Decode checks the token
        against its grammar and counts it."""
        token_id = tok.token_id
        req.append_token(token_id, tok.logprob, tok.top)
        if req.grammar is not None:
            req.grammar.accept(token_id)
        return check_stops(req, token_id, self.eos_token_ids, self.max_model_len)

    def _make_output(self, req: Request) -> RequestOutput:
        """``req``'s output after this step (``Request.make_output``; a separate method:
        ``bench host`` times it)."""
        return req.make_output()
