"""OpenAI's error body, shared by the worker and the router (no engine imports)."""

from __future__ import annotations

from pdserve.tracing import REQUEST_ID

_TYPES = {
    400: "invalid_request_error",
    409: "conflict_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_json(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's error object.

    ``status`` is the HTTP status (the response's, not in the body): it picks ``type``
    (``invalid_request_error`` for 400 and any other 4xx without its own, e.g. 404 (as
    OpenAI's ``model_not_found`` and unknown-URL answers), 405 or 413 (a body over the
    cap: OpenAI has no type of its own for it),
    ``service_unavailable`` for 503, ...), which is
    also what tells errors apart inside a stream.  ``code`` is a string naming the error
    where OpenAI has one (``model_not_found``, ``context_length_exceeded``), else null,
    as OpenAI's API sends it (vLLM and SGLang put the status number there instead; the
    ``openai`` client types ``APIError.code`` as ``str | None``).  Inside an API request
    the body also has ``request_id`` beside ``error`` (whose keys stay OpenAI's four): the
    id its log lines carry on the router and both workers (``pdserve/tracing.py``)."""
    kind = _TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
    body: dict = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    request_id = REQUEST_ID.get()
    if request_id is not None:
        body["request_id"] = request_id
    return body


def http_error_message(status: int, detail: str, method: str, path: str) -> str:
    """The message of an HTTP error raised outside the endpoints: Starlette's words for a
    path no route serves (404) or a method it does not take (405) followed by the
    request's method and path (``Not Found: GET /v1/nothing``, the two OpenAI's "Invalid
    URL" answer names); ``detail`` as it is for another status (a 413's own message)."""
    return f"{detail}: {method} {path}" if status in (404, 405) else detail


def error_status(body: object) -> int | None:
    """The HTTP status an OpenAI error body stands for (its ``error.type``, the inverse of
    :func:`error_json`'s choice: ``invalid_request_error`` 400, ``service_unavailable``
    503, ..., a type of no status of its own 500), or
    None when ``body`` is not an error body. For an error event inside a stream, whose
    HTTP status was 200 already."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None
    kind = error.get("type")
    return next((status for status, name in _TYPES.items() if name == kind), 500)
