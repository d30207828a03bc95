"""The one owner of KV pages: reference counts over the page ids, plus the prefix cache.

Every page is **held** (``refcount > 0``; shared only when a cached full page was matched
by several requests), **cached** (unreferenced, indexed, evictable LRU) or **free** (in
:class:`PageIds`' free list), so ``held + cached + free == total`` at all times. The
scheduler and the PD flow allocate and release only through :class:`KVCacheManager`; at
the end of a request a full computed page that is cached stays (evictable), any other
goes back to the free list. With ``enable_prefix_caching=False`` nothing is cached.
This module also holds what the owner rests on: :class:`PageIds` (page and aux-slot ids;
no tensor), :class:`RunAllocator` (free pages as runs) and :class:`PrefixCache`.

**Free runs.** A transfer costs per NIXL descriptor, and consecutive pages on both sides
are one descriptor once NIXL merges adjacent ones, so a request should get few runs.  The
policy of :meth:`RunAllocator.allocate`: (1) growing a request (``after`` = its last
page), the pages right after it first; (2) else best fit: the shortest free run that holds
all ``n`` pages, at its low end (ties: the lowest start), so long runs stay whole; (3) else
the longest free runs whole, longest first.  Freed pages merge with their free neighbours
at once: O(log R) per run touched (``R`` distinct free-run lengths), O(k) for ``k`` pages.

**Prefix cache.** A full page's key is ``blake2b(parent_key || int64le(tokens))``, the
parent being the previous page's key (16 zero bytes for the first), so a key names the
whole prefix up to the end of its page (as nano-vllm's and vLLM's chained block hashes).
:mod:`hashlib`, never Python's ``hash``: every process (any ``PYTHONHASHSEED``) derives the
same key.  Only full computed pages are cached, and a cached page is never written again
(writes start at ``num_computed_tokens``, past every matched page).  :class:`PrefixCache`
owns no page: the manager tells it when a cached page is unreferenced (evictable, least
recently used first) or referenced again.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from pdserve.bounds import check_min

ROOT_KEY = bytes(16)  # the parent key of a prompt's first page
KEY_BYTES = 16


class RunAllocator:
    """Page ids ``0 .. num_pages-1`` handed out in runs (module doc).

    ``allocate`` raises RuntimeError when fewer than ``n`` pages are free; ``free`` raises
    RuntimeError (freeing nothing) for a page out of range, already free, or listed twice.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        check_min(self, 1, "num_pages")
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


