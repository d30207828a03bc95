"""A fast front for an ASGI app's hottest POSTs: uvicorn's httptools protocol (keep-alive,
pipelining, ``Expect: 100-continue``, a malformed request answered 400 and closed,
graceful shutdown, the keep-alive timeout: all uvicorn's), with the POSTs to a few paths
served straight from the parsed request by :class:`FrontHandler` instead of through the
app's layers (FastAPI/Starlette, middlewares, Starlette's request objects). No engine or
routing imports: the router (pdserve/router/app.py) uses it for the four paths it forwards
to workers, whose requests at its usual rates pay those layers' Python on their critical
path (``pdserve bench router``; docs/benchmarks.md, "The router's cost"). One rule is
added for every request: a request line and headers over ``MAX_HEAD_BYTES`` are answered
431 and the connection closed (httptools, unlike h11, has no limit of its own).

Every other request goes to the ASGI app as before, and so does a POST to those paths
that the front does not take: a body without ``Content-Length`` (chunked), one over the
body cap (the app's 413 with its draining), an HTTP/1.0 request.

What a request gets here is what the app would give it: the handler's answer (a Starlette
``Response``, whole, or a ``StreamingResponse`` sent with chunked transfer encoding as its
chunks come), uvicorn's default headers, its ``x-request-id`` (the caller's when valid,
else a new one; set for the handler's log lines and outgoing calls as the app's
``tracing.RequestContext`` does), the client leaving cancelling the handler's task (a
stream's iterator closed; counted by ``count`` as 499 when no answer was made yet), and a
request cut by the shutdown's grace period answered 503 JSON (``http.shutdown``'s words).
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
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pdserve.http.http_errors import error_json
from pdserve.http.shutdown import ShutdownFlag
from pdserve.tracing import REQUEST_ID, REQUEST_ID_HEADER, REQUEST_START, request_id_from

log = logging.getLogger(__name__)

_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode("latin-1")

# bytes of a request's target and header lines (names and values) the front accepts; more
# is answered 431 and the connection closed (h11, uvicorn's other parser, stops at 16 KiB;
# httptools has no limit of its own)
MAX_HEAD_BYTES = 64 * 1024


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the request's head is over ``MAX_HEAD_BYTES``."""


