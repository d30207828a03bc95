"""The bytes of one rank's KV cache: one tensor for every layer's K and V pages, plus the
host aux buffer.

The physical order of the tensor, the per-layer views attention reads and the byte
ranges the transfer layer registers all come from one
:class:`~pdserve.engine.kv.layout.KVCacheLayout` (``storage.kv_layout``); this module
computes no offset itself.  It allocates no ids: which pages and aux slots a request
uses is decided on the engine thread (:class:`pdserve.engine.kv.cache.PageIds`), so
every rank builds only this.  :func:`compute_num_pages` sizes it on each rank.
"""

from __future__ import annotations

import math

import torch

from pdserve.bounds import check_min
from pdserve.config import CacheConfig
from pdserve.disagg.base import AUX_RECORD_BYTES, KVArgs, KVLayout
from pdserve.engine.kv.layout import (
    KVCacheLayout,
    check_order,
    default_order,
    default_page_size,
)

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 1 * GiB


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of K and V of one token over all layers."""
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def compute_num_pages(
    cache: CacheConfig,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    max_running_requests: int,
    max_model_len: int,
    extra_bytes_per_token: int = 0,
) -> int:
    """Number of pages of the pool.

    Precedence: ``cache.num_pages``; else ``cache.kv_cache_memory`` GiB; else on CUDA
    ``gpu_memory_utilization`` of the free device memory (call after loading weights),
    on CPU 1 GiB capped to what ``max_running_requests`` full-length requests need (so a
    small model does not allocate 1 GiB for nothing).  ``extra_bytes_per_token``: KV bytes
    per token (all layers) of a second pool with as many pages that shares the budget (a
    speculative draft model's: ``rank_worker.draft_kv_bytes_per_token``), so the budget is
    split between the two by their bytes per token.  Raises ValueError naming the field
    when the memory would not hold a single page (of both pools).
    """
    if cache.num_pages is not None:
        return cache.num_pages
    page_size = cache.page_size or default_page_size(device)
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    page_bytes = page_size * (per_token + extra_bytes_per_token)
    if cache.kv_cache_memory is not None:
        field, budget = "kv_cache_memory", int(cache.kv_cache_memory * GiB)
        pages = budget // page_bytes
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        field, budget = "gpu_memory_utilization", int(free * cache.gpu_memory_utilization)
        pages = budget // page_bytes
    else:
        field, budget = "kv_cache_memory", CPU_DEFAULT_KV_BYTES
        needed = max_running_requests * math.ceil(max_model_len / page_size)
        pages = min(budget // page_bytes, needed)
    if pages < 1:
        raise ValueError(f"{field}: {budget} bytes of KV cache hold no page of {page_bytes} bytes")
    return pages


class KVStorage:
    """One rank's KV cache tensor and aux buffer (no allocator).

    kv: the tensor on ``device``, of ``kv_layout.shape`` (the order ``kv_order``, default
    :func:`~pdserve.engine.kv.layout.default_order` of the device); layer_caches: per layer
    the ``(k_cache, v_cache)`` views ``[P, page_size, Hkv, D]`` attention reads and writes.
    aux: ``uint8[num_aux_slots, AUX_RECORD_BYTES]`` in host memory (aux records of
    disaggregated requests, written and read by the transfer layer at ``kv_args()``'s
    address).  kv_scales: an FP8 pool's per-layer ``(k_scale, v_scale)`` (part of the
    layout peers compare).  ValueError when ``num_pages`` or ``num_aux_slots`` is below 1,
    or for an unknown ``kv_order``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int,
        num_pages: int,
        num_aux_slots: int,
        model_fingerprint: str,
        kv_order: str | None = None,
        speculative: str = "",
        kv_scales: tuple[tuple[float, float], ...] | None = None,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_aux_slots = num_aux_slots
        check_min(self, 1, "num_pages", "num_aux_slots")
        self.device = torch.device(device)
        order = default_order(self.device) if kv_order is None else check_order(kv_order)
        self.kv_layout = KVCacheLayout(
            order, num_layers, num_kv_heads, head_dim, page_size, num_pages, dtype, kv_scales or ()
        )
        self.kv = self.kv_layout.allocate(self.device)
        self.layer_caches = self.kv_layout.layer_views(self.kv)
        self.aux = torch.zeros(num_aux_slots, AUX_RECORD_BYTES, dtype=torch.uint8)
        self._layout = self.kv_layout.fingerprint(model_fingerprint, speculative=speculative)

    # --- what the transfer layer sees ------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer, K and V."""
        return self.kv_layout.page_bytes

    def kv_args(
        self,
        gpu_id: int = 0,
        engine_rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int | None = None,
    ) -> KVArgs:
        """Addresses of the storage for the transfer layer (the layout's regions and the
        aux buffer, :meth:`~pdserve.engine.kv.layout.KVCacheLayout.kv_args`).  Under
        tensor parallelism it holds rank ``engine_rank``'s KV heads of the model's
        ``total_kv_heads`` (default: this storage's count); ValueError naming
        ``num_kv_heads`` when that is not the rank's share (``parallel.kv_head_range``)."""
        layout = self._layout
        if total_kv_heads is not None:
            layout = self.kv_layout.fingerprint(layout.model, total_kv_heads, layout.speculative)
        return self.kv_layout.kv_args(
            self.kv,
            self.aux.data_ptr(),
            self.aux.numel(),
            layout,
            gpu_id=gpu_id,
            engine_rank=engine_rank,
            tp_size=tp_size,
        )
