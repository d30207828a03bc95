"""Decode side of one room over NIXL, on one decode rank, and the prefill peers that write
rooms (:class:`PrefillPeers`): the receivers and the peer table are what the manager's
threads share.

States: ``Bootstrapping`` (the prefill ranks that write this rank's KV heads looked up on
the bootstrap thread; protocol, layout and rank facts checked) -> ``WaitingForInput``
(``init`` may be called) -> ``Transferring`` (destination sent to every writer; pages at
their disposal) -> ``Success`` (every writer's completion notification arrived and, on
decode rank 0, the aux record's room guard matches) or ``Failed``.

Writers: one prefill rank per KV head (:mod:`pdserve.disagg.bootstrap`); with equal TP
sizes that is one. Once the destination was sent, a failure (abort, waiting timeout,
injection, one writer failing) is told to every writer and becomes ``Failed`` only when
each writer answered that it will not WRITE any more (``RoomStatus``), completed anyway
(``XferDone``), is known gone, or was declared dead by the heartbeat: never while a
writer may still write into the pages. A writer declared dead but not known gone keeps
the room's pages held (``holds_pages``): the quarantine of :mod:`.manager`'s module doc.

A peer is one prefill rank *instance* (:class:`PrefillPeer`, keyed ``(host, port,
engine_rank)``), its NIXL agent loaded once; a suspect is kept until that incarnation ends
its quarantined rooms or is known gone, then forgotten like any gone peer
(:func:`~pdserve.disagg.nixl.agent.peer_life.forget_agent`). :meth:`PrefillPeers.heartbeat`
(one ``GET /health`` per prefill bootstrap server) declares peers dead or gone. Used by
the bootstrap thread (``peer_for``), the heartbeat thread (``heartbeat``) and ``stats``.
"""

from __future__ import annotations

