"""A JSON 503 instead of uvicorn's bare 500 for a request that the server's shutdown cut
(no engine imports, so the router can use it too).

On SIGINT/SIGTERM uvicorn gives in-flight requests ``timeout_graceful_shutdown`` seconds,
then cancels their tasks; a cancelled handler that has not started its response would end
in uvicorn's "Exception in ASGI application" traceback and a plain-text 500.
:class:`ShutdownAnswer` answers such a request with OpenAI's error body, status 503, type
``service_unavailable`` (what a stream cut the same way ends with).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pdserve.http.http_errors import error_json


class ShutdownFlag:
    """Set once when the server begins to shut down (``set`` is the app's
    ``state.before_shutdown``, run by ``netutil.GracefulServer``)."""

    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True


class ShutdownAnswer:
    """ASGI middleware: an HTTP request cancelled while ``flag`` is set, before its
    response started, is answered 503 ``server shutting down: <who> was stopped while this
    request ran`` (JSON); any other cancellation propagates unchanged. The handler's own
    clean-up (``finally`` blocks, e.g. aborting engine requests) has run by then."""

    def __init__(self, app: Any, flag: ShutdownFlag, who: str) -> None:
        self.app, self.flag, self.who = app, flag, who

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_wrapper(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            if started or not self.flag.is_set:
                raise
            message = f"server shutting down: {self.who} was stopped while this request ran"
            body = json.dumps(error_json(503, message)).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
