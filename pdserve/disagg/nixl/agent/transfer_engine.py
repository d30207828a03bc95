"""Everything a worker does with its NIXL agents once they exist: the agent with its KV pool
and aux buffer registered once, the WRITE of one room's pages (made ahead or at the send,
posted, polled, released), the descriptor lists those WRITEs index into
(:class:`PreparedLists`, prepared once per side: local at start, remote once per peer
instance) and the notifier agent; both sides' managers and senders use them.

Lists are in NIXL's strided form, one row per KV buffer expanding to one descriptor per
page: index ``b * num_pages + p`` is page ``p`` of buffer ``b`` (buffers in
:meth:`pdserve.engine.kv.layout.KVCacheLayout.regions` order: 2L for a layer-major pool,
one for a page-major pool). A room lists its indices buffer by buffer in prompt order, so
consecutive pages are address-contiguous descriptors, which ``make_prepped_xfer``
coalesces.

Tensor parallelism: when this rank writes exactly the peer rank's KV heads the lists are
the whole-page ones. Otherwise only a page-major pool can be split: inside a page
``[L, 2, H, ps, D]`` heads ``[a, b)`` of one (layer, K|V) are one contiguous run, so the
slice lists have ``2L`` strided rows of ``P`` descriptors; index ``j * P + p`` is page
``p``'s run ``j``, the same formula as whole pages.

Why prefill sends ``XferDone`` from a second agent (:class:`NixlNotifier`, no memory
registered, no WRITE): with UCX a notification is an active message on the endpoint's TCP
lane, which flags it ``NEED_FLUSH``; the flush that ends the next WRITE on it then waits
for decode's worker to progress (``uct_tcp_ep_flush``), a round trip per room
(docs/benchmarks.md). Decode reads notifications of any agent (``get_new_notifs``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdserve.disagg.base import PAGE_MAJOR, KVArgs, Role
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.nixl.agent.init import as_str, create_agent, device_type
from pdserve.disagg.transfer_config import THREAD_PARAM, NixlInitSpec
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


class NixlTransferEngine(PreparedLists):
    """The NIXL agent of one worker (see module doc). Thread-safe: the agent runs with
    ``NIXL_THREAD_SYNC_STRICT``; the few Python-side dicts are guarded by a lock.

    Raises at creation whatever :func:`create_agent` raises, and NIXL's errors when the
    memory cannot be registered.
    """

    def __init__(
        self, api: NixlApi, kv_args: KVArgs, role: str, name: str, spec: NixlInitSpec
    ) -> None:
        self.name = name
        self.role = role
        self.kv_args = kv_args
        self.spec = spec
        self.agent = create_agent(api, name, kv_args, role, spec)
        on_gpu = device_type(kv_args) != "cpu"
        self.kv_mem = "VRAM" if on_gpu else "DRAM"
        dev = kv_args.gpu_id if on_gpu else 0
        self.kv_descs = BufferDescs(
            list(kv_args.kv_data_ptrs),
            list(kv_args.kv_data_lens),
            list(kv_args.kv_item_lens),
            self.kv_mem,
            dev,
        )
        self.aux_descs = BufferDescs(
            [kv_args.aux_data_ptr], [kv_args.aux_data_len], [kv_args.aux_item_len], "DRAM", 0
        )
        self.num_pages = check_descs(self.kv_descs, "kv_args.kv_data_lens/kv_item_lens")
        self.num_aux_slots = check_descs(self.aux_descs, "kv_args.aux_data_len/aux_item_len")
        self.num_buffers = len(kv_args.kv_data_ptrs)
        self.page_bytes = sum(kv_args.kv_item_lens)  # one page, all buffers
        self.kv_heads = kv_args.kv_heads  # [start, end) of the model's KV heads held here
        self._lock = threading.Lock()
        self._regs: list[Any] = []
        self._made: set[int] = set()  # ids of make_room_write handles not released yet
        self.premade_made = 0  # make_room_write handles made, total
        self.premade_posted = 0  # of them posted (by post), total
        self._regs.append(
            self.agent.register_memory(
                [(p, n, dev, "") for p, n in zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens)],
                self.kv_mem,
            )
        )
        self._regs.append(
            self.agent.register_memory(
                [(kv_args.aux_data_ptr, kv_args.aux_data_len, 0, "")], "DRAM"
            )
        )
        self._prepare_local(role)

    # --- metadata -----------------------------------------------------------------
    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's agent metadata; returns its agent name."""
        return as_str(self.agent.add_remote_agent(metadata))

    def remove_remote(self, agent_name: str) -> None:
        self.agent.remove_remote_agent(agent_name)

    def connect(self, agent_name: str) -> None:
        """Open the connection ahead of the first WRITE (else the first one pays for it)."""
        self.agent.make_connection(agent_name)

    # --- transfers ------------------------------------------------------------------
    def _kv_indices(
        self,
        remote: RemoteSide,
        src_pages: list[int] | np.ndarray,
        dst_pages: list[int] | np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``int32`` page id arrays of a WRITE of ``src_pages`` onto the peer's
        ``dst_pages``; ValueError for unequal counts or ids out of range."""
        try:
            src = np.asarray(src_pages, dtype=np.int32)  # int32 already: no copy
            dst = np.asarray(dst_pages, dtype=np.int32)
        except OverflowError:
            raise ValueError("page id out of range (beyond int32)") from None
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError(
                f"page count mismatch: {src.size} source vs {dst.size} destination pages"
            )
        if src.size:
            both = np.concatenate((src, dst))  # one reduction each for both sides
            lo = both.reshape(2, -1).min(axis=1)
            hi = both.reshape(2, -1).max(axis=1)
            for what, i, n in (("source", 0, self.num_pages), ("destination", 1, remote.num_pages)):
                if lo[i] < 0 or hi[i] >= n:
                    raise ValueError(f"{what} page id out of range [0, {n})")
        return src, dst

    def _make_kv_write(
        self, remote: RemoteSide, src: np.ndarray, dst: np.ndarray, notif: bytes
    ) -> Any:
        return self.agent.make_prepped_xfer(
            "WRITE",
            remote.local_kv,
            page_indices(remote.num_rows, self.num_pages, src),
            remote.kv,
            page_indices(remote.num_rows, remote.num_pages, dst),
            notif,
        )

    def make_room_write(
        self,
        remote: RemoteSide,
        src_pages: list[int] | np.ndarray,
        dst_pages: list[int] | np.ndarray,
    ) -> Any:
        """Make, without posting, the KV WRITE of ``src_pages`` onto the peer's
        ``dst_pages`` (as :meth:`post_room_write` would): a handle for :meth:`post`, which
        sets its notification. Every handle made here is released by :meth:`release`
        (posted or not); :meth:`num_premade_writes` counts those not yet released.
        ValueError as :meth:`post_room_write`, and for no pages."""
        src, dst = self._kv_indices(remote, src_pages, dst_pages)
        if not src.size:
            raise ValueError("a WRITE made ahead needs pages")
        handle = self._make_kv_write(remote, src, dst, b"")
        with self._lock:
            self._made.add(id(handle))
            self.premade_made += 1
        return handle

    def post(self, handle: Any, notif: bytes = b"") -> None:
        """Post a handle of :meth:`make_room_write`; ``notif``: the NIXL notification the
        peer receives once that WRITE is complete (NIXL's ``transfer(handle, notif_msg)``
        sets it per post; prefill sends none this way: :class:`NixlNotifier` says why). Raises
        NIXL's error when the post is refused."""
        if self.agent.transfer(handle, notif) == "ERR":
            raise RuntimeError("NIXL refused to post a prepared WRITE")
        with self._lock:
            self.premade_posted += 1

    def num_premade_writes(self) -> int:
        """Handles of :meth:`make_room_write` not released yet (posted ones included)."""
        with self._lock:
            return len(self._made)

    def post_room_write(
        self,
        remote: RemoteSide,
        src_pages: list[int] | np.ndarray,
        dst_pages: list[int] | np.ndarray,
        src_slot: int | None = None,
        dst_slot: int | None = None,
        notif: bytes = b"",
    ) -> list[Any]:
        """Post the WRITE of ``src_pages`` (all buffers, or the peer's head slice) onto
        ``dst_pages`` of the peer, and of aux slot ``src_slot`` onto the peer's
        ``dst_slot`` (none when ``src_slot`` is None). The index arrays go to NIXL's
        prepared lists, which merge adjacent pages. ``notif``: a NIXL notification the
        peer receives once the KV WRITE is complete (sent from the poll that sees it
        done; needs pages). Returns the posted handles (KV first; none for KV when there
        are no pages). ValueError for ids out of range."""
        src, dst = self._kv_indices(remote, src_pages, dst_pages)
        if src_slot is not None and (
            dst_slot is None
            or not 0 <= dst_slot < remote.num_aux_slots
            or not 0 <= src_slot < self.num_aux_slots
        ):
            raise ValueError(f"aux slot out of range (source {src_slot}, destination {dst_slot})")
        if notif and not src.size:
            raise ValueError("a notification rides on a KV WRITE: no pages given")
        handles = []
        if src.size:
            handles.append(self._make_kv_write(remote, src, dst, notif))
        if src_slot is not None:
            handles.append(
                self.agent.make_prepped_xfer(
                    "WRITE", self.local_aux, [src_slot], remote.aux, [dst_slot]
                )
            )
        for h in handles:
            self.agent.transfer(h)
        return handles

    def state(self, handle: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR``."""
        return self.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        """Release a transfer handle (NIXL cancels it if running; raises if it cannot)."""
        self.agent.release_xfer_handle(handle)
        with self._lock:
            self._made.discard(id(handle))

    def new_notifs(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()

    def close(self) -> None:
        """Release prepared lists and deregister memory (best effort)."""
        self._release_lists()
        with self._lock:
            regs, self._regs = self._regs, []
        for reg in regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                pass


class NixlNotifier:
    """A NIXL agent (the backend of ``spec``, no worker threads) that sends notifications
    to the decode agents loaded into it. Thread-safe (the agent is created
    ``NIXL_THREAD_SYNC_STRICT``). Raises at creation whatever :func:`create_agent` raises.

    name: the agent's name (unique per process); spec: the WRITE agent's init spec.
    """

    def __init__(self, api: NixlApi, name: str, kv_args: KVArgs, spec: NixlInitSpec) -> None:
        thread_key = THREAD_PARAM.get(spec.backend)
        params = {k: v for k, v in spec.params.items() if k != thread_key}
        self.agent = create_agent(
            api, name, kv_args, Role.PREFILL, replace(spec, params=params, num_threads=0)
        )
        self._lock = threading.Lock()
        self._remotes: set[str] = set()

    def add_remote(self, metadata: bytes) -> str:
        """Load a decode agent's metadata and open the connection; returns its name."""
        name = as_str(self.agent.add_remote_agent(metadata))
        self.agent.make_connection(name)
        with self._lock:
            self._remotes.add(name)
        return name

    def remove_remote(self, agent_name: str) -> None:
        """Forget a decode agent (a no-op for one never loaded)."""
        with self._lock:
            if agent_name not in self._remotes:
                return
            self._remotes.discard(agent_name)
        self.agent.remove_remote_agent(agent_name)

    def num_remotes(self) -> int:
        with self._lock:
            return len(self._remotes)

    def send_notif(self, agent_name: str, payload: bytes) -> None:
        """Send ``payload`` to a loaded decode agent (NIXL's ``send_notif``; raises NIXL's
        error when it cannot)."""
        self.agent.send_notif(agent_name, payload)

    def progress(self) -> None:
        """Progress the agent's worker (connection wire-up, completions of sends)."""
        self.agent.get_new_notifs()
