"""The page lists of ``bench transfer``'s request, the same shape on both sides: the
``served`` pattern (what the real allocator hands out after a churn of mixed-length
requests) and the ``runs`` pattern (runs of ``--run-len`` consecutive pages, shuffled).
"""

from __future__ import annotations

import random


def page_lists(
    pattern: str, num_pages: int, pool_pages: int, run_len: int, seed: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(src, dst, one_src, one_dst)``: the request's prefill and decode page ids of a
    ``pool_pages`` pool by ``pattern`` (``served``: :func:`served_pages`; ``runs``:
    :func:`scattered_pages` of ``run_len``), and the one-page request's page on each side,
    outside the big request's. ValueError as :func:`scattered_pages`."""
    if pattern == "served":
        src = served_pages(num_pages, pool_pages, seed + 1)
        dst = served_pages(num_pages, pool_pages, seed + 2)
    else:
        src = scattered_pages(num_pages, pool_pages, run_len, seed + 1)
        dst = scattered_pages(num_pages, pool_pages, run_len, seed + 2)
    one_src = [min(set(range(pool_pages)) - set(src))]
    one_dst = [min(set(range(pool_pages)) - set(dst))]
    return src, dst, one_src, one_dst


def scattered_pages(num_pages: int, pool_pages: int, run_len: int, seed: int) -> list[int]:
    """``num_pages`` distinct page ids of a ``pool_pages`` pool: runs of ``run_len``
    consecutive ids at shuffled, non-adjacent places."""
    starts = list(range(0, pool_pages - run_len + 1, run_len + 1)) or [0]
    random.Random(seed).shuffle(starts)
    pages: list[int] = []
    for s in starts:
        pages.extend(range(s, min(s + run_len, pool_pages)))
        if len(pages) >= num_pages:
            return pages[:num_pages]
    raise ValueError(f"pool_factor too small for {num_pages} pages in runs of {run_len}")


def served_pages(num_pages: int, pool_pages: int, seed: int) -> list[int]:
    """The page list the real allocator (:class:`~pdserve.engine.kv.cache.RunAllocator`)
    hands a ``num_pages`` request after 500 mixed-length requests (1 page to half the
    request) were allocated and freed at random, the pool kept up to 3/4 full around the
    room the request needs: the pool as a busy server leaves it."""
    from pdserve.engine.kv.cache import RunAllocator

    rng = random.Random(seed)
    alloc, held = RunAllocator(pool_pages), list[list[int]]()
    room = pool_pages - num_pages
    top = max(1, num_pages // 2)
    for _ in range(500):
        n = rng.randint(1, top)
        used = pool_pages - alloc.num_free
        if held and (used + n > min(room, 3 * pool_pages // 4) or rng.random() < 0.4):
            alloc.free(held.pop(rng.randrange(len(held))))
        elif used + n <= room:
            held.append(alloc.allocate(n, None))
    return alloc.allocate(num_pages)