@dataclass
class FrontHandler:
    """What the front needs of the app: ``paths``, the POST paths it serves;
    ``answer(path, body)``, the answer to one (its body's bytes), not counted;
    ``count(response, path, start)``, the app's metrics of a request (``start``: its
    ``time.perf_counter()``), called once a whole answer is written, before a stream is
    (it may wrap the stream's iterator, to count at its end, and returns the response),
    or with a 499 response when the client left before any answer; ``max_body_bytes``, the body cap (larger bodies go to the
    app, which answers 413); ``stopping``, set when the server's shutdown begins; ``who``,
    the server in messages ("the router")."""

    paths: frozenset[str]
    answer: Callable[[str, bytes], Awaitable[Response]]
    count: Callable[[Response, str, float], Response]
    max_body_bytes: int
    stopping: ShutdownFlag
    who: str = "the server"

    def __post_init__(self) -> None:
        self._raw_paths = {p.encode("ascii"): p for p in self.paths}

    def endpoint(self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The forwarded path of a request the front serves, None for one the ASGI app
        serves: the front takes a POST to a forwarded path (written plainly, a query
        allowed) whose body has one ``Content-Length`` within the cap."""
        if method != b"POST":
            return None
        endpoint = self._raw_paths.get(url.split(b"?", 1)[0])
        if endpoint is None:
            return None
        length = None
        for name, value in headers:
            if name == b"content-length":
                if length is not None:
                    return None  # repeated: the app's server decides
                length = value
            elif name == b"transfer-encoding":
                return None
        try:
            return endpoint if length is not None and int(length) <= self.max_body_bytes else None
        except ValueError:
            return None


class _Noop:
    def set(self) -> None:
        pass


class FrontCycle:
    """One request the front serves, in the place of uvicorn's ``RequestResponseCycle``
    on the protocol (whose connection and pipelining code reads ``response_complete``,
    ``disconnected``, ``keep_alive`` and ``message_event`` of the current one)."""

    message_event = _Noop()  # the body is read whole before the task starts: no reader waits

    def __init__(
        self,
        endpoint: str,
        headers: list[tuple[bytes, bytes]],
        transport: asyncio.Transport,
        flow: Any,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        expect_100_continue: bool,
        on_response: Callable[[], None],
        count: Callable[[Response, str, float], Response] | None = None,
    ) -> None:
        self.endpoint, self.headers = endpoint, headers
        self.count, self.start = count, time.perf_counter()
        self.transport, self.flow, self.default_headers = transport, flow, default_headers
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.on_response = on_response
        self.body: list[bytes] = []
        self.body_done = False  # the whole body arrived
        self.released = False  # its turn on the connection came (pipelining)
        self.disconnected = False
        self.response_started = False
        self.response_complete = False

    def read_timed_out(self) -> None:
        """Its body stopped arriving and the read timeout answered 408
        (http/read_timeout.py): counted as the app's requests are."""
        if self.count is not None:
            self.count(Response(status_code=408), self.endpoint, self.start)


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's id from its ``x-request-id`` (the last one, as the app's
    ``RequestContext`` reads it) or a new one."""
    given = ""
    for name, value in headers:
        if name == _REQUEST_ID_NAME:
            given = value.decode("latin-1")
    return request_id_from(given)


def _head(cycle: FrontCycle, response: Response, request_id: str, chunked: bool) -> bytes:
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


def _complete(cycle: FrontCycle) -> None:
    """The answer's last byte is written: the connection goes on to its next request (or
    closes, when it is not kept alive)."""
    cycle.response_complete = True
    if not cycle.keep_alive:
        cycle.transport.close()
    on_response, cycle.on_response = cycle.on_response, lambda: None
    on_response()


def _client_left(cycle: FrontCycle) -> bool:
    """Whether the client's connection is closing (it left, e.g. an SDK that closes once it
    read a stream's ``[DONE]``, before the last chunk's terminator): then nothing more is
    written (uvloop's transport raises on a write after close) and the cycle is marked
    disconnected."""
    if cycle.transport.is_closing():
        cycle.disconnected = True
    return cycle.disconnected


async def _write(cycle: FrontCycle, response: Response, request_id: str) -> None:
    """Write ``response`` to the client: whole, or a stream's chunks as they come; stops
    quietly where the client left (:func:`_client_left`)."""
    cycle.response_started = True
    transport = cycle.transport
    if not isinstance(response, StreamingResponse):
        if not _client_left(cycle):
            transport.write(_head(cycle, response, request_id, chunked=False) + response.body)
        _complete(cycle)
        return
    chunks: Any = response.body_iterator
    # the head goes out with the first chunk, in one write: the router's relay answers
    # once its first chunk is known (an error before it gets its own status), so nothing
    # waits for it, and a head alone would make the first chunk a second TCP segment
    head = _head(cycle, response, request_id, chunked=True)
    try:
        async for chunk in chunks:
            if _client_left(cycle):
                break
            if isinstance(chunk, str):
                chunk = chunk.encode("utf-8")
            if not chunk:
                continue
            if cycle.flow.write_paused:
                await cycle.flow.drain()
            if _client_left(cycle):
                break
            transport.write(b"%b%x\r\n%b\r\n" % (head, len(chunk), chunk))
            head = b""
        if not _client_left(cycle):
            transport.write(head + b"0\r\n\r\n")
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:  # ended early (the client left): the relay closes its legs
            with anyio.CancelScope(shield=True):
                await close()
    _complete(cycle)


def _error_body(status: int, message: str) -> Response:
    body = json.dumps(error_json(status, message), separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type="application/json")


async def _serve(front: FrontHandler, cycle: FrontCycle) -> None:
    """One forwarded POST, its body read whole, to the last byte of its answer."""
    endpoint = cycle.endpoint
    start = time.perf_counter()
    request_id = _request_id(cycle.headers)
    REQUEST_ID.set(request_id)  # this task's context: its log lines and its legs
    REQUEST_START.set(start)
    response: Response | None = None
    try:
        response = await front.answer(endpoint, b"".join(cycle.body))
        if isinstance(response, StreamingResponse):  # counted as it ends
            await _write(cycle, front.count(response, endpoint, start), request_id)
        else:  # counted once written: off the client's wait
            await _write(cycle, response, request_id)
            front.count(response, endpoint, start)
    except asyncio.CancelledError:
        if cycle.disconnected:  # the client left: nothing more to write
            if response is None:
                front.count(Response(status_code=499), endpoint, start)
            return
        if not cycle.response_started and front.stopping.is_set:
            await _write(
                cycle,
                _error_body(
                    503, f"server shutting down: {front.who} was stopped while this request ran"
                ),
                request_id,
            )
        raise
    except Exception:
        log.exception("the front failed on a %s request", endpoint)
        if not cycle.response_started:
            cycle.keep_alive = False
            await _write(cycle, _error_body(500, f"internal error in {front.who}"), request_id)
        else:
            cycle.transport.close()


def front_protocol(front: FrontHandler) -> type[HttpToolsProtocol]:
    """An uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) that serves the
    requests ``front.endpoint`` names with ``front`` and every other one with the ASGI
    app (uvicorn's own way)."""

    class RouterFrontProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with some POSTs served by :class:`FrontHandler`
        (pdserve/http/front.py)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._front: tuple[asyncio.Task, FrontCycle] | None = None
            self._head_refused = False
            self._refusal: bytes | str | None = None  # a refused request's answer, held back
            self._in_head = False
            self._head_read = 0
            self._before: Any = None  # the request before the one being read

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True  # until its headers are complete
            self._head_read = 0  # bytes read since, in later reads

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_read += len(data)
            super().data_received(data)
            # httptools holds a header's bytes until the header ends: a head that never
            # ends is refused once this much of it was read
            if (
                self._in_head
                and self._head_read > MAX_HEAD_BYTES
                and not self._head_refused
                and not self.transport.is_closing()
            ):
                self._head_refused = True
                self.send_400_response("")

        def send_400_response(self, msg: str) -> None:
            """The answer to a request the parser refused (uvicorn's 400; 431 JSON when the
            head was too large), then the connection closes. Requests before it on the
            connection (pipelined, or a stream still running) are answered first: uvicorn
            writes its 400 at once, into the middle of an answer in flight."""
            if self._head_refused:  # a new id: the head that would carry one is refused
                request_id = request_id_from("")
                error = error_json(
                    431, f"the request's line and headers are over {MAX_HEAD_BYTES} bytes"
                )
                error["request_id"] = request_id
                body = json.dumps(error, separators=(",", ":")).encode()
                self._refusal = (
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n"
                    b"%b: %b\r\nconnection: close\r\n\r\n%b"
                    % (len(body), _REQUEST_ID_NAME, request_id.encode("latin-1"), body)
                )
            else:
                self._refusal = msg
            self.flow.pause_reading()  # nothing after a refused request is read
            if not self._answering():
                self._refuse()

        def _answering(self) -> bool:
            """Whether an earlier request's answer is still being written or queued. When
            the refused request is the current one (its head was read, its body was not:
            a bad chunk), it leaves the pipeline (it is never served) and only the request
            before it counts: waiting for its own answer would hold the refusal forever."""
            cycle = self.cycle
            if cycle is not None and (
                not cycle.body_done
                if isinstance(cycle, FrontCycle)
                else getattr(cycle, "more_body", False)
            ):
                for item in [i for i in self.pipeline if i[0] is cycle]:
                    self.pipeline.remove(item)
                before = self._before
                return before is not None and not getattr(before, "response_complete", True)
            busy = cycle is not None and not getattr(cycle, "response_complete", True)
            return busy or bool(self.pipeline)

        def _refuse(self) -> None:
            refusal, self._refusal = self._refusal, None
            if refusal is None or self.transport.is_closing():
                return
            if isinstance(refusal, bytes):
                self.transport.write(refusal)
                self.transport.close()
            else:
                super().send_400_response(refusal)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._refusal is not None:
                self.flow.pause_reading()  # (super resumed it)
                if not self._answering():
                    self._refuse()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._before = self.cycle  # the request before this one (answered or not)
            size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers)
            if size > MAX_HEAD_BYTES:
                self._head_refused = True
                raise _HeadTooLarge  # the parser stops; uvicorn answers it (send_400_response)
            parser = self.parser
            endpoint = (
                front.endpoint(parser.get_method(), self.url, self.headers)
                if parser.get_http_version() == "1.1" and not parser.should_upgrade()
                else None
            )
            if endpoint is None:
                return super().on_headers_complete()
            existing = self.cycle
            self.cycle = cycle = FrontCycle(  # type: ignore[assignment]
                endpoint,
                self.headers,
                self.transport,
                self.flow,
                self.server_state.default_headers,
                parser.should_keep_alive(),
                self.expect_100_continue,
                self.on_response_complete,
                front.count,
            )
            if existing is None or existing.response_complete:
                self._release(cycle)
            else:  # pipelined: its turn comes when the one before has answered
                self.flow.pause_reading()
                self.pipeline.appendleft((cycle, None))  # type: ignore[arg-type]

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if isinstance(cycle, FrontCycle):
                cycle.body.append(body)
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
            cycle = self.cycle
            if not isinstance(cycle, FrontCycle):
                return super().on_message_complete()
            cycle.body_done = True
            if cycle.released:
                self._start(cycle)

        def _release(self, cycle: FrontCycle) -> None:
            """Its turn on the connection: served once its body is whole."""
            cycle.released = True
            if cycle.body_done:
                self._start(cycle)
            elif cycle.waiting_for_100_continue and not self.transport.is_closing():
                cycle.waiting_for_100_continue = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

        def _start(self, cycle: FrontCycle) -> None:
            task = self.loop.create_task(_serve(front, cycle))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)
            self._front = (task, cycle)

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if isinstance(cycle, FrontCycle):  # a pipelined one's turn
                self._release(cycle)
            else:
                super()._start_asgi_task(cycle, app)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            if self._front is not None:
                task, cycle = self._front
                if not task.done() and not cycle.response_complete:
                    cycle.disconnected = True
                    task.cancel()  # the handler ends (the router's legs close: the workers abort)

    return RouterFrontProtocol
