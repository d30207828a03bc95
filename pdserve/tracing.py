"""Where a request's time goes: OpenTelemetry traces (OTLP/HTTP, off by default) and the
request id that follows a request through router, prefill and decode.

Shared by the router and the workers (both import this leaf; it imports nothing of theirs).

- :class:`Tracing` owns one process's ``TracerProvider``: spans are exported by the SDK's
  ``BatchSpanProcessor`` from its own thread, never on the engine thread or the event loop.
  ``Tracing.create(None, ...)`` is ``None``: with tracing off, callers do one ``is None``
  check and nothing else.
- :class:`RequestContext` (ASGI middleware) gives each API request an id (the client's
  ``x-request-id`` header when well-formed, else a new one) and, with tracing on, a server span continuing
  the caller's W3C ``traceparent`` (the router's for a worker, the client's for the
  router); the span ends after the response's last byte, with an error status for a 5xx
  or a client gone before the end.
- :func:`outgoing_headers` are the headers a leg to a worker carries (``traceparent`` of
  the current span, ``x-request-id``).
- :func:`add_phases` records phase spans (explicit start/end) under a span, from
  ``time.perf_counter()`` floats (:func:`epoch_ns` converts them).
- :class:`RequestIdFilter` puts ``request_id`` on every log record (``-`` outside a
  request); :func:`pdserve.http.netutil.configure_logging` installs it.
"""

from __future__ import annotations

import contextvars
import logging
import random
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

TRACEPARENT = "traceparent"
REQUEST_ID_HEADER = "x-request-id"
# a caller's x-request-id is kept when it looks like one (else a new id is drawn)
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# The current API request's id, and its tracer, server span and the phase spans that end
# with it (None: tracing off or no request).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdserve_request_id", default=None
)
CURRENT_SPAN: contextvars.ContextVar[tuple[Tracing, Any, list] | None] = contextvars.ContextVar(
    "pdserve_current_span", default=None
)
# When the current API request entered the app (``time.perf_counter()``; 0.0: unknown).
REQUEST_START: contextvars.ContextVar[float] = contextvars.ContextVar(
    "pdserve_request_start", default=0.0
)


def _epoch_offset_ns(pairs: int = 32) -> int:
    """``time_ns() - perf_counter_ns()`` from the tightest of ``pairs`` readings of the wall
    clock between two perf_counter reads: a preemption between the reads (a busy 2-core
    machine) would skew a single pair by as long, and with it every Unix time this process
    reports (the bench's ``to_worker`` stage compares them with the client's clock)."""
    best_gap, offset = None, 0
    for _ in range(pairs):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best_gap is None or after - before < best_gap:
            best_gap, offset = after - before, wall - (before + after) // 2
    return offset


# perf_counter -> Unix epoch, fixed once per process: spans need epoch nanoseconds, the
# engine records perf_counter floats. A wall-clock step after start (NTP) shifts this
# process's span times by as much; durations are unaffected.
_EPOCH_OFFSET_NS = _epoch_offset_ns()


def epoch_ns(perf: float) -> int:
    """``time.perf_counter()`` seconds of this process as Unix epoch nanoseconds."""
    return int(perf * 1e9) + _EPOCH_OFFSET_NS


