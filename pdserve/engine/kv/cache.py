"""The one owner of KV pages: reference counts over the page ids, plus the prefix cache.

Every page is in exactly one of three states:

- **held**: referenced by one or more requests (``refcount > 0``); a page is shared only
  when it is a cached full page that several requests matched;
- **cached**: unreferenced but indexed by the prefix cache (evictable, LRU);
- **free**: in the free list of :class:`pdserve.engine.kv.page_ids.PageIds` (which keeps its
  own allocation policy; the bytes are each rank's ``KVStorage``).

So ``held + cached + free == total`` at all times.  The scheduler (admission, growth,
preemption, end of a request) and the PD flow (decode's receive pages, a prefill room's
pages until its terminal poll) allocate and release only through this class; the end of a
request is one decision here: a full computed page that is cached stays (evictable), any
other page goes back to the free list.  With ``enable_prefix_caching=False`` nothing is ever
cached and this is plain refcounted allocation.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from pdserve.engine.kv.page_ids import PageIds
from pdserve.engine.kv.prefix_cache import ROOT_KEY, PrefixCache, page_key, page_keys


class KVCacheManager:
    """Refcounted pages over ``page_ids`` with an optional prefix cache.

    page_ids: the ids and their free list (``allocate(n)`` / ``free(pages)`` / ``num_free_pages``).
    enable_prefix_caching: index full computed pages for reuse by later requests.
    Errors: ``RuntimeError`` on allocating more than is available or releasing a page not
    held (nothing changes then).
    """

    def __init__(self, page_ids: PageIds, *, enable_prefix_caching: bool = True) -> None:
        self.page_ids = page_ids
        self.page_size = page_ids.page_size
        self.num_pages = page_ids.num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.cache = PrefixCache()
        self._ref = [0] * page_ids.num_pages
        self._num_held = 0

    # --- counts ----------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages in the free list (not counting evictable cached pages)."""
        return self.page_ids.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Unreferenced cached pages (evictable)."""
        return self.cache.num_evictable

    @property
    def num_held_pages(self) -> int:
        return self._num_held

    @property
    def num_available_pages(self) -> int:
        """Pages an ``allocate`` can hand out now: free plus evictable."""
        return self.page_ids.num_free_pages + self.cache.num_evictable

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens (ceil division by ``page_size``)."""
        return -(-num_tokens // self.page_size)

    # --- allocation ---------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` fresh pages, each held once.  Evicts least recently used cached pages
        when the free list is short.  ``after``: the caller's last page, whose run
        the free list extends first (``PageIds.allocate``: contiguous runs, few transfer
        descriptors).  RuntimeError if fewer than ``n`` are available."""
        if n > self.num_available_pages:
            raise RuntimeError(f"asked for {n} KV pages, {self.num_available_pages} available")
        short = n - self.page_ids.num_free_pages
        if short > 0:
            self.page_ids.free(self.cache.evict(short))
        pages = self.page_ids.allocate(n, after)
        for p in pages:
            self._ref[p] = 1
        self._num_held += n
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Take one more reference on each of ``pages`` (cached pages a request matched);
        an evictable page is held again.  RuntimeError if a page is neither held nor cached."""
        pages = list(pages)
        for p in pages:
            if self._ref[p] == 0 and not self.cache.is_evictable(p):
                raise RuntimeError(f"share of KV page {p}, which is neither held nor cached")
        for p in pages:
            if self._ref[p] == 0:
                self.cache.touch(p)
                self._num_held += 1
            self._ref[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference on each of ``pages``; a page left unreferenced stays cached
        (evictable) if the prefix cache indexes it, else goes back to the free list.
        Pages are released last to first (a page table's tail is evicted before its head).
        RuntimeError (and nothing released) if a page is not held as often as listed."""
        pages = list(pages)
        counts: dict[int, int] = {}
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
        for p, c in counts.items():
            if not 0 <= p < self.num_pages or self._ref[p] < c:
                raise RuntimeError(f"release of KV page {p} that is not held (double free?)")
        to_free = []
        # Last pages first: a prompt's tail becomes evictable before its head, so LRU
        # eviction drops leaves before the pages their keys chain from.
        for p in reversed(pages):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._num_held -= 1
                if self.cache.is_cached(p):
                    self.cache.park(p)
                else:
                    to_free.append(p)
        if to_free:
            self.page_ids.free(to_free)

    # --- prefix cache -------------------------------------------------------------------
    def match_prefix(
        self, token_ids: Sequence[int], max_tokens: int
    ) -> tuple[list[int], list[bytes]]:
        """Cached pages holding the longest prefix of ``token_ids`` of at most
        ``max_tokens`` tokens, in full pages, and their keys.  Takes no reference (call
        :meth:`share` to use them).  Empty when prefix caching is off."""
        if not self.enable_prefix_caching or max_tokens < self.page_size:
            return [], []
        keys = page_keys(token_ids[: max_tokens - max_tokens % self.page_size], self.page_size)
        pages = self.cache.match(keys)
        return pages, keys[: len(pages)]

    def num_matchable(
        self, token_ids: Sequence[int], max_tokens: int, soon: Collection[bytes] = ()
    ) -> int:
        """An upper bound on ``len(match_prefix(token_ids, max_tokens)[0])`` once the keys
        ``soon`` are cached too: the longest run of leading full pages whose keys are cached
        or in ``soon`` (0 when prefix caching is off).  Takes no reference."""
        if not self.enable_prefix_caching or max_tokens < self.page_size:
            return 0
        ps, parent = self.page_size, ROOT_KEY
        for p in range(max_tokens // ps):
            parent = page_key(parent, token_ids[p * ps : (p + 1) * ps])
            if not (self.cache.has(parent) or parent in soon):
                return p
        return max_tokens // ps

    def keys_to_cache(
        self, token_ids: Sequence[int], keys: Sequence[bytes], num_computed: int
    ) -> list[bytes]:
        """The keys :meth:`cache_full_pages` would add for a request (its ``token_ids``,
        its page ``keys`` so far) once ``num_computed`` tokens have KV; changes nothing."""
        full = num_computed // self.page_size
        if not self.enable_prefix_caching or full <= len(keys):
            return []
        parent = keys[-1] if keys else ROOT_KEY
        return page_keys(
            token_ids[: full * self.page_size], self.page_size, start=len(keys), parent=parent
        )

    def num_evictable_among(self, pages: Iterable[int]) -> int:
        """How many of ``pages`` are unreferenced cached pages (sharing them makes them
        unavailable to ``allocate``)."""
        return sum(1 for p in pages if self._ref[p] == 0)

    def cache_full_pages(
        self, token_ids: Sequence[int], pages: Sequence[int], keys: list[bytes], num_computed: int
    ) -> None:
        """Index the request's full pages whose KV is computed.

        token_ids: the request's tokens; pages: its page table; keys: keys of its first
        ``len(keys)`` pages, extended in place; num_computed: tokens with KV in ``pages``.
        A page whose key is cached already (another request computed the same prefix at
        the same time) stays uncached and is freed on release.  No-op when caching is off.
        """
        if not self.enable_prefix_caching:
            return
        full = num_computed // self.page_size
        if full <= len(keys):
            return
        start = len(keys)
        parent = keys[-1] if keys else ROOT_KEY
        new = page_keys(
            token_ids[: full * self.page_size], self.page_size, start=start, parent=parent
        )
        keys.extend(new)
        for i, key in enumerate(new, start):
            self.cache.insert(key, pages[i])

    def reset_cache(self) -> int:
        """Evict every unreferenced cached page; returns how many."""
        evicted = self.cache.clear_evictable()
        self.page_ids.free(evicted)
        return len(evicted)

    # --- stats and checks ----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters for /metrics: prefix-cache lookups and hits in tokens, evicted pages,
        and the pages by state."""
        c = self.cache
        return {
            "prefix_cache_query_tokens": c.num_query_tokens,
            "prefix_cache_hit_tokens": c.num_hit_tokens,
            "prefix_cache_evicted_pages": c.num_evicted,
            "num_cached_pages": c.num_evictable,
            "num_held_pages": self._num_held,
        }

    def check_integrity(self, holders: Iterable[Sequence[int]]) -> None:
        """AssertionError unless the page states add up: ``holders`` are the page lists of
        every holder (requests, draining rooms); each page's refcount equals how often it is
        listed, no holder lists a page twice, and held + cached + free == total."""
        seen = [0] * self.num_pages
        for pages in holders:
            assert len(set(pages)) == len(pages), f"a holder lists a page twice: {list(pages)}"
            for p in pages:
                seen[p] += 1
        assert seen == self._ref, "refcounts differ from the holders' page lists"
        held = sum(1 for r in self._ref if r > 0)
        assert held == self._num_held
        for p in range(self.num_pages):
            if self.cache.is_evictable(p):
                assert self._ref[p] == 0 and self.cache.is_cached(p), f"page {p}"
        total = held + self.cache.num_evictable + self.page_ids.num_free_pages
        assert total == self.num_pages, (
            f"held {held} + cached {self.cache.num_evictable} + free "
            f"{self.page_ids.num_free_pages} != {self.num_pages}"
        )
