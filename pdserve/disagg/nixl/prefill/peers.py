"""Prefill's decode peers: the decode rank instances that said Hello, each with its NIXL
agent loaded (into the WRITE agent and the notifier) and its memory prepared for the
heads this rank writes there, or why it is unusable; and their end (the rules:
:mod:`.manager`'s module doc). A decode that ZMQ can no longer route a ``Ping`` to is gone
(its process ended or restarted as a new instance): its prepared lists are released and
its agent removed (:func:`~pdserve.disagg.nixl.agent.peer_life.forget_agent`), unless a room still holds it.
Used by the control thread only (``hello``, ``forget_gone``); ``counts`` by stats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.disagg.bootstrap import reads_from
from pdserve.disagg.nixl.agent.dlists import RemoteSide
from pdserve.disagg.nixl.agent.notifier import NixlNotifier
from pdserve.disagg.nixl.agent.peer_life import forget_agent
from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
from pdserve.disagg.wire import Hello
from pdserve.parallel import TPRank, kv_head_range

log = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    """A decode rank instance that said Hello: its NIXL agent and memory (prepared for the
    heads this rank writes there), or why it is unusable; its rank and TP size."""

    instance_id: str
    identity: bytes
    remote: RemoteSide | None
    error: str | None = None
    engine_rank: int = 0
    tp_size: int = 1


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
