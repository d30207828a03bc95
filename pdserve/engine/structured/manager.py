"""One engine's structured-output state: the compile cache, per-request matchers, and the
batched step that turns the matchers of a step's sampling rows into allowed-token masks."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.structured.backend import XGrammarBackend
from pdserve.engine.structured.bitmask import allocate_bitmask, bitmask_to_bool
from pdserve.engine.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pdserve.engine.step import BatchPlan

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (LRU); a JSON-schema grammar is ~0.1-1 MB


class GrammarState:
    """The matcher of one request: where its output stands in its grammar.

    ``accept(token_id)`` advances it (False when the grammar rejects the token, which
    then puts the matcher in a failed state); ``is_terminated`` is True once the grammar
    is complete and a stop token was accepted.
    """

    def __init__(self, matcher: Any, spec: StructuredOutputsParams) -> None:
        self.matcher = matcher
        self.spec = spec
        self.failed = False

    def accept(self, token_id: int) -> bool:
        if self.failed:
            return False
        if self.matcher.is_terminated():
            return True  # tokens after the end (ignore_eos) are not the grammar's business
        ok = bool(self.matcher.accept_token(token_id))
        self.failed = not ok
        return ok

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles (with an LRU cache) and hands out :class:`GrammarState`s for one engine.

    tokenizer, vocab_size, stop_token_ids: see :class:`XGrammarBackend`.
    ``compile`` may be called from any thread (the server validates a request's
    constraint off the engine thread before submitting it); the rest is engine-thread only.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        self.backend = XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (cached); ValueError naming ``spec.field``."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self.backend.compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A matcher at the start of the output of a new request."""
        return GrammarState(self.backend.matcher(self.compile(spec)), spec)

    def masks(self, states: Sequence[GrammarState], device: torch.device) -> list[torch.Tensor]:
        """``bool[V]`` allowed-token masks (True = allowed) for ``states``, in order, on
        ``device``: one batched fill of a ``[B, ceil(V/32)]`` bitmask, one unpack, one copy."""
        bitmask = allocate_bitmask(len(states), self.vocab_size)
        self.backend.fill([s.matcher for s in states], bitmask)
        allowed = bitmask_to_bool(bitmask, self.vocab_size).to(device, non_blocking=True)
        return list(allowed.unbind(0))

    def attach_masks(
        self,
        plan: BatchPlan,
        grammar_of: Callable[[str], GrammarState | None],
        device: torch.device,
    ) -> BatchPlan:
        """``plan`` with each sampling row of a request with a live grammar
        (``grammar_of(request_id)``: not failed, not terminated) given its allowed-token mask
        (``ScheduledSeq.logits_mask``), all rows filled in one batched call; ``plan`` itself
        when no row has one."""
        rows = []
        for i, seq in enumerate(plan.seqs):
            if seq.logits_mask is not None:
                continue  # a verify row whose masks the engine set (speculative decoding)
            grammar = grammar_of(seq.request_id) if seq.sample else None
            if grammar is not None and not grammar.failed and not grammar.is_terminated:
                rows.append((i, grammar))
        if not rows:
            return plan
        masks = self.masks([g for _, g in rows], device)
        seqs = list(plan.seqs)
        for (i, _), mask in zip(rows, masks):
            banned = seqs[i].banned_token_ids
            if banned and int(mask.sum()) == int(mask[list(banned)].sum()):
                # The grammar is complete and allows only EOS: it ends the output even
                # before min_tokens (masking both would leave no token at all).
                banned = ()
            seqs[i] = seqs[i]._replace(logits_mask=mask, banned_token_ids=banned)
        return replace(plan, seqs=tuple(seqs))
