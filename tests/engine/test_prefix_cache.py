"""Prefix-cache keys and the page owner alone: chained keys equal across processes with
different PYTHONHASHSEED, refcounted sharing, LRU eviction, and the error cases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.engine.kv.cache import ROOT_KEY, KVCacheManager, PageIds, page_key, page_keys

_KEYS_SCRIPT = (
    "from pdserve.engine.kv.cache import page_keys; "
    "print(','.join(k.hex() for k in page_keys(list(range(100, 140)), 16)))"
)


def manager(num_pages=8, page_size=4, enable=True):
    page_ids = PageIds(num_pages, page_size, num_aux_slots=1)
    return KVCacheManager(page_ids, enable_prefix_caching=enable)


def test_keys_are_equal_across_processes_with_different_hash_seeds():
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        outs.add(run.stdout.strip())
    assert len(outs) == 1
    assert outs.pop() == ",".join(k.hex() for k in page_keys(list(range(100, 140)), 16))


def test_a_key_names_the_whole_prefix_not_just_its_page():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second page, other prefix
    assert a[1] == page_key(a[0], [5, 6, 7, 8]) and a[0] == page_key(ROOT_KEY, [1, 2, 3, 4])
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # a partial page has no key
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, start=1, parent=a[0]) == a[1:]


def test_shared_pages_are_refcounted_and_parked_in_the_cache_on_last_release():
    kv = manager()
    tokens = list(range(10))
    pages = kv.allocate(3)
    kv.cache_full_pages(tokens, pages, keys := [], num_computed=10)
    assert len(keys) == 2  # 10 tokens: two full pages
    hit, hit_keys = kv.match_prefix(tokens, 9)
    assert hit == pages[:2] and hit_keys == keys
    kv.share(hit)
    assert [kv.refcount(p) for p in pages] == [2, 2, 1]
    kv.release(pages)
    assert kv.num_held_pages == 2 and kv.num_cached_pages == 0 and kv.num_free_pages == 6
    kv.release(hit)
    assert kv.num_held_pages == 0 and kv.num_cached_pages == 2 and kv.num_free_pages == 6
    kv.check_integrity([])
    assert kv.match_prefix(tokens, 9)[0] == pages[:2]  # still cached
    kv.share(pages[:2])  # a cached page is held again
    assert kv.num_cached_pages == 0 and kv.num_held_pages == 2
    kv.check_integrity([pages[:2]])


def test_allocate_evicts_least_recently_released_leaves_first():
    kv = manager(num_pages=4)
    a = kv.allocate(2)
    kv.cache_full_pages(list(range(8)), a, [], 8)
    b = kv.allocate(2)
    kv.cache_full_pages(list(range(50, 58)), b, [], 8)
    kv.release(a)  # a's tail (a[1]) is parked before its head
    kv.release(b)
    assert kv.num_free_pages == 0 and kv.num_available_pages == 4
    got = kv.allocate(1)
    assert got == [a[1]] and kv.cache.num_evicted == 1
    assert kv.match_prefix(list(range(8)), 8)[0] == [a[0]]  # the head still matches
    kv.check_integrity([got])


def test_errors_change_nothing():
    kv = manager(num_pages=4)
    pages = kv.allocate(2)
    with pytest.raises(RuntimeError, match="available"):
        kv.allocate(3)
    with pytest.raises(RuntimeError, match="not held"):
        kv.release(pages + pages[:1])
    with pytest.raises(RuntimeError, match="neither held nor cached"):
        kv.share([3])
    kv.check_integrity([pages])
    kv.release(pages)
    with pytest.raises(RuntimeError, match="not held"):
        kv.release(pages)
    kv.check_integrity([])


def test_caching_off_never_matches_and_frees_pages_on_release():
    kv = manager(enable=False)
    pages = kv.allocate(2)
    kv.cache_full_pages(list(range(8)), pages, keys := [], 8)
    assert keys == [] and kv.match_prefix(list(range(8)), 8) == ([], [])
    kv.release(pages)
    assert kv.num_free_pages == 8 and kv.num_cached_pages == 0


def test_a_second_copy_of_a_cached_prefix_stays_uncached_and_is_freed():
    kv = manager()
    a, b = kv.allocate(1), kv.allocate(1)
    kv.cache_full_pages([1, 2, 3, 4], a, [], 4)
    kv.cache_full_pages([1, 2, 3, 4], b, [], 4)  # computed at the same time elsewhere
    kv.release(b)
    assert kv.num_free_pages == 7 and kv.num_cached_pages == 0
    kv.release(a)
    assert kv.num_cached_pages == 1


def test_page_keys_up_to_a_page_read_only_those_pages():
    """``end`` stops at a page without the caller slicing the tokens (a running request's
    new pages are indexed without copying its whole context): the keys equal those of the
    slice, and no token past the last page is read."""

    class Tokens(list):
        def __getitem__(self, i):
            if isinstance(i, slice):
                assert i.stop is not None and i.stop <= 12, "read past page 3"
            return super().__getitem__(i)

    tokens = Tokens(range(1, 41))
    first = page_keys(tokens[:8], 4)
    rest = page_keys(tokens, 4, start=2, parent=first[-1], end=3)
    assert first + rest == page_keys(list(range(1, 13)), 4)
    assert page_keys(list(range(1, 41)), 4, end=99) == page_keys(list(range(1, 41)), 4)


def test_page_keys_equal_the_chain_of_page_key():
    """``page_keys`` packs every page's tokens at once: each key is still ``page_key`` of
    its parent and its page, big ids and 0 included, from any start."""
    tokens = [0, 2**40, 7, 128255] * 9 + [5]
    chain, parent = [], ROOT_KEY
    for p in range(len(tokens) // 4):
        parent = page_key(parent, tokens[4 * p : 4 * p + 4])
        chain.append(parent)
    assert page_keys(tokens, 4) == chain and len(chain) == 9
    assert page_keys(tokens, 4, start=3, parent=chain[2], end=7) == chain[3:7]
    assert page_keys(tokens, 4, start=9, parent=chain[8]) == []


def test_known_keys_are_taken_not_hashed_again(monkeypatch):
    """A request's page keys from its lookup (``match_prefix_keys``) are reused by the next
    lookup and by ``cache_full_pages``: the same keys cached, and pages past the known ones
    hashed from the last known key."""
    import pdserve.engine.kv.cache as cache_mod

    kv = manager(num_pages=16)
    tokens = list(range(1, 23))  # 5 full pages of 4, 2 tokens over
    hit, keys = kv.match_prefix_keys(tokens, 21)
    assert hit == [] and keys == page_keys(tokens, 4) and len(keys) == 5
    assert kv.match_prefix(tokens, 21) == ([], [])
    hashed = []
    real = cache_mod.page_keys
    monkeypatch.setattr(
        cache_mod, "page_keys", lambda t, ps, **kw: hashed.append(kw) or real(t, ps, **kw)
    )
    assert kv.match_prefix_keys(tokens, 21, keys) == ([], keys) and hashed == []
    # a longer bound hashes only the pages past the known ones
    _, longer = kv.match_prefix_keys(tokens, 22, keys[:3])
    assert longer == keys and [h["start"] for h in hashed] == [3]
    hashed.clear()
    pages = kv.allocate(6)
    mine: list[bytes] = []
    kv.cache_full_pages(tokens, pages, mine, 12, known=keys)  # 3 pages: all known
    assert mine == keys[:3] and hashed == []
    more = tokens + [99, 98]  # the request went on: page 5 is new
    kv.cache_full_pages(more, pages, mine, 24, known=keys)
    assert mine == page_keys(more, 4) and [h["start"] for h in hashed] == [5]
    assert kv.match_prefix(more, 24)[0] == pages
