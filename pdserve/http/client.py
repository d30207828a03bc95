"""An HTTP client for per-request traffic between pdserve processes — the router's worker
legs of client requests: aiohttp's keep-alive connection pool (C-accelerated HTTP/1.1
parser), and an incremental Server-Sent Events decoder for streamed answers. No routing or
PD logic: the router's dispatcher and relay hold that.

Why not httpx here: for a one-token non-streamed POST to a worker that answers at once,
httpx/httpcore spent 0.55-1.1 ms of CPU per request on this project's 2-core machine
(httpcore re-checks every pooled connection's expiry on each request) against
0.07-0.11 ms for aiohttp (``pdserve bench router``; docs/benchmarks.md, "The router's
cost"). The router's other requests (health checks, the Responses store, ``/v1/models``,
the tokenizer endpoints) stay on httpx: they are not per-token work.

Errors: a failed connection, a connection lost before the whole answer, a malformed answer
all raise :data:`TRANSPORT_ERRORS` (aiohttp's ``ClientError``), which the dispatcher turns
into a failed leg.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

TRANSPORT_ERRORS: tuple[type[Exception], ...] = (aiohttp.ClientError,)

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


class WorkerStream:
    """A worker's open streamed answer (``status_code`` known, body not read yet); the
    caller reads it with :meth:`aiter_sse` or :meth:`aread` and ends it with
    :meth:`aclose` (which closes the connection when the body was not read to its end,
    so the worker sees the client leave and aborts the request)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status

    async def aread(self) -> bytes:
        """The rest of the body."""
        return await self._resp.read()

    async def aiter_sse(self) -> AsyncIterator[ServerSentEvent]:
        """The body's SSE events as they arrive; raises a ``TRANSPORT_ERRORS`` member
        when the connection breaks."""
        decoder = SSEDecoder()
        async for chunk in self._resp.content.iter_any():
            for event in decoder.feed(chunk):
                yield event

    async def aclose(self) -> None:
        self._resp.close()


class WorkerClient:
    """Pooled keep-alive HTTP/1.1 connections to the workers (one aiohttp session, made on
    first use on the running event loop). ``connect_timeout``: seconds to open a
    connection; reading an answer has no timeout of its own (the router's request
    deadline bounds it)."""

    def __init__(self, connect_timeout: float = 10.0) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout, sock_read=None
        )
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=None),
                timeout=self._timeout,
                auto_decompress=False,  # the workers send identity bodies; pass bytes on
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    @staticmethod
    def _encode(body: dict, headers: Mapping[str, str]) -> tuple[bytes, dict[str, str]]:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return data.encode("utf-8"), {"content-type": "application/json", **headers}

    async def post(self, url: str, body: dict, headers: Mapping[str, str]) -> WorkerResponse:
        """POST ``body`` as JSON to ``url``; the whole answer (any status)."""
        data, all_headers = self._encode(body, headers)
        async with self._open().post(url, data=data, headers=all_headers) as resp:
            return WorkerResponse(resp.status, await resp.read())

    async def open(self, url: str, body: dict, headers: Mapping[str, str]) -> WorkerStream:
        """POST ``body`` as JSON to ``url`` and return once the answer's head arrived
        (any status); the caller must :meth:`WorkerStream.aclose` it."""
        data, all_headers = self._encode(body, headers)
        resp = await self._open().post(url, data=data, headers=all_headers)
        return WorkerStream(resp)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
