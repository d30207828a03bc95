"""The prefill worker's NIXL KV manager: bootstrap server, ZMQ control endpoint (ROUTER),
and a pool of transfer workers that WRITE rooms' pages into decode's memory.

Threads: ``control`` (every ZMQ socket; decode's Hello/RoomDest/RoomAbort in, RoomStatus
out), ``transfer-i`` (:mod:`.sender`), and the bootstrap HTTP server (:mod:`.bootstrap`).
A destination may arrive before the engine created the room (the router sends to both
workers at once): it waits in ``_pending`` (bounded by the bootstrap timeout); an abort
for a room not created yet waits in ``_early_aborts``. Two NIXL agents: the engine's
(memory registered, every WRITE) and a notifier
(:class:`~pdserve.disagg.nixl.agent.transfer_engine.NixlNotifier`, ``XferDone`` only);
each decode agent is loaded into both.

Tensor parallelism: one manager per rank. Rank 0 runs the worker's bootstrap server;
every rank registers its :class:`RankInfo` there over HTTP. A decode rank says Hello to
each prefill rank that writes some of its heads (:mod:`pdserve.disagg.bootstrap`); a
room's sender waits for the destination of every decode rank it writes into. Only rank 0
writes the aux record, and only into decode rank 0.

The decode peers (:class:`DecodePeers`, used by the control thread and stats only): the
decode rank instances that said Hello, each with its agent loaded and its memory prepared
for the heads this rank writes there, or why it is unusable. A decode that ZMQ can no
longer route a ``Ping`` to is gone: its lists are released and its agent forgotten
(:func:`~pdserve.disagg.nixl.agent.peer_life.forget_agent`), unless a room still holds it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from pdserve.advertise import advertised_host, url_host
from pdserve.disagg.base import (
    PEER_FAILED,
    PEER_RESTARTED,
    PROTOCOL_VERSION,
    SHUTDOWN,
    FailureInjector,
    KVArgs,
    KVManager,
    KVReceiver,
    KVSender,
    Role,
    RoomTable,
    ServiceThreads,
    check_room,
)
from pdserve.disagg.bootstrap import reads_from
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.nixl.agent.init import select_device
from pdserve.disagg.nixl.agent.peer_life import forget_agent
from pdserve.disagg.nixl.agent.transfer_engine import NixlNotifier, NixlTransferEngine
from pdserve.disagg.nixl.prefill.bootstrap import PrefillBootstrap, rank_info
from pdserve.disagg.nixl.prefill.sender import (
    DecodePeer,
    NixlSender,
    SenderContext,
    TransferWorkers,
)
from pdserve.disagg.transfer_config import TransferConfig
from pdserve.disagg.wire import (
    HealthInfo,
    Hello,
    Outbox,
    Ping,
    RoomAbort,
    RoomDest,
    RoomStatus,
    WireError,
    decode_control,
    encode_control,
    recv_all,
)
from pdserve.parallel import TPRank, kv_head_range

log = logging.getLogger(__name__)


class NixlPrefillManager(KVManager):
    """Prefill role over NIXL (see module doc).

    args: the KV pool and aux buffer to register; cfg: the worker's transfer settings
    (``cfg.bootstrap``: where the bootstrap server and the ZMQ control endpoint listen,
    port 0 = free port; for a rank >= 1 (``args.engine_rank``) its port is rank 0's
    server, where it registers; its ``advertise_host``: the address decode reaches the
    control endpoint by, ``None``: derived from the host by
    :func:`pdserve.advertise.advertised_host`). Raises
    OSError naming the port when it is taken, and whatever NIXL initialisation raises.
    """

    role = Role.PREFILL

    def __init__(
        self,
        args: KVArgs,
        cfg: TransferConfig,
        *,
        api: NixlApi,
        start_threads: bool = True,
    ) -> None:
        self.instance_id = uuid.uuid4().hex
        self.cfg = cfg
        self.bootstrap_timeout = cfg.bootstrap_timeout_s
        self.transfer_timeout = cfg.waiting_timeout_s
        self.rank = args.tp
        bootstrap_host = cfg.bootstrap.host
        # checked before any agent or socket exists (a bad port leaks nothing)
        self._bootstrap = PrefillBootstrap(
            self.rank, bootstrap_host, cfg.bootstrap.port, self._health
        )
        self._injector = FailureInjector(cfg.failure_prob)
        self._metrics = TransferMetrics()
        self._rooms: RoomTable[NixlSender] = RoomTable(Role.PREFILL)
        self._match = threading.Lock()  # rooms vs pending destinations / early aborts
        self._pending: dict[int, tuple[RoomDest, bytes, float]] = {}
        self._early_aborts: dict[int, tuple[str, str, bytes, float]] = {}
        self._ended: dict[int, tuple[str, str, float]] = {}  # recently failed rooms: reason, kind
        self._down = False
        self.engine = NixlTransferEngine(
            api, args, Role.PREFILL, f"pdserve-prefill-{self.instance_id[:12]}", cfg.agent
        )
        self.notifier = NixlNotifier(api, f"{self.engine.name}-notif", args, self.engine.spec)
        self._peers = DecodePeers(self.engine, self.notifier, self.rank)
        self._workers = TransferWorkers(
            self.engine, self.instance_id, self.transfer_timeout, self.notifier, self._metrics
        )
        self._room_ctx = SenderContext(
            self._rooms,
            self._metrics,
            self._injector,
            self.engine,
            self.rank,
            self.bootstrap_timeout,
            self._workers.submit,
            self.room_failed,
        )
        self._threads = ServiceThreads("pdserve-prefill")
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> error: peer gone
        host = bootstrap_host
        zmq_host = f"[{host}]" if ":" in host else host
        if ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        control_port = self._router.bind_to_random_port(f"tcp://{zmq_host}")
        advertised = url_host(advertised_host(host, cfg.bootstrap.advertise_host))
        self.control_endpoint = f"tcp://{advertised}:{control_port}"
        self._outbox = Outbox(self._ctx)
        try:
            if start_threads:
                self._start()
        except BaseException:
            self.shutdown()
            raise

    # --- start-up -------------------------------------------------------------------
    def _start(self) -> None:
        self._bootstrap.serve()
        for i in range(self.cfg.transfer_workers):
            self._threads.start(f"transfer-{i}", self._workers.loop)
        self._threads.start("control", self._control_loop)
        self._bootstrap.register(
            rank_info(self.instance_id, self.engine, self.control_endpoint, self.rank.size)
        )

    def _health(self) -> HealthInfo:
        return HealthInfo(
            "ok" if self.is_healthy() else "unhealthy", self.instance_id, PROTOCOL_VERSION
        )

    # --- KVManager ------------------------------------------------------------------
    @property
    def bootstrap_port(self) -> int | None:
        return self._bootstrap.port

    def create_sender(self, bootstrap_room: int) -> KVSender:
        room = check_room(bootstrap_room)
        if self._down:
            raise RuntimeError("the prefill KV manager is shut down")
        sender = NixlSender(room, self._room_ctx)
        with self._match:
            self._rooms.add(room, sender)
            self._ended.pop(room, None)
            early = self._early_aborts.pop(room, None)
            pending = self._pending.pop(room, None)
        if early is not None:
            reason, kind, identity, _ = early
            sender.peer_abort(reason, kind, identity)
        elif pending is not None:
            self._attach(sender, *pending[:2])
        return sender

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int
    ) -> KVReceiver:
        raise RuntimeError("create_receiver on a prefill KV manager")

    def is_healthy(self) -> bool:
        return not self._down and self._threads.healthy() and self._bootstrap.serving()

    def forget_rank(self, engine_rank: int) -> None:
        """Rank 0: the process of ``engine_rank`` died; its registration is removed, so
        decode's heartbeat knows that rank's instance gone (its rooms fail there)."""
        self._bootstrap.forget_rank(engine_rank)

    def num_live_rooms(self) -> int:
        return len(self._rooms)

    def stats(self) -> dict:
        return dict(
            self._rooms.stats(self._metrics, "nixl"),
            **self._peers.counts(),
            notifier_remote_agents=self.notifier.num_remotes(),
            notifs_sent=self._workers.notifs_sent,
            prepared_dlists=self.engine.num_prepared_lists(),
            premade_writes=self.engine.num_premade_writes(),
            premade_writes_made=self.engine.premade_made,
            premade_writes_posted=self.engine.premade_posted,
            healthy=self.is_healthy(),
        )

    def shutdown(self) -> None:
        if self._down:
            return
        self._down = True
        for sender in self._rooms.handles():
            sender.fail("the prefill KV manager shut down", SHUTDOWN)
        self._threads.stop()
        self._bootstrap.stop()
        self._outbox.close()
        self._router.close(linger=0)
        self._ctx.term()
        self.engine.close()

    # --- used by senders ----------------------------------------------------------------
    def room_failed(self, sender: NixlSender, reason: str, kind: str) -> None:
        """Tell decode (if it is known) that the room ended on prefill."""
        with self._match:
            self._ended[sender.room] = (reason, kind, time.monotonic())
        for identity in sender.reply_identities():
            self._outbox.put(
                (identity, RoomStatus(sender.room, self.instance_id, False, reason, kind))
            )

    # --- control thread ---------------------------------------------------------------
    def _control_loop(self, stop: threading.Event) -> None:
        select_device(self.engine.kv_args)  # it loads decode agents and opens connections
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.wake_socket, zmq.POLLIN)
        next_prune = time.monotonic() + 1.0
        while not stop.is_set():
            poller.poll(50)
            # Progress UCX while idle too (prefill gets no notifications; this discards none
            # anyone reads): a peer's one-sided READ over TCP (`pdserve doctor --peer`) and
            # connection wire-up need this side to answer.
            self.engine.new_notifs()
            self.notifier.progress()
            for frames in recv_all(self._router):
                self._on_message(frames[0], frames[-1])
            for identity, msg in self._outbox.drain():
                self._send(identity, msg)
            if time.monotonic() > next_prune:
                self._prune()
                next_prune = time.monotonic() + 1.0

    def _send(self, identity: bytes, msg) -> bool:
        """Send on the ROUTER; False when ZMQ cannot route to ``identity`` (gone)."""
        try:
            self._router.send_multipart([identity, encode_control(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # that decode's connection is closed
                return False
            log.warning("control message to %r not sent: %s", identity, exc)
            return True

    def _reply(self, identity: bytes, room: int, reason: str, kind: str) -> None:
        self._send(identity, RoomStatus(room, self.instance_id, False, reason, kind))

    def _on_message(self, identity: bytes, data: bytes) -> None:
        try:
            msg = decode_control(data)
        except WireError as exc:
            log.warning("dropped a control message from %r: %s", identity, exc)
            return
        if isinstance(msg, Ping):
            return  # prefill sends pings; it does not expect any
        if msg.prefill_instance != self.instance_id:
            if not isinstance(msg, Hello):
                self._reply(
                    identity,
                    msg.room,
                    f"prefill instance {msg.prefill_instance} is gone "
                    f"(restarted as {self.instance_id})",
                    PEER_RESTARTED,
                )
            return
        if isinstance(msg, Hello):
            self._peers.hello(identity, msg)
        elif isinstance(msg, RoomDest):
            self._on_dest(identity, msg)
        elif isinstance(msg, RoomAbort):
            self._on_abort(identity, msg)

    def _on_dest(self, identity: bytes, dest: RoomDest) -> None:
        with self._match:
            sender = self._rooms.get(dest.room)
            if sender is None:
                ended = self._ended.get(dest.room)
                if ended is None:
                    self._pending[dest.room] = (dest, identity, time.monotonic())
                    return
        if sender is None:
            assert ended is not None  # a room with no sender and no ending was parked above
            self._reply(identity, dest.room, ended[0], ended[1])
            return
        self._attach(sender, dest, identity)

    def _attach(self, sender: NixlSender, dest: RoomDest, identity: bytes) -> None:
        peer = self._peers.get(dest.decode_instance)
        if peer is None or peer.remote is None:
            why = peer.error if peer is not None else "no Hello from this decode instance"
            sender.peer_abort(
                f"decode {dest.decode_instance} is unusable: {why}", PEER_FAILED, identity
            )
            return
        sender.attach_dest(dest, peer, identity, self._peers.expected_dests(peer.tp_size))

    def _on_abort(self, identity: bytes, abort: RoomAbort) -> None:
        with self._match:
            sender = self._rooms.get(abort.room)
            if sender is None:
                self._pending.pop(abort.room, None)
                if abort.room not in self._ended:
                    self._early_aborts[abort.room] = (
                        abort.reason,
                        abort.kind,
                        identity,
                        time.monotonic(),
                    )
        if sender is None:  # nothing of decode's is touched: acknowledge at once
            self._reply(
                identity, abort.room, f"room {abort.room} is not running on prefill", abort.kind
            )
        else:
            sender.peer_abort(abort.reason, abort.kind, identity)

    def _prune(self) -> None:
        """Forget destinations, aborts and endings older than the bootstrap timeout; a
        destination nobody claimed fails on decode; decode peers that are gone (a
        ``Ping`` ZMQ cannot route: :meth:`~.peers.DecodePeers.forget_gone`)."""
        used = {id(p) for s in self._rooms.handles() for p in s.peers()}
        self._peers.forget_gone(lambda identity: self._send(identity, Ping(self.instance_id)), used)
        cutoff = time.monotonic() - self.bootstrap_timeout
        with self._match:
            stale = [(r, v) for r, v in self._pending.items() if v[2] < cutoff]
            for r, _ in stale:
                del self._pending[r]
            for r in [r for r, v in self._early_aborts.items() if v[3] < cutoff]:
                del self._early_aborts[r]
            for r in [r for r, v in self._ended.items() if v[2] < cutoff]:
                del self._ended[r]
        for room, (_, identity, _) in stale:
            self._reply(
                identity,
                room,
                f"prefill never received room {room} within {self.bootstrap_timeout:g} s",
                "bootstrap_timeout",
            )


class DecodePeers:
    """The decode peers of one prefill manager, by decode instance id (module doc); not
    thread-safe (its control thread alone changes it)."""

    def __init__(self, engine: NixlTransferEngine, notifier: NixlNotifier, rank: TPRank) -> None:
        self._engine = engine
        self._notifier = notifier
        self._rank = rank
        self._peers: dict[str, DecodePeer] = {}

    def get(self, decode_instance: str) -> DecodePeer | None:
        return self._peers.get(decode_instance)

    def counts(self) -> dict[str, int]:
        """``decode_peers`` known, ``remote_agents`` of them loaded (usable)."""
        peers = list(self._peers.values())
        return dict(
            decode_peers=len(peers),
            remote_agents=sum(1 for p in peers if p.remote is not None),
        )

    def hello(self, identity: bytes, hello: Hello) -> None:
        """A decode rank said Hello: load its agent into both agents, prepare its memory
        and connect; a peer it cannot be made into is kept with why (its rooms fail on
        attach). A known instance only updates its ZMQ identity."""
        peer = self._peers.get(hello.decode_instance)
        if peer is not None:
            peer.identity = identity
            return
        try:
            heads = self._heads_for(hello)
            name = self._engine.add_remote(hello.agent_metadata)
            remote = self._engine.prepare_remote(
                name, hello.kv, hello.aux, heads, (hello.kv_heads[0], hello.kv_heads[1])
            )
            self._engine.connect(name)
            self._notifier.add_remote(hello.agent_metadata)
            peer = DecodePeer(
                hello.decode_instance, identity, remote, None, hello.engine_rank, hello.tp_size
            )
        except Exception as exc:  # noqa: BLE001 - the peer is unusable, the worker is fine
            log.warning("decode %s cannot be used: %s", hello.decode_instance, exc)
            peer = DecodePeer(
                hello.decode_instance,
                identity,
                None,
                f"{type(exc).__name__}: {exc}",
                hello.engine_rank,
                hello.tp_size,
            )
        self._peers[hello.decode_instance] = peer

    def _heads_for(self, hello: Hello) -> tuple[int, int]:
        """The model heads this rank writes into the decode rank of ``hello``. ValueError
        when its rank facts break the split rules or it needs no head of ours."""
        total = self._engine.kv_args.layout.num_kv_heads
        theirs = TPRank(hello.engine_rank, hello.tp_size)
        if list(kv_head_range(total, theirs)) != list(hello.kv_heads):
            raise ValueError(
                f"decode rank {theirs.rank}/{theirs.size} says it holds heads "
                f"{list(hello.kv_heads)}, the split rules give {list(kv_head_range(total, theirs))}"
            )
        mine = [s for s in reads_from(total, self._rank, theirs.size) if s.dst_rank == theirs.rank]
        if not mine:
            raise ValueError(
                f"prefill rank {self._rank.rank} writes no KV head of decode rank {theirs.rank}"
            )
        return mine[0].start, mine[0].end

    def expected_dests(self, decode_tp_size: int) -> frozenset[int]:
        """The decode ranks whose destination a room waits for: those this rank writes."""
        total = self._engine.kv_args.layout.num_kv_heads
        return frozenset(s.dst_rank for s in reads_from(total, self._rank, decode_tp_size))

    def forget_gone(self, ping: Callable[[bytes], bool], used: set[int]) -> None:
        """``ping`` every decode peer (by ZMQ identity; False: it cannot be routed to, so
        it is gone) and forget those gone, unless a room still holds them (``used``: ids
        of the peers rooms hold; then at the next round)."""
        for instance, peer in list(self._peers.items()):
            if ping(peer.identity) or id(peer) in used:
                continue
            del self._peers[instance]
            if peer.remote is not None:
                forget_agent(
                    self._engine,
                    peer.remote.agent_name,
                    f"decode {instance}",
                    peer.remote,
                    self._notifier,
                )
