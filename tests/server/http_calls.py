"""HTTP calls of the server tests that talk to a real worker (the ``worker`` fixture:
tests/server/conftest.py)."""

from __future__ import annotations

import json

import httpx

from pdserve_procs import Proc


def post(worker: Proc, path: str, body, **kw) -> httpx.Response:
    return httpx.post(worker.url + path, json=body, timeout=60.0, **kw)


def sse_events(resp: httpx.Response) -> list:
    """The JSON payloads of an SSE body; asserts it ends with [DONE]."""
    events = [
        line[len("data: ") :] for line in resp.text.split("\n\n") if line.startswith("data: ")
    ]
    assert events and events[-1] == "[DONE]", resp.text[-300:]
    return [json.loads(e) for e in events[:-1]]
