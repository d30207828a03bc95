"""AsyncEngine with a stub EngineCore: outputs reach the event loop, aborts and add errors
are routed, a dying engine thread turns the engine unhealthy; the thread is always joined."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

import pytest

from pdserve.server.serving import AsyncEngine, EngineDeadError

pytestmark = pytest.mark.timeout(30)


@dataclass
class Out:
    request_id: str
    finished: bool
    step: int


@dataclass
class StubCore:
    """Each request finishes after ``steps`` steps; records the calling threads."""

    steps: int = 3
    fail_at_step: int | None = None
    live: dict = field(default_factory=dict)
    aborted: list = field(default_factory=list)
    threads: set = field(default_factory=set)
    num_free_pages: int = 10
    n_steps: int = 0

    def add_request(self, request_id, prompt, params, disagg=None):
        self.threads.add(threading.current_thread().name)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        self.live[request_id] = 0

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    @property
    def num_steps(self):  # EngineCore.num_steps: no model steps here, outputs are progress
        return 0

    def step(self):
        self.threads.add(threading.current_thread().name)
        self.n_steps += 1
        if self.fail_at_step is not None and self.n_steps >= self.fail_at_step:
            raise RuntimeError("boom")
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] >= self.steps
            outs.append(Out(rid, done, self.live[rid]))
            if done:
                del self.live[rid]
        return outs

    def stats(self):
        return {"num_running": len(self.live)}


async def _collect(engine: AsyncEngine, rid: str, prompt=(1,)) -> list:
    q: asyncio.Queue = asyncio.Queue()
    engine.add(rid, list(prompt), None, None, q.put_nowait)
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), 5)
        items.append(item)
        if isinstance(item, Exception) or item.finished:
            return items


def test_outputs_arrive_on_the_loop_from_one_engine_thread():
    core = StubCore()

    async def main():
        engine = AsyncEngine(core)
        engine.start(asyncio.get_running_loop())
        try:
            a, b = await asyncio.gather(_collect(engine, "a"), _collect(engine, "b"))
            bad = await _collect(engine, "c", prompt=())
            return a, b, bad, engine.snapshot.steps
        finally:
            engine.stop()
            assert not engine.alive

    a, b, bad, steps = asyncio.run(main())
    assert [o.step for o in a] == [1, 2, 3] and [o.step for o in b] == [1, 2, 3]
    assert isinstance(bad[0], ValueError) and "prompt" in str(bad[0])
    assert core.threads == {"pdserve-engine"} and steps >= 3


def test_abort_reaches_the_core_and_stops_outputs():
    core = StubCore(steps=10**9)

    async def main():
        engine = AsyncEngine(core)
        engine.start(asyncio.get_running_loop())
        try:
            q: asyncio.Queue = asyncio.Queue()
            engine.add("x", [1], None, None, q.put_nowait)
            await asyncio.wait_for(q.get(), 5)
            engine.abort("x")
            for _ in range(200):
                if "x" in core.aborted:
                    break
                await asyncio.sleep(0.01)
            return core.aborted
        finally:
            engine.stop()

    assert asyncio.run(main()) == ["x"]
    assert not core.live


def test_engine_thread_death_is_reported():
    core = StubCore(steps=10**9, fail_at_step=3)

    async def main():
        engine = AsyncEngine(core)
        engine.start(asyncio.get_running_loop())
        try:
            items = await _collect(engine, "r")
            with pytest.raises(EngineDeadError):
                engine.add("later", [1], None, None, lambda item: None)
            return items, engine.alive, engine.error
        finally:
            engine.stop()

    items, alive, error = asyncio.run(main())
    assert isinstance(items[-1], EngineDeadError) and "boom" in str(items[-1])
    assert not alive and "RuntimeError: boom" in error


@dataclass
class ChunkedCore(StubCore):
    """Each request first needs ``silent`` model steps that emit nothing (prefill chunks;
    ``num_steps`` counts them like EngineCore), then ``steps`` steps with output.
    ``rooms_pending``: unfinished work that nothing can schedule (KV transfer rooms)."""

    silent: int = 10
    rooms_pending: bool = False
    model_steps: int = 0
    polls: int = 0

    def has_unfinished_requests(self):
        return bool(self.live) or self.rooms_pending

    def step(self):
        self.polls += 1
        if self.live and any(v < 0 for v in self.live.values()):
            self.model_steps += 1
            for rid in self.live:
                self.live[rid] += 1
            return []
        if self.live:
            self.model_steps += 1
        return super().step()

    def add_request(self, request_id, prompt, params, disagg=None):
        super().add_request(request_id, prompt, params, disagg)
        self.live[request_id] = -self.silent

    @property
    def num_steps(self):
        return self.model_steps

    def stats(self):
        return {"num_running": len(self.live), "steps": self.model_steps}


class RecordingInbox:
    """The engine's command queue, recording how long the engine thread asked to wait
    before each step (0: ``get_nowait``; None: until a command arrives).  A timed wait on
    an empty queue returns at once as if the time had passed, so what the tests check is
    the thread's decision to wait, not the clock."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.waits: list[float | None] = []

    def put(self, item) -> None:
        self._q.put(item)

    def get_nowait(self):
        self.waits.append(0)
        return self._q.get_nowait()

    def get(self, block: bool = True, timeout: float | None = None):
        self.waits.append(timeout)
        if timeout is not None and self._q.empty():
            raise queue.Empty
        return self._q.get(block, timeout)


def _engine_with_inbox(core, idle: float) -> tuple[AsyncEngine, RecordingInbox]:
    engine = AsyncEngine(core, idle_poll_interval=idle)
    engine._inbox = inbox = RecordingInbox()
    return engine, inbox


def test_steps_that_run_the_model_without_output_are_not_paced_by_the_idle_wait():
    core = ChunkedCore(silent=10, steps=1)

    async def main():
        engine, inbox = _engine_with_inbox(core, idle=0.2)
        engine.start(asyncio.get_running_loop())
        try:
            items = await _collect(engine, "long-prompt")
            return items, list(inbox.waits)
        finally:
            engine.stop()

    items, waits = asyncio.run(main())
    assert items[-1].finished and core.model_steps == 11
    # Each of the 10 silent steps ran the model: the thread went on without the idle wait.
    assert 0.2 not in waits and waits.count(0) >= 10, waits


def test_only_transfer_rooms_pending_polls_at_the_idle_interval_without_spinning():
    core = ChunkedCore(rooms_pending=True)
    polled = threading.Event()
    step = core.step

    def counted_step():
        out = step()
        if core.polls == 20:
            polled.set()
        return out

    core.step = counted_step
    engine, inbox = _engine_with_inbox(core, idle=0.05)

    async def main():
        engine.start(asyncio.get_running_loop())
        try:
            await asyncio.to_thread(polled.wait, 10)
        finally:
            engine.stop()

    asyncio.run(main())
    # Rooms are polled (20 steps), and every poll after the first waited the idle interval
    # for a command (the thread does not spin).
    waits = inbox.waits[: core.polls]
    assert core.polls >= 20 and waits[0] == 0 and set(waits[1:]) == {0.05}, waits
