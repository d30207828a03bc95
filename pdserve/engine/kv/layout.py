"""The physical order of the paged KV pool, in one place: nothing else computes an offset.

Two orders are supported (``KV_ORDERS``); ``L`` layers, ``P`` pages of ``ps`` tokens,
``H`` KV heads of ``D`` elements, ``2`` = K then V:

``layer_major``  ``kv[L, 2, P, ps, H, D]``
    Each (layer, K|V) is one contiguous buffer of ``P`` pages.  NIXL sees ``2L`` buffers
    (L0.K, L0.V, L1.K, ...), each ``P`` items of ``ps*H*D`` elements: one page of a request
    is ``2L`` descriptors (64 at Llama-8B shapes).
``page_major``   ``kv[P, L, 2, H, ps, D]``
    Each page is one contiguous block holding every layer's K and V.  NIXL sees one
    buffer of ``P`` items of ``L*2*H*ps*D`` elements: one page is one descriptor.  Inside
    a page, head ``h`` of layer ``l``'s K is a contiguous ``[ps, D]`` block (HND), so a
    head slice is contiguous: heterogeneous TP moves ``2L`` runs a page
    (:mod:`pdserve.disagg.nixl.agent.transfer_engine` builds them from the registered region).

What attention reads, for every order (:meth:`KVCacheLayout.layer_views`): per layer a
``(k_cache, v_cache)`` pair of *strided views* of logical shape ``[P, ps, H, D]``; token
``j`` of a sequence sits at ``[page_table[j // ps], j % ps]``.  The element strides of
these views are :meth:`KVCacheLayout.view_strides` ``(page, token, head, dim)``; a kernel
must use them and never assume a view is contiguous (only ``dim`` is always stride 1).

What NIXL registers and moves (:meth:`KVCacheLayout.regions`): ``(address, bytes,
item_bytes)`` per buffer, page ``p`` of a buffer being bytes ``[p*item_bytes,
(p+1)*item_bytes)`` of it.  :meth:`KVCacheLayout.fingerprint` is what peers compare at
bootstrap; its ``kv_order`` field names the order, so a peer with equal sizes but
another order fails the first request naming ``kv_order``.

Which order is the default on which device is decided by measurement (docs/benchmarks.md,
``pdserve bench transfer``); see :func:`default_order`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.disagg.base import AUX_RECORD_BYTES, LAYER_MAJOR, PAGE_MAJOR, KVArgs, KVLayout
from pdserve.disagg.base import KV_ORDERS as KV_ORDERS  # re-exported: the order names' owner
from pdserve.disagg.base import check_order as check_order


def default_order(device: torch.device | str) -> str:
    """The order a pool on ``device`` uses unless configured (``CacheConfig.kv_order``).

    ``page_major`` everywhere: one descriptor per page instead of ``2L`` (the H200 and CPU
    measurements behind this choice are in docs/benchmarks.md, "KV transfer")."""
    del device  # one answer on every device today; kept so the choice stays per device
    return PAGE_MAJOR


def default_page_size(device: torch.device | str) -> int:
    """Tokens per page on ``device`` unless configured (``CacheConfig.page_size``).

    16 on CPU. 128 on CUDA: a page-major page of Llama-3.1-8B shapes in bf16 is then one
    16 MiB NIXL descriptor, and a transfer costs per descriptor whatever its size (the
    measurements: docs/benchmarks.md, "KV transfer by order, page size and page pattern",
    and "Notes moved from engine docstrings"). The price is a prefix cache that reuses
    whole 128-token pages only."""
    return 128 if torch.device(device).type == "cuda" else 16


@dataclass(frozen=True)
class KVCacheLayout:
    """Geometry and physical order of one worker's KV pool (see module doc).

    order: one of :data:`KV_ORDERS`; num_pages: pages in the pool; page_size: tokens per
    page; dtype: element type of K and V; kv_scales: per layer ``(k_scale, v_scale)`` of
    an FP8 (``float8_e4m3fn``) pool, ``()`` for any other.  Raises ValueError naming the
    field for an unknown order, a non-positive size or one scale pair per layer missing.
    """

    order: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: torch.dtype
    kv_scales: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        check_order(self.order, "order")
        if self.kv_scales and len(self.kv_scales) != self.num_layers:
            raise ValueError(
                f"kv_scales: {len(self.kv_scales)} (k, v) pairs for {self.num_layers} layers"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    # --- sizes ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Physical shape of the pool tensor (module doc)."""
        L, P, ps, H, D = (
            self.num_layers,
            self.num_pages,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )
        return (L, 2, P, ps, H, D) if self.order == LAYER_MAJOR else (P, L, 2, H, ps, D)

    @property
    def element_size(self) -> int:
        """Bytes of one element of ``dtype``."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer, K and V."""
        return (
            self.num_layers
            * 2
            * self.page_size
            * self.num_kv_heads
            * self.head_dim
            * self.element_size
        )

    @property
    def descs_per_page(self) -> int:
        """NIXL descriptors one page costs when it is not next to another: ``2L`` or 1."""
        return 2 * self.num_layers if self.order == LAYER_MAJOR else 1

    @property
    def item_bytes(self) -> int:
        """Bytes of one page of one registered buffer (the descriptor size)."""
        return self.page_bytes // self.descs_per_page

    @property
    def page_dim(self) -> int:
        """Dimension of :attr:`shape` that indexes pages (2 or 0)."""
        return 2 if self.order == LAYER_MAJOR else 0

    # --- the tensor ------------------------------------------------------------------
    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """A zeroed pool tensor of :attr:`shape` on ``device``.  On CPU it sits on huge
        pages before first touch: NIXL/UCX pins every descriptor's pages when it copies
        between processes, ~1.4x faster on 2 MiB pages (disagg/hostmem.py)."""
        device = torch.device(device)
        if device.type == "cpu":
            from pdserve.disagg.hostmem import empty_host

            return empty_host(self.shape, self.dtype).zero_()
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def check(self, kv: torch.Tensor) -> None:
        """ValueError unless ``kv`` is a contiguous pool tensor of this layout."""
        if tuple(kv.shape) != self.shape or kv.dtype != self.dtype or not kv.is_contiguous():
            raise ValueError(
                f"kv: expected a contiguous {self.dtype} tensor of shape {self.shape} "
                f"({self.order}), got {kv.dtype} {tuple(kv.shape)}"
            )

    def layer_views(self, kv: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per layer ``(k_cache, v_cache)``: strided views of logical shape ``[P, ps, H, D]``
        into ``kv`` (no copy; writes land in the pool)."""
        self.check(kv)
        if self.order == LAYER_MAJOR:
            return tuple((kv[l, 0], kv[l, 1]) for l in range(self.num_layers))
        # kv[:, l, s] is [P, H, ps, D]; swap to the logical [P, ps, H, D]
        return tuple(
            (kv[:, l, 0].transpose(1, 2), kv[:, l, 1].transpose(1, 2))
            for l in range(self.num_layers)
        )

    def view_strides(self) -> tuple[int, int, int, int]:
        """Element strides ``(page, token, head, dim)`` of every view of :meth:`layer_views`."""
        L, ps, H, D = self.num_layers, self.page_size, self.num_kv_heads, self.head_dim
        if self.order == LAYER_MAJOR:
            return (ps * H * D, H * D, D, 1)
        return (L * 2 * H * ps * D, D, ps * D, 1)

    def pages(self, kv: torch.Tensor, page_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Copy of pages ``page_ids`` of ``kv`` (every layer, K and V), indexed along
        :attr:`page_dim`; assignable back with :meth:`write_pages`."""
        idx = torch.as_tensor(page_ids, dtype=torch.int64, device=kv.device)
        return kv.index_select(self.page_dim, idx)

    def write_pages(
        self, kv: torch.Tensor, page_ids: torch.Tensor | list[int], data: torch.Tensor
    ) -> None:
        """Write ``data`` (as returned by :meth:`pages`) into pages ``page_ids`` of ``kv``."""
        idx = torch.as_tensor(page_ids, dtype=torch.int64, device=kv.device)
        kv.index_copy_(self.page_dim, idx, data.to(kv.device))

    # --- what NIXL sees --------------------------------------------------------------
    def regions(self, kv: torch.Tensor) -> list[tuple[int, int, int]]:
        """``(address, bytes, item_bytes)`` of each buffer NIXL registers, in descriptor
        order: layer-major ``2L`` buffers L0.K, L0.V, L1.K, ...; page-major one buffer."""
        self.check(kv)
        item = self.item_bytes
        if self.order == LAYER_MAJOR:
            return [
                (kv[l, s].data_ptr(), self.num_pages * item, item)
                for l in range(self.num_layers)
                for s in (0, 1)
            ]
        return [(kv.data_ptr(), self.num_pages * item, item)]

    def kv_args(
        self,
        kv: torch.Tensor,
        aux_ptr: int,
        aux_len: int,
        fingerprint: KVLayout,
        *,
        gpu_id: int = 0,
        engine_rank: int = 0,
        tp_size: int = 1,
    ) -> KVArgs:
        """What the transfer layer registers for pool tensor ``kv`` of this layout: its
        :meth:`regions` and a host aux buffer at ``aux_ptr`` of ``aux_len`` bytes, slots of
        :data:`AUX_RECORD_BYTES`.  ``fingerprint`` is what peers compare
        (:meth:`fingerprint`, with the model's total KV heads under tensor parallelism);
        ``gpu_id`` is used when ``kv``'s device has no index.  The pool must hold rank
        ``engine_rank``/``tp_size``'s share of ``fingerprint.num_kv_heads``
        (``parallel.kv_head_range``): ValueError naming ``num_kv_heads`` otherwise, and
        ``KVArgs``' own errors for a split not allowed."""
        regions = self.regions(kv)
        args = KVArgs(
            kv_data_ptrs=tuple(r[0] for r in regions),
            kv_data_lens=tuple(r[1] for r in regions),
            kv_item_lens=tuple(r[2] for r in regions),
            aux_data_ptr=aux_ptr,
            aux_data_len=aux_len,
            aux_item_len=AUX_RECORD_BYTES,
            layout=fingerprint,
            device=kv.device.type,
            gpu_id=gpu_id if kv.device.index is None else kv.device.index,
            engine_rank=engine_rank,
            tp_size=tp_size,
        )
        start, end = args.kv_heads
        if end - start != self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: the pool holds {self.num_kv_heads} KV heads, rank "
                f"{engine_rank}/{tp_size} of {fingerprint.num_kv_heads} holds {end - start}"
            )
        return args

    def page_byte_ranges(self, page: int) -> list[tuple[int, int]]:
        """``(offset from the pool's base, bytes)`` of every byte range NIXL moves for
        ``page``, in descriptor order.  ValueError for a page out of range."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} out of range [0, {self.num_pages})")
        item = self.item_bytes
        if self.order == LAYER_MAJOR:
            buf = self.num_pages * item
            return [(b * buf + page * item, item) for b in range(2 * self.num_layers)]
        return [(page * item, item)]

    def fingerprint(
        self, model: str, total_kv_heads: int | None = None, speculative: str = ""
    ) -> KVLayout:
        """What a peer must match to copy pages byte for byte (compared at bootstrap): the
        model facts, ``total_kv_heads`` the model's KV heads when this pool holds one
        tensor-parallel rank's share (default: this pool's), and the speculative
        configuration (``KVLayout.speculative``)."""
        return KVLayout(
            model=model,
            dtype=str(self.dtype).removeprefix("torch."),
            page_size=self.page_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads if total_kv_heads is None else total_kv_heads,
            head_dim=self.head_dim,
            kv_order=self.order,
            speculative=speculative,
            k_scales=tuple(float(k) for k, _ in self.kv_scales),
            v_scales=tuple(float(v) for _, v in self.kv_scales),
        )
