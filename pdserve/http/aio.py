"""asyncio waits that never lose a cancellation (no engine imports: the router uses them
too).

Why not ``asyncio.wait_for``: on Python 3.10 and 3.11 it returns the inner result when
the awaited future completes in the same loop iteration as the cancellation of the task
awaiting it, and the cancellation is lost (CPython gh-86296, fixed in 3.12). A request
handler cancelled by uvicorn's graceful-shutdown timeout while tokens stream in then runs
on, and its later failure is logged as "Task exception was never retrieved"."""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


async def get_within(queue: asyncio.Queue[T], timeout: float) -> T:
    """The next item of ``queue``, waiting at most ``timeout`` seconds.

    Raises ``asyncio.TimeoutError`` when none came in time (the item stays queued for the
    next call) and ``asyncio.CancelledError`` whenever the caller is cancelled, even if an
    item arrived at the same moment (that item is dropped: the caller is going away)."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    try:
        done, _ = await asyncio.wait({getter}, timeout=timeout)
    except asyncio.CancelledError:
        getter.cancel()
        raise
    if not done:
        getter.cancel()  # Queue.get leaves the queue as it was when cancelled
        raise asyncio.TimeoutError
    return getter.result()


def retrieve_later(task: asyncio.Future) -> None:
    """Mark ``task``'s outcome as seen once it ends, so a task abandoned by a cancelled
    caller (it may still fail, e.g. when the engine stops) is not logged as "Task exception
    was never retrieved"."""

    def _seen(t: asyncio.Future) -> None:
        if not t.cancelled():
            t.exception()

    task.add_done_callback(_seen)
