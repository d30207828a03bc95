"""Cancel a request handler when its HTTP client goes away (no engine imports, so the
router can use it too)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from pdserve.http.aio import retrieve_later

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message is http.disconnect
    # (uvicorn delivers it when the socket closes or after the response is sent).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (its ``finally`` blocks
    run, e.g. aborting engine requests) and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        retrieve_later(task)  # it may end with the engine's failure after we are gone
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 the watcher's own end
        pass
    raise ClientDisconnected()
