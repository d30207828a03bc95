"""Descriptor lists of a worker's NIXL agent, prepared once per side (local: at start;
remote: once per peer instance), and the descriptor indices of one room's pages in them.

Lists are in NIXL's strided form, one row per KV buffer expanding to one descriptor per
page: index ``b * num_pages + p`` is page ``p`` of buffer ``b`` (buffers in the pool
layout's descriptor order, :meth:`pdserve.engine.kv.layout.KVCacheLayout.regions`: 2L
for a layer-major pool, one for a page-major pool). A room's transfer lists its indices
buffer by buffer in prompt order, so a run of consecutive pages on both sides is a run of
address-contiguous descriptors, which NIXL's ``make_prepped_xfer`` coalesces into one
(as fast as hand-built coalesced descriptors: docs/benchmarks.md).

Tensor parallelism: when this rank writes exactly the KV heads the peer rank holds (equal
head ranges, the usual case) the lists are the whole-page ones above.  Otherwise
(heterogeneous TP, replicas) only a page-major pool can be split: inside a page
``[L, 2, H, ps, D]`` the heads ``[a, b)`` of one (layer, K|V) are one contiguous run of
``(b - a) * ps * D`` elements, so the slice lists have one strided row per (layer, K|V)
(``2L`` rows, each ``P`` descriptors a page stride apart) on each side, prepared once per
peer (remote) and once per distinct slice (local); descriptor index ``j * P + p`` is
page ``p``'s run ``j``, the same index formula as whole pages with ``2L`` buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.disagg.base import PAGE_MAJOR, KVArgs, Role
from pdserve.disagg.wire import BufferDescs


def _strided_rows(d: BufferDescs) -> np.ndarray:
    """``int64[num_buffers, 5]`` rows ``(addr, item_len, dev_id, stride, count)``."""
    rows = [(p, item, d.dev_id, item, n // item) for p, n, item in zip(d.ptrs, d.lens, d.item_lens)]
    return np.asarray(rows, dtype=np.int64)


def check_descs(d: BufferDescs, what: str) -> int:
    """Number of items per buffer (all equal); ValueError naming ``what`` otherwise."""
    if not d.ptrs or not len(d.ptrs) == len(d.lens) == len(d.item_lens):
        raise ValueError(f"{what}: ptrs, lens and item_lens must be non-empty and of equal length")
    counts = {n // item if item > 0 else -1 for n, item in zip(d.lens, d.item_lens)}
    if len(counts) != 1 or min(counts) < 1:
        raise ValueError(
            f"{what}: every buffer must hold the same number (>= 1) of items, got {sorted(counts)}"
        )
    return counts.pop()


@dataclass
class RemoteSide:
    """A peer's memory as prepared descriptor lists on this agent, and the local list
    its WRITEs read from. num_rows: descriptor rows of both lists (buffers for whole
    pages, ``2L`` for a head slice); heads: the model heads ``[start, end)`` written
    there."""

    agent_name: str
    kv: Any
    aux: Any
    num_pages: int
    num_aux_slots: int
    item_lens: tuple[int, ...]
    local_kv: Any = None
    num_rows: int = 1
    heads: tuple[int, int] = (0, 0)


def _slice_rows(
    d: BufferDescs, num_layers: int, held: tuple[int, int], heads: tuple[int, int], what: str
) -> np.ndarray:
    """``int64[2L, 5]`` strided rows of heads ``heads`` inside every page of a page-major
    pool holding heads ``held`` (see module doc). ValueError naming ``what`` when the page
    size is not ``2L * heads_held * head_bytes``."""
    (page,), (base,) = d.item_lens, d.ptrs
    count = d.lens[0] // page
    num_held = held[1] - held[0]
    head_bytes, rest = divmod(page, 2 * num_layers * num_held)
    if rest:
        raise ValueError(
            f"{what}: {page} page bytes do not split into {num_layers} layers x K|V x {num_held} heads"
        )
    off, n = heads[0] - held[0], heads[1] - heads[0]
    rows = [
        (base + (j * num_held + off) * head_bytes, n * head_bytes, d.dev_id, page, count)
        for j in range(2 * num_layers)
    ]
    return np.asarray(rows, dtype=np.int64)


def page_indices(num_buffers: int, num_pages: int, pages: list[int] | np.ndarray) -> np.ndarray:
    """``int32[num_buffers * len(pages)]``: descriptor indices of ``pages`` in every buffer,
    buffer-major, pages in the given order."""
    if num_buffers == 1:  # page-major, whole pages: the page ids themselves
        return np.asarray(pages, dtype=np.int32)
    buf = np.arange(num_buffers, dtype=np.int64)[:, None] * num_pages
    return (buf + np.asarray(pages, dtype=np.int64)[None, :]).ravel().astype(np.int32)


class PreparedLists:
    """The descriptor lists one NIXL agent prepared (module doc), and the peers' memory as
    WRITE targets (:class:`RemoteSide`): the part of
    :class:`~.transfer_engine.NixlTransferEngine` that prepares, counts and releases
    lists. The engine sets the attributes annotated here, then calls
    :meth:`_prepare_local`; every method is thread-safe (``_lock``)."""

    agent: Any
    kv_args: KVArgs
    kv_descs: BufferDescs
    aux_descs: BufferDescs
    num_buffers: int
    _lock: threading.Lock

    def _prepare_local(self, role: str) -> None:
        """The local lists: only the initiator of WRITEs (prefill) needs them."""
        self._dlists: list[Any] = []
        self.local_kv = self.local_aux = None
        self._local_slices: dict[tuple[int, int], Any] = {}  # heads -> local slice list
        if role == Role.PREFILL:
            self.local_kv = self._prep("NIXL_INIT_AGENT", self.kv_descs)
            self.local_aux = self._prep("NIXL_INIT_AGENT", self.aux_descs)

    def _prep(self, agent_name: str, d: BufferDescs, rows: np.ndarray | None = None) -> Any:
        rows = _strided_rows(d) if rows is None else rows
        handle = self.agent.prep_xfer_dlist(agent_name, rows, d.mem_type)
        with self._lock:
            self._dlists.append(handle)
        return handle

    def _local_slice(self, heads: tuple[int, int]) -> Any:
        with self._lock:
            handle = self._local_slices.get(heads)
        if handle is None:
            rows = _slice_rows(
                self.kv_descs, self.kv_args.layout.num_layers, self.kv_args.kv_heads, heads, "ours"
            )
            handle = self._prep("NIXL_INIT_AGENT", self.kv_descs, rows)
            with self._lock:
                handle = self._local_slices.setdefault(heads, handle)
        return handle

    def prepare_remote(
        self,
        agent_name: str,
        kv: BufferDescs,
        aux: BufferDescs,
        heads: tuple[int, int] | None = None,
        peer_heads: tuple[int, int] | None = None,
    ) -> RemoteSide:
        """Prepare a (loaded) peer's KV and aux memory as WRITE targets: the model KV heads
        ``heads`` (default: all ours) of every page go into the peer's pool, which holds
        heads ``peer_heads`` (default: ours). Equal head ranges: whole pages; else head
        slices (module doc). ValueError when the buffer geometry differs from ours, or
        names ``kv_order`` when heads must be split in a layer-major pool."""
        mine = self.kv_args.kv_heads
        heads, peer_heads = heads or mine, peer_heads or mine
        if not (mine[0] <= heads[0] < heads[1] <= mine[1]) or not (
            peer_heads[0] <= heads[0] and heads[1] <= peer_heads[1]
        ):
            raise ValueError(
                f"peer {agent_name}: heads {list(heads)} are not held by both ranks "
                f"(ours {list(mine)}, peer's {list(peer_heads)})"
            )
        if not heads == mine == peer_heads:
            return self._prepare_slice(agent_name, kv, aux, heads, peer_heads)
        if len(kv.ptrs) != self.num_buffers or list(kv.item_lens) != list(
            self.kv_args.kv_item_lens
        ):
            raise ValueError(
                f"peer {agent_name}: KV buffers differ (count {len(kv.ptrs)} vs "
                f"{self.num_buffers}, page bytes {kv.item_lens[:2]}... vs "
                f"{list(self.kv_args.kv_item_lens[:2])}...)"
            )
        return self._remote_side(
            agent_name, kv, aux, None, lambda: self.local_kv, self.num_buffers, heads
        )

    def _prepare_slice(
        self,
        agent_name: str,
        kv: BufferDescs,
        aux: BufferDescs,
        heads: tuple[int, int],
        peer_heads: tuple[int, int],
    ) -> RemoteSide:
        order = self.kv_args.layout.kv_order
        if order != PAGE_MAJOR or self.num_buffers != 1 or len(kv.ptrs) != 1:
            raise ValueError(
                f"kv_order: {order!r} cannot split KV heads between tensor-parallel ranks "
                f"holding heads {list(self.kv_args.kv_heads)} and {list(peer_heads)} "
                f"(a head slice of a page is contiguous only in {PAGE_MAJOR!r})"
            )
        layers = self.kv_args.layout.num_layers
        rows = _slice_rows(kv, layers, peer_heads, heads, f"peer {agent_name}")
        if (
            rows[0, 1]
            != _slice_rows(self.kv_descs, layers, self.kv_args.kv_heads, heads, "ours")[0, 1]
        ):
            raise ValueError(f"peer {agent_name}: bytes per head differ from ours")
        return self._remote_side(
            agent_name, kv, aux, rows, lambda: self._local_slice(heads), 2 * layers, heads
        )

    def _remote_side(
        self,
        agent_name: str,
        kv: BufferDescs,
        aux: BufferDescs,
        kv_rows: np.ndarray | None,
        local_kv: Callable[[], Any],
        num_rows: int,
        heads: tuple[int, int],
    ) -> RemoteSide:
        """The peer's prepared lists (KV as ``kv_rows``, default whole pages; aux) with
        the local list its WRITEs read from (``local_kv()``, asked for once the peer's are
        prepared). ValueError when its aux record size differs from ours or a buffer's
        item count is off."""
        if aux.item_lens != [self.kv_args.aux_item_len]:
            raise ValueError(
                f"peer {agent_name}: aux record size {aux.item_lens} vs {self.kv_args.aux_item_len}"
            )
        num_pages = check_descs(kv, f"peer {agent_name} kv")
        num_slots = check_descs(aux, f"peer {agent_name} aux")
        return RemoteSide(
            agent_name,
            self._prep(agent_name, kv, kv_rows),
            self._prep(agent_name, aux),
            num_pages,
            num_slots,
            tuple(kv.item_lens),
            local_kv(),
            num_rows,
            heads,
        )

    def num_prepared_lists(self) -> int:
        """Prepared descriptor lists alive on this agent (local ones plus 2 per peer)."""
        with self._lock:
            return len(self._dlists)

    def release_remote(self, remote: RemoteSide) -> None:
        for handle in (remote.kv, remote.aux):
            with self._lock:
                if handle in self._dlists:
                    self._dlists.remove(handle)
            handle.release()

    def _release_lists(self) -> None:
        """Release every prepared list (best effort: shutting down)."""
        with self._lock:
            dlists, self._dlists = self._dlists, []
            self._local_slices.clear()
        for handle in dlists:
            try:
                handle.release()
            except Exception:  # noqa: BLE001 - shutting down
                pass
