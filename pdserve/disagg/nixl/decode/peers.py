"""Decode's prefill peers: the prefill rank instances it writes rooms with, the suspects
among them, and the quarantine bookkeeping (the rules: :mod:`.manager`'s module doc).

A peer is one prefill rank *instance* (``PrefillPeer``, keyed ``(host, port,
engine_rank)``), with its NIXL agent loaded once. A peer declared dead by the heartbeat
while one of its rooms holds decode's pages stays a *suspect* (agent loaded, still
heartbeaten) until that incarnation ends the room or is known gone; then, as any peer
that is gone, its agent is removed (``remove_remote_agent``), so restarts leave remote
agents flat (:func:`~pdserve.disagg.nixl.agent.peer_life.forget_agent`). The heartbeat (:meth:`PrefillPeers.heartbeat`:
one ``GET /health`` per prefill bootstrap server, judging every peer and suspect of it)
declares peers dead or gone. Used by the bootstrap thread (``peer_for``) and the heartbeat
thread (``heartbeat``); ``stats`` by whoever reads the manager's stats.
"""

from __future__ import annotations

import base64
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import httpx

from pdserve.disagg.base import HEARTBEAT_LOST, PEER_RESTARTED, RoomTable
from pdserve.disagg.bootstrap import BootstrapClient, BootstrapError
from pdserve.disagg.nixl.agent.peer_life import forget_agent
from pdserve.disagg.nixl.decode.receiver import NixlReceiver, PrefillPeer
from pdserve.disagg.wire import RankInfo

if TYPE_CHECKING:
    from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine


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
