"""The prefix cache: full KV pages indexed by the chained hash of the tokens they hold.

A page's key is ``blake2b(parent_key || tokens)`` over the ``page_size`` token ids of that
page (little-endian int64) and the key of the page before it (16 zero bytes for the
first), so a key names the whole prefix up to the end of its page (nano-vllm's and vLLM's
chained block hashes).  Keys come from :mod:`hashlib`, never from Python's ``hash``, so two
processes (any ``PYTHONHASHSEED``) derive the same key for the same tokens.

Only full pages whose KV is computed are cached, and a cached page is never written again
(writes start at a request's ``num_computed_tokens``, past every page it matched).  The
cache does not own pages: :class:`pdserve.engine.kv.cache.KVCacheManager` does, and tells
the cache when a cached page is no longer referenced (it becomes evictable, least recently
used first) or referenced again.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

ROOT_KEY = bytes(16)  # the parent key of a prompt's first page
KEY_BYTES = 16


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of one full page: 16 bytes of ``blake2b(parent || int64le(tokens))``.

    parent: the previous page's key (``ROOT_KEY`` for the first page); tokens: the page's
    token ids.  Deterministic across processes and platforms.
    """
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def page_keys(
    token_ids: Sequence[int], page_size: int, *, start: int = 0, parent: bytes = ROOT_KEY
) -> list[bytes]:
    """Keys of the full pages ``start, start + 1, ...`` of ``token_ids``.

    parent: the key of page ``start - 1`` (``ROOT_KEY`` when ``start == 0``).  Returns one
    key per full page from ``start`` on (a partial last page has none).
    """
    keys: list[bytes] = []
    for p in range(start, len(token_ids) // page_size):
        parent = page_key(parent, token_ids[p * page_size : (p + 1) * page_size])
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
