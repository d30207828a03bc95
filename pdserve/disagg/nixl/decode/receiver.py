"""Decode side of one room over NIXL, on one decode rank.

States: ``Bootstrapping`` (the prefill ranks that write this rank's KV heads looked up on
the bootstrap thread; protocol, layout and rank facts checked) -> ``WaitingForInput``
(``init`` may be called) -> ``Transferring`` (destination sent to every writer; pages at
their disposal) -> ``Success`` (every writer's completion notification arrived and, on
decode rank 0, the aux record's room guard matches) or ``Failed``.

Writers: one prefill rank per KV head (:mod:`pdserve.disagg.bootstrap`); with equal TP
sizes that is one. Once the destination was sent, a failure (abort, waiting timeout,
injection, one writer failing) is told to every writer and becomes ``Failed`` only when
each writer answered that it will not WRITE any more (``RoomStatus``), completed anyway
(``XferDone``), is known gone, or was declared dead by the heartbeat — never while a
writer may still write into the pages. A writer declared dead but not known gone keeps
the room's pages held (``holds_pages``) until that incarnation ends the room or is known
gone (quarantine, per writer).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.disagg.base import (
    AUX_RECORD_BYTES,
    PEER_FAILED,
    TRANSFER_ERROR,
    WAITING_TIMEOUT,
    AuxRecord,
    FailureInjector,
    KVPoll,
    KVReceiver,
    KVTransferError,
    RoomHandle,
    RoomTable,
)
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
from pdserve.disagg.wire import RankInfo, RoomAbort, RoomDest, RoomStatus


@dataclass
class PrefillPeer:
    """A room's writer: one instance of a prefill rank, as found at its bootstrap server
    ``key[:2]``; ``key`` is ``(host, port, engine_rank)`` (:mod:`.peers` keeps
    them; here so that a room and the peer table need not import each other)."""

    key: tuple[str, int, int]
    info: RankInfo
    agent_name: str | None  # None: never loaded (mismatched peer, only told about aborts)
    misses: int = 0
    dead: bool = False


@dataclass(frozen=True)
class ReceiverContext:
    """What a decode room uses of its manager, fixed when the manager starts: the room
    table, counters and failure injection every room shares, the transfer engine, this
    manager's instance id, whether aux records land on this rank (decode rank 0), the
    waiting timeout, and how a control message reaches a prefill peer (``send``: queued
    for the control thread)."""

    rooms: RoomTable[NixlReceiver]
    metrics: TransferMetrics
    injector: FailureInjector
    engine: NixlTransferEngine
    instance_id: str
    writes_aux: bool
    waiting_timeout_s: float
    send: Callable[[PrefillPeer, RoomDest | RoomAbort], None]


class NixlReceiver(RoomHandle, KVReceiver):
    """See module doc. Created by ``NixlDecodeManager.create_receiver``."""

    def __init__(self, room: int, ctx: ReceiverContext, host: str, port: int) -> None:
        super().__init__(room, ctx.rooms, ctx.metrics, ctx.injector)
        self._ctx = ctx
        self.key = (host, port)
        self.peers: dict[int, PrefillPeer] = {}  # writer prefill rank -> its peer
        self.dst_pages: list[int] = []
        self.aux_slot: int | None = None
        self.init_at = 0.0
        self.handed_over = False
        self.abort_request: tuple[str, str] | None = None
        self._told: set[int] = set()  # writers told of the abort
        self.ended: set[int] = set()  # writers that will not WRITE any more
        self.done: set[int] = set()  # writers whose completion notification arrived
        self.suspects: set[int] = set()  # writers declared dead that may still WRITE
        # failed while a writer may still WRITE (declared dead, not known gone): the pages
        # stay out of use until that incarnation ends the room or is known gone
        self.quarantined_at: float | None = None

    @property
    def peer(self) -> PrefillPeer | None:
        """Prefill rank 0's peer (the bootstrap server's own rank) once bootstrapped."""
        return self.peers.get(min(self.peers)) if self.peers else None

    def rank_of(self, prefill_instance: str) -> int | None:
        """The writer rank whose peer is that prefill instance, or None."""
        for rank, peer in self.peers.items():
            if peer.info.instance_id == prefill_instance:
                return rank
        return None

    # --- engine side --------------------------------------------------------------------
    def _tick(self) -> None:
        if (
            self._state == KVPoll.Transferring
            and self.abort_request is None
            and time.monotonic() - self.init_at > self._ctx.waiting_timeout_s
        ):
            self._fail(
                f"room {self.room}: the KV cache did not arrive within {self._ctx.waiting_timeout_s:g} s "
                "(PDSERVE_DISAGGREGATION_WAITING_TIMEOUT)",
                WAITING_TIMEOUT,
            )

    def init(self, dst_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        eng = self._ctx.engine
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
            assert self.peers  # WaitingForInput means the writers were looked up
            dead = [p for p in self.peers.values() if p.dead]
            if dead:
                self._finish_failed(
                    f"room {self.room}: prefill {self.key[0]}:{self.key[1]} rank "
                    f"{dead[0].info.engine_rank} is gone",
                    PEER_FAILED,
                )
                return
            self.dst_pages, self.aux_slot = list(dst_pages), aux_slot
            self.handed_over = True
            self._state = KVPoll.Transferring
            self.init_at = time.monotonic()
            peers = list(self.peers.values())
        for peer in peers:
            self._ctx.send(
                peer,
                RoomDest(
                    self.room,
                    peer.info.instance_id,
                    self._ctx.instance_id,
                    self.dst_pages,
                    aux_slot,
                    skip_pages,
                ),
            )

    def aux_record(self) -> AuxRecord:
        """The aux record prefill wrote; KVTransferError before Success, on a guard
        mismatch, or on a decode rank other than 0 (the record goes to rank 0 only)."""
        if self._state != KVPoll.Success:
            raise KVTransferError(f"room {self.room} has no aux record in state {self._state.name}")
        if not self._ctx.writes_aux:
            raise KVTransferError(
                f"room {self.room}: the aux record is written into decode rank 0 only"
            )
        rec = self._read_aux()
        if rec.room != self.room:
            raise KVTransferError(
                f"aux record guard: room {rec.room} found in the slot of room {self.room}"
            )
        return rec

    def _read_aux(self) -> AuxRecord:
        args = self._ctx.engine.kv_args
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
                if self.abort_request is None:
                    self.abort_request = (reason, kind)
                if self._settled():
                    self._finish_failed(*self.abort_request)
            else:
                self._finish_failed(reason, kind)
            tell = [p for r, p in self.peers.items() if r not in self._told and r not in self.ended]
            self._told.update(p.info.engine_rank for p in tell)
        # the writers' senders fail too (and acknowledge when they hold our pages)
        for peer in tell:
            self._ctx.send(
                peer,
                RoomAbort(self.room, peer.info.instance_id, self._ctx.instance_id, reason, kind),
            )

    def _settled(self) -> bool:
        """No writer may WRITE except suspects (caller holds the lock)."""
        return all(r in self.ended or r in self.suspects for r in self.peers)

    # --- background threads ---------------------------------------------------------------
    def bootstrapped(self, peers: dict[int, PrefillPeer]) -> None:
        """The writer ranks were looked up and their agents loaded (bootstrap thread)."""
        with self._lock:
            self.peers = dict(peers)
            if self._state == KVPoll.Bootstrapping:
                self._state = KVPoll.WaitingForInput
                return
            failed_early = self._state == KVPoll.Failed
            tell = [] if not failed_early else [p for r, p in peers.items() if r not in self._told]
            self._told.update(peers)
        exc = self.failure_exception()
        for peer in tell:  # e.g. aborted while bootstrapping: prefill's senders must end too
            self._ctx.send(
                peer,
                RoomAbort(
                    self.room, peer.info.instance_id, self._ctx.instance_id, str(exc), PEER_FAILED
                ),
            )

    def holds_pages(self) -> bool:
        return self.quarantined_at is not None

    def fail_now(self, reason: str, kind: str) -> None:
        """Terminal at once: no writer can WRITE (mismatch before any destination, the
        manager shut down)."""
        self._finish_failed(reason, kind)

    def writer_lost(self, rank: int, reason: str, kind: str, gone: bool) -> None:
        """Writer ``rank`` is gone (``gone``: known not to WRITE any more: restarted,
        refused, deregistered) or declared dead by the heartbeat (it may still WRITE: the
        pages stay held if the destination went out). The room fails; the other writers
        are told."""
        with self._lock:
            if gone:
                self.ended.add(rank)
                self.suspects.discard(rank)
            elif rank not in self.ended and not self.is_terminal():
                self.suspects.add(rank)
                if self.handed_over and self.quarantined_at is None:
                    self.quarantined_at = time.monotonic()
            self._update_quarantine()
        self._fail(reason, kind)

    def _update_quarantine(self) -> None:
        if not (self.suspects - self.ended):
            self.quarantined_at = None

    def on_status(self, rank: int, status: RoomStatus) -> None:
        """Writer ``rank`` says the room ended there (control thread): it will not WRITE."""
        with self._lock:
            self.ended.add(rank)
            self.suspects.discard(rank)
            self._update_quarantine()
        self._fail(f"prefill rank {rank} failed room {self.room}: {status.reason}", PEER_FAILED)

    def on_done(self, rank: int, aux: bytes = b"") -> None:
        """Writer ``rank``'s completion notification arrived: its WRITEs are in our memory;
        ``aux``: the aux record it carries (for decode rank 0), stored in the room's slot
        here, the slot's one writer, while the room still owns the slot."""
        with self._lock:
            self.ended.add(rank)
            self.done.add(rank)
            self.suspects.discard(rank)
            self._update_quarantine()
            if self.is_terminal():
                return
            if aux and self._ctx.writes_aux and self.aux_slot is not None:
                args = self._ctx.engine.kv_args
                n = min(len(aux), args.aux_item_len)
                ctypes.memmove(args.aux_data_ptr + self.aux_slot * args.aux_item_len, aux, n)
            if self.abort_request is not None:
                if self._settled():
                    self._finish_failed(*self.abort_request)
                return
            if not self.done >= set(self.peers):
                return
            if self._ctx.writes_aux:
                rec = self._read_aux()
                if rec.room != self.room:
                    self._finish_failed(
                        f"aux record guard: room {rec.room} found in the slot of room {self.room}",
                        TRANSFER_ERROR,
                    )
                    return
            eng = self._ctx.engine
            aux_bytes = eng.kv_args.aux_item_len if self._ctx.writes_aux else 0
            self._finish_success(
                len(self.dst_pages) * eng.page_bytes + aux_bytes,
                len(self.dst_pages),
                time.monotonic() - self.init_at,
            )
