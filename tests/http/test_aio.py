"""asyncio waits that keep a cancellation: the race that let a worker's request handler,
cancelled by uvicorn's graceful-shutdown timeout while tokens streamed in, run on and log
"Task exception was never retrieved" (CI, 2026-12-02)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.http.aio import get_within, retrieve_later


def test_a_cancellation_arriving_with_an_item_is_not_lost():
    async def main() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        got: list[int] = []

        async def reader() -> None:
            while True:
                got.append(await get_within(queue, 5.0))

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader waits in get_within
        queue.put_nowait(1)  # the item and the cancellation land in one loop iteration
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)
        assert task.cancelled()

    asyncio.run(main())


def test_get_within_times_out_and_keeps_the_item_for_the_next_call():
    async def main() -> None:
        queue: asyncio.Queue[str] = asyncio.Queue()
        with pytest.raises(asyncio.TimeoutError):
            await get_within(queue, 0.01)
        queue.put_nowait("a")
        queue.put_nowait("b")
        assert await get_within(queue, 1.0) == "a"
        assert await get_within(queue, 1.0) == "b"
        later = asyncio.ensure_future(get_within(queue, 1.0))
        await asyncio.sleep(0.01)
        queue.put_nowait("c")
        assert await later == "c"

    asyncio.run(main())


def test_an_abandoned_task_failing_later_is_not_reported_unretrieved():
    reports: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reports.append(ctx))
        release = asyncio.Event()

        async def fails_later() -> None:
            await release.wait()
            raise RuntimeError("engine stopped")

        task = asyncio.ensure_future(fails_later())
        retrieve_later(task)
        await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0.01)
        assert task.done()
        del task

    asyncio.run(main())
    import gc

    gc.collect()
    assert not [r for r in reports if "never retrieved" in r.get("message", "")], reports
