"""``pdserve/tracing.py`` without processes: the OTLP URL, phases from boundaries, the
request id (taken from the caller when well-formed, in log records, in error bodies, in
engine ids), and the middleware's spans through the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import logging

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdserve import tracing
from pdserve.http.http_errors import error_json


def test_traces_url():
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        tracing.traces_url("c:4318")


def test_contiguous_phases_skip_unreached_and_clamp():
    bounds = [("a", 1.0), ("b", 0.0), ("c", 3.0), ("d", 2.5)]
    assert tracing.contiguous(bounds, 5.0) == [("a", 1.0, 3.0), ("c", 3.0, 3.0), ("d", 3.0, 5.0)]
    assert tracing.contiguous([], 1.0) == []


def test_request_id_in_logs_errors_and_engine_ids(caplog):
    record = logging.LogRecord("x", logging.INFO, "f", 1, "m", None, None)
    tracing.RequestIdFilter().filter(record)
    assert record.request_id == "-"
    assert set(error_json(400, "m")) == {"error"}
    assert len(tracing.engine_request_id()) == 32
    token = tracing.REQUEST_ID.set("abc-1")
    try:
        tracing.RequestIdFilter().filter(record)
        assert record.request_id == "abc-1"
        assert error_json(500, "m")["request_id"] == "abc-1"
        assert set(error_json(500, "m")["error"]) == {"message", "type", "param", "code"}
        assert tracing.engine_request_id().startswith("abc-1-")
        assert tracing.outgoing_headers() == {"x-request-id": "abc-1"}  # tracing off
    finally:
        tracing.REQUEST_ID.reset(token)


def _app(status: int, *, stream_abort: bool = False):
    """An ASGI app answering ``status``; a phase span under the request's span; with
    ``stream_abort`` it sends a first body chunk and then fails as a gone client would."""

    async def app(scope, receive, send):
        current = tracing.CURRENT_SPAN.get()
        assert current is not None and tracing.REQUEST_ID.get() is not None
        assert "traceparent" in tracing.outgoing_headers()
        now = tracing.REQUEST_START.get()
        tracing.add_phases(current, [("work", now, now + 0.001)], {"k": 1})
        await send({"type": "http.response.start", "status": status, "headers": []})
        if stream_abort:
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            raise OSError("client gone")
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def _run(app, tracer, headers=()):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/generate", "headers": list(headers)}
    middleware = tracing.RequestContext(app, tracer, ["/generate"])
    try:
        asyncio.run(middleware(scope, receive, send))
    except OSError:
        pass
    return sent


@pytest.fixture
def tracer():
    t = tracing.Tracing("http://127.0.0.1:9/v1/traces", "decode")  # never exported to
    memory = InMemorySpanExporter()
    t.provider.add_span_processor(SimpleSpanProcessor(memory))
    yield t, memory
    t.provider.shutdown()


def test_middleware_spans_continue_the_callers_trace(tracer):
    t, memory = tracer
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    sent = _run(_app(200), t, [(b"traceparent", parent.encode()), (b"x-request-id", b"r-1")])
    assert (b"x-request-id", b"r-1") in sent[0]["headers"]
    spans = {s.name: s for s in memory.get_finished_spans()}
    request, work = spans["decode.request"], spans["work"]
    assert format(request.context.trace_id, "032x") == "ab" * 16
    assert format(request.parent.span_id, "016x") == "cd" * 8
    assert work.parent.span_id == request.context.span_id
    assert request.attributes["pdserve.request_id"] == "r-1" and work.attributes["k"] == 1
    assert request.status.status_code is not StatusCode.ERROR


def test_middleware_marks_5xx_and_aborted_streams_and_drops_bad_ids(tracer):
    t, memory = tracer
    sent = _run(_app(503), t, [(b"x-request-id", b"bad id with spaces")])
    given = dict(sent[0]["headers"])[b"x-request-id"]
    assert given != b"bad id with spaces" and len(given) == 32
    _run(_app(200, stream_abort=True), t)
    requests = [s for s in memory.get_finished_spans() if s.name == "decode.request"]
    assert [s.status.status_code for s in requests] == [StatusCode.ERROR, StatusCode.ERROR]
    assert "abort" in requests[1].attributes["error.message"]
