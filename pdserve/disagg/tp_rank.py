"""The rank side of the tensor-parallel KV facade (:mod:`pdserve.disagg.tp`): one rank's
own manager and its rooms by room id (:class:`RankRooms`), the functions a rank process
runs through the executor's ``call_rank(r, fn, *args)`` (:func:`start_rank_manager`,
:func:`rank_call`; the rank keeps its :class:`RankRooms` in ``ctx.services["kv"]``), and
the engine-side proxy of a rank >= 1 (:class:`RemoteRank`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.disagg.base import AuxRecord, KVManager, KVPoll, KVReceiver, KVSender, Role
from pdserve.disagg.transfer_config import TransferConfig

# (state, failure text, holds_pages) of one room on one rank
RankState = tuple[int, str | None, bool]


class RankRooms:
    """The rooms of one rank's manager, by room id (module doc). Thread-safe."""

    def __init__(self, manager: KVManager) -> None:
        self.manager = manager
        self._handles: dict[int, KVSender | KVReceiver] = {}
        self._lock = threading.Lock()

    def _get(self, room: int) -> Any:
        with self._lock:
            return self._handles[room]

    def create(self, room: int, host: str | None = None, port: int | None = None) -> None:
        """A sender (prefill) or a receiver of ``host:port`` (decode) for ``room``."""
        if self.manager.role == Role.PREFILL:
            handle: KVSender | KVReceiver = self.manager.create_sender(room)
        else:
            assert host is not None and port is not None  # decode rooms name their prefill
            handle = self.manager.create_receiver(host, port, room)
        with self._lock:
            self._handles[room] = handle

    def init(self, room: int, *args: Any) -> None:
        self._get(room).init(*args)

    def send(self, room: int, pages: list[int], last: bool, aux: AuxRecord | None) -> None:
        self._get(room).send(pages, last=last, aux=aux)

    def abort(self, room: int) -> None:
        self._get(room).abort()

    def close(self, room: int) -> None:
        with self._lock:
            handle = self._handles.pop(room)
        handle.close()

    def poll_all(self, rooms: Sequence[int]) -> tuple[list[RankState], bool]:
        """:meth:`poll` and the manager's health, in one call."""
        return self.poll(rooms), self.manager.is_healthy()

    def poll(self, rooms: Sequence[int]) -> list[RankState]:
        """Every room's state; a poll that raises is ``Failed`` with its text (after a
        best-effort abort), as the engine treats a single manager."""
        out: list[RankState] = []
        for room in rooms:
            with self._lock:
                handle = self._handles.get(room)
            if handle is None:
                out.append((int(KVPoll.Failed), f"room {room} is not live on this rank", False))
                continue
            try:
                state = handle.poll()
                error = None
                if state == KVPoll.Failed:
                    exc = handle.failure_exception()
                    error = str(exc) if exc else "KV transfer failed"
                holds = bool(getattr(handle, "holds_pages", lambda: False)())
            except Exception as exc:  # noqa: BLE001 - reported as the room's failure
                try:
                    handle.abort()
                except Exception:  # noqa: BLE001
                    pass
                state, error, holds = (
                    KVPoll.Failed,
                    f"poll raised {type(exc).__name__}: {exc}",
                    True,
                )
            out.append((int(state), error, holds))
        return out

    def aux_record(self, room: int) -> AuxRecord:
        return self._get(room).aux_record()

    def is_healthy(self) -> bool:
        return self.manager.is_healthy()

    def stats(self) -> dict[str, Any]:
        return self.manager.stats()

    def forget_rank(self, engine_rank: int) -> None:
        forget = getattr(self.manager, "forget_rank", None)
        if forget is not None:
            forget(engine_rank)

    def bootstrap_port(self) -> int | None:
        return self.manager.bootstrap_port

    def shutdown(self) -> None:
        self.manager.shutdown()


# --- functions run in a rank process by ``call_rank`` (ctx: the executor's RankContext) ---
def start_rank_manager(
    ctx: Any,
    backend: str,
    role: str,
    total_kv_heads: int,
    cfg: TransferConfig,
) -> int | None:
    """Create this rank's manager over its pool (its KV heads of ``total_kv_heads``; its
    backend created on its own device, ``ctx.gpu_id``, by the backend's initialisation
    contract) with the worker's settings ``cfg`` and keep it in ``ctx.services["kv"]``.
    ``cfg.bootstrap.port``: rank 0's server for ranks >= 1. Returns the manager's
    bootstrap port."""
    from pdserve.disagg.registry import create_kv_manager

    tp = ctx.tp.tp  # the rank's TPGroup -> its TPRank
    args = ctx.storage.kv_args(
        gpu_id=ctx.gpu_id, engine_rank=tp.rank, tp_size=tp.size, total_kv_heads=total_kv_heads
    )
    manager = create_kv_manager(backend, args, role, cfg)
    ctx.services["kv"] = RankRooms(manager)
    return manager.bootstrap_port


def rank_call(ctx: Any, method: str, *args: Any) -> Any:
    """Run ``RankRooms.<method>(*args)`` on this rank's rooms."""
    return getattr(ctx.services["kv"], method)(*args)


class RemoteRank:
    """A rank >= 1's :class:`RankRooms`, through ``call(rank, fn, *args)`` (the executor's
    ``call_rank``): every method is one call."""

    def __init__(self, call: Callable[..., Any], rank: int) -> None:
        self._call, self.rank = call, rank

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self._call(self.rank, rank_call, method, *args)
