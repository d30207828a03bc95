"""OpenAI's error body, shared by the worker and the router (no engine imports)."""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_json(status: int, message: str, param: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``; ``code`` is the HTTP status."""
    kind = _TYPES.get(status, "internal_server_error" if status >= 500 else "error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
