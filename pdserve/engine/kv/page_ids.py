"""Page ids and aux-slot ids of one worker's KV cache: who may use which, on the engine thread.

:class:`PageIds` is the allocator half of the KV memory: the free pages as runs of
consecutive ids (:mod:`.page_runs`) and the free aux slots.  It holds no tensor; the
bytes live on every rank in ``engine/worker/kv_storage.py`` (:class:`KVStorage`), and the
engine thread reaches them only through the executor.  Pages are taken and returned only
through the one page owner, :class:`pdserve.engine.kv.cache.KVCacheManager`; aux slots
by the PD flow (``engine/core/pd_flow.py``).
"""

from __future__ import annotations

import heapq

from pdserve.engine.kv.page_runs import RunAllocator


class PageIds:
    """Ids ``0 .. num_pages-1`` of pages of ``page_size`` tokens and ids
    ``0 .. num_aux_slots-1`` of aux slots, each owned by at most one request at a time.

    ``allocate``/``free`` keep the free pages as runs of consecutive ids and hand a request
    as few runs as they can (:mod:`.page_runs`), so its transfer is few NIXL descriptors.
    ValueError when ``num_pages`` or ``num_aux_slots`` is below 1.
    """

    def __init__(self, num_pages: int, page_size: int, num_aux_slots: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if num_aux_slots < 1:
            raise ValueError(f"num_aux_slots must be >= 1, got {num_aux_slots}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_aux_slots = num_aux_slots
        self._pages = RunAllocator(num_pages)
        self._free_slots = list(range(num_aux_slots))
        self._slot_is_free = [True] * num_aux_slots

    # --- pages ------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self._pages.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free pages as few runs of consecutive ids as the free list allows;
        ``after``: the last page the caller already holds (its run is extended first).
        RuntimeError if fewer than ``n`` are free."""
        return self._pages.allocate(n, after)

    def free(self, pages: list[int]) -> None:
        """Return pages.  RuntimeError (and nothing freed) if any page is out of range,
        already free, or listed twice."""
        self._pages.free(pages)

    def free_page_runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of each run of free pages (tests, ``bench transfer``)."""
        return self._pages.free_runs()

    # --- aux slots ----------------------------------------------------------------
    @property
    def num_free_aux_slots(self) -> int:
        return len(self._free_slots)

    def allocate_aux_slot(self) -> int | None:
        """Take a free aux slot (the lowest id), or ``None`` when all are in use."""
        if not self._free_slots:
            return None
        slot = heapq.heappop(self._free_slots)
        self._slot_is_free[slot] = False
        return slot

    def free_aux_slot(self, slot: int) -> None:
        """Return an aux slot.  RuntimeError on a double free."""
        if not 0 <= slot < len(self._slot_is_free) or self._slot_is_free[slot]:
            raise RuntimeError(f"double free (or foreign slot) of aux slot {slot}")
        self._slot_is_free[slot] = True
        heapq.heappush(self._free_slots, slot)
