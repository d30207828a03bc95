"""The draft-model drafter: a smaller model of the same tokenizer proposes greedily.

It runs on its own executor (``engine/worker/``: its own model, its own paged KV storage
and, on CUDA, its own CUDA graphs of its one-token decode steps) with page ids of its own
(a ``KVCacheManager`` without prefix caching).  Per step, for the rows asked: one forward
catches each row's draft KV up with the row's tokens (the whole prompt the first time,
later the target's kept tokens) and proposes the first draft; ``k - 1`` one-token steps
propose the rest.  Its proposal is the draft model's argmax, a deterministic function of
the row's tokens, so the verify step's one-hot rule applies (``verify.py``) also to
sampled rows.

Rollback needs no message: the drafter remembers which tokens its KV holds; on the next
call the part that still agrees with the row's tokens is kept (the accepted drafts) and
the rest is recomputed; pages past it are released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.kv.cache import KVCacheManager, PageIds
from pdserve.engine.spec.drafter import Draft, Drafter, DraftInput
from pdserve.engine.step import BatchPlan, ScheduledSeq

if TYPE_CHECKING:
    from pdserve.engine.worker.executor import Executor


@dataclass
class _DraftSeq:
    """One request's draft KV: its pages and the tokens whose KV they hold."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftModelDrafter(Drafter):
    """Greedy proposals of a draft model run by ``executor`` (module docstring).

    executor: the draft model's executor (TP = 1), its pool's pages given out here.
    num_speculative_tokens: k.  A row whose pages the draft pool cannot hold gets no
    draft that step (the target decodes it plainly).
    """

    name = "draft"

    def __init__(self, executor: Executor, num_speculative_tokens: int) -> None:
        self.executor = executor
        self.k = num_speculative_tokens
        geo = executor.geometry
        self.kv = KVCacheManager(
            PageIds(geo.num_pages, geo.page_size, geo.num_aux_slots), enable_prefix_caching=False
        )
        self._seqs: dict[str, _DraftSeq] = {}

    def _seq(self, row: DraftInput) -> _DraftSeq:
        """The row's state, its KV cut back to the longest prefix that agrees with the
        row's tokens (at most all but the last one, which is computed with the first
        draft), pages past it released."""
        st = self._seqs.setdefault(row.request_id, _DraftSeq())
        ids = row.token_ids
        n = min(len(st.tokens), len(ids) - 1)
        keep = 0
        while keep < n and st.tokens[keep] == ids[keep]:
            keep += 1
        del st.tokens[keep:]
        need = self.kv.pages_needed(keep)
        if len(st.pages) > need:
            self.kv.release(st.pages[need:])
            st.pages = st.pages[:need]
        return st

    def _reserve(self, st: _DraftSeq, num_tokens: int) -> bool:
        need = self.kv.pages_needed(num_tokens) - len(st.pages)
        if need <= 0:
            return True
        if need > self.kv.num_available_pages:
            return False
        st.pages = st.pages + self.kv.allocate(need, st.pages[-1] if st.pages else None)
        return True

    def propose(self, rows: Sequence[DraftInput]) -> list[Draft]:
        live: list[tuple[int, DraftInput, _DraftSeq, int]] = []  # (index, row, state, k)
        for i, row in enumerate(rows):
            k = min(row.max_k, self.k)
            st = self._seq(row)
            if k < 1 or not self._reserve(st, len(row.token_ids) + k - 1):
                continue
            live.append((i, row, st, k))
        drafts: list[list[int]] = [[] for _ in rows]
        if not live:
            return [Draft([]) for _ in rows]
        # catch up and propose the first draft: one forward over every row's new tokens
        seqs = []
        for _, row, st, _ in live:
            start = len(st.tokens)
            seqs.append(
                ScheduledSeq.greedy(row.request_id, list(row.token_ids[start:]), start, st.pages)
            )
            st.tokens.extend(row.token_ids[start:])
        sampled = self._run(seqs)
        for i, row, _, _ in live:
            drafts[i].append(sampled[row.request_id])
        # then one token per step for the rows that want more
        for j in range(1, max(k for *_, k in live)):
            seqs = []
            for i, row, st, k in live:
                if k > j:
                    prev = drafts[i][-1]
                    seqs.append(
                        ScheduledSeq.greedy(row.request_id, [prev], len(st.tokens), st.pages)
                    )
                    st.tokens.append(prev)
            sampled = self._run(seqs)
            for i, row, _, k in live:
                if k > j:
                    drafts[i].append(sampled[row.request_id])
        return [Draft(d) for d in drafts]

    def _run(self, seqs: list[ScheduledSeq]) -> dict[str, int]:
        result = self.executor.execute(BatchPlan(tuple(seqs)))
        return {rid: t.token_id for rid, t in result.sampled.items()}

    def release(self, request_id: str) -> None:
        st = self._seqs.pop(request_id, None)
        if st is not None and st.pages:
            self.kv.release(st.pages)

    @property
    def num_held_pages(self) -> int:
        """Draft pool pages held by live requests (0 once every request left)."""
        return self.kv.num_held_pages

    def check_integrity(self) -> None:
        """AssertionError unless the draft pool's accounting adds up."""
        self.kv.check_integrity([st.pages for st in self._seqs.values()])
