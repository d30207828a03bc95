"""An HTTP client for per-request traffic between pdserve processes — the router's worker
legs of client requests: keep-alive HTTP/1.1 connections pooled per worker, responses
parsed by httptools (llhttp, the C parser uvicorn uses too), and an incremental
Server-Sent Events decoder for streamed answers. No routing or PD logic: the router's
dispatcher and relay hold that.

Why not a general client here: a leg is a POST of a JSON body to a worker on the same
network that answers with Content-Length or chunked bytes, and at the router's usual rate
the client's own Python is on every request's critical path. Against stub workers that
answer at once (``pdserve bench router``, docs/benchmarks.md "The router's cost"): httpx
spent 0.55-1.1 ms of CPU a request, aiohttp 0.07-0.11 ms back to back but about 0.75 ms
of added latency per request at 50 req/s (a minimal proxy with aiohttp legs added
1.39-1.45 ms, the same proxy with this client 0.63-0.66 ms). The router's other requests
(health checks, the Responses store, ``/v1/models``, the tokenizer endpoints) stay on
httpx: they are not per-request work.

Errors: a failed or timed-out connection, a connection lost before the whole answer, a
malformed answer all raise :class:`WorkerConnectionError` (the one member of
:data:`TRANSPORT_ERRORS`), which the dispatcher turns into a failed leg.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httptools


class WorkerConnectionError(Exception):
    """The connection to a worker could not be opened, broke before the whole answer
    arrived, or carried bytes that are not an HTTP/1.1 answer."""


TRANSPORT_ERRORS: tuple[type[Exception], ...] = (WorkerConnectionError,)

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


@dataclass
class ServerSentEvent:
    """One dispatched SSE event: ``data`` (its ``data`` lines joined by ``\\n``),
    ``event`` (its type, ``""`` when unnamed) and ``id`` (the last event id seen)."""

    data: str
    event: str = ""
    id: str = ""


class SSEDecoder:
    """Incremental ``text/event-stream`` decoder (the WHATWG HTML "event stream
    interpretation"): lines end at CRLF, CR or LF (a CRLF split across two chunks counts
    once); ``:`` starts a comment; ``field: value`` drops one space after the colon; an
    event is dispatched at a blank line when it had at least one ``data`` line; unknown
    fields and a ``retry`` are ignored; bytes after the last line end at EOF are dropped.
    Text is UTF-8 (invalid bytes replaced), a leading BOM skipped."""

    def __init__(self) -> None:
        self._tail = b""  # an unfinished line
        self._skip_lf = False  # the last chunk ended with CR: a LF next is its CRLF
        self._start = True
        self._data: list[str] = []
        self._has_data = False
        self._event = ""
        self._id = ""

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """The events completed by ``chunk`` (bytes of the stream, any split)."""
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        if not chunk:
            return []
        buf = self._tail + chunk if self._tail else chunk
        if self._start:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._tail = buf
                return []
            self._start = False
            if buf.startswith(_BOM):
                buf = buf[len(_BOM) :]
        lines = _LINE_END.split(buf)
        self._tail = lines.pop()  # after the last line end: unfinished (b"" when none)
        self._skip_lf = buf.endswith(b"\r")
        events: list[ServerSentEvent] = []
        for line in lines:
            if not line:
                if self._has_data:
                    events.append(ServerSentEvent("\n".join(self._data), self._event, self._id))
                self._data, self._has_data, self._event = [], False, ""
                continue
            if line[:1] == b":":
                continue
            name, colon, value = line.partition(b":")
            if colon and value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                self._data.append(value.decode("utf-8", "replace"))
                self._has_data = True
            elif name == b"event":
                self._event = value.decode("utf-8", "replace")
            elif name == b"id" and b"\0" not in value:
                self._id = value.decode("utf-8", "replace")
        return events


class WorkerResponse:
    """A worker's whole answer: ``status_code``, ``content`` (the body's bytes)."""

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def json(self) -> Any:
        """The body parsed as JSON; ValueError when it is not JSON."""
        return json.loads(self.content)

    async def aclose(self) -> None:
        """Nothing to release (the answer was read whole)."""


# bytes of a streamed answer held unread before the connection stops reading (the relay
# forwards chunks as they come; a client that reads slowly holds the worker back)
_STREAM_HIGH_WATER = 1 << 20


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a worker and the answer now read on it (one
    request at a time; httptools parses the answer as its bytes arrive)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle = False  # in the pool: any byte now is not an answer to us
        self._waiter: asyncio.Future | None = None
        self.start()

    def start(self) -> None:
        """Ready for the answer to a new request."""
        self.idle = False
        self.status = 0
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.until_close = True  # no Content-Length and not chunked: the body ends at EOF
        self.got_bytes = False
        self.streaming = False
        self.paused = False
        self.error: WorkerConnectionError | None = None
        self.chunks: deque[bytes] = deque()
        self.stamps: deque[float] = deque()  # each chunk's arrival, perf_counter seconds
        self.received_at = 0.0
        self.buffered = 0

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.idle:  # nothing was asked: the connection cannot be trusted any more
            self.close()
            return
        self.got_bytes = True
        self.received_at = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(WorkerConnectionError(f"the worker's answer is not valid HTTP/1.1: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete or self.idle:
            return
        if self.head_done and self.until_close and exc is None:
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
            return
        reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self._fail(
            WorkerConnectionError(
                "the worker closed the connection before its whole answer" + reason
            )
        )

    # -- httptools callbacks -------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.until_close = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.stamps.append(self.received_at)
        self.buffered += len(body)
        if self.streaming and self.buffered > _STREAM_HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- the reader's side ---------------------------------------------------------------
    def _fail(self, error: WorkerConnectionError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _progress(self) -> None:
        """Until the parser or the connection has news."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self) -> None:
        """Until the answer's status line and headers arrived."""
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._progress()

    async def read_all(self) -> bytes:
        """The whole body."""
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self._progress()
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.stamps.clear()
        self.buffered = 0
        return data

    async def next_chunk(self) -> bytes | None:
        """The body's next bytes as they arrived; None at its end."""
        got = await self.next_chunk_timed()
        return None if got is None else got[1]

    async def next_chunk_timed(self) -> tuple[float, bytes] | None:
        """(when its bytes came off the socket: ``time.perf_counter()`` seconds at the
        ``data_received`` that carried them, the body's next bytes as they arrived); None
        at the body's end."""
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                stamp = self.stamps.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered <= _STREAM_HIGH_WATER // 2:
                    self.paused = False
                    self.transport.resume_reading()  # type: ignore[union-attr]
                return stamp, chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._progress()

    def reusable(self) -> bool:
        """Whether the next request may go on this connection."""
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        """Close the connection (a worker streaming to it sees the client leave)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _close_made(connecting: asyncio.Future) -> None:
    """Close the connection of a connect attempt given up, if it was made anyway."""
    if not connecting.cancelled() and connecting.exception() is None:
        connecting.result()[0].close()


class WorkerStream:
    """A worker's open streamed answer (``status_code`` known, body not read yet); the
    caller reads it with :meth:`aiter_sse` or :meth:`aread` and ends it with
    :meth:`aclose` (which closes the connection when the body was not read to its end,
    so the worker sees the client leave and aborts the request)."""

    def __init__(self, client: WorkerClient, conn: _Connection) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self.status_code = conn.status

    async def aread(self) -> bytes:
        """The rest of the body."""
        if self._conn is None:
            raise WorkerConnectionError("the stream was closed")
        return await self._conn.read_all()

    async def aiter_sse(self) -> AsyncIterator[ServerSentEvent]:
        """The body's SSE events as they arrive; raises a ``TRANSPORT_ERRORS`` member
        when the connection breaks."""
        if self._conn is None:
            raise WorkerConnectionError("the stream was closed")
        conn = self._conn
        conn.streaming = True
        decoder = SSEDecoder()
        while (chunk := await conn.next_chunk()) is not None:
            for event in decoder.feed(chunk):
                yield event

    async def aiter_sse_timed(self) -> AsyncIterator[tuple[float, ServerSentEvent]]:
        """As :meth:`aiter_sse`, each event with when the bytes that completed it came off
        the socket (``time.perf_counter()`` seconds, stamped in the connection's
        ``data_received``): a reader that gets to an event late (its event loop busy with
        other streams) still knows when it arrived."""
        if self._conn is None:
            raise WorkerConnectionError("the stream was closed")
        conn = self._conn
        conn.streaming = True
        decoder = SSEDecoder()
        while (got := await conn.next_chunk_timed()) is not None:
            for event in decoder.feed(got[1]):
                yield got[0], event

    async def aclose(self) -> None:
        """End the answer: its connection back to the pool when it was read to its end,
        else closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._release(conn)


