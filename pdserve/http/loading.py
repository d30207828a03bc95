"""503 answers on a worker's port while its model loads.

A worker binds its port before it loads the model, so that a taken port fails at once
rather than after a minute of loading. Until uvicorn takes the socket over, the kernel
would accept connections on it that nobody reads: a client (``curl /health``, a load
balancer's probe, a router added by hand) would hang until the model was up. vLLM and
SGLang answer nothing during that time either (their port opens late); we answer every
request at once with OpenAI's error body, status 503, type ``service_unavailable`` and a
``Retry-After`` header, so that a probe knows the worker is alive and not ready.

:func:`answer_503_while_loading` runs that answerer on a thread of its own for the length
of a ``with`` block and joins it on the way out; the socket is left as it was (blocking,
listening) for uvicorn.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import select
import socket
import threading
from collections.abc import Iterator

from pdserve.http.http_errors import error_json
from pdserve.tracing import REQUEST_ID_HEADER, request_id_from

log = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the answerer looks at its stop flag, seconds
_READ_S = 1.0  # how long it waits for a request's head, seconds
_HEAD_LIMIT = 65536  # bytes of a request read before answering anyway


# a request's x-request-id header line, in its head's bytes
_REQUEST_ID_LINE = re.compile(rb"\r\nx-request-id:[ \t]*([^\r\n]*)", re.IGNORECASE)


def loading_response(message: str, head: bytes = b"") -> bytes:
    """The whole HTTP/1.1 response sent while loading to the request whose ``head`` was
    read: status 503, a JSON error body (:func:`error_json`) with the request's id (its
    ``x-request-id`` when well-formed, else a new one; also the header of that name),
    ``Retry-After: 1`` and ``Connection: close``; to a ``HEAD`` request the same without
    the body."""
    given = _REQUEST_ID_LINE.findall(head.split(b"\r\n\r\n", 1)[0])
    request_id = request_id_from(given[-1].strip().decode("latin-1") if given else "")
    body = json.dumps({**error_json(503, message), "request_id": request_id}).encode()
    lines = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"{REQUEST_ID_HEADER}: {request_id}\r\n"
        "retry-after: 1\r\n"
        "connection: close\r\n\r\n"
    )
    return lines.encode() + (b"" if head.startswith(b"HEAD ") else body)


def _answer(conn: socket.socket, message: str) -> None:
    """Read the request's head (so that closing does not reset the connection under an
    unread request), send :func:`loading_response` of ``message``, close."""
    with conn:
        conn.settimeout(_READ_S)
        received = b""
        try:
            while b"\r\n\r\n" not in received and len(received) < _HEAD_LIMIT:
                chunk = conn.recv(4096)
                if not chunk:
                    return  # the client went away
                received += chunk
            conn.sendall(loading_response(message, received))
            conn.shutdown(socket.SHUT_WR)
        except OSError:  # a client that stalls or resets: nothing to answer
            return


def _serve(sock: socket.socket, message: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            ready, _, _ = select.select([sock], [], [], _POLL_S)
            if not ready or stop.is_set():
                continue
            conn, _ = sock.accept()
        except OSError as exc:  # the socket closed under us: nothing left to answer
            log.debug("loading answerer stops: %s", exc)
            return
        _answer(conn, message)


@contextlib.contextmanager
def answer_503_while_loading(sock: socket.socket, message: str) -> Iterator[None]:
    """Answer every connection on the listening ``sock`` with a 503 carrying ``message``
    (:func:`loading_response`) until the block ends; then stop and join the answering
    thread (within ~0.1 s plus one request's read time, :data:`_READ_S`) and hand the
    socket back unchanged. Connections that arrive after the block wait in the backlog
    for the real server."""
    stop = threading.Event()
    thread = threading.Thread(
        target=_serve,
        args=(sock, message, stop),
        name="pdserve-loading-503",
        daemon=True,
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