import base64
import ctypes
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdserve.disagg.base import (
    AUX_RECORD_BYTES,
    HEARTBEAT_LOST,
    PEER_FAILED,
    PEER_RESTARTED,
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
from pdserve.disagg.bootstrap import BootstrapClient, BootstrapError
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.nixl.agent.peer_life import forget_agent
from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
from pdserve.disagg.wire import RankInfo, RoomAbort, RoomDest, RoomStatus


@dataclass
class PrefillPeer:
    """A room's writer: one instance of a prefill rank, as found at its bootstrap server
    ``key[:2]``; ``key`` is ``(host, port, engine_rank)`` (:class:`PrefillPeers` keeps
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
        # time.perf_counter() when the notification thread read a writer's XferDone (the
        # last one's; benchmarks read it: bench transfer's stages)
        self.notif_read_at = 0.0

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
            ready = self._state == KVPoll.Bootstrapping
            if ready:
                self._state = KVPoll.WaitingForInput
            else:
                failed_early = self._state == KVPoll.Failed
                tell = [p for r, p in peers.items() if r not in self._told] if failed_early else []
                self._told.update(peers)
        if ready:
            self._table.wake()  # the engine may init the room now
            return
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


class PrefillPeers:
    """The live peers and the suspects of one decode manager (module doc); thread-safe."""

    def __init__(self, engine: NixlTransferEngine, rooms: RoomTable[NixlReceiver]) -> None:
        self._engine = engine
        self._rooms = rooms
        self._peers: dict[tuple[str, int, int], PrefillPeer] = {}
        self._suspects: dict[str, PrefillPeer] = {}  # by instance: dead, may still WRITE
        self._lock = threading.Lock()

    def all(self) -> list[PrefillPeer]:
        """Every live peer, then every suspect."""
        with self._lock:
            return list(self._peers.values()) + list(self._suspects.values())

    def peer_for(self, key: tuple[str, int, int], info: RankInfo) -> PrefillPeer:
        """The peer of this instance; a new instance replaces (and fails) the old one.
        Raises what NIXL raises when it refuses the agent metadata."""
        with self._lock:
            old = self._peers.get(key)
            if old is not None and old.info.instance_id == info.instance_id and not old.dead:
                return old
            suspect = self._suspects.get(info.instance_id)
            if suspect is not None:  # a frozen prefill answers again: its agent is loaded
                self._suspects.pop(info.instance_id)
                suspect.dead, suspect.misses = False, 0
                self._peers[key] = suspect
                return suspect
        if old is not None:
            self.peer_gone(
                old,
                f"prefill {key[0]}:{key[1]} rank {key[2]} restarted as a new instance",
                PEER_RESTARTED,
            )
        for s in list(self._suspects.values()):
            if s.key == key:  # another instance answers at that address: the old one is gone
                self.peer_gone(s, "", PEER_RESTARTED)
        name = self._engine.add_remote(base64.b64decode(info.agent_metadata))
        peer = PrefillPeer(key, info, name)
        with self._lock:
            self._peers[key] = peer
        return peer

    def peer_gone(self, peer: PrefillPeer, reason: str, kind: str, gone: bool = True) -> None:
        """Every room of ``peer`` fails now. ``gone``: the incarnation is known gone (new
        instance, connection refused), so quarantined pages are released and its agent
        removed; else (declared dead by the heartbeat) rooms whose destination went out
        are quarantined, RoomAbort is queued to it, and it is kept as a suspect."""
        with self._lock:
            peer.dead = True
            if self._peers.get(peer.key) is peer:
                del self._peers[peer.key]
            if gone:
                self._suspects.pop(peer.info.instance_id, None)
        rank = peer.info.engine_rank
        for r in self._rooms.handles():
            if r.peers.get(rank) is peer:
                r.writer_lost(rank, f"room {r.room}: {reason}", kind, gone)
        if not gone and any(
            r.peers.get(rank) is peer and rank in r.suspects and r.holds_pages()
            for r in self._rooms.handles()
        ):
            with self._lock:
                self._suspects[peer.info.instance_id] = peer
            return
        with self._lock:
            self._suspects.pop(peer.info.instance_id, None)
        self._forget_agent(peer)

    def heartbeat(self, client: BootstrapClient, interval: float, max_failure: int) -> None:
        """One round: one ``/health`` per prefill bootstrap server (``interval``: its
        timeout, s), judging every known peer and suspect of it: ``max_failure`` misses in
        a row, a rank missing there or a new instance id fail all that peer's rooms; an
        idle peer (or a suspect) whose server refuses connections is gone."""
        busy = {
            p.info.instance_id
            for r in self._rooms.handles()
            if not r.is_terminal()
            for p in r.peers.values()
        }
        servers: dict[tuple[str, int], list[PrefillPeer]] = defaultdict(list)
        for peer in self.all():
            servers[peer.key[:2]].append(peer)
        for (host, port), group in servers.items():
            where = f"prefill {host}:{port}"
            try:
                health = client.health(host, port, interval)
            except BootstrapError as exc:
                refused = isinstance(exc.__cause__, httpx.ConnectError)
                for peer in group:
                    suspect = peer.dead
                    peer.misses += 1
                    if refused and (suspect or peer.info.instance_id not in busy):
                        self.peer_gone(peer, f"{where} is gone ({exc})", HEARTBEAT_LOST)
                    elif not suspect and peer.misses >= max_failure:
                        self.peer_gone(
                            peer,
                            f"{where} missed {peer.misses} heartbeats ({exc})",
                            HEARTBEAT_LOST,
                            gone=refused,
                        )
                continue
            for peer in group:
                rank = peer.info.engine_rank
                now = health.ranks.get(rank, health.instance_id if rank == 0 else None)
                if now is None:
                    self.peer_gone(peer, f"{where} rank {rank} is gone", HEARTBEAT_LOST)
                elif now != peer.info.instance_id:
                    self.peer_gone(
                        peer, f"{where} rank {rank} restarted as a new instance", PEER_RESTARTED
                    )
                else:
                    peer.misses = 0
        self.settle_suspects()

    def settle_suspects(self) -> None:
        """Forget suspects none of whose rooms is quarantined any more."""
        held = {
            r.peers[rank].info.instance_id
            for r in self._rooms.handles()
            if r.holds_pages()
            for rank in r.suspects - r.ended
            if rank in r.peers
        }
        with self._lock:
            done = [s for i, s in self._suspects.items() if i not in held]
            for s in done:
                del self._suspects[s.info.instance_id]
        for s in done:
            self._forget_agent(s)

    def stats(self, quarantine_bound: float) -> dict:
        """Peer and quarantine counts; ``unhealthy_prefill_peers``: ``"host:port"`` ->
        age (s) of its oldest quarantine, for quarantines older than ``quarantine_bound``."""
        quarantined = [r for r in self._rooms.handles() if r.holds_pages()]
        now = time.monotonic()
        unhealthy: dict[str, float] = {}
        for r in quarantined:
            age = now - (r.quarantined_at or now)
            if age > quarantine_bound:
                key = f"{r.key[0]}:{r.key[1]}"
                unhealthy[key] = max(unhealthy.get(key, 0.0), age)
        with self._lock:
            peers, suspects = len(self._peers), len(self._suspects)
        return dict(
            prefill_peers=peers,
            suspect_prefill_peers=suspects,
            remote_agents=peers + suspects,
            quarantined_rooms=len(quarantined),
            quarantined_pages=sum(len(r.dst_pages) for r in quarantined),
            unhealthy_prefill_peers=unhealthy,
        )

    def _forget_agent(self, peer: PrefillPeer) -> None:
        if peer.agent_name is not None:
            name, peer.agent_name = peer.agent_name, None
            forget_agent(self._engine, name, f"prefill {peer.key}")