def traces_url(endpoint: str, name: str = "otlp_traces_endpoint") -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: as given when it has a path, else with
    OTLP's ``/v1/traces``. ValueError naming ``name`` for a URL that is not http(s)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"{name} must be an http:// or https:// URL, got {endpoint!r} "
            "(an OTLP/HTTP collector, e.g. http://127.0.0.1:4318)"
        )
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class Tracing:
    """One process's tracer: ``service`` names the process in the traces (``router``,
    ``prefill``, ``decode``, ``mixed``); spans go to ``endpoint`` (OTLP/HTTP protobuf)
    in batches from the SDK's exporter thread. Build it with :meth:`create`."""

    def __init__(self, endpoint: str, service: str, *, schedule_delay_ms: int = 500) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = traces_url(endpoint)
        self.service = service
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=self.endpoint, timeout=5),
                schedule_delay_millis=schedule_delay_ms,
            )
        )
        self.tracer = self.provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def create(cls, endpoint: str | None, service: str) -> Tracing | None:
        """A tracer for ``endpoint``, or None when it is None or empty (tracing off)."""
        return cls(endpoint, service) if endpoint else None

    def start_request(self, name: str, headers: Mapping[str, str], attributes: dict) -> Any:
        """A server span ``name`` continuing the ``traceparent`` in ``headers`` (a new
        trace without one)."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(carrier=dict(headers))
        return self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )

    def inject(self, span: Any, headers: dict[str, str]) -> None:
        """Put ``span``'s ``traceparent`` into ``headers``."""
        from opentelemetry.trace import set_span_in_context

        self._propagator.inject(headers, context=set_span_in_context(span))

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter thread (bounded by its timeout)."""
        self.provider.shutdown()


def engine_request_id() -> str:
    """A new engine request id: the current API request's id and a unique suffix
    (``<request id>-<8 hex>``; a bare hex id outside a request), so the engine thread's
    log lines that name a request name its API request too."""
    request_id = REQUEST_ID.get()
    suffix = uuid.uuid4().hex
    return suffix if request_id is None else f"{request_id}-{suffix[:8]}"


def outgoing_headers() -> dict[str, str]:
    """Headers for a request to a worker on behalf of the current API request: its
    ``x-request-id`` and, with tracing on, the ``traceparent`` of its span."""
    headers: dict[str, str] = {}
    request_id = REQUEST_ID.get()
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    current = CURRENT_SPAN.get()
    if current is not None:
        current[0].inject(current[1], headers)
    return headers


def phase_so_far(name: str, attributes: dict) -> None:
    """With tracing on: a phase span ``name`` of the current request from its start
    until now, ``attributes`` on it and on the request's span; else nothing."""
    current = CURRENT_SPAN.get()
    if current is not None:
        start = REQUEST_START.get() or time.perf_counter()
        add_phases(current, [(name, start, time.perf_counter())], attributes)


def current_error(message: str) -> None:
    """With tracing on: mark the current request's span failed with ``message``."""
    current = CURRENT_SPAN.get()
    if current is not None:
        set_error(current[1], message)


