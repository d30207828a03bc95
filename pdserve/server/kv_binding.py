"""A KV manager slot that is bound after the engine exists.

``EngineCore`` takes its KV managers when it is built, but a manager needs the engine's
``KVPool.kv_args()`` (pool addresses), which exist only after the engine is built. The
worker therefore gives the engine a :class:`BoundKVManager` per backend and binds the real
manager into it right after; no request can arrive in between (the HTTP server starts later).
"""

from __future__ import annotations

from pdserve.disagg.base import KVManager, KVReceiver, KVSender


class BoundKVManager(KVManager):
    """Forwards every call to the manager given to :meth:`bind` (RuntimeError before)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.target: KVManager | None = None

    def bind(self, manager: KVManager) -> None:
        if manager.role != self.role:
            raise ValueError(f"role: the manager is {manager.role!r}, this slot is {self.role!r}")
        self.target = manager

    def _t(self) -> KVManager:
        if self.target is None:
            raise RuntimeError("KV manager used before it was bound")
        return self.target

    def create_sender(self, bootstrap_room: int) -> KVSender:
        return self._t().create_sender(bootstrap_room)

    def create_receiver(self, bootstrap_host: str, bootstrap_port: int, bootstrap_room: int) -> KVReceiver:
        return self._t().create_receiver(bootstrap_host, bootstrap_port, bootstrap_room)

    def is_healthy(self) -> bool:
        return self.target is not None and self.target.is_healthy()

    def stats(self) -> dict:
        return self._t().stats() if self.target is not None else {}

    def shutdown(self) -> None:
        if self.target is not None:
            self.target.shutdown()

    @property
    def bootstrap_port(self) -> int | None:
        return self.target.bootstrap_port if self.target is not None else None