class WorkerClient:
    """Pooled keep-alive HTTP/1.1 connections to the workers, opened on the running event
    loop as needed. ``connect_timeout``: seconds to open a connection; reading an answer
    has no timeout of its own (the router's request deadline bounds it). A request that
    finds its pooled connection closed by the worker (idle too long) before any byte of
    the answer goes once more on a new connection."""

    def __init__(self, connect_timeout: float = 10.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        """(host, port) of ``url`` and its request's first lines (POST, host,
        content type)."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise WorkerConnectionError(f"cannot POST to {url}: not an http:// URL")
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            netloc = parts.netloc.rsplit("@", 1)[-1]
            start = f"POST {path} HTTP/1.1\r\nhost: {netloc}\r\ncontent-type: application/json\r\n"
            target = ((parts.hostname, parts.port or 80), start.encode("utf-8"))
            if len(self._targets) < 4096:  # worker URLs x endpoints: a few
                self._targets[url] = target
        return target

    async def _connect(self, address: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = address
        # asyncio.wait, not wait_for: Python 3.11's wait_for returns the connection when it
        # is made as the caller is cancelled (the cancellation is lost, and the leg the
        # dispatcher gave up goes on); here a cancelled caller never gets it
        connecting = asyncio.ensure_future(
            loop.create_connection(lambda: _Connection(address), host, port)
        )
        try:
            await asyncio.wait((connecting,), timeout=self.connect_timeout)
        except BaseException:
            connecting.cancel()
            connecting.add_done_callback(_close_made)
            raise
        if not connecting.done():
            connecting.cancel()
            connecting.add_done_callback(_close_made)
            raise WorkerConnectionError(
                f"connecting to {host}:{port} timed out after {self.connect_timeout:g} s"
            )
        try:
            _, conn = connecting.result()
        except OSError as exc:
            raise WorkerConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc
        self._open.add(conn)
        return conn

    def _pooled(self, address: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            self._drop(conn)
        return None

    def _release(self, conn: _Connection) -> None:
        if conn.reusable():
            conn.idle = True
            self._idle.setdefault(conn.address, []).append(conn)
        else:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    async def _request(self, url: str, body: dict, headers: Mapping[str, str]) -> _Connection:
        """Send the POST; the connection once the answer's head arrived."""
        address, start = self._target(url)
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        payload = data.encode("utf-8")
        lines = [start]
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"content-length: %d\r\n\r\n" % len(payload))
        lines.append(payload)
        message = b"".join(lines)
        conn = self._pooled(address)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(address)
            conn.start()
            try:
                try:
                    conn.transport.write(message)  # type: ignore[union-attr]
                except RuntimeError as exc:  # uvloop's transport closed (a worker gone)
                    host, port = address
                    raise WorkerConnectionError(
                        f"connection to {host}:{port} closed before the request: {exc}"
                    ) from exc
                await conn.head()
                return conn
            except WorkerConnectionError:
                self._drop(conn)
                if not (reused and not conn.got_bytes):
                    raise
                conn, reused = None, False  # the worker had closed it while it was idle
            except BaseException:  # cancelled: the worker must see the client leave
                self._drop(conn)
                raise

    async def post(self, url: str, body: dict, headers: Mapping[str, str]) -> WorkerResponse:
        """POST ``body`` as JSON to ``url``; the whole answer (any status)."""
        conn = await self._request(url, body, headers)
        try:
            content = await conn.read_all()
        except BaseException:
            self._drop(conn)
            raise
        status = conn.status
        self._release(conn)
        return WorkerResponse(status, content)

    async def open(self, url: str, body: dict, headers: Mapping[str, str]) -> WorkerStream:
        """POST ``body`` as JSON to ``url`` and return once the answer's head arrived
        (any status); the caller must :meth:`WorkerStream.aclose` it."""
        return WorkerStream(self, await self._request(url, body, headers))

    async def aclose(self) -> None:
        """Close every connection."""
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()
