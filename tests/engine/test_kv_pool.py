"""KV memory's two halves: page and aux-slot ids (``kv/cache.py:PageIds``: allocation,
exactly-once free, aux slots) and each rank's storage (``worker/kv_storage.py``: the aux
bytes and what the transfer layer sees, sizing)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.config import CacheConfig
from pdserve.disagg.base import AUX_RECORD_BYTES, AuxRecord
from pdserve.engine.kv.cache import PageIds
from pdserve.engine.kv.layout import default_page_size
from pdserve.engine.worker.kv_storage import KVStorage, compute_num_pages, kv_bytes_per_token


def make_ids(num_pages=10):
    return PageIds(num_pages, page_size=4, num_aux_slots=3)


def make_pool(num_pages=10, dtype=torch.float32, kv_order=None):
    return KVStorage(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        device=torch.device("cpu"),
        page_size=4,
        num_pages=num_pages,
        num_aux_slots=3,
        model_fingerprint="fp",
        kv_order=kv_order,
    )


def test_allocate_and_free_exactly_once():
    pool = make_ids()
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_pages == 7
    b = pool.allocate(7)
    assert sorted(a + b) == list(range(10)) and pool.num_free_pages == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b[0], b[0]])
    with pytest.raises(RuntimeError):
        pool.free([99])
    assert pool.num_free_pages == 3  # failed frees changed nothing
    pool.free(b)
    assert pool.num_free_pages == 10
    assert pool.allocate(2) == [0, 1]  # lowest ids first: consecutive pages


def test_aux_slots():
    pool, storage = make_ids(), make_pool()
    slots = [pool.allocate_aux_slot() for _ in range(3)]
    assert slots == [0, 1, 2] and pool.allocate_aux_slot() is None
    rec = AuxRecord(
        room=7, first_token_id=42, logprob=-0.5, top_ids=(42, 3), top_logprobs=(-0.5, -2.0)
    )
    # the record's bytes through the addresses the transfer layer registers (kv_args), as
    # a receiver writes and reads slot 1: they land in the storage's aux buffer, row 1
    args = storage.kv_args()
    ctypes.memmove(args.aux_data_ptr + 1 * args.aux_item_len, rec.pack(), AUX_RECORD_BYTES)
    assert storage.aux[1].numpy().tobytes() == rec.pack()
    got = ctypes.string_at(args.aux_data_ptr + 1 * args.aux_item_len, AUX_RECORD_BYTES)
    assert AuxRecord.unpack(got) == rec
    pool.free_aux_slot(1)
    with pytest.raises(RuntimeError):
        pool.free_aux_slot(1)


@pytest.mark.parametrize("order", ["layer_major", "page_major"])
def test_kv_args_describe_the_tensor(order):
    pool = make_pool(dtype=torch.bfloat16, kv_order=order)
    args = pool.kv_args()
    item = 4 * 2 * 8 * 2  # one (layer, K|V) of a page: page_size x heads x head_dim x 2 B
    assert (
        args.num_pages == 10 and args.num_aux_slots == 3 and args.aux_item_len == AUX_RECORD_BYTES
    )
    if order == "layer_major":  # one buffer per (layer, K|V); page p at base + p * item
        assert len(args.kv_data_ptrs) == 6
        assert args.kv_item_lens == (item,) * 6 and args.kv_data_lens == (10 * item,) * 6
        for i, ptr in enumerate(args.kv_data_ptrs):
            layer, kv = divmod(i, 2)
            assert ptr == pool.kv[layer, kv].data_ptr()
            assert pool.kv[layer, kv, 5].data_ptr() == ptr + 5 * item
    else:  # one buffer; a page (every layer, K and V) is one item
        assert args.kv_data_ptrs == (pool.kv.data_ptr(),)
        assert args.kv_item_lens == (6 * item,) and args.kv_data_lens == (60 * item,)
        assert pool.kv[5].data_ptr() == args.kv_data_ptrs[0] + 5 * 6 * item
    assert pool.page_bytes == 6 * item
    assert args.layout.dtype == "bfloat16" and args.layout.page_size == 4
    assert args.layout.kv_order == order
    assert args.layout.num_layers == 3 and args.layout.model == "fp" and args.device == "cpu"


def test_default_order_and_bad_order():
    assert make_pool().kv_layout.order == "page_major"
    with pytest.raises(ValueError, match="kv_order"):
        make_pool(kv_order="head_major")
    with pytest.raises(ValueError, match="kv_order"):
        CacheConfig(kv_order="nope")


def test_allocator_hands_out_contiguous_runs_and_merges_freed_pages():
    pool = make_ids(num_pages=32)
    a, b, c = pool.allocate(4), pool.allocate(4), pool.allocate(4)
    assert a == [0, 1, 2, 3] and b == [4, 5, 6, 7] and c == [8, 9, 10, 11]
    pool.free(b)  # a hole of 4 between a and c
    assert pool.allocate(3) == [4, 5, 6]  # best fit: the hole, not the long tail
    assert pool.allocate(2, after=c[-1]) == [12, 13]  # growing c extends its run
    assert pool.allocate(1, after=a[-1]) == [7]  # a's neighbour is taken: best fit
    pool.free([4, 5, 6, 7])
    pool.free(a)
    assert pool.free_page_runs() == [(0, 8), (14, 18)]  # freed pages merged with neighbours
    assert pool.allocate(10) == list(range(14, 24))  # one run when one run can hold it
    # no run holds 12: the longest runs whole, longest first (8 + 4 = two runs)
    assert pool.allocate(12) == [*range(0, 8), *range(24, 28)]
    assert pool.num_free_pages == 32 - len(c) - 2 - 10 - 12


def test_churn_keeps_accounting_exact_and_runs_few():
    import random

    pool = make_ids(num_pages=512)
    rng, held = random.Random(0), []
    for _ in range(3000):
        if held and (rng.random() < 0.5 or pool.num_free_pages < 40):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(pool.allocate(rng.randint(1, 40)))
        pages = [p for h in held for p in h]
        assert len(set(pages)) == len(pages)
        assert pool.num_free_pages + len(pages) == 512
    for h in held:
        pool.free(h)
    assert pool.free_page_runs() == [(0, 512)]


def test_sizing_precedence():
    shape = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_running_requests=4,
        max_model_len=100,
    )
    page_bytes = 16 * kv_bytes_per_token(2, 2, 8, torch.float32)
    assert compute_num_pages(CacheConfig(num_pages=5), **shape) == 5
    assert compute_num_pages(CacheConfig(kv_cache_memory=1.0), **shape) == (1 << 30) // page_bytes
    # CPU default: 1 GiB, capped to max_running_requests full-length requests
    assert compute_num_pages(CacheConfig(), **shape) == 4 * 7
    with pytest.raises(ValueError, match="kv_cache_memory"):
        compute_num_pages(CacheConfig(kv_cache_memory=1e-9), **shape)


def test_page_size_defaults_by_device():
    """An unset page size is 16 tokens on CPU and 128 on CUDA (one large NIXL descriptor a
    page); an explicit one wins. Sizing by memory uses the resolved size (no GPU needed:
    ``kv_cache_memory`` does not ask the device for its free memory)."""
    assert CacheConfig().page_size is None
    assert default_page_size("cpu") == 16
    assert default_page_size(torch.device("cuda", 0)) == 128
    shape = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_running_requests=4,
        max_model_len=100,
    )
    per_token = kv_bytes_per_token(2, 2, 8, torch.float32)
    cfg = CacheConfig(kv_cache_memory=1.0)
    cuda = compute_num_pages(cfg, device=torch.device("cuda"), **shape)
    assert cuda == (1 << 30) // (128 * per_token)
    explicit = CacheConfig(kv_cache_memory=1.0, page_size=32)
    assert compute_num_pages(explicit, device=torch.device("cuda"), **shape) == (1 << 30) // (
        32 * per_token
    )
    with pytest.raises(ValueError, match="page_size"):
        CacheConfig(page_size=0)
