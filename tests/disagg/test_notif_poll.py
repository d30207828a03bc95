"""Decode's notification poller (NotifPoller of pdserve/disagg/nixl/decode/manager.py), driven step by step
with recorded waits: no thread, no timing."""

from __future__ import annotations

import threading

from pdserve.disagg.nixl.decode import manager
from pdserve.disagg.nixl.decode.manager import NotifPoller


class RecordingEvent(threading.Event):
    """An event whose ``wait`` never blocks: it records whether it was set (a real wait
    would have returned at once) and the timeout asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[bool, float | None]] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append((self.is_set(), timeout))
        return self.is_set()


def _poller(on_host: bool, notifs: list[bool], transferring=lambda: True):
    calls: list[tuple[str, float | None]] = []
    wake = RecordingEvent()
    poller = NotifPoller(
        lambda: notifs.pop(0) if notifs else False,
        transferring,
        wake,
        on_host,
        sleep=lambda s: calls.append(("sleep", s)),
        yield_=lambda: calls.append(("yield", None)),
    )
    return poller, calls, wake


def test_on_vram_a_transferring_room_is_polled_back_to_back_however_long_it_waits():
    notifs = [False] * 49 + [True]  # a long prefill, then its notification
    poller, calls, wake = _poller(on_host=False, notifs=notifs)
    for _ in range(60):
        poller.step()
    assert calls == [("yield", None)] * 60  # never a sleep, never a back-off
    assert wake.waits == []


def test_on_host_memory_a_transferring_room_is_read_every_host_poll_s():
    """Host memory: a CPU does the copy while decode waits, so decode reads at a calm,
    fixed cadence, from the first read on (no spin after a destination or a notification)."""
    poller, calls, wake = _poller(on_host=True, notifs=[False, True, False])
    wake.set()  # a destination just went out
    for _ in range(3):
        poller.step()
    assert calls == [("sleep", manager.HOST_POLL_S)] * 3
    assert manager.HOST_POLL_S >= 100e-6  # not a spin: each wake-up costs the copy CPU


def test_no_room_transferring_waits_for_a_destination_and_never_loses_one():
    """A destination sent while the poller looks at the rooms (after the look, before the
    wait) leaves the wake event set: the wait returns at once instead of sleeping
    IDLE_WAIT_S while that room's notification may already be there."""
    wake_box: list[threading.Event] = []

    def transferring() -> bool:  # the room is not transferring yet when looked at ...
        wake_box[0].set()  # ... and its destination goes out right then
        return False

    poller, calls, wake = _poller(on_host=False, notifs=[], transferring=transferring)
    wake_box.append(wake)
    poller.step()
    assert wake.waits == [(True, manager.IDLE_WAIT_S)]  # set: a real wait returns at once
    assert calls == []


def test_idle_poller_waits_on_the_event_with_the_idle_bound():
    poller, calls, wake = _poller(on_host=False, notifs=[], transferring=lambda: False)
    poller.step()
    assert wake.waits == [(False, manager.IDLE_WAIT_S)] and calls == []


def test_run_stops_when_told():
    stop = threading.Event()
    steps = []
    poller, _, _ = _poller(on_host=False, notifs=[])
    poller.step = lambda: (steps.append(1), stop.set())  # type: ignore[method-assign]
    poller.run(stop)
    assert steps == [1]
