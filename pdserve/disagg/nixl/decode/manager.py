"""The decode worker's NIXL KV manager: looks prefill ranks up, introduces itself to them,
sends each room's destination, learns of completion, and watches prefill peers.

Threads: ``bootstrap`` (:mod:`.bootstrap`: HTTP lookups grouped per prefill;
protocol/layout checks; loads the prefill's NIXL agent once per instance), ``control`` (every ZMQ socket: one DEALER per
prefill control endpoint; sends Hello before the first destination to an instance; reads
RoomStatus), ``notifs`` (NIXL completion notifications, :mod:`.notif_poll`: read back to back
while a room is transferring, with ``os.sched_yield`` between reads on VRAM, every
``HOST_POLL_S`` on host memory; else it waits
on an event set when a destination goes out), ``heartbeat`` (``GET /health`` of every prefill
that has live rooms every ``PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL`` s; after
``PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` misses in a row, or a new instance id,
every room of that prefill fails at once; the round: :meth:`~.peers.PrefillPeers.heartbeat`).

Quarantine (a late WRITE must never land in pages given to another request): a room
whose destination went out and whose prefill was declared dead by the heartbeat fails at
once, but its pages stay held (``NixlReceiver.holds_pages``) until that prefill
*incarnation* ends the room (``RoomStatus`` or ``XferDone``: it will not WRITE any more)
or is known gone (its bootstrap answers as a new instance, or refuses the connection):
never on a timeout alone. Such a peer is kept as a *suspect* (agent loaded, still
heartbeaten); once no quarantined room is left it is forgotten (``remove_remote_agent``).
A quarantine older than ``PDSERVE_DISAGGREGATION_QUARANTINE_BOUND`` lists the peer in
``stats()["unhealthy_prefill_peers"]``. Idle peers that restarted or went away are
forgotten too, so restarts leave remote agents flat. The peers, suspects and these
counts are kept by :class:`~.peers.PrefillPeers`; a peer's agent is forgotten by
:func:`~pdserve.disagg.nixl.agent.peer_life.forget_agent`, as on prefill.

Tensor parallelism: one manager per decode rank, in that rank's process. A room's writers
are the prefill ranks owning this rank's KV heads (:func:`pdserve.disagg.bootstrap.writes_into`),
looked up at the prefill's bootstrap server (rank 0 first: it names the TP size); a peer is
one prefill rank instance, keyed ``(host, port, engine_rank)``. Splitting heads needs a
page-major pool on both sides: a layer-major pair with different head ranges fails at
bootstrap naming ``kv_order``. The heartbeat reads every rank's instance from the one
``/health`` of the prefill's bootstrap server: a rank missing there is gone.
"""

from __future__ import annotations

import logging
import threading
import uuid

import msgspec
import zmq

from pdserve.disagg.base import (
    SHUTDOWN,
    FailureInjector,
    KVArgs,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    Role,
    RoomTable,
    ServiceThreads,
    check_room,
)
from pdserve.disagg.bootstrap import BootstrapClient
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.nixl.agent.init import select_device
from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
from pdserve.disagg.nixl.decode.bootstrap import DecodeBootstrap
from pdserve.disagg.nixl.decode.notif_poll import NotifPoller
from pdserve.disagg.nixl.decode.peers import PrefillPeers
from pdserve.disagg.nixl.decode.receiver import NixlReceiver, PrefillPeer, ReceiverContext
from pdserve.disagg.transfer_config import TransferConfig
from pdserve.disagg.wire import (
    Hello,
    Outbox,
    RoomAbort,
    RoomDest,
    RoomStatus,
    WireError,
    decode_control,
    decode_xfer_done,
    encode_control,
    recv_all,
)
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

    def num_live_rooms(self) -> int:
        return len(self._rooms)

    def stats(self) -> dict:
        return dict(
            self._rooms.stats(self._metrics, "nixl"),
            **self._prefills.stats(self.quarantine_bound),
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
        for payloads in self.engine.new_notifs().values():
            for payload in payloads:
                got = True
                self._on_notif(payload)
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

    def _on_notif(self, payload: bytes) -> None:
        try:
            done = decode_xfer_done(payload)
        except WireError as exc:
            log.warning("dropped a NIXL notification: %s", exc)
            return
        r = self._rooms.get(done.room)
        rank = r.rank_of(done.prefill_instance) if r is not None else None
        if r is not None and rank is not None:
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
