"""One :class:`KVManager` for the engine over the per-rank managers of a tensor-parallel
worker (every rank has its own NIXL agent, pool and rooms).

Rank side: :mod:`pdserve.disagg.tp_rank` (its docstring; re-exported here).

Engine side: :class:`TPKVManager` fans ``create``/``init``/``send``/``abort``/``close`` out
to a room's ranks (decode: every rank; prefill: the writers,
:func:`pdserve.disagg.bootstrap.is_writer`) and aggregates their states: ``Success`` when
every rank succeeded; ``Failed`` when one failed (named), reported only once every rank of
the room is terminal (the others are aborted first; the room reads ``Bootstrapping``
meanwhile), so no rank's pages are freed while its transfer layer may use them; else the
least advanced state. ``holds_pages`` if any rank holds; the aux record comes from rank 0.
One engine step's polls cost one call per rank (the first ``poll()`` of an already read
room refreshes every live room on every rank).

A rank that is gone (the executor failed) counts as ``Failed`` for its rooms. A watcher
thread notices the failure even while the engine is idle: rank 0 then aborts its live
rooms and, on prefill, deregisters ranks >= 1 at its bootstrap server, so decode's
heartbeat fails their rooms at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from pdserve.disagg.base import (
    AuxRecord,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
    Role,
    pd_role,
)
from pdserve.disagg.bootstrap import is_writer
from pdserve.disagg.tp_rank import RankRooms, RankState, RemoteRank, rank_call, start_rank_manager
from pdserve.disagg.transfer_config import TransferConfig
from pdserve.parallel import TPRank

__all__ = [
    "RankRooms",
    "RankState",
    "RemoteRank",
    "TPKVManager",
    "create_tp_kv_manager",
    "rank_call",
    "start_rank_manager",
]

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2  # how often the facade checks whether ranks >= 1 are gone


def create_tp_kv_manager(
    executor: Any,
    backend: str,
    role: str,
    total_kv_heads: int,
    cfg: TransferConfig,
) -> TPKVManager:
    """Start a manager in every rank of ``executor`` (``call_rank``, ``tp_size``,
    ``failure``, ``rank0``: tpexec's executor; rank 0 first: on prefill its bootstrap port
    goes to the others) and return the facade over them. ``cfg``: the worker's transfer
    settings, sent to every rank (pickled by ``call_rank``), so no rank reads the
    environment. Raises what a rank's manager creation raises (the managers already
    started are shut down first)."""
    started: list[int] = []
    try:
        port = executor.call_rank(0, start_rank_manager, backend, role, total_kv_heads, cfg)
        started.append(0)
        rank0 = replace(cfg, bootstrap=replace(cfg.bootstrap, port=port or 0))
        for r in range(1, executor.tp_size):
            executor.call_rank(r, start_rank_manager, backend, role, total_kv_heads, rank0)
            started.append(r)
    except BaseException:
        for r in reversed(started):
            try:
                executor.call_rank(r, rank_call, "shutdown")
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
        raise
    ranks = [executor.rank0.services["kv"]] + [
        RemoteRank(executor.call_rank, r) for r in range(1, executor.tp_size)
    ]
    return TPKVManager(ranks, role, total_kv_heads, lambda: executor.failure)


class _Room(KVSender, KVReceiver):
    """The engine's handle of one room over its ranks (see module doc)."""

    def __init__(self, mgr: TPKVManager, room: int, ranks: list[int]) -> None:
        self._mgr, self.room, self.ranks = mgr, room, ranks
        self._aborted = False
        self._closed = False
        self.first_failure: tuple[int, str | None] | None = None  # the rank that failed first

    # --- KVSender / KVReceiver --------------------------------------------------------
    def init(self, *args: Any, **kwargs: Any) -> None:
        if self._mgr.role == Role.DECODE:
            dst_pages, aux_slot = args[0], args[1]
            skip = kwargs.get("skip_pages", args[2] if len(args) > 2 else 0)
            args = (list(dst_pages), aux_slot, skip)
        else:
            args = (
                args[0] if args else kwargs["num_pages"],
                args[1] if len(args) > 1 else kwargs["aux_slot"],
            )
        self._mgr._fan(self, "init", *args)

    def send(self, page_ids: list[int], *, last: bool, aux: AuxRecord | None = None) -> None:
        if last and aux is None or not last and aux is not None:
            raise ValueError("aux is required with last=True and only then")
        self._mgr._fan(self, "send", list(page_ids), last, aux)

    def poll(self) -> KVPoll:
        return self._mgr._aggregate(self, consume=True)[0]

    def failure_exception(self) -> Exception | None:
        state, error = self._mgr._aggregate(self, consume=False)
        return KVTransferError(error) if state == KVPoll.Failed else None

    def holds_pages(self) -> bool:
        return any(holds for _, _, holds in self._mgr._states(self))

    def aux_record(self) -> AuxRecord:
        if self._mgr._aggregate(self, consume=False)[0] != KVPoll.Success:
            raise KVTransferError(f"room {self.room} has no aux record before Success")
        return self._mgr.ranks[0].aux_record(self.room)

    def abort(self) -> None:
        self._aborted = True
        self._mgr._fan(self, "abort")

    def close(self) -> None:
        if self._closed:
            raise RuntimeError(f"close() called twice for room {self.room}")
        self._closed = True
        self._mgr._close(self)


