"""Decode's notification thread: when it reads NIXL's completion notifications, and how it
waits between reads.

While a room is ``Transferring`` (its destination went out, its ``XferDone`` has not come)
the notifications are read back to back:

- on VRAM, with ``os.sched_yield`` between reads and no back-off, however long the
  prefill takes: the copy engines move the bytes and the CPU has nothing else to do for
  the room; ``time.sleep(0)`` would sleep the timer slack (~50-60 us) and a back-off
  after a few ms put decode 0.1-0.3 ms behind prefill on every room (H200, main a8c6fea:
  a one-page room was ``Success`` on prefill 0.094 ms after ``send``, on decode 0.270 ms);
- on host memory, where a CPU does the copy (UCX CMA runs on prefill's posting thread) and
  a spinning reader takes a core of a small machine from it: ``time.sleep(0)`` (~60 us)
  for ``NOTIF_SPIN_S`` after the last notification or destination, then every
  ``HOST_BACKOFF_S[0]`` until ``HOST_BACKOFF_AFTER_S``, then every ``HOST_BACKOFF_S[1]``.

With no room transferring it waits on the manager's *wake* event (set when a destination
goes out) for at most ``IDLE_WAIT_S``, so late notifications still drain. The event is
cleared *before* the rooms are looked at: a destination sent between the look and the
wait leaves it set, and the wait returns at once (clearing it after the look lost that
wake-up and cost the room up to ``IDLE_WAIT_S``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

NOTIF_SPIN_S = 0.002  # host memory: back to back this long after activity
HOST_BACKOFF_AFTER_S = 0.05
HOST_BACKOFF_S = (50e-6, 250e-6)  # host memory: pauses before / after HOST_BACKOFF_AFTER_S
IDLE_WAIT_S = 0.02  # no room transferring: the longest wait for a wake-up


class NotifPoller:
    """The loop of decode's notification thread (module doc).

    drain: reads and handles the pending notifications, True if there were any;
    transferring: True while some room awaits its completion; wake: the event a sent
    destination sets; on_host: the KV pool is host memory. ``sleep``, ``yield_`` and
    ``clock`` (seconds, monotonic) are the waits and the clock, injectable for tests.
    """

    def __init__(
        self,
        drain: Callable[[], bool],
        transferring: Callable[[], bool],
        wake: threading.Event,
        on_host: bool,
        *,
        sleep: Callable[[float], None] = time.sleep,
        yield_: Callable[[], None] = os.sched_yield,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._drain = drain
        self._transferring = transferring
        self._wake = wake
        self.on_host = on_host
        self._sleep, self._yield, self._clock = sleep, yield_, clock
        self._active_at = clock()  # last notification or wake-up (host back-off)

    def step(self) -> None:
        """One read of the notifications and the wait after it."""
        got = self._drain()
        woke = self._wake.is_set()
        self._wake.clear()  # before the look: a destination sent after it keeps it set
        if self._transferring():
            if got or woke:
                self._active_at = self._clock()
            self._pause()
        else:
            self._wake.wait(IDLE_WAIT_S)
            self._active_at = self._clock()

    def _pause(self) -> None:
        if not self.on_host:
            self._yield()
            return
        quiet = self._clock() - self._active_at
        if quiet < NOTIF_SPIN_S:
            self._sleep(0)
        else:
            self._sleep(HOST_BACKOFF_S[0] if quiet < HOST_BACKOFF_AFTER_S else HOST_BACKOFF_S[1])

    def run(self, stop: threading.Event) -> None:
        """Steps until ``stop`` is set."""
        while not stop.is_set():
            self.step()
