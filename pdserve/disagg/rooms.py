"""What every backend's rooms share: the live-room table, failure kinds, failure injection,
and the terminal-state bookkeeping of one sender/receiver."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from typing import Any, Generic, TypeVar

from pdserve.disagg.base import DuplicateRoomError, KVPoll, KVTransferError, Role
from pdserve.disagg.metrics import TransferMetrics

log = logging.getLogger(__name__)

# Failure kinds: the label of the "failed transfers by reason" metric.
BOOTSTRAP_TIMEOUT = "bootstrap_timeout"  # prefill: decode's destination never came
WAITING_TIMEOUT = "waiting_timeout"  # decode: the KV cache never came
HEARTBEAT_LOST = "heartbeat_lost"  # decode: the prefill peer stopped answering
PEER_RESTARTED = "peer_restarted"  # the peer came back as a new instance
PEER_FAILED = "peer_failed"  # the other side failed or aborted the room
LAYOUT_MISMATCH = "layout_mismatch"  # KVLayout fields differ
PROTOCOL_MISMATCH = "protocol_mismatch"  # PROTOCOL_VERSION differs
BOOTSTRAP_ERROR = "bootstrap_error"  # bootstrap server unreachable / bad answer
TRANSFER_ERROR = "transfer_error"  # NIXL reported an error
ABORTED = "aborted"  # abort() by the engine
INJECTED = "injected"  # PDSERVE_TEST_DISAGG_FAILURE_PROB
SHUTDOWN = "shutdown"  # the manager shut down

_TERMINAL = (KVPoll.Success, KVPoll.Failed)

H = TypeVar("H", bound="RoomHandle")


class FailureInjector:
    """Testing only: ``roll()`` is True with probability ``prob`` (a manager's
    ``TransferConfig.failure_prob``: ``PDSERVE_TEST_DISAGG_FAILURE_PROB``; 0 = never).

    ``poll()`` rolls once per non-terminal state it reports for the first time (so at most
    three times per room), not once per call: the engine polls every step, and a per-call
    probability would fail nearly every room whatever its value."""

    def __init__(self, prob: float = 0.0, seed: int | None = None) -> None:
        self.prob = prob
        if not 0.0 <= self.prob <= 1.0:
            raise ValueError(f"PDSERVE_TEST_DISAGG_FAILURE_PROB must be in [0, 1], got {self.prob}")
        self._rng = random.Random(seed)

    def roll(self) -> bool:
        return self.prob > 0.0 and self._rng.random() < self.prob


class RoomTable(Generic[H]):
    """Live rooms of one manager, by room id; a room stays live until ``close()``."""

    def __init__(self, role: Role) -> None:
        self._role = role
        self._lock = threading.Lock()
        self._rooms: dict[int, H] = {}

    def add(self, room: int, handle: H) -> None:
        with self._lock:
            if room in self._rooms:
                raise DuplicateRoomError(
                    f"bootstrap_room {room} is still live on this {self._role} worker"
                )
            self._rooms[room] = handle

    def get(self, room: int) -> H | None:
        with self._lock:
            return self._rooms.get(room)

    def discard(self, room: int, handle: H) -> None:
        with self._lock:
            if self._rooms.get(room) is handle:
                del self._rooms[room]

    def handles(self) -> list[H]:
        with self._lock:
            return list(self._rooms.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    def count_by_state(self) -> dict[str, int]:
        counts = Counter(h.poll_state().name for h in self.handles())
        return {s.name: counts.get(s.name, 0) for s in KVPoll}

    def stats(self, metrics: TransferMetrics, backend: str) -> dict[str, Any]:
        """The head every manager's ``stats()`` starts with: the transfer counters, the
        role and backend, live rooms by state and in all."""
        return dict(
            metrics.snapshot(),
            role=str(self._role),
            backend=backend,
            rooms=self.count_by_state(),
            live_rooms=len(self),
        )


class RoomHandle:
    """State of one room on one side. Subclasses move ``_state`` forward under ``_lock``
    and call :meth:`_finish_failed` / :meth:`_finish_success` to end it (exactly once)."""

    def __init__(
        self, room: int, table: RoomTable, metrics: TransferMetrics, injector: FailureInjector
    ) -> None:
        self.room = room
        self._table = table
        self._metrics = metrics
        self._injector = injector
        self._lock = threading.RLock()
        self._state = KVPoll.Bootstrapping
        self._error: KVTransferError | None = None
        self._closed = False
        self._rolled: KVPoll | None = None  # last state failure injection rolled for
        # time.perf_counter() when the room turned terminal here (CLOCK_MONOTONIC: benchmarks
        # compare it across processes of one host)
        self.finished_at: float | None = None

    # --- subclass hooks -----------------------------------------------------------
    def _tick(self) -> None:
        """Check deadlines (called by ``poll``)."""

    def _fail(self, reason: str, kind: str) -> None:
        """Start failing the room; by default at once (no pages at the peer's disposal)."""
        self._finish_failed(reason, kind)

    # --- shared -------------------------------------------------------------------
    def poll_state(self) -> KVPoll:
        return self._state

    def is_terminal(self) -> bool:
        return self._state in _TERMINAL

    def poll(self) -> KVPoll:
        """Current state; never blocks. May inject a failure (same path as a real one)."""
        self._tick()
        state = self._state
        if state not in _TERMINAL and state != self._rolled:
            self._rolled = state
            if self._injector.roll():
                self._fail(
                    f"injected failure of room {self.room} (PDSERVE_TEST_DISAGG_FAILURE_PROB)",
                    INJECTED,
                )
        return self._state

    def failure_exception(self) -> Exception | None:
        return self._error if self._state == KVPoll.Failed else None

    def abort(self) -> None:
        """Ask for termination; ``poll()`` reports ``Failed`` once nothing can touch the pages."""
        with self._lock:
            if self._state not in _TERMINAL:
                self._fail(f"room {self.room} aborted", ABORTED)

    def close(self) -> None:
        """Release the room id (once, after a terminal poll). RuntimeError on a second call."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"close() called twice for room {self.room}")
            if self._state not in _TERMINAL:
                log.error("room %d closed before a terminal poll; aborting it", self.room)
                self._fail(f"room {self.room} closed before it ended", ABORTED)
            self._closed = True
        self._table.discard(self.room, self)

    def _finish_failed(self, reason: str, kind: str) -> bool:
        """Make the room terminal ``Failed``; False if it already was terminal."""
        with self._lock:
            if self._state in _TERMINAL:
                return False
            self.finished_at = time.perf_counter()
            self._state = KVPoll.Failed
            self._error = KVTransferError(reason)
        self._metrics.record_failure(kind)
        log.debug("room %d failed (%s): %s", self.room, kind, reason)
        return True

    def _finish_success(self, nbytes: int, npages: int, seconds: float) -> bool:
        with self._lock:
            if self._state in _TERMINAL:
                return False
            self.finished_at = time.perf_counter()
            self._state = KVPoll.Success
        self._metrics.record_success(nbytes, npages, seconds)
        return True


class ServiceThreads:
    """Named daemon background threads of one manager. A thread whose loop raises is
    logged and stays dead, which makes :meth:`healthy` False (the worker reports
    unhealthy instead of being silently broken)."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self.stop_event = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def start(self, name: str, loop) -> None:
        """Run ``loop(stop_event)`` on a new daemon thread named ``{owner}-{name}``."""

        def run() -> None:
            try:
                loop(self.stop_event)
            except BaseException as exc:
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                log.exception("%s background thread %s died", self._owner, name)

        thread = threading.Thread(target=run, name=f"{self._owner}-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def healthy(self) -> bool:
        return not self.errors and all(t.is_alive() for t in self._threads)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stop_event.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout_s)
