"""The router's front: uvicorn's httptools protocol (keep-alive, pipelining, ``Expect:
100-continue``, a malformed request answered 400 and closed, graceful shutdown, the
keep-alive timeout: all uvicorn's), with the POSTs the router forwards to workers served
straight from the parsed request by :class:`FrontHandler` instead of through the ASGI
app's layers (FastAPI/Starlette, the body cap, request id and shutdown middlewares,
Starlette's request and response objects): at the router's usual rates each request pays
those layers' Python on its critical path (``pdserve bench router``; docs/benchmarks.md,
"The router's cost"). Every other request (health, metrics, models, the admin API, stored
Responses, the tokenizer endpoints) goes to the Starlette app as before, and so does a
forwarded POST the front does not take: a body without ``Content-Length`` (chunked), one
over ``--max-request-body-bytes`` (the app's 413 with its draining), any request while
tracing is on (the app's tracing middleware makes its spans).

What a forwarded POST gets here is what the app gave it: the same answer (the app's
``answer`` function: JSON checks, the dispatch, the metrics), its ``x-request-id``
(the caller's when valid, else a new one; the id of the log lines and the worker legs),
the relayed SSE stream as chunked transfer encoding, the client leaving cancelling the
dispatch (the legs close, the workers abort; counted as 499), and a request cut by the
shutdown's grace period answered 503 JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from pdserve.http.http_errors import error_json
from pdserve.http.shutdown import ShutdownFlag
from pdserve.tracing import REQUEST_ID, REQUEST_ID_HEADER, REQUEST_START, request_id_from

log = logging.getLogger("pdserve.router")

_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode("latin-1")


@dataclass
class FrontHandler:
    """What the front needs of the router app: ``paths``, the forwarded POST paths;
    ``answer(endpoint, body)``, the counted answer to one (``router.app``); ``count(response,
    endpoint, start)``, the metrics of a request that ends without one (the client left:
    499); ``max_body_bytes``, the body cap (larger bodies go to the app, which answers 413);
    ``stopping``, set when the router's shutdown begins."""

    paths: frozenset[str]
    answer: Callable[[str, bytes], Awaitable[Response]]
    count: Callable[[Response, str, float], Response]
    max_body_bytes: int
    stopping: ShutdownFlag

    def takes(self, scope: dict) -> bool:
        """Whether the front serves this request (else the ASGI app does): a POST to a
        forwarded path whose body has a ``Content-Length`` within the cap."""
        if scope["method"] != "POST" or scope["path"] not in self.paths:
            return False
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                if length is not None:
                    return False  # repeated: the app's parser decides
                length = value
            elif name == b"transfer-encoding":
                return False
        try:
            return length is not None and int(length) <= self.max_body_bytes
        except ValueError:
            return False


def _request_id(scope: dict) -> str:
    for name, value in scope["headers"]:
        if name == _REQUEST_ID_NAME:
            return request_id_from(value.decode("latin-1"))
    return request_id_from("")


def _head(cycle: RequestResponseCycle, response: Response, request_id: str, chunked: bool) -> bytes:
    """The answer's status line and headers: uvicorn's default ones (``date``,
    ``server``), the response's, the request id, and the connection's framing."""
    parts = [STATUS_LINE[response.status_code]]
    for name, value in (*cycle.default_headers, *response.raw_headers):
        parts += (name, b": ", value, b"\r\n")
    parts += (_REQUEST_ID_NAME, b": ", request_id.encode("latin-1"), b"\r\n")
    if chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    if not cycle.keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _complete(cycle: RequestResponseCycle) -> None:
    """The answer's last byte is written: the connection goes on to its next request (or
    closes, when it is not kept alive)."""
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    on_response, cycle.on_response = cycle.on_response, lambda: None
    on_response()


async def _write(cycle: RequestResponseCycle, response: Response, request_id: str) -> None:
    """Write ``response`` to the client: whole, or a stream's chunks as they come."""
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    transport = cycle.transport
    if not isinstance(response, StreamingResponse):
        transport.write(_head(cycle, response, request_id, chunked=False) + response.body)
        _complete(cycle)
        return
    chunks: Any = response.body_iterator
    try:
        transport.write(_head(cycle, response, request_id, chunked=True))
        async for chunk in chunks:
            if isinstance(chunk, str):
                chunk = chunk.encode("utf-8")
            if not chunk:
                continue
            if cycle.flow.write_paused:
                await cycle.flow.drain()
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        transport.write(b"0\r\n\r\n")
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:  # ended early (the client left): the relay closes its legs
            with anyio.CancelScope(shield=True):
                await close()
    _complete(cycle)


def _error_body(status: int, message: str) -> Response:
    body = json.dumps(error_json(status, message), separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type="application/json")


async def _serve(front: FrontHandler, cycle: RequestResponseCycle) -> None:
    """One forwarded POST, from its body to the last byte of its answer."""
    scope = cycle.scope
    endpoint = scope["path"]
    start = time.perf_counter()
    request_id = _request_id(scope)
    REQUEST_ID.set(request_id)  # this task's context: its log lines and its legs
    REQUEST_START.set(start)
    response: Response | None = None
    try:
        body = b""
        while True:
            message = await cycle.receive()  # sends 100 Continue when it is expected
            if message["type"] != "http.request":  # the client left before its body's end
                front.count(Response(status_code=499), endpoint, start)
                return
            body += message["body"]
            if not message["more_body"]:
                break
        response = await front.answer(endpoint, body)
        await _write(cycle, response, request_id)
    except asyncio.CancelledError:
        if cycle.disconnected:  # the client left: nothing more to write
            if response is None:
                front.count(Response(status_code=499), endpoint, start)
            return
        if not cycle.response_started and front.stopping.is_set:
            await _write(
                cycle,
                _error_body(
                    503, "server shutting down: the router was stopped while this request ran"
                ),
                request_id,
            )
        raise
    except Exception:
        log.exception("the router's front failed on a %s request", endpoint)
        if not cycle.response_started:
            cycle.keep_alive = False
            await _write(cycle, _error_body(500, "internal error in the router"), request_id)
        else:
            cycle.transport.close()


def front_protocol(front: FrontHandler) -> type[HttpToolsProtocol]:
    """An uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) that serves the
    requests ``front.takes`` with ``front`` and every other one with the ASGI app."""

    class RouterFrontProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with the router's forwarded POSTs served by
        :class:`FrontHandler` (pdserve/router/front.py)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._front: tuple[asyncio.Task, RequestResponseCycle] | None = None

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
            if app is not self.app or not front.takes(cycle.scope):
                self._front = None
                return super()._start_asgi_task(cycle, app)
            task = self.loop.create_task(_serve(front, cycle))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)
            self._front = (task, cycle)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            if self._front is not None:
                task, cycle = self._front
                if not task.done() and not cycle.response_complete:
                    cycle.disconnected = True
                    task.cancel()  # the dispatch and its legs end; the workers abort

    return RouterFrontProtocol