class PageIds:
    """Ids ``0 .. num_pages-1`` of pages of ``page_size`` tokens and ids
    ``0 .. num_aux_slots-1`` of aux slots, each owned by at most one request at a time.

    ``allocate``/``free`` keep the free pages as runs of consecutive ids and hand a request
    as few runs as they can (:class:`RunAllocator`), so its transfer is few NIXL descriptors.
    ValueError when ``num_pages`` or ``num_aux_slots`` is below 1.
    """

    def __init__(self, num_pages: int, page_size: int, num_aux_slots: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_aux_slots = num_aux_slots
        check_min(self, 1, "num_pages", "num_aux_slots")
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


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of one full page: 16 bytes of ``blake2b(parent || int64le(tokens))``.

    parent: the previous page's key (``ROOT_KEY`` for the first page); tokens: the page's
    token ids.  Deterministic across processes and platforms.
    """
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def page_keys(
    token_ids: Sequence[int],
    page_size: int,
    *,
    start: int = 0,
    parent: bytes = ROOT_KEY,
    end: int | None = None,
) -> list[bytes]:
    """Keys of the full pages ``start, start + 1, ...`` of ``token_ids``, up to page
    ``end`` (exclusive; ``None``: every full page).

    parent: the key of page ``start - 1`` (``ROOT_KEY`` when ``start == 0``).  Returns one
    key per full page from ``start`` on (a partial last page has none).  Only the pages
    hashed are read: a caller indexing a running request's new pages passes ``end``
    instead of a slice of its tokens (a copy of its whole context each time).
    """
    keys: list[bytes] = []
    last = len(token_ids) // page_size if end is None else min(end, len(token_ids) // page_size)
    if last <= start:
        return keys
    # the bytes page_key hashes, packed for all the pages at once (one C call, not one
    # per page), then hashed page by page over views of them: the same keys
    lo, n = start * page_size, (last - start) * page_size
    data = memoryview(struct.pack(f"<{n}q", *token_ids[lo : lo + n]))
    step = 8 * page_size
    for off in range(0, 8 * n, step):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(data[off : off + step])
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Index ``key -> page`` of cached pages, and the LRU list of the unreferenced ones.

    A cached page is either referenced (some request holds it) or evictable (in the LRU
    list, least recently released first).  Counters: ``num_query_tokens`` /
    ``num_hit_tokens`` (prompt tokens looked up at admission / found cached: the hit
    rate), ``num_evicted`` (pages dropped to make room).
    """

    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted = 0

    # --- queries ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def is_evictable(self, page: int) -> bool:
        return page in self._lru

    def has(self, key: bytes) -> bool:
        """Whether a page is cached under ``key``."""
        return key in self._page_of

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of ``keys`` (one page per key, in order)."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one admission's lookup (tokens asked, tokens found) for the hit rate."""
        self.num_query_tokens += query_tokens
        self.num_hit_tokens += hit_tokens

    # --- changes (called by the page owner) ----------------------------------------------
    def insert(self, key: bytes, page: int) -> bool:
        """Index a referenced, full, computed ``page`` under ``key``.  Returns False (and
        changes nothing) when ``key`` is cached already (on another page: the caller keeps
        its page uncached) or ``page`` is cached under another key."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def touch(self, page: int) -> None:
        """A cached page got its first reference again: no longer evictable."""
        self._lru.pop(page, None)

    def park(self, page: int) -> None:
        """A cached page lost its last reference: evictable, most recently used."""
        self._lru[page] = None
        self._lru.move_to_end(page)

    def evict(self, n: int) -> list[int]:
        """Drop the ``n`` least recently used evictable pages from the cache and return
        them (the caller frees them).  ValueError if fewer than ``n`` are evictable."""
        if n > len(self._lru):
            raise ValueError(f"evict: {n} pages asked, {len(self._lru)} evictable")
        out = []
        for _ in range(n):
            page, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            out.append(page)
        self.num_evicted += n
        return out

    def clear_evictable(self) -> list[int]:
        """Evict every unreferenced page (returns them)."""
        return self.evict(len(self._lru))


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
        pages, keys = self.match_prefix_keys(token_ids, max_tokens)
        return pages, keys[: len(pages)]

    def match_prefix_keys(
        self, token_ids: Sequence[int], max_tokens: int, known: Sequence[bytes] = ()
    ) -> tuple[list[int], list[bytes]]:
        """:meth:`match_prefix`, with the keys of every full page of the first
        ``max_tokens`` tokens (the hits' first). known: keys of the first ``len(known)``
        pages of ``token_ids`` hashed before (an earlier call's keys), taken instead of
        hashing those pages again. A caller keeps the keys for its next lookup and for
        :meth:`cache_full_pages` (``known``), so a request's pages are hashed once, not at
        every try while it waits and again when they fill."""
        if not self.enable_prefix_caching or max_tokens < self.page_size:
            return [], []
        full = min(max_tokens, len(token_ids)) // self.page_size
        keys = list(known[:full])
        if len(keys) < full:
            parent = keys[-1] if keys else ROOT_KEY
            keys += page_keys(token_ids, self.page_size, start=len(keys), parent=parent, end=full)
        return self.cache.match(keys), keys

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
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        keys: list[bytes],
        num_computed: int,
        known: Sequence[bytes] = (),
    ) -> None:
        """Index the request's full pages whose KV is computed.

        token_ids: the request's tokens; pages: its page table; keys: keys of its first
        ``len(keys)`` pages, extended in place; num_computed: tokens with KV in ``pages``;
        known: keys of the first ``len(known)`` pages of ``token_ids`` hashed already
        (:meth:`match_prefix_keys`), taken instead of hashing those pages again.
        A page whose key is cached already (another request computed the same prefix at
        the same time) stays uncached and is freed on release.  No-op when caching is off.
        """
        if not self.enable_prefix_caching:
            return
        full = num_computed // self.page_size
        if full <= len(keys):
            return
        start = len(keys)
        new = list(known[start:full])
        if start + len(new) < full:
            parent = new[-1] if new else keys[-1] if keys else ROOT_KEY
            new += page_keys(
                token_ids, self.page_size, start=start + len(new), parent=parent, end=full
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
