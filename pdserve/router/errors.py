"""OpenAI-shaped error bodies and SSE error events produced by the router itself."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from pdserve.http.http_errors import error_json
from pdserve.http.wire import SSE_DONE, sse_event


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """A JSON error response with ``status`` and OpenAI's error body."""
    return JSONResponse(error_json(status, message, param, code), status_code=status)


def sse_error(status: int, message: str) -> bytes:
    """One SSE event carrying an error body, followed by the terminating ``[DONE]`` event."""
    return sse_event(error_json(status, message)) + SSE_DONE


def error_from_worker(status: int, content: bytes, who: str) -> JSONResponse:
    """Pass a worker's error through: its JSON body if it has OpenAI's shape, else a
    wrapped message naming ``who`` (e.g. ``"decode worker http://h:p"``)."""
    try:
        body = json.loads(content)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return JSONResponse(body, status_code=status)
    except (ValueError, UnicodeDecodeError):
        pass
    text = content[:500].decode("utf-8", "replace")
    return error_response(status, f"{who} answered HTTP {status}: {text}")
