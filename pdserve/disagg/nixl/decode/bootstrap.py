"""Decode's bootstrap thread: the prefill ranks a batch of rooms writes from, looked up at
their bootstrap server (``GET /route/0``, then the other writer ranks' routes, one lookup
per prefill and batch), checked (protocol version, ``KVLayout.first_difference``, rank
facts, the head split), and made peers (:meth:`~.peers.PrefillPeers.peer_for`:
the prefill's NIXL agent is loaded once per instance). A mismatch fails the rooms at once
naming the field; a layout mismatch tells prefill too (``RoomAbort``), whose rooms fail.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from pdserve.disagg.base import (
    BOOTSTRAP_ERROR,
    LAYOUT_MISMATCH,
    PAGE_MAJOR,
    PROTOCOL_MISMATCH,
    PROTOCOL_VERSION,
    KVArgs,
    KVLayout,
)
from pdserve.disagg.bootstrap import BootstrapClient, BootstrapError, HeadSlice, writes_into
from pdserve.disagg.nixl.agent.init import select_device
from pdserve.disagg.nixl.decode.peers import PrefillPeers
from pdserve.disagg.nixl.decode.receiver import NixlReceiver, PrefillPeer
from pdserve.disagg.wire import RankInfo, RoomAbort
from pdserve.parallel import TPRank, kv_head_range


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
