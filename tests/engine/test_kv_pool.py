"""KV pool: allocation, exactly-once free, aux slots, what the transfer layer sees, sizing."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig
from pdserve.disagg.base import AUX_RECORD_BYTES, AuxRecord
from pdserve.engine.kv_pool import KVPool, compute_num_pages, kv_bytes_per_token


def make_pool(num_pages=10, dtype=torch.float32):
    return KVPool(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        device=torch.device("cpu"),
        page_size=4,
        num_pages=num_pages,
        num_aux_slots=3,
        model_fingerprint="fp",
    )


def test_allocate_and_free_exactly_once():
    pool = make_pool()
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
    pool = make_pool()
    slots = [pool.allocate_aux_slot() for _ in range(3)]
    assert slots == [0, 1, 2] and pool.allocate_aux_slot() is None
    rec = AuxRecord(
        room=7, first_token_id=42, logprob=-0.5, top_ids=(42, 3), top_logprobs=(-0.5, -2.0)
    )
    pool.write_aux(1, rec.pack())
    assert AuxRecord.unpack(pool.read_aux(1)) == rec
    pool.free_aux_slot(1)
    with pytest.raises(RuntimeError):
        pool.free_aux_slot(1)


def test_kv_args_describe_the_tensor():
    pool = make_pool(dtype=torch.bfloat16)
    args = pool.kv_args()
    page_bytes = 4 * 2 * 8 * 2
    assert len(args.kv_data_ptrs) == 6  # 3 layers x (K, V)
    assert args.kv_item_lens == (page_bytes,) * 6 and args.kv_data_lens == (10 * page_bytes,) * 6
    assert (
        args.num_pages == 10 and args.num_aux_slots == 3 and args.aux_item_len == AUX_RECORD_BYTES
    )
    # layer-major order, and page p of buffer (l, kv) starts at base + p * page_bytes
    for i, ptr in enumerate(args.kv_data_ptrs):
        layer, kv = divmod(i, 2)
        assert ptr == pool.kv[layer, kv].data_ptr()
        assert pool.kv[layer, kv, 5].data_ptr() == ptr + 5 * page_bytes
    assert args.layout.dtype == "bfloat16" and args.layout.page_size == 4
    assert args.layout.num_layers == 3 and args.layout.model == "fp" and args.device == "cpu"


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
