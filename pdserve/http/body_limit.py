"""ASGI middleware capping the size of a request body (worker and router): a larger body
gets 413 in OpenAI's error shape before it is parsed (no engine imports).

The 413 must reach a client that is still sending. A server that answers and closes the
connection while request bytes are unread makes the kernel reset it (RFC 9112 §9.6), and
the reset can overtake the answer: the client then reads "connection reset" instead of
the 413. So the rest of an oversized body is read and discarded first, up to
``DRAIN_LIMIT_BYTES`` past the cap; then the 413 is sent and the connection stays usable.
A client announcing ``Expect: 100-continue`` has sent no body yet and gets the 413 at once.
Only a body more than ``DRAIN_LIMIT_BYTES`` past the cap is answered without being drained
(reading unbounded data would tie the server up), with ``Connection: close``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from pdserve.http.http_errors import error_json

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Bytes past the cap read and discarded so the 413 is not lost to a reset (a client
# normally sends an oversized body by mistake, by a few MB: a 33 MiB body to a 32 MiB cap).
DRAIN_LIMIT_BYTES = 64 * 2**20


class _TooLarge(HTTPException):
    """The body grew past the cap while it was being received (an HTTPException, so the
    app's handler answers it with the same 413 even when the app catches errors of its read)."""


class BodySizeLimit:
    """Rejects a request whose body exceeds ``max_bytes`` with HTTP 413.

    A ``Content-Length`` over the cap is answered without passing the body to the app; a
    body without one (chunked) is counted while the app receives it, and the app's read
    fails with 413 as soon as the count passes the cap (so at most ``max_bytes`` plus one
    chunk is ever buffered). Either way the rest of the body is drained (at most
    ``DRAIN_LIMIT_BYTES``) before the 413 is sent, so the client reads it.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _text(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes (--max-request-body-bytes)"

    @staticmethod
    async def _drain(receive: Receive, limit: int = DRAIN_LIMIT_BYTES) -> bool:
        """Read and drop the rest of the body; True when it ended within ``limit`` bytes
        (False: limit reached, or the client left)."""
        drained = 0
        while drained <= limit:
            message = await receive()
            if message["type"] != "http.request":
                return False  # http.disconnect
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    async def _reject(self, send: Send, *, close: bool) -> None:
        # rendered as every other error body (JSONResponse: compact, UTF-8)
        body = JSONResponse(error_json(413, self._text())).body
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length, expects_continue = None, False
        for key, value in scope.get("headers") or []:
            name = key.lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    pass  # uvicorn rejects a malformed Content-Length itself
            elif name == b"expect" and value.lower() == b"100-continue":
                expects_continue = True
        if length is not None and length > self.max_bytes:
            # uvicorn sends "100 Continue" on the first receive(): a client waiting for it
            # has sent nothing, so do not ask for the body.
            drain = not expects_continue and length - self.max_bytes <= DRAIN_LIMIT_BYTES
            drained = drain and await self._drain(receive, limit=length)
            return await self._reject(send, close=not drained)
        received, started, overflowed, pending = 0, False, False, True

        async def limited_receive() -> Message:
            nonlocal received, overflowed, pending
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                pending = False  # the body ended (or the client left)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    overflowed = True
                    raise _TooLarge(413, self._text())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started, pending
            if message["type"] == "http.response.start":
                started = True
                if overflowed and pending:  # the app answered the 413 itself: drain first
                    pending = False
                    if not await self._drain(receive):
                        headers = [*message.get("headers", []), (b"connection", b"close")]
                        message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                drained = not pending or await self._drain(receive)
                await self._reject(send, close=not drained)