def set_error(span: Any, message: str) -> None:
    """Mark ``span`` failed with ``message`` (status ERROR, ``error.message``)."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.message", message[:500])
    span.set_status(Status(StatusCode.ERROR, message[:500]))


def add_phases(
    current: tuple[Tracing, Any, list],
    phases: Iterable[tuple[str, float, float]],
    attributes: dict | None = None,
    error: str | None = None,
    events: Mapping[str, list[tuple[float, int]]] | None = None,
    marks: Mapping[str, float] | None = None,
    open_last: bool = False,
) -> None:
    """Child spans of ``current`` (a ``CURRENT_SPAN`` value: tracer, span, spans ending
    with it), one per ``(name, start, end)`` (perf_counter seconds), with ``attributes``
    on each (and on the request's span); with ``error``, the last phase and the request's
    span are marked failed; ``open_last``: the last phase ends with the request's span
    (after the response's last byte) instead of at its ``end``. ``events[name]``: ``(perf_counter time, tokens)`` pairs added to phase
    ``name`` as ``tokens`` events (the decode steps a client saw); ``marks``: events of
    the request's span at perf_counter times (e.g. ``first_token``; 0.0: skipped)."""
    from opentelemetry.trace import set_span_in_context

    tracing, span, ending = current
    parent = set_span_in_context(span)
    tracer = tracing.tracer
    phases = list(phases)
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        set_error(span, error)
    for mark, when in (marks or {}).items():
        if when:
            span.add_event(mark, timestamp=epoch_ns(when))
    for i, (name, start, end) in enumerate(phases):
        child = tracer.start_span(
            name, context=parent, start_time=epoch_ns(start), attributes=attributes
        )
        for when, count in (events or {}).get(name, ()):
            child.add_event("tokens", {"count": count}, timestamp=epoch_ns(when))
        last = i == len(phases) - 1
        if error is not None and last:
            set_error(child, error)
        if last and open_last:
            ending.append(child)
        else:
            child.end(end_time=epoch_ns(end))


def contiguous(bounds: Iterable[tuple[str, float]], end: float) -> list[tuple[str, float, float]]:
    """Phases from boundaries: ``[(name, start), ...]`` in time order (a 0.0 start: not
    reached, skipped; a start before the previous one is taken as the previous one), each
    phase ending where the next reached one starts, the last at ``end``."""
    reached = [(name, t) for name, t in bounds if t]
    out: list[tuple[str, float, float]] = []
    last = 0.0
    for i, (name, t) in enumerate(reached):
        start = max(t, last)
        stop = reached[i + 1][1] if i + 1 < len(reached) else end
        stop = max(stop, start)
        out.append((name, start, stop))
        last = stop
    return out


# New request ids: 128 random bits from a generator seeded from os.urandom at import (ids
# only need to differ; os.urandom's syscall per request was ~2 % of the router's CPU).
_NEW_IDS = random.Random()


def request_id_from(given: str) -> str:
    """A request's id: ``given`` (the caller's ``x-request-id``) when it is 1-128 of
    ``A-Za-z0-9._:-``, else a new hex id."""
    if given and _REQUEST_ID_OK.fullmatch(given):
        return given
    return f"{_NEW_IDS.getrandbits(128):032x}"


class RequestContext:
    """ASGI middleware: every HTTP request runs with its request id (``x-request-id`` from
    the caller when it is 1-128 of ``A-Za-z0-9._:-``, else a new hex id; echoed in the
    response headers, and the ``request_id`` of its error bodies, a 404 for an unknown path
    or a 405 too) and, for one of ``paths`` with ``tracing``, a server span
    ``<service>.request`` continuing the caller's
    ``traceparent`` (attributes: ``http.route``, ``pdserve.request_id``,
    ``http.status_code``), ended after the last byte; a 5xx, or a client gone before the
    last byte (``client aborted``), sets its status to ERROR."""

    def __init__(self, app: Any, tracing: Tracing | None, paths: Iterable[str]) -> None:
        self.app, self.tracing, self.paths = app, tracing, frozenset(paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given, wanted = b"", REQUEST_ID_HEADER.encode()
        for name, value in scope["headers"]:  # the last one, as a dict of them would keep
            if name.lower() == wanted:
                given = value
        request_id = request_id_from(given.decode("latin-1"))
        id_token = REQUEST_ID.set(request_id)
        start_token = REQUEST_START.set(time.perf_counter())
        span, current = None, None
        ending: list = []  # phase spans that end with the request's (add_phases open_last)
        if self.tracing is not None and scope.get("path") in self.paths:
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            span = self.tracing.start_request(
                f"{self.tracing.service}.request",
                headers,
                {"http.route": scope["path"], "pdserve.request_id": request_id},
            )
            current = (self.tracing, span, ending)
        span_token = CURRENT_SPAN.set(current)
        state = {"status": 0, "done": False}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", []),
                    (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")),
                ]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            REQUEST_ID.reset(id_token)
            REQUEST_START.reset(start_token)
            CURRENT_SPAN.reset(span_token)
            if span is not None:
                for child in ending:
                    child.end()
                span.set_attribute("http.status_code", state["status"])
                if not state["done"] or state["status"] == 499:
                    set_error(span, "client aborted before the last byte")
                elif state["status"] >= 500:
                    set_error(span, f"HTTP {state['status']}")
                span.end()


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id``: the current request's id, ``-`` outside a request."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get() or "-"
        return True
