"""Decode's notification poller (pdserve/disagg/nixl/notif_poll.py), driven step by step
with a fake clock and recorded waits: no thread, no timing."""

from __future__ import annotations

import threading

from pdserve.disagg.nixl import notif_poll
from pdserve.disagg.nixl.notif_poll import NotifPoller


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
    clock, calls = Clock(), []
    wake = RecordingEvent()
    poller = NotifPoller(
        lambda: notifs.pop(0) if notifs else False,
        transferring,
        wake,
        on_host,
        sleep=lambda s: calls.append(("sleep", s)),
        yield_=lambda: calls.append(("yield", None)),
        clock=clock,
    )
    return poller, clock, calls, wake


def test_on_vram_a_transferring_room_is_polled_back_to_back_however_long_it_waits():
    poller, clock, calls, wake = _poller(on_host=False, notifs=[])
    for _ in range(50):
        poller.step()
        clock.now += 0.01  # 0.5 s without a notification: a long prefill
    assert calls == [("yield", None)] * 50  # never a sleep, never a back-off
    assert wake.waits == []


def test_on_host_memory_the_poll_sleeps_and_backs_off_as_before():
    poller, clock, calls, _ = _poller(on_host=True, notifs=[])
    poller.step()  # just after activity: back to back (sleep(0))
    clock.now += notif_poll.NOTIF_SPIN_S * 2
    poller.step()
    clock.now += notif_poll.HOST_BACKOFF_AFTER_S
    poller.step()
    assert calls == [
        ("sleep", 0),
        ("sleep", notif_poll.HOST_BACKOFF_S[0]),
        ("sleep", notif_poll.HOST_BACKOFF_S[1]),
    ]


def test_on_host_memory_a_notification_or_a_destination_restarts_the_spin():
    notifs = [False, True, False]
    poller, clock, calls, wake = _poller(on_host=True, notifs=notifs)
    clock.now += 1.0
    poller.step()  # quiet for 1 s: backed off
    clock.now += 1.0
    poller.step()  # a notification came: spin again
    clock.now += 1.0
    wake.set()  # a destination went out
    poller.step()
    assert [s for _, s in calls] == [notif_poll.HOST_BACKOFF_S[1], 0, 0]


def test_no_room_transferring_waits_for_a_destination_and_never_loses_one():
    """A destination sent while the poller looks at the rooms (after the look, before the
    wait) leaves the wake event set: the wait returns at once instead of sleeping
    IDLE_WAIT_S while that room's notification may already be there."""
    wake_box: list[threading.Event] = []

    def transferring() -> bool:  # the room is not transferring yet when looked at ...
        wake_box[0].set()  # ... and its destination goes out right then
        return False

    poller, _, calls, wake = _poller(on_host=False, notifs=[], transferring=transferring)
    wake_box.append(wake)
    poller.step()
    assert wake.waits == [(True, notif_poll.IDLE_WAIT_S)]  # set: a real wait returns at once
    assert calls == []


def test_idle_poller_waits_on_the_event_with_the_idle_bound():
    poller, _, calls, wake = _poller(on_host=False, notifs=[], transferring=lambda: False)
    poller.step()
    assert wake.waits == [(False, notif_poll.IDLE_WAIT_S)] and calls == []


def test_run_stops_when_told():
    stop = threading.Event()
    steps = []
    poller, _, _, _ = _poller(on_host=False, notifs=[])
    poller.step = lambda: (steps.append(1), stop.set())  # type: ignore[method-assign]
    poller.run(stop)
    assert steps == [1]
