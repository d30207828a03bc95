"""A read timeout for uvicorn's HTTP/1.1 protocols (worker, router, bootstrap server): a
client that opens a connection and then sends its request slowly, or stops part-way
(a "slow loris", or a client that hung), no longer holds the connection and its handler
for ever. uvicorn has a keep-alive timeout between requests and none while one is read.

The rule (:func:`with_read_timeout`, ``--request-read-timeout``, default
:data:`DEFAULT_REQUEST_READ_TIMEOUT_S`):

- a request's line and headers must be whole within the timeout of its first byte (a
  deadline for the head, as nginx's ``client_header_timeout`` and Node's
  ``headersTimeout``: bytes dribbled in one at a time do not extend it);
- its body must not pause longer than the timeout between two reads (nginx's
  ``client_body_timeout``: a large body on a slow link may take longer in all, as long
  as it keeps coming; the body's size is bounded by ``--max-request-body-bytes``);
- a new connection that sends nothing within the timeout is closed without an answer.

On expiry the client gets ``408 Request Timeout`` with an OpenAI error body (``request_id``:
the request's ``x-request-id`` when its head was read, else a new one) and the connection
closes: a handler waiting for the body sees the client leave (``http.disconnect``), as if
it had gone; its ASGI ``scope["state"]`` has ``READ_TIMED_OUT`` set, for the apps' metrics to count a
408. Time the server itself stops reading (a pipelined request waiting its turn,
a body the app has not taken yet, ``Expect: 100-continue`` before the body is asked for)
is not counted against the client.

The default, 60 s, is nginx's for both ``client_header_timeout`` and
``client_body_timeout`` (Node's ``headersTimeout`` is 60 s too): long enough for any
client on a working link, short enough that a stuck one is gone within a minute.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import h11
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.http.http_errors import error_json
from pdserve.tracing import REQUEST_ID, REQUEST_ID_HEADER, request_id_from

log = logging.getLogger("pdserve.http")

DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0

_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode("latin-1")

# set True in the ASGI scope's ``state`` (shared by the scope's copies) of a request whose body timed out (answered 408 here; its
# handler sees http.disconnect): the apps' metrics count it as 408, not as a client gone
READ_TIMED_OUT = "pdserve.read_timed_out"

# phases of reading one request: the first byte awaited on a new connection, the head
# (line and headers) arriving, the body arriving; None: no request is being read
_WAIT, _HEAD, _BODY = "wait", "head", "body"


def timed_out(scope: Mapping[str, Any]) -> bool:
    """Whether the request of ``scope`` (ASGI) was answered 408 here: its body stopped
    arriving."""
    state = scope.get("state")
    return isinstance(state, dict) and bool(state.get(READ_TIMED_OUT))


def protocol_class(http: str | type) -> type:
    """The protocol class uvicorn would use for ``http`` (a class, or a name of
    ``uvicorn.Config(http=...)``: ``auto``, ``h11``, ``httptools``)."""
    if isinstance(http, type):
        return http
    return import_from_string(HTTP_PROTOCOLS.get(http, http))


def timeout_answer(
    status_line: bytes,
    message: str,
    request_id: str,
    default_headers: list[tuple[bytes, bytes]],
) -> bytes:
    """A whole HTTP/1.1 answer (``status_line`` e.g. ``b"HTTP/1.1 408 Request Timeout"``)
    whose body is the OpenAI error of ``message`` with ``request_id``, that closes the
    connection."""
    status = int(status_line.split(b" ", 2)[1])
    payload = error_json(status, message)
    payload["request_id"] = request_id
    body = json.dumps(payload, separators=(",", ":")).encode()
    head = [status_line, b"\r\n"]
    for name, value in default_headers:
        head += (name, b": ", value, b"\r\n")
    head += (
        b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
        _REQUEST_ID_NAME + b": " + request_id.encode("latin-1") + b"\r\n",
        b"connection: close\r\n\r\n",
    )
    return b"".join(head) + body


def with_read_timeout(base: Any, timeout_s: float) -> type:
    """``base`` (an uvicorn HTTP protocol class: h11's, httptools', or a subclass such as
    the router's front) with the read timeout of this module, ``timeout_s`` seconds (> 0,
    finite).
    ValueError for a protocol class it does not know."""
    if not 0 < timeout_s < math.inf:
        raise ValueError(f"the request read timeout must be > 0 s and finite, got {timeout_s}")
    if issubclass(base, H11Protocol):
        phases: Any = _H11Phases
    else:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        if not issubclass(base, HttpToolsProtocol):
            raise ValueError(f"no read timeout for the HTTP protocol {base.__name__}")
        phases = _HttpToolsPhases

    class ReadTimeoutProtocol(phases, base):
        read_timeout_s = timeout_s

    ReadTimeoutProtocol.__name__ = ReadTimeoutProtocol.__qualname__ = f"ReadTimeout{base.__name__}"
    return ReadTimeoutProtocol


class _ReadTimeout:
    """The timer and what ends a slow request; the subclasses say which phase of reading
    a request the connection is in (``_phase``). Mixed in before an uvicorn protocol."""

    read_timeout_s: float
    # of the uvicorn protocol this is mixed into
    loop: Any
    transport: Any
    flow: Any
    cycle: Any
    headers: Any
    client: Any
    server_state: Any

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        now = self.loop.time()
        self._rt_phase: str | None = _WAIT
        self._rt_since = now  # when the phase's deadline started (head: its first byte)
        self._rt_last = now  # the last read
        self._rt_read = 0  # bytes read of the current request (for the message)
        self._rt_timer: Any = None
        self._rt_draining = False  # a 408 was written: input dropped until the close
        self._rt_arm(self.read_timeout_s)
        resume = self.flow.resume_reading

        def resume_reading() -> None:
            # the client's time starts again when the server reads again: bytes it sent
            # while reading was paused are only read now (on a loaded machine, maybe
            # after the deadline counted from the last check during the pause)
            if self.flow.read_paused:
                self._rt_last = self.loop.time()
                if self._rt_phase == _HEAD:
                    self._rt_since = self._rt_last
            resume()

        self.flow.resume_reading = resume_reading

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # type: ignore[misc]
        if self._rt_timer is not None:
            self._rt_timer.cancel()
            self._rt_timer = None

    def data_received(self, data: bytes) -> None:
        if self._rt_draining:
            return  # after a 408: dropped until the lingering close
        self._rt_last = self.loop.time()
        super().data_received(data)  # type: ignore[misc]
        self._rt_observe()
        if self._rt_phase in (_HEAD, _BODY):
            self._rt_read += len(data)  # (about: a packet may end one request, begin the next)
        if self._rt_phase is not None and self._rt_timer is None:
            self._rt_arm(self.read_timeout_s)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._rt_observe()  # a pipelined request's head may have been read meanwhile
        if self._rt_phase is not None and self._rt_timer is None:
            self._rt_arm(self.read_timeout_s)

    def _rt_set(self, phase: str | None) -> None:
        """The connection enters ``phase``; a new head's deadline starts now."""
        if phase == _HEAD and self._rt_phase != _HEAD:
            self._rt_since, self._rt_read = self._rt_last, 0
        elif phase == _BODY and self._rt_phase not in (_HEAD, _BODY):
            self._rt_read = 0  # (h11: a head and body's start seen in one read)
        self._rt_phase = phase

    def _rt_observe(self) -> None:
        """Update ``_rt_phase`` from the parser's state (h11); callbacks do it for httptools."""

    def _rt_arm(self, delay: float) -> None:
        self._rt_timer = self.loop.call_later(max(delay, 0.0), self._rt_fire)

    def _rt_paused_by_server(self) -> bool:
        """Whether the server, not the client, is why nothing is read: reading paused
        (pipelining, a body the app has not taken yet, a refused request being answered) or
        a client told to wait for ``100 Continue`` not told yet."""
        cycle = self.cycle
        return bool(self.flow.read_paused) or bool(
            self._rt_phase == _BODY
            and cycle is not None
            and getattr(cycle, "waiting_for_100_continue", False)
        )

    def _rt_fire(self) -> None:
        self._rt_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        self._rt_observe()
        phase = self._rt_phase
        if phase is None:
            return  # nothing being read: the next request's first byte re-arms
        now = self.loop.time()
        if self._rt_paused_by_server():
            self._rt_since = self._rt_last = now  # the client's time starts when reading does
            self._rt_arm(self.read_timeout_s)
            return
        due = (self._rt_last if phase == _BODY else self._rt_since) + self.read_timeout_s
        if now < due:
            self._rt_arm(due - now)
            return
        self._rt_expire(phase)

    def _rt_expire(self, phase: str) -> None:
        """The client was too slow in ``phase``: 408 (nothing on a connection that never
        sent a byte) and the connection closed."""
        timeout = f"{self.read_timeout_s:g} s"
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        transport, cycle = self.transport, self.cycle
        if phase == _WAIT:
            log.info("closed a connection from %s: no request within %s", peer, timeout)
            transport.close()
            return
        if phase == _HEAD:
            request_id = request_id_from("")
            message = (
                f"the request's line and headers did not arrive within {timeout} "
                "(--request-read-timeout)"
            )
        else:
            given = ""
            for name, value in self.headers or ():
                if name == _REQUEST_ID_NAME:
                    given = value.decode("latin-1")
            request_id = request_id_from(given)
            message = (
                f"the request's body stopped arriving: nothing was received for {timeout} "
                "(--request-read-timeout)"
            )
            if cycle is not None and getattr(cycle, "response_started", False):
                # answered already (without reading the whole body): only close
                transport.close()
                return
        token = REQUEST_ID.set(request_id)  # the log line's request id
        try:
            log.warning(
                "408 to %s: %s (%d bytes of the request read)", peer, message, self._rt_read
            )
        finally:
            REQUEST_ID.reset(token)
        self._rt_phase = None
        if cycle is not None and phase == _BODY:
            cycle.disconnected = True  # its handler sees the client leave; nothing more is written
            cycle.message_event.set()
            state = (getattr(cycle, "scope", None) or {}).get("state")
            if isinstance(state, dict):  # an ASGI request: its metrics count a 408
                state[READ_TIMED_OUT] = True
            timed_out = getattr(cycle, "read_timed_out", None)
            if callable(timed_out):  # the router's front (http/front.py): counts its 408
                timed_out()
        transport.write(
            timeout_answer(
                b"HTTP/1.1 408 Request Timeout",
                message,
                request_id,
                self.server_state.default_headers,
            )
        )
        self._rt_linger()

    def _rt_linger(self) -> None:
        """Close after the 408 without losing it: a socket closed while its client is still
        sending answers those bytes with a reset, which can discard the 408 before the
        client reads it (nginx's lingering close). The write side is shut (FIN after the
        answer), what still comes is read and dropped, and the connection closes
        ``min(1 s, the timeout)`` later."""
        transport = self.transport
        self._rt_draining = True
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(min(1.0, self.read_timeout_s), transport.close)


class _HttpToolsPhases(_ReadTimeout):
    """Phases from httptools' parser callbacks (the parser reads every byte it is given:
    pipelined requests' heads too)."""

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._rt_set(_HEAD)

    def on_headers_complete(self) -> None:
        self._rt_set(_BODY)
        super().on_headers_complete()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._rt_set(None)
        super().on_message_complete()  # type: ignore[misc]


class _H11Phases(_ReadTimeout):
    """Phases from h11's connection state: the client's side sending a body, or idle with
    bytes of a head not parsed yet."""

    conn: Any

    def _rt_observe(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._rt_set(_BODY)
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._rt_set(_HEAD)
        elif state is h11.IDLE and self._rt_phase == _WAIT:
            pass  # a new connection that sent nothing yet
        else:
            self._rt_set(None)
