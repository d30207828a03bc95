"""The paged KV pool: one tensor for every layer's K and V pages, plus host aux slots.

The physical order of the tensor, the per-layer views attention reads and the byte
ranges the transfer layer registers all come from one :class:`~.kv_layout.KVCacheLayout`
(``pool.kv_layout``); this module computes no offset itself.
"""

from __future__ import annotations

import heapq
import logging
import math

import torch

from pdserve.config import CacheConfig
from pdserve.disagg.base import AUX_RECORD_BYTES, KVArgs, KVLayout
from pdserve.engine.kv.layout import (
    KVCacheLayout,
    check_order,
    default_order,
    default_page_size,
)
from pdserve.engine.kv.page_runs import RunAllocator

logger = logging.getLogger(__name__)

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
) -> int:
    """Number of pages of the pool.

    Precedence: ``cache.num_pages``; else ``cache.kv_cache_memory`` GiB; else on CUDA
    ``gpu_memory_utilization`` of the free device memory (call after loading weights),
    on CPU 1 GiB capped to what ``max_running_requests`` full-length requests need (so a
    small model does not allocate 1 GiB for nothing).  Raises ValueError naming the
    field when the memory would not hold a single page.
    """
    if cache.num_pages is not None:
        return cache.num_pages
    page_size = cache.page_size or default_page_size(device)
    page_bytes = page_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
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


class KVPool:
    """Pages of KV cache and aux slots, each owned by at most one request at a time.

    kv: the pool tensor on ``device``, of ``kv_layout.shape`` (the order ``kv_order``,
    default :func:`~.kv_layout.default_order` of the device); layer_caches: per layer the
    ``(k_cache, v_cache)`` views ``[P, page_size, Hkv, D]`` attention reads and writes.
    aux: ``uint8[num_aux_slots, AUX_RECORD_BYTES]`` in host memory (aux records of
    disaggregated requests).  ``allocate``/``free`` keep the free pages as runs of
    consecutive ids and hand a request as few runs as they can (:mod:`.page_runs`), so
    its transfer is few NIXL descriptors.
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
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if num_aux_slots < 1:
            raise ValueError(f"num_aux_slots must be >= 1, got {num_aux_slots}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        order = default_order(self.device) if kv_order is None else check_order(kv_order)
        self.kv_layout = KVCacheLayout(
            order, num_layers, num_kv_heads, head_dim, page_size, num_pages, dtype
        )
        self.kv = self.kv_layout.allocate(self.device)
        self.layer_caches = self.kv_layout.layer_views(self.kv)
        self.aux = torch.zeros(num_aux_slots, AUX_RECORD_BYTES, dtype=torch.uint8)
        self._layout = self.kv_layout.fingerprint(model_fingerprint)
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
        """Return pages to the pool.  RuntimeError (and nothing freed) if any page is
        out of range, already free, or listed twice."""
        self._pages.free(pages)

    def free_page_runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of each run of free pages (tests, ``bench transfer``)."""
        return self._pages.free_runs()

    # --- aux slots ----------------------------------------------------------------
    @property
    def num_free_aux_slots(self) -> int:
        return len(self._free_slots)

    def allocate_aux_slot(self) -> int | None:
        """Take a free aux slot, or ``None`` when all are in use."""
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

    def read_aux(self, slot: int) -> bytes:
        return self.aux[slot].numpy().tobytes()

    def write_aux(self, slot: int, data: bytes) -> None:
        self.aux[slot] = torch.frombuffer(bytearray(data[:AUX_RECORD_BYTES]), dtype=torch.uint8)

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
        """Addresses of the pool for the transfer layer (the layout's regions and the aux
        buffer, :meth:`~.kv_layout.KVCacheLayout.kv_args`).  Under tensor parallelism
        the pool holds rank ``engine_rank``'s KV heads of the model's
        ``total_kv_heads`` (default: this pool's count); ValueError naming
        ``num_kv_heads`` when that is not the rank's share (``parallel.kv_head_range``)."""
        layout = self._layout
        if total_kv_heads is not None:
            layout = self.kv_layout.fingerprint(layout.model, total_kv_heads)
        return self.kv_layout.kv_args(
            self.kv,
            self.aux.data_ptr(),
            self.aux.numel(),
            layout,
            gpu_id=gpu_id,
            engine_rank=engine_rank,
            tp_size=tp_size,
        )
