"""ASGI middleware capping the size of a request body (worker and router): a larger body
gets 413 in OpenAI's error shape before it is parsed (no engine imports)."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from pdserve.http.http_errors import error_json


class _TooLarge(HTTPException):
    """The body grew past the cap while it was being received (an HTTPException, so the
    app's handler answers it with the same 413 even when the app catches errors of its read)."""


class BodySizeLimit:
    """Rejects a request whose body exceeds ``max_bytes`` with HTTP 413.

    A ``Content-Length`` over the cap is answered at once without reading the body; a
    body without one (chunked) is counted while the app receives it, and the app's read
    fails with 413 as soon as the count passes the cap (so at most ``max_bytes`` plus one
    chunk is ever buffered).
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _text(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes (--max-request-body-bytes)"

    async def _reject(self, send) -> None:
        body = json.dumps(error_json(413, self._text())).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for key, value in scope.get("headers") or []:
            if key.lower() == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False  # uvicorn rejects a malformed Content-Length itself
                if too_large:
                    return await self._reject(send)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(413, self._text())
            return message

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(send)
