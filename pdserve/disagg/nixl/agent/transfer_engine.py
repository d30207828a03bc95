"""A worker's NIXL agent with its KV pool and aux buffer registered once, and the WRITE
of one room's pages: made (ahead, or at the send), posted, polled and released. The
descriptor lists these WRITEs index into, and the peers' memory as WRITE targets, are
prepared by its base :class:`~.dlists.PreparedLists` (:mod:`.dlists`: their layout).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from pdserve.disagg.base import KVArgs
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.nixl.agent.dlists import PreparedLists, RemoteSide, check_descs, page_indices
from pdserve.disagg.nixl.agent.init import as_str, create_agent, device_type
from pdserve.disagg.transfer_config import NixlInitSpec
from pdserve.disagg.wire import BufferDescs


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
        sets it per post; prefill sends none this way: :mod:`.notifier` says why). Raises
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
