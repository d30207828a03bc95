"""The free list of the KV pool as runs of consecutive page ids, so a request gets few runs.

Why: a transfer costs per NIXL descriptor, and a run of consecutive pages on both sides is
one descriptor after NIXL merges adjacent ones (``pdserve.engine.kv.layout``,
docs/benchmarks.md).  The policy, in :meth:`RunAllocator.allocate`:

1. growing a request (``after`` = its last page): take the pages right after it first;
2. else best fit: the shortest free run that holds all ``n`` pages, at its low end
   (ties: the lowest start), so long runs stay whole for long prompts;
3. else the longest free runs whole, longest first, until ``n`` pages are taken.

Freed pages merge with their free neighbours at once.  Cost: O(log R) per run touched
(``R`` distinct free-run lengths), O(k) for ``k`` pages freed; no per-page scan.
"""

from __future__ import annotations

import bisect


class RunAllocator:
    """Page ids ``0 .. num_pages-1`` handed out in runs (module doc).

    ``allocate`` raises RuntimeError when fewer than ``n`` pages are free; ``free`` raises
    RuntimeError (freeing nothing) for a page out of range, already free, or listed twice.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._is_free = bytearray(b"\x01") * num_pages
        self._num_free = 0
        self._start: dict[int, int] = {}  # run start -> length
        self._end: dict[int, int] = {}  # run end (exclusive) -> start
        self._by_len: dict[int, set[int]] = {}  # length -> starts of runs that long
        self._lens: list[int] = []  # sorted distinct lengths of free runs
        self._add_run(0, num_pages)
        self._num_free = num_pages

    # --- queries ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    def free_runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every free run, by start (for tests and metrics)."""
        return sorted(self._start.items())

    # --- run bookkeeping ----------------------------------------------------------------
    def _add_run(self, start: int, length: int) -> None:
        self._start[start] = length
        self._end[start + length] = start
        starts = self._by_len.get(length)
        if starts is None:
            starts = self._by_len[length] = set()
            bisect.insort(self._lens, length)
        starts.add(start)

    def _drop_run(self, start: int) -> int:
        length = self._start.pop(start)
        del self._end[start + length]
        starts = self._by_len[length]
        starts.discard(start)
        if not starts:
            del self._by_len[length]
            del self._lens[bisect.bisect_left(self._lens, length)]
        return length

    def _take(self, start: int, n: int) -> list[int]:
        """Take ``n`` pages from the low end of the free run at ``start``."""
        length = self._drop_run(start)
        if n < length:
            self._add_run(start + n, length - n)
        for p in range(start, start + n):
            self._is_free[p] = 0
        self._num_free -= n
        return list(range(start, start + n))

    # --- allocate / free -----------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free pages (module doc for the order).  ``after``: the last page the
        caller already holds, to extend its run."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self._num_free:
            raise RuntimeError(f"asked for {n} KV pages, {self._num_free} free")
        pages: list[int] = []
        if after is not None and n and (after + 1) in self._start:
            pages = self._take(after + 1, min(n, self._start[after + 1]))
        while len(pages) < n:
            need = n - len(pages)
            i = bisect.bisect_left(self._lens, need)
            if i < len(self._lens):
                pages += self._take(min(self._by_len[self._lens[i]]), need)
            else:
                longest = self._lens[-1]
                pages += self._take(min(self._by_len[longest]), longest)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return ``pages`` (any order); they merge with free neighbours."""
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"double free: pages listed twice in {pages}")
        for p in pages:
            if not 0 <= p < self.num_pages or self._is_free[p]:
                raise RuntimeError(f"double free (or foreign page) of KV page {p}")
        for start, length in runs_of(sorted(pages)):
            for p in range(start, start + length):
                self._is_free[p] = 1
            end = start + length
            if start in self._end:  # a free run ends where this one starts
                left = self._end[start]
                length += self._drop_run(left)
                start = left
            if end in self._start:  # a free run starts where this one ends
                length += self._drop_run(end)
            self._add_run(start, length)
        self._num_free += len(pages)


def runs_of(pages: list[int]) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of consecutive ids, in list order:
    ``[4, 5, 6, 9, 2]`` -> ``[(4, 3), (9, 1), (2, 1)]``."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def paired_runs(src: list[int], dst: list[int]) -> int:
    """Number of runs in which both ``src[i]`` and ``dst[i]`` are consecutive: the NIXL
    descriptors per registered buffer a transfer of ``src`` onto ``dst`` costs once
    adjacent ones are merged."""
    if len(src) != len(dst):
        raise ValueError(f"src has {len(src)} pages, dst {len(dst)}")
    return sum(
        1 for i in range(len(src)) if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1
    )
