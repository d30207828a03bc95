"""``AsyncEngine``: runs ``EngineCore.step()`` in ONE dedicated engine thread and connects
it to the asyncio event loop of the HTTP server.

Requests and aborts go in through a thread-safe queue; each engine request's outputs come
back through ``loop.call_soon_threadsafe`` to a per-request callback on the event loop,
so the HTTP loop never waits on a forward pass. When idle the thread blocks on the input
queue; while a step runs the model (a prefill chunk that emits nothing counts too) or
emits output, the next step follows at once; while requests are unfinished but nothing
could be scheduled (only KV transfer rooms pending) it waits on the queue for
``idle_poll_interval`` seconds between steps, polling the rooms without spinning. If the
thread dies, or the engine reports a ``failure`` (a tensor-parallel rank is gone, noticed
even while idle), ``alive`` turns False (``/health`` then answers 503) and every live
request gets the error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pdserve.server")

# sink(item): called on the event loop with a RequestOutput or an Exception (add failed,
# or the engine thread died).
Sink = Callable[[Any], None]


class EngineDeadError(RuntimeError):
    """The engine thread is not running; the message says why it stopped."""


class _EngineFailed(Exception):
    """Ends the engine thread's loop: the engine reports a ``failure`` (already logged)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters published after every step (read by /health, /metrics, server info)."""

    num_free_pages: int = 0
    stats: dict | None = None
    steps: int = 0
    time: float = 0.0


class AsyncEngine:
    """Owns the engine thread of one worker. ``core`` is an ``EngineCore`` (only ever
    touched from the engine thread after :meth:`start`)."""

    def __init__(self, core: Any, *, idle_poll_interval: float = 0.002) -> None:
        self.core = core
        self._idle = idle_poll_interval
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: str | None = None
        self.snapshot = EngineSnapshot(num_free_pages=core.num_free_pages, stats=_safe_stats(core))

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to finish and join it, then shut the engine's ranks down
        (``core.shutdown``: a tensor-parallel engine's rank processes); idempotent."""
        self._stopping = True
        self._inbox.put(("stop",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        shutdown = getattr(self.core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    @property
    def error(self) -> str | None:
        """Why the engine does not serve (its thread died, or a tensor-parallel rank is
        gone: ``core.failure``), or None."""
        return self._error or getattr(self.core, "failure", None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # --- requests (called on the event loop) --------------------------------------------
    def add(
        self, request_id: str, prompt_token_ids: list[int], params: Any, disagg: Any, sink: Sink
    ) -> None:
        """Queue one single-sample engine request; ``sink`` gets its outputs (or the
        ValueError / DuplicateRoomError of ``add_request``) on the event loop.
        Raises EngineDeadError at once if the engine thread is not running."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error or 'not started'}")
        self._inbox.put(("add", request_id, prompt_token_ids, params, disagg, sink))

    def abort(self, request_id: str) -> None:
        """Abort one engine request (no-op if it already finished)."""
        self._inbox.put(("abort", request_id))

    # --- engine thread ------------------------------------------------------------------
    def _deliver(self, sink: Sink, item: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(sink, item)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, disagg, sink = command
            try:
                self.core.add_request(request_id, prompt, params, disagg=disagg)
            except Exception as exc:  # noqa: BLE001 ValueError / DuplicateRoomError: that request only
                self._deliver(sink, exc)
                return
            self._sinks[request_id] = sink
        elif kind == "abort":
            if self._sinks.pop(command[1], None) is not None:
                self.core.abort_request(command[1])
        elif kind == "stop":
            self._stopping = True

    def _drain(self, timeout: float | None) -> None:
        """Handle every queued command; block up to ``timeout`` (None = forever) for the first."""
        try:
            self._handle(
                self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _run(self) -> None:
        progressed = True
        try:
            while not self._stopping:
                if not self.core.has_unfinished_requests():
                    self._drain(None)  # idle: sleep until a request (or stop) arrives
                else:
                    self._drain(0 if progressed else self._idle)
                if self._stopping:
                    break
                steps_before = self.core.num_steps
                outputs = self.core.step()
                stats = _safe_stats(self.core)
                # A chunked-prefill step emits nothing while work remains: the model having run
                # (EngineCore.num_steps moved) is progress too, so no idle wait.
                progressed = bool(outputs) or self.core.num_steps != steps_before
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is None:
                        continue  # aborted by the client
                    if out.finished:
                        del self._sinks[out.request_id]
                    self._deliver(sink, out)
                self.snapshot = EngineSnapshot(
                    self.core.num_free_pages, stats, self.snapshot.steps + 1, time.time()
                )
                failure = getattr(self.core, "failure", None)
                if failure is not None:  # a rank is gone: its requests ended with an error
                    raise _EngineFailed(failure)
        except BaseException as exc:  # the worker turns unhealthy; every caller learns why
            # A rank that is gone is the cause (core.failure names it); else the exception.
            self._error = getattr(self.core, "failure", None) or (
                f"engine thread died: {type(exc).__name__}: {exc}"
            )
            if not isinstance(exc, _EngineFailed):  # the executor logged its failure once
                log.exception("engine thread died")
            for sink in self._sinks.values():
                self._deliver(sink, EngineDeadError(self.error))
            self._sinks.clear()
        finally:
            self._abort_all_on_stop()

    def _abort_all_on_stop(self) -> None:
        reason = self.error or "worker is shutting down"
        while True:  # requests still queued get an answer too
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._deliver(command[5], EngineDeadError(reason))
        if self.error is None:
            for request_id, sink in list(self._sinks.items()):
                try:
                    self.core.abort_request(request_id)
                except Exception:  # noqa: BLE001 shutting down: best effort
                    pass
                self._deliver(sink, EngineDeadError("worker is shutting down"))
            self._sinks.clear()


def _safe_stats(core: Any) -> dict | None:
    try:
        return dict(core.stats())
    except Exception:  # noqa: BLE001 stats are best effort
        return None
