"""The engine's wake-up on a room's state change (``KVManager.set_wakeup``): a room that
ends, or may be init'ed, calls it once from the transfer layer's thread, and the serving
thread waiting between polls (only rooms pending) steps at once instead of at its next
idle poll. Counted, not timed: the idle interval here is a minute."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from pdserve.disagg.base import FailureInjector, KVPoll, Role, RoomHandle, RoomTable
from pdserve.disagg.fake import FakeKVManager
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.nixl.decode.receiver import NixlReceiver, ReceiverContext
from pdserve.disagg.nixl.prefill.sender import DecodePeer, NixlSender, SenderContext
from pdserve.disagg.wire import RoomDest
from pdserve.parallel import TPRank
from pdserve.server.serving import AsyncEngine


def _table() -> tuple[RoomTable, list[int]]:
    table: RoomTable = RoomTable(Role.DECODE)
    calls: list[int] = []
    table.set_wakeup(lambda: calls.append(1))
    return table, calls


def test_a_room_ending_wakes_once_and_only_when_it_ends():
    table, calls = _table()
    ok = RoomHandle(1, table, TransferMetrics(), FailureInjector())
    assert ok.poll() == KVPoll.Bootstrapping and calls == []  # polls do not wake
    assert ok._finish_success(10, 1, 0.1) and calls == [1]
    assert not ok._finish_failed("late", "aborted") and calls == [1]  # already ended
    failed = RoomHandle(2, table, TransferMetrics(), FailureInjector())
    failed.abort()
    assert failed.poll() == KVPoll.Failed and calls == [1, 1]
    table.set_wakeup(None)
    RoomHandle(3, table, TransferMetrics(), FailureInjector())._finish_success(1, 1, 0.1)
    assert calls == [1, 1]


def test_a_manager_over_a_room_table_takes_the_wakeup():
    mgr = FakeKVManager(SimpleNamespace(), Role.DECODE)
    calls: list[int] = []
    assert mgr.set_wakeup(lambda: calls.append(1)) is True
    r = mgr.create_receiver("127.0.0.1", 1, 5)
    r.abort()
    assert r.poll() == KVPoll.Failed and calls == [1]


def test_a_decode_room_whose_writers_are_known_wakes_the_engine():
    table, calls = _table()
    ctx = ReceiverContext(
        table, TransferMetrics(), FailureInjector(), None, "d", True, 60.0, lambda p, m: None
    )
    r = NixlReceiver(7, ctx, "127.0.0.1", 1)
    r.bootstrapped({0: SimpleNamespace()})
    assert r.poll() == KVPoll.WaitingForInput and calls == [1]


def test_a_prefill_room_whose_destination_arrived_wakes_the_engine():
    table, calls = _table()
    engine = SimpleNamespace(num_aux_slots=4)
    ctx = SenderContext(
        table,
        TransferMetrics(),
        FailureInjector(),
        engine,
        TPRank(0, 1),
        60.0,
        lambda *a: None,
        lambda *a: None,
    )
    s = NixlSender(7, ctx)
    peer = DecodePeer("d", b"id", SimpleNamespace(), engine_rank=0)
    s.attach_dest(RoomDest(7, "p", "d", [3, 4], 0), peer, b"id", frozenset({0}))
    assert s.poll() == KVPoll.WaitingForInput and calls == [1]
    s.attach_dest(RoomDest(7, "p", "d", [3, 4], 0), peer, b"id", frozenset({0}))  # again
    assert calls == [1]


class RoomsPendingCore:
    """An engine with a request whose room never advances: every step emits nothing and
    runs no model, so the serving thread waits ``idle_poll_interval`` between steps."""

    num_free_pages = 10
    num_steps = 0

    def __init__(self) -> None:
        self.steps = 0
        self.stepped = threading.Event()
        self.wakeup = None

    def set_kv_wakeup(self, wakeup) -> None:
        self.wakeup = wakeup

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self):
        self.steps += 1
        self.stepped.set()
        return []

    def stats(self) -> dict:
        return {}


def test_the_serving_thread_steps_when_a_room_wakes_it_not_after_its_idle_interval():
    core = RoomsPendingCore()
    engine = AsyncEngine(core, idle_poll_interval=60.0)
    loop = asyncio.new_event_loop()
    try:
        engine.start(loop)
        assert core.wakeup == engine.wake  # installed on the managers at start
        assert core.stepped.wait(20)  # the first step, then a minute's idle wait
        for _ in range(3):
            core.stepped.clear()
            steps = core.steps
            threading.Thread(target=core.wakeup).start()  # a transfer-layer thread
            assert core.stepped.wait(20), "not woken: only the idle interval would end it"
            assert core.steps == steps + 1
    finally:
        engine.stop()
        loop.close()


def test_wakeups_before_the_engine_looks_are_one_item_in_its_queue():
    engine = AsyncEngine(RoomsPendingCore(), idle_poll_interval=60.0)
    for _ in range(100):
        engine.wake()
    assert engine._inbox.qsize() == 1
    engine._drain(0)
    engine.wake()
    assert engine._inbox.qsize() == 1
