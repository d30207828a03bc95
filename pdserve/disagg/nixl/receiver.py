"""Decode side of one room over NIXL.

States: ``Bootstrapping`` (prefill looked up on the bootstrap thread; layout and protocol
checked) -> ``WaitingForInput`` (``init`` may be called) -> ``Transferring`` (destination
sent; pages at prefill's disposal) -> ``Success`` (completion notification arrived and
the aux record's room guard matches) or ``Failed``.

Once the destination was sent, a failure (abort, waiting timeout, injection) is first
told to prefill and becomes ``Failed`` only when prefill answers that it will not WRITE
any more, when the WRITEs completed anyway, or when prefill is declared dead by the
heartbeat — never while prefill may still write into the pages.
"""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING

from pdserve.disagg.base import AUX_RECORD_BYTES, AuxRecord, KVPoll, KVReceiver, KVTransferError
from pdserve.disagg.messages import RoomAbort, RoomDest, RoomStatus
from pdserve.disagg.rooms import PEER_FAILED, TRANSFER_ERROR, WAITING_TIMEOUT, RoomHandle

if TYPE_CHECKING:
    from pdserve.disagg.nixl.decode import NixlDecodeManager, PrefillPeer


class NixlReceiver(RoomHandle, KVReceiver):
    """See module doc. Created by ``NixlDecodeManager.create_receiver``."""

    def __init__(self, room: int, manager: NixlDecodeManager, host: str, port: int) -> None:
        super().__init__(room, manager._rooms, manager._metrics, manager._injector)
        self._mgr = manager
        self.key = (host, port)
        self.peer: PrefillPeer | None = None
        self.dst_pages: list[int] = []
        self.aux_slot: int | None = None
        self.init_at = 0.0
        self.handed_over = False
        self.abort_request: tuple[str, str] | None = None
        self._told_prefill = False
        # failed while prefill may still WRITE (declared dead, not known gone): the pages
        # stay out of use until that incarnation ends the room or is known gone
        self.quarantined_at: float | None = None

    # --- engine side --------------------------------------------------------------------
    def _tick(self) -> None:
        if (
            self._state == KVPoll.Transferring
            and self.abort_request is None
            and time.monotonic() - self.init_at > self._mgr.waiting_timeout
        ):
            self._fail(
                f"room {self.room}: the KV cache did not arrive within {self._mgr.waiting_timeout:g} s "
                "(PDSERVE_DISAGGREGATION_WAITING_TIMEOUT)",
                WAITING_TIMEOUT,
            )

    def init(self, dst_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        eng = self._mgr.engine
        if skip_pages < 0:
            raise ValueError(f"skip_pages must be >= 0, got {skip_pages}")
        if dst_pages and not (min(dst_pages) >= 0 and max(dst_pages) < eng.num_pages):
            raise ValueError(f"dst_pages must be page ids in [0, {eng.num_pages})")
        if not 0 <= aux_slot < eng.num_aux_slots:
            raise ValueError(f"aux_slot must be in [0, {eng.num_aux_slots}), got {aux_slot}")
        with self._lock:
            if self.is_terminal():
                return  # failed meanwhile; the engine sees it at its next poll
            if self._state != KVPoll.WaitingForInput:
                raise RuntimeError(f"init() on room {self.room} in state {self._state.name}")
            peer = self.peer
            assert peer is not None  # WaitingForInput means the prefill peer said hello
            if peer.dead:
                self._finish_failed(
                    f"room {self.room}: prefill {self.key[0]}:{self.key[1]} is gone", PEER_FAILED
                )
                return
            self.dst_pages, self.aux_slot = list(dst_pages), aux_slot
            self.handed_over = True
            self._state = KVPoll.Transferring
            self.init_at = time.monotonic()
        self._mgr.send(
            peer,
            RoomDest(
                self.room,
                peer.info.instance_id,
                self._mgr.instance_id,
                self.dst_pages,
                aux_slot,
                skip_pages,
            ),
        )

    def aux_record(self) -> AuxRecord:
        """The aux record prefill wrote; KVTransferError before Success or on a guard mismatch."""
        if self._state != KVPoll.Success:
            raise KVTransferError(f"room {self.room} has no aux record in state {self._state.name}")
        rec = self._read_aux()
        if rec.room != self.room:
            raise KVTransferError(
                f"aux record guard: room {rec.room} found in the slot of room {self.room}"
            )
        return rec

    def _read_aux(self) -> AuxRecord:
        args = self._mgr.engine.kv_args
        assert self.aux_slot is not None  # read only after init() gave the slot
        return AuxRecord.unpack(
            ctypes.string_at(
                args.aux_data_ptr + self.aux_slot * args.aux_item_len, AUX_RECORD_BYTES
            )
        )

    def _fail(self, reason: str, kind: str) -> None:
        with self._lock:
            if self.is_terminal():
                return
            if self.handed_over:
                if self.abort_request is not None:
                    return
                self.abort_request = (reason, kind)
            else:
                self._finish_failed(reason, kind)
            peer = self.peer
            tell = peer is not None and not self._told_prefill
            self._told_prefill = self._told_prefill or tell
        # prefill's sender fails too (and acknowledges when it holds our pages)
        if tell and peer is not None:
            self._mgr.send(
                peer,
                RoomAbort(self.room, peer.info.instance_id, self._mgr.instance_id, reason, kind),
            )

    # --- background threads ---------------------------------------------------------------
    def bootstrapped(self, peer: PrefillPeer) -> None:
        """The prefill rank was looked up and its agent loaded (bootstrap thread)."""
        with self._lock:
            self.peer = peer
            if self._state == KVPoll.Bootstrapping:
                self._state = KVPoll.WaitingForInput
                return
            failed_early = self._state == KVPoll.Failed and not self._told_prefill
            self._told_prefill = True
        if failed_early:  # e.g. aborted while bootstrapping: prefill's sender must end too
            exc = self.failure_exception()
            self._mgr.send(
                peer,
                RoomAbort(
                    self.room, peer.info.instance_id, self._mgr.instance_id, str(exc), PEER_FAILED
                ),
            )

    def holds_pages(self) -> bool:
        return self.quarantined_at is not None

    def fail_now(self, reason: str, kind: str, quarantine: bool = False) -> None:
        """Terminal at once. ``quarantine``: the peer was declared dead but may still
        WRITE, so a room whose destination went out keeps its pages (``holds_pages``)
        until :meth:`release_quarantine`; else the peer is known not to WRITE (mismatch
        before any destination, peer restarted or gone)."""
        with self._lock:
            if quarantine and self.handed_over and not self.is_terminal():
                self.quarantined_at = time.monotonic()
            self._finish_failed(reason, kind)

    def release_quarantine(self) -> None:
        """That prefill incarnation ended the room or is known gone: the pages are free."""
        self.quarantined_at = None

    def on_status(self, status: RoomStatus) -> None:
        """Prefill says the room ended there (control thread): it will not WRITE any more."""
        reason, kind = self.abort_request or (
            f"prefill failed room {self.room}: {status.reason}",
            PEER_FAILED,
        )
        self._finish_failed(reason, kind)
        self.release_quarantine()

    def on_done(self) -> None:
        """The completion notification arrived: every WRITE of the room is in our memory."""
        with self._lock:
            self.release_quarantine()
            if self.is_terminal():
                return
            if self.abort_request is not None:
                self._finish_failed(*self.abort_request)
                return
            rec = self._read_aux()
            if rec.room != self.room:
                self._finish_failed(
                    f"aux record guard: room {rec.room} found in the slot of room {self.room}",
                    TRANSFER_ERROR,
                )
                return
            eng = self._mgr.engine
            self._finish_success(
                len(self.dst_pages) * eng.page_bytes + eng.kv_args.aux_item_len,
                len(self.dst_pages),
                time.monotonic() - self.init_at,
            )
