"""The decode worker's NIXL KV manager: looks prefill ranks up, introduces itself to them,
sends each room's destination, learns of completion, and watches prefill peers. It owns
the manager and its threads' loops; a room and the peers that write it live in
:mod:`.receiver` (:class:`~.receiver.PrefillPeers`).

Threads: ``bootstrap`` (:class:`DecodeBootstrap`: per batch of rooms, one lookup per
prefill at its bootstrap server, ``GET /route/0`` then the other writer ranks; protocol,
``KVLayout.first_difference``, rank facts and head split checked, a mismatch fails the
rooms naming the field, a layout mismatch tells prefill too with ``RoomAbort``; the
prefill's NIXL agent loaded once per instance), ``control`` (every ZMQ socket: one DEALER
per prefill control endpoint; Hello before the first destination; reads RoomStatus),
``notifs`` (:class:`NotifPoller`, below) and ``heartbeat`` (``GET /health`` of every
prefill with live rooms every ``PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL`` s; after
``PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` misses in a row, or a new instance id,
every room of that prefill fails at once).

Quarantine (a late WRITE must never land in pages given to another request): a room
whose destination went out and whose prefill was declared dead fails at once, but its
pages stay held (``NixlReceiver.holds_pages``) until that prefill *incarnation* ends the
room (``RoomStatus`` or ``XferDone``) or is known gone (a new instance, or a refused
connection): never on a timeout alone. Such a peer stays a *suspect* (agent loaded, still
heartbeaten) and is forgotten (``forget_agent``) once no quarantined room is left; one
older than ``PDSERVE_DISAGGREGATION_QUARANTINE_BOUND`` is listed in
``stats()["unhealthy_prefill_peers"]``. Idle peers that restarted or went away are
forgotten too.

Tensor parallelism: one manager per decode rank. A room's writers are the prefill ranks
owning this rank's KV heads (:func:`pdserve.disagg.bootstrap.writes_into`); a peer is one
prefill rank instance, keyed ``(host, port, engine_rank)``. Splitting heads needs a
page-major pool on both sides (a layer-major pair with different head ranges fails at
bootstrap naming ``kv_order``). The heartbeat reads every rank's instance from the one
``/health`` of the prefill's bootstrap server.

Notifications (:class:`NotifPoller`): while a room is ``Transferring`` they are read back
to back with ``os.sched_yield`` on VRAM (the copy engines move the bytes; a back-off would
put decode behind prefill on every room), every ``HOST_POLL_S`` on host memory (there a
CPU does the copy, and each read takes CPU from it); figures: docs/benchmarks.md. Else it
waits on the *wake* event (set when a destination goes out) for at most ``IDLE_WAIT_S``;
the event is cleared *before* the rooms are looked at, so a destination sent in between
is never missed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import zmq

from pdserve.disagg.base import (
    BOOTSTRAP_ERROR,
    LAYOUT_MISMATCH,
    PAGE_MAJOR,
    PROTOCOL_MISMATCH,
    PROTOCOL_VERSION,
    SHUTDOWN,
    FailureInjector,
    KVArgs,
    KVLayout,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    Role,
    RoomTable,
    ServiceThreads,
    check_room,
)
from pdserve.disagg.bootstrap import BootstrapClient, BootstrapError, HeadSlice, writes_into
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.nixl.agent.init import select_device
from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
from pdserve.disagg.nixl.decode.receiver import (
    NixlReceiver,
    PrefillPeer,
    PrefillPeers,
    ReceiverContext,
)
from pdserve.disagg.transfer_config import TransferConfig
from pdserve.disagg.wire import (
    Hello,
    Outbox,
    RankInfo,
    RoomAbort,
    RoomDest,
    RoomStatus,
    WireError,
    decode_control,
    decode_xfer_done,
    encode_control,
    recv_all,
)
from pdserve.parallel import TPRank, kv_head_range
from pdserve.ports import check_port

log = logging.getLogger(__name__)


class NixlDecodeManager(KVManager):
    """Decode role over NIXL (see module doc); ``cfg``: the worker's transfer settings
    (timeouts, heartbeat, quarantine bound, the agent's spec). Raises whatever NIXL
    initialisation raises."""

    role = Role.DECODE

    def __init__(
        self, args: KVArgs, cfg: TransferConfig, *, api: NixlApi, start_threads: bool = True
    ) -> None:
        self.instance_id = uuid.uuid4().hex
        self.waiting_timeout = cfg.waiting_timeout_s
        self.heartbeat_interval = cfg.heartbeat_interval_s
        self.heartbeat_max_failure = cfg.heartbeat_max_failure
        self.quarantine_bound = cfg.quarantine_bound_s
        self._injector = FailureInjector(cfg.failure_prob)
        self._metrics = TransferMetrics()
        self._rooms: RoomTable[NixlReceiver] = RoomTable(Role.DECODE)
        self._transferring = threading.Event()  # a destination went out: watch notifications
        self._down = False
        # the notification hop's own counters (stats()): what the notification thread read,
        # what matched no live room of that prefill instance, and when it last read
        self._notifs_received = 0
        self._notifs_unmatched = 0
        self._notifs_read_at = time.monotonic()
        self.engine = NixlTransferEngine(
            api, args, Role.DECODE, f"pdserve-decode-{self.instance_id[:12]}", cfg.agent
        )
        self._prefills = PrefillPeers(self.engine, self._rooms)
        self._hello = Hello(
            "",
            self.instance_id,
            self.engine.name,
            self.engine.metadata(),
            self.engine.kv_descs,
            self.engine.aux_descs,
            args.tp_size,
            args.engine_rank,
            list(args.kv_heads),
        )
        self.rank = args.tp
        self.writes_aux = args.engine_rank == 0  # prefill rank 0 writes aux here only
        self._bootstrap = DecodeBootstrap(args, self._prefills, self.send, self.instance_id)
        self._room_ctx = ReceiverContext(
            self._rooms,
            self._metrics,
            self._injector,
            self.engine,
            self.instance_id,
            self.writes_aux,
            self.waiting_timeout,
            self.send,
        )
        self._ctx = zmq.Context()
        self._outbox = Outbox(self._ctx)
        self._threads = ServiceThreads("pdserve-decode")
        if start_threads:
            self._threads.start("bootstrap", self._bootstrap.loop)
            self._threads.start("control", self._control_loop)
            self._threads.start("notifs", self._notif_loop)
            self._threads.start("heartbeat", self._heartbeat_loop)

    # --- KVManager ------------------------------------------------------------------------
    def create_sender(self, bootstrap_room: int) -> KVSender:
        raise RuntimeError("create_sender on a decode KV manager")

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int
    ) -> KVReceiver:
        room = check_room(bootstrap_room)
        if not isinstance(bootstrap_host, str) or not bootstrap_host:
            raise ValueError(f"bootstrap_host must be a non-empty string, got {bootstrap_host!r}")
        check_port(bootstrap_port, "bootstrap_port", allow_zero=False)
        if self._down:
            raise RuntimeError("the decode KV manager is shut down")
        receiver = NixlReceiver(room, self._room_ctx, bootstrap_host, bootstrap_port)
        self._rooms.add(room, receiver)
        self._bootstrap.put(receiver)
        return receiver

    def is_healthy(self) -> bool:
        return not self._down and self._threads.healthy()

    def stats(self) -> dict:
        return dict(
            self._rooms.stats(self._metrics, "nixl"),
            **self._prefills.stats(self.quarantine_bound),
            notifs_received=self._notifs_received,
            notifs_unmatched=self._notifs_unmatched,
            notifs_read_age_s=round(time.monotonic() - self._notifs_read_at, 3),
            healthy=self.is_healthy(),
        )

    def shutdown(self) -> None:
        if self._down:
            return
        self._down = True
        self._threads.stop()
        for r in self._rooms.handles():  # no thread left to hear prefill: nothing else ends them
            r.fail_now("the decode KV manager shut down", SHUTDOWN)
        self._outbox.close()
        self._ctx.destroy(linger=0)
        self.engine.close()

    # --- used by receivers ------------------------------------------------------------------
    def send(self, peer: PrefillPeer, msg: RoomDest | RoomAbort) -> None:
        """Queue a control message to ``peer`` (sent by the control thread)."""
        self._outbox.put((peer.info.control_endpoint, peer.info.instance_id, msg))
        if isinstance(msg, RoomDest):
            self._transferring.set()

    # --- control thread ---------------------------------------------------------------------
    def _control_loop(self, stop: threading.Event) -> None:
        select_device(self.engine.kv_args)
        poller = zmq.Poller()
        poller.register(self._outbox.wake_socket, zmq.POLLIN)
        dealers: dict[str, zmq.Socket] = {}
        greeted: set[tuple[str, str]] = set()
        try:
            while not stop.is_set():
                poller.poll(20)  # control messages wake it (the outbox has a wake socket)
                for sock in dealers.values():
                    for frames in recv_all(sock):
                        self._on_message(frames[-1])
                for endpoint, instance, msg in self._outbox.drain():
                    dealer = dealers.get(endpoint)
                    if dealer is None:
                        dealer = dealers[endpoint] = self._ctx.socket(zmq.DEALER)
                        dealer.setsockopt(zmq.IDENTITY, self.instance_id.encode())
                        dealer.setsockopt(zmq.LINGER, 0)
                        if endpoint.startswith("tcp://["):
                            dealer.setsockopt(zmq.IPV6, 1)
                        dealer.connect(endpoint)
                        poller.register(dealer, zmq.POLLIN)
                    if isinstance(msg, RoomDest) and (endpoint, instance) not in greeted:
                        hello = msgspec.structs.replace(self._hello, prefill_instance=instance)
                        dealer.send(encode_control(hello))
                        greeted.add((endpoint, instance))
                    dealer.send(encode_control(msg))
        finally:
            for sock in dealers.values():
                sock.close(linger=0)

    # --- notification thread ----------------------------------------------------------------
    def _notif_loop(self, stop: threading.Event) -> None:
        select_device(self.engine.kv_args)
        NotifPoller(
            self._drain_notifs,
            self._awaiting_completion,
            self._transferring,
            on_host=self.engine.kv_mem == "DRAM",
        ).run(stop)

    def _drain_notifs(self) -> bool:
        """Handle the notifications NIXL has; True if there were any."""
        got = False
        notifs = self.engine.new_notifs()
        read_at = time.perf_counter()
        for payloads in notifs.values():
            for payload in payloads:
                got = True
                self._notifs_received += 1
                self._on_notif(payload, read_at)
        self._notifs_read_at = time.monotonic()
        return got

    def _awaiting_completion(self) -> bool:
        return any(r.poll_state() == KVPoll.Transferring for r in self._rooms.handles())

    def _on_message(self, data: bytes) -> None:
        try:
            msg = decode_control(data)
        except WireError as exc:
            log.warning("dropped a control message from prefill: %s", exc)
            return
        if isinstance(msg, RoomStatus):
            r = self._rooms.get(msg.room)
            rank = r.rank_of(msg.prefill_instance) if r is not None else None
            if r is not None and rank is not None:
                r.on_status(rank, msg)

    def _on_notif(self, payload: bytes, read_at: float = 0.0) -> None:
        try:
            done = decode_xfer_done(payload)
        except WireError as exc:
            log.warning("dropped a NIXL notification: %s", exc)
            return
        r = self._rooms.get(done.room)
        rank = r.rank_of(done.prefill_instance) if r is not None else None
        if r is None or rank is None:
            # Once a destination went out a room ends only on XferDone, RoomStatus or its
            # writer's death, so this is rare: say it, it may be a room that now hangs
            self._notifs_unmatched += 1
            log.warning(
                "XferDone of room %d from prefill instance %s matches %s",
                done.room,
                done.prefill_instance,
                "no live room" if r is None else "none of the room's writers",
            )
            return
        r.notif_read_at = read_at
        r.on_done(rank, done.aux)

    # --- heartbeat thread -------------------------------------------------------------------
    def _heartbeat_loop(self, stop: threading.Event) -> None:
        client = BootstrapClient()
        try:
            while not stop.wait(self.heartbeat_interval):
                self._prefills.heartbeat(
                    client, self.heartbeat_interval, self.heartbeat_max_failure
                )
        finally:
            client.close()


class DecodeBootstrap:
    """The bootstrap thread of one decode manager (module doc): ``put`` queues a new
    receiver, :meth:`loop` is the thread. ``send(peer, msg)`` queues a control message;
    ``instance_id``: the decode manager's."""

    def __init__(
        self,
        kv_args: KVArgs,
        prefills: PrefillPeers,
        send: Callable[[PrefillPeer, RoomAbort], None],
        instance_id: str,
    ) -> None:
        self._kv_args = kv_args
        self._rank = kv_args.tp
        self._prefills = prefills
        self._send = send
        self._instance_id = instance_id
        self._queue: queue.SimpleQueue[NixlReceiver] = queue.SimpleQueue()

    def put(self, receiver: NixlReceiver) -> None:
        self._queue.put(receiver)

    def loop(self, stop: threading.Event) -> None:
        """Until ``stop``: take every queued receiver, grouped by prefill bootstrap server."""
        select_device(self._kv_args)
        client = BootstrapClient()
        try:
            while not stop.is_set():
                try:
                    batch = [self._queue.get(timeout=0.1)]
                except queue.Empty:
                    continue
                while True:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                groups: dict[tuple[str, int], list[NixlReceiver]] = {}
                for r in batch:
                    groups.setdefault(r.key, []).append(r)
                for key, receivers in groups.items():
                    self._group(client, key, receivers)
        finally:
            client.close()

    def _group(
        self, client: BootstrapClient, key: tuple[str, int], receivers: list[NixlReceiver]
    ) -> None:
        host, port = key
        infos: dict[int, RankInfo] = {}
        slices: list[HeadSlice] = []
        problem = None
        try:
            infos[0] = client.fetch_rank(host, port, 0)
            problem = self._check_info(key, infos[0], None)
            if problem is None:
                slices = writes_into(
                    self._kv_args.layout.num_kv_heads, infos[0].tp_size, self._rank
                )
                for sl in slices:
                    if sl.src_rank not in infos:
                        infos[sl.src_rank] = client.fetch_rank(host, port, sl.src_rank)
                        problem = problem or self._check_info(key, infos[sl.src_rank], infos[0])
                problem = problem or self._check_split(key, slices, infos)
        except BootstrapError as exc:
            for r in receivers:
                r.fail_now(f"room {r.room}: {exc}", BOOTSTRAP_ERROR)
            return
        if problem is not None:
            for r in receivers:
                r.fail_now(f"room {r.room}: {problem[0]}", problem[1])
            if problem[1] == LAYOUT_MISMATCH:  # same protocol: prefill's rooms fail too
                for rank, info in infos.items():
                    stranger = PrefillPeer((host, port, rank), info, None)
                    for r in receivers:
                        self._send(
                            stranger,
                            RoomAbort(r.room, info.instance_id, self._instance_id, *problem),
                        )
            return
        try:
            peers = {
                sl.src_rank: self._prefills.peer_for((host, port, sl.src_rank), infos[sl.src_rank])
                for sl in slices
            }
        except Exception as exc:  # noqa: BLE001 - e.g. NIXL refuses the metadata
            for r in receivers:
                r.fail_now(
                    f"room {r.room}: prefill {host}:{port} agent unusable: {exc}", BOOTSTRAP_ERROR
                )
            return
        for r in receivers:
            r.bootstrapped(peers)

    def _check_info(
        self, key: tuple[str, int], info: RankInfo, rank0: RankInfo | None
    ) -> tuple[str, str] | None:
        """Why a prefill rank cannot write here (protocol, model facts, rank facts), or None."""
        host, port = key
        if info.protocol_version != PROTOCOL_VERSION:
            return (
                f"protocol_version: ours {PROTOCOL_VERSION} vs prefill's {info.protocol_version}",
                PROTOCOL_MISMATCH,
            )
        try:
            theirs = KVLayout.from_dict(info.layout)
            diff = self._kv_args.layout.first_difference(theirs)
            if diff is None:
                tp = TPRank(info.engine_rank, info.tp_size)
                if rank0 is not None and info.tp_size != rank0.tp_size:
                    diff = f"tp_size: rank {tp.rank} has {tp.size}, rank 0 {rank0.tp_size}"
                elif list(kv_head_range(theirs.num_kv_heads, tp)) != list(info.kv_heads):
                    diff = f"kv_heads: rank {tp.rank}/{tp.size} holds {info.kv_heads}"
        except (KeyError, TypeError, ValueError) as exc:
            diff = f"unreadable layout or rank facts ({exc})"
        if diff is not None:
            return f"KV layout mismatch with prefill {host}:{port}: {diff}", LAYOUT_MISMATCH
        return None

    def _check_split(
        self, key: tuple[str, int], slices: list[HeadSlice], infos: dict[int, RankInfo]
    ) -> tuple[str, str] | None:
        """Heads split between ranks (any writer's or our range differs) need page-major."""
        order = self._kv_args.layout.kv_order
        mine = tuple(self._kv_args.kv_heads)
        split = any(
            (sl.start, sl.end) != mine or tuple(infos[sl.src_rank].kv_heads) != mine
            for sl in slices
        )
        if split and order != PAGE_MAJOR:
            return (
                f"KV layout mismatch with prefill {key[0]}:{key[1]}: kv_order: {order!r} cannot "
                f"split KV heads between prefill TP {infos[0].tp_size} and decode TP "
                f"{self._rank.size} (page_major can)",
                LAYOUT_MISMATCH,
            )
        return None


HOST_POLL_S = 250e-6  # host memory: the pause between reads while a room transfers
IDLE_WAIT_S = 0.02  # no room transferring: the longest wait for a wake-up


class NotifPoller:
    """The loop of decode's notification thread (module doc).

    drain: reads and handles the pending notifications, True if there were any;
    transferring: True while some room awaits its completion; wake: the event a sent
    destination sets; on_host: the KV pool is host memory. ``sleep`` and ``yield_`` are
    the waits, injectable for tests.
    """

    def __init__(
        self,
        drain: Callable[[], bool],
        transferring: Callable[[], bool],
        wake: threading.Event,
        on_host: bool,
        *,
        sleep: Callable[[float], None] = time.sleep,
        yield_: Callable[[], None] = os.sched_yield,
    ) -> None:
        self._drain = drain
        self._transferring = transferring
        self._wake = wake
        self.on_host = on_host
        self._sleep, self._yield = sleep, yield_

    def step(self) -> None:
        """One read of the notifications and the wait after it."""
        self._drain()
        self._wake.clear()  # before the look: a destination sent after it keeps it set
        if not self._transferring():
            self._wake.wait(IDLE_WAIT_S)
        elif self.on_host:
            self._sleep(HOST_POLL_S)
        else:
            self._yield()

    def run(self, stop: threading.Event) -> None:
        """Steps until ``stop`` is set."""
        while not stop.is_set():
            self.step()
