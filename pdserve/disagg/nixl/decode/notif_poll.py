"""Decode's notification thread: when it reads NIXL's completion notifications, and how it
waits between reads.

While a room is ``Transferring`` (its destination went out, its ``XferDone`` has not come)
the notifications are read:

- on VRAM, back to back with ``os.sched_yield`` between reads and no back-off, however
  long the prefill takes: the copy engines move the bytes and the CPU has nothing else to
  do for the room; ``time.sleep(0)`` would sleep the timer slack and a back-off put
  decode behind prefill on every room (figures: docs/benchmarks.md, "Notes moved from
  disagg docstrings");
- on host memory, every ``HOST_POLL_S``: there a CPU does the copy (UCX CMA, inside
  prefill's post) while decode waits, and each read of decode's takes CPU from that copy
  on a small machine; reading less often made large transfers faster and small ones no
  slower (figures: docs/benchmarks.md); a CPU engine polls its rooms once per step,
  milliseconds apart.

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

HOST_POLL_S = 250e-6  # host memory: the pause between reads while a room transfers
IDLE_WAIT_S = 0.02  # no room transferring: the longest wait for a wake-up


class NotifPoller:
    """The loop of decode's notification thread (module doc).

    drain: reads and handles the pending notifications, True if there were any;
    transferring: True while some room awaits its completion; wake: the event a sent
    destination sets; on_host: the KV pool is host memory. ``sleep`` and ``yield_`` are
    the waits, injectable for tests.
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
    ) -> None:
        self._drain = drain
        self._transferring = transferring
        self._wake = wake
        self.on_host = on_host
        self._sleep, self._yield = sleep, yield_

    def step(self) -> None:
        """One read of the notifications and the wait after it."""
        self._drain()
        self._wake.clear()  # before the look: a destination sent after it keeps it set
        if not self._transferring():
            self._wake.wait(IDLE_WAIT_S)
        elif self.on_host:
            self._sleep(HOST_POLL_S)
        else:
            self._yield()

    def run(self, stop: threading.Event) -> None:
        """Steps until ``stop`` is set."""
        while not stop.is_set():
            self.step()
