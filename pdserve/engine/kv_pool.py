"""The paged KV pool: one tensor for every layer's K and V pages, plus host aux slots.

Layout (the contract in docs/architecture.md): ``kv[L, 2, P, page_size, Hkv, D]``, so
``kv[l, 0]`` (K of layer l) and ``kv[l, 1]`` (V) are each one contiguous buffer of ``P``
pages; page ``p`` of a buffer starts ``p * page_bytes`` after its base.  That is what
:meth:`KVPool.kv_args` hands to the transfer layer.
"""

from __future__ import annotations

import heapq
import logging
import math

import torch

from pdserve.config import CacheConfig
from pdserve.disagg.base import AUX_RECORD_BYTES, KVArgs, KVLayout
from pdserve.disagg.hostmem import empty_host

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
    page_bytes = cache.page_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    if cache.kv_cache_memory is not None:
        field, budget = "kv_cache_memory", int(cache.kv_cache_memory * GiB)
        pages = budget // page_bytes
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        field, budget = "gpu_memory_utilization", int(free * cache.gpu_memory_utilization)
        pages = budget // page_bytes
    else:
        field, budget = "kv_cache_memory", CPU_DEFAULT_KV_BYTES
        needed = max_running_requests * math.ceil(max_model_len / cache.page_size)
        pages = min(budget // page_bytes, needed)
    if pages < 1:
        raise ValueError(f"{field}: {budget} bytes of KV cache hold no page of {page_bytes} bytes")
    return pages


class KVPool:
    """Pages of KV cache and aux slots, each owned by at most one request at a time.

    kv: ``Tensor[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` on ``device``.
    aux: ``uint8[num_aux_slots, AUX_RECORD_BYTES]`` in host memory (aux records of
    disaggregated requests).  ``allocate``/``free`` hand out the lowest free ids first so
    one request's pages tend to be consecutive (fewer transfer descriptors).
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
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if num_aux_slots < 1:
            raise ValueError(f"num_aux_slots must be >= 1, got {num_aux_slots}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        if self.device.type == "cpu":
            # Huge pages before first touch: NIXL/UCX pins every descriptor's pages when it
            # copies between processes, ~1.4x faster on 2 MiB pages (disagg/hostmem.py).
            self.kv = empty_host(shape, dtype).zero_()
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.aux = torch.zeros(num_aux_slots, AUX_RECORD_BYTES, dtype=torch.uint8)
        self._layout = KVLayout(
            model=model_fingerprint,
            dtype=str(dtype).removeprefix("torch."),
            page_size=page_size,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self._free_pages = list(range(num_pages))  # a heap
        self._page_is_free = [True] * num_pages
        self._free_slots = list(range(num_aux_slots))
        self._slot_is_free = [True] * num_aux_slots

    # --- pages ------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (lowest ids first).  RuntimeError if fewer are free."""
        if n > len(self._free_pages):
            raise RuntimeError(f"asked for {n} KV pages, {len(self._free_pages)} free")
        pages = [heapq.heappop(self._free_pages) for _ in range(n)]
        for p in pages:
            self._page_is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool.  RuntimeError (and nothing freed) if any page is
        out of range, already free, or listed twice."""
        if len(set(pages)) != len(pages):
            raise RuntimeError(f"double free: pages listed twice in {pages}")
        for p in pages:
            if not 0 <= p < self.num_pages or self._page_is_free[p]:
                raise RuntimeError(f"double free (or foreign page) of KV page {p}")
        for p in pages:
            self._page_is_free[p] = True
            heapq.heappush(self._free_pages, p)

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
        """Bytes of one page of one (layer, K|V) buffer: the page stride."""
        return int(self.kv[0, 0, 0].numel() * self.kv.element_size())

    def kv_args(self, gpu_id: int = 0, engine_rank: int = 0) -> KVArgs:
        """Addresses of the pool for the transfer layer: one buffer per (layer, K|V),
        layer-major (L0.K, L0.V, L1.K, ...), each ``num_pages * page_bytes`` long."""
        num_layers = self.kv.shape[0]
        ptrs = tuple(self.kv[l, kv].data_ptr() for l in range(num_layers) for kv in (0, 1))
        buf_len = self.num_pages * self.page_bytes
        return KVArgs(
            kv_data_ptrs=ptrs,
            kv_data_lens=(buf_len,) * len(ptrs),
            kv_item_lens=(self.page_bytes,) * len(ptrs),
            aux_data_ptr=self.aux.data_ptr(),
            aux_data_len=self.aux.numel(),
            aux_item_len=AUX_RECORD_BYTES,
            layout=self._layout,
            device=self.device.type,
            gpu_id=gpu_id if self.device.index is None else self.device.index,
            engine_rank=engine_rank,
        )
