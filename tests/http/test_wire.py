"""The one spelling of JSON bodies and SSE events (pdserve/http/wire.py), which the worker
(Starlette's JSONResponse for whole answers) and the router write alike."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from pdserve.http.wire import SSE_DONE, json_bytes, sse_event
from pdserve.router.errors import sse_error


def test_json_bytes_is_compact_utf8_as_a_worker_answer_is_rendered():
    doc = {"text": "café — 東京", "logprobs": [-0.5, -1.25], "n": None, "ok": True}
    assert (
        json_bytes(doc)
        == '{"text":"café — 東京","logprobs":[-0.5,-1.25],"n":null,"ok":true}'.encode()
    )
    assert json_bytes(doc) == JSONResponse(doc).body
    assert json.loads(json_bytes(doc)) == doc


def test_sse_event_frames_one_json_document_and_the_stream_ends_with_done():
    assert sse_event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_the_router_s_own_error_event_is_spelled_the_same():
    body = sse_error(503, "no decode worker")
    first, rest = body.split(b"\n\n", 1)
    doc = json.loads(first.removeprefix(b"data: "))
    assert doc["error"]["type"] == "service_unavailable"
    assert first + b"\n\n" == sse_event(doc)
    assert rest == SSE_DONE
