"""The bytes of a JSON answer and of one SSE event, written the same way by the worker and
the router, so a request answered through PD and one answered by a mixed worker differ in
content only, never in spelling.

Compact separators and raw UTF-8, as Starlette's ``JSONResponse`` renders a body (and as
the OpenAI API sends its own): ``{"a":1,"b":"é"}``.
"""

from __future__ import annotations

import json
from typing import Any


def json_bytes(data: Any) -> bytes:
    """``data`` as compact UTF-8 JSON (``(",", ":")`` separators, no ASCII escaping).

    Raises ``TypeError`` for a value JSON cannot hold."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(data: Any) -> bytes:
    """One server-sent event carrying ``data`` as JSON: ``b"data: {...}\\n\\n"``."""
    return b"data: " + json_bytes(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream."""