class TPKVManager(KVManager):
    """The engine's KV manager of a TP worker (module doc).

    ranks: the :class:`RankRooms` of rank 0 (local) and stubs of the others
    (:class:`RemoteRank`), rank order; role: ``prefill`` or ``decode``; num_kv_heads: the
    model's KV heads (which prefill ranks write); failure: the executor's ``failure``
    (why its ranks >= 1 are gone, or None).
    """

    def __init__(
        self,
        ranks: Sequence[Any],
        role: str,
        num_kv_heads: int,
        failure: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.role = pd_role(role)
        self.ranks = list(ranks)
        self._failure = failure
        self._gone: str | None = None
        size = len(self.ranks)
        self._room_ranks = (
            [r for r in range(size) if is_writer(num_kv_heads, TPRank(r, size))]
            if self.role == Role.PREFILL
            else list(range(size))
        )
        self._rooms: dict[int, _Room] = {}
        self._cache: dict[int, list[RankState]] = {}
        self._fresh: set[int] = set()
        self._healthy = [True] * size  # ranks' manager health, as of their last answer
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if size > 1:
            self._watcher = threading.Thread(
                target=self._watch, name=f"pdserve-tp-kv-{role}", daemon=True
            )
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            if self._check_gone() is not None:
                return

    # --- rank calls --------------------------------------------------------------------
    def _check_gone(self) -> str | None:
        with self._lock:
            if self._gone is not None or self._failure() is None:
                return self._gone
            self._gone = self._failure()
            rooms = list(self._rooms)
        log.error("KV ranks >= 1 are gone: %s", self._gone)
        if self.role == Role.PREFILL:  # decode's heartbeat learns it from rank 0's server
            for r in range(1, len(self.ranks)):
                self.ranks[0].forget_rank(r)
        for room in rooms:  # their peers are told now, not at their timeouts
            try:
                self.ranks[0].abort(room)
            except Exception:  # noqa: BLE001 - rank 0 only holds some of them
                pass
        return self._gone

    def _on_rank(self, rank: int, method: str, *args: Any) -> Any:
        """Call a rank; None when rank >= 1 is gone (then also returned for its calls)."""
        if rank == 0:
            return getattr(self.ranks[0], method)(*args)
        if self._check_gone() is not None:
            return None
        try:
            return getattr(self.ranks[rank], method)(*args)
        except Exception:
            if self._check_gone() is not None:
                return None
            raise

    def _fan(self, room: _Room, method: str, *args: Any) -> None:
        for r in room.ranks:
            self._on_rank(r, method, room.room, *args)
        with self._lock:
            self._fresh.discard(room.room)  # the states moved: read them again

    # --- KVManager ---------------------------------------------------------------------
    def create_sender(self, bootstrap_room: int) -> KVSender:
        if self.role != Role.PREFILL:
            raise RuntimeError("create_sender on a decode KV manager")
        return self._create(bootstrap_room)

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int
    ) -> KVReceiver:
        if self.role != Role.DECODE:
            raise RuntimeError("create_receiver on a prefill KV manager")
        return self._create(bootstrap_room, bootstrap_host, bootstrap_port)

    def _create(self, room: int, *where: Any) -> _Room:
        handle = _Room(self, room, self._room_ranks)
        self.ranks[0].create(room, *where)  # DuplicateRoomError/ValueError before the others
        made = [0]
        try:
            for r in self._room_ranks[1:]:
                self._on_rank(r, "create", room, *where)
                made.append(r)
        except BaseException:
            for r in made:  # undo: the room never existed
                self._on_rank(r, "abort", room)
            raise
        with self._lock:
            self._rooms[room] = handle
        return handle

    def _close(self, room: _Room) -> None:
        for r in room.ranks:
            self._on_rank(r, "close", room.room)
        with self._lock:
            self._rooms.pop(room.room, None)
            self._cache.pop(room.room, None)
            self._fresh.discard(room.room)

    # --- aggregation -------------------------------------------------------------------
    def _refresh(self) -> None:
        """Poll every live room on every rank: one call per rank."""
        with self._lock:
            rooms = list(self._rooms)
        states: dict[int, list[RankState]] = {room: [] for room in rooms}
        for r in range(len(self.ranks)):
            mine = [room for room in rooms if r in self._rooms[room].ranks]
            if not mine:
                continue
            answer = self._on_rank(r, "poll_all", mine)
            if answer is None:
                got = [(int(KVPoll.Failed), f"the rank is gone: {self._gone}", False)] * len(mine)
            else:
                got, self._healthy[r] = answer
            for room, st in zip(mine, got):
                states[room].append(st)
        with self._lock:
            self._cache.update(states)
            self._fresh = set(states)

    def _states(self, room: _Room) -> list[RankState]:
        with self._lock:
            cached = self._cache.get(room.room)
        if cached is None:
            self._refresh()
            with self._lock:
                cached = self._cache.get(room.room, [])
        return cached

    def _aggregate(self, room: _Room, consume: bool) -> tuple[KVPoll, str | None]:
        with self._lock:
            stale = room.room not in self._fresh
        if consume and stale:
            self._refresh()
        states = self._states(room)
        if consume:
            with self._lock:
                self._fresh.discard(room.room)
        kinds = [KVPoll(s) for s, _, _ in states]
        failed = [(r, e) for r, (s, e, _) in zip(room.ranks, states) if s == KVPoll.Failed]
        if failed and room.first_failure is None:
            room.first_failure = failed[0]
        if failed:
            if not all(k in (KVPoll.Success, KVPoll.Failed) for k in kinds):
                if not room._aborted:  # the others end too, then the room is Failed
                    room.abort()
                return KVPoll.Bootstrapping, None  # nothing starts while it fails
            r, error = room.first_failure or failed[0]
            return KVPoll.Failed, f"tensor-parallel rank {r}: {error}"
        return min(kinds), None

    # --- the rest of KVManager -------------------------------------------------------------
    def set_wakeup(self, wakeup: Callable[[], None] | None) -> bool:
        """Rank 0's manager (in this process) calls ``wakeup`` each time one of its rooms
        moves to a state the engine acts on (:meth:`KVManager.set_wakeup`), so an idle
        engine polls the room at once; the ranks >= 1 live in other processes, and a room
        they still hold back is found by the engine's idle poll (``idle_poll_interval``).
        Returns what rank 0's manager returns (False: it cannot wake the engine)."""
        return bool(self.ranks[0].manager.set_wakeup(wakeup))

    def is_healthy(self) -> bool:
        """Rank 0's manager is healthy, no rank is gone, and ranks >= 1 were healthy at
        their last answer (a poll or ``stats``: no call here, so ``/health`` never waits
        for a step to end)."""
        return self.ranks[0].is_healthy() and self._check_gone() is None and all(self._healthy)

    def stats(self) -> dict[str, Any]:
        """Rank 0's stats, ``ranks``: each rank's (None once gone), ``healthy`` over all,
        and ``unhealthy_prefill_peers`` merged over the ranks (decode)."""
        per = [self.ranks[0].stats()] + [
            self._on_rank(r, "stats") for r in range(1, len(self.ranks))
        ]
        for r, s in enumerate(per[1:], 1):
            if s is not None:
                self._healthy[r] = bool(s.get("healthy", True))
        out = dict(per[0], ranks=per, healthy=self.is_healthy())
        if self.role == Role.DECODE:
            merged: dict[str, float] = {}
            for s in per:
                for k, v in (s or {}).get("unhealthy_prefill_peers", {}).items():
                    merged[k] = max(merged.get(k, 0.0), v)
            out["unhealthy_prefill_peers"] = merged
        return out

    def shutdown(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5.0)
        for r in range(len(self.ranks) - 1, -1, -1):  # rank 0 (the bootstrap server) last
            try:
                self._on_rank(r, "shutdown")
            except Exception as exc:  # noqa: BLE001 - e.g. the rank processes ended first
                log.info("KV manager of rank %d: not shut down here: %s", r, exc)

    @property
    def bootstrap_port(self) -> int | None:
        return self.ranks[0].bootstrap_port()

    def num_live_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)
