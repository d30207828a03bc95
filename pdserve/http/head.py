"""``HEAD`` answered as ``GET`` without its body, for every path of an app.

Load balancers and Kubernetes probes may send ``HEAD /health``; FastAPI's routes declared
with ``@app.get`` accept only ``GET`` (Starlette's own ``Route`` adds ``HEAD`` to a
``GET`` route; FastAPI's ``APIRoute`` does not), so without this such a probe gets a 405.
RFC 9110 9.3.2: the server answers ``HEAD`` with the status and headers it would send for
``GET`` (``Content-Length`` included), and no content. A path that takes no ``GET``
(``POST /v1/completions``) stays a 405 naming its methods in ``Allow``.
"""

from __future__ import annotations

from typing import Any


class HeadAsGet:
    """ASGI middleware: an HTTP ``HEAD`` request goes to ``app`` as a ``GET``; the answer's
    status and headers are sent as they come, its body is not (the server, e.g. uvicorn,
    writes none for ``HEAD`` either: this keeps it so under any server)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            return await self.app(scope, receive, send)

        async def send_head(message) -> None:
            if message["type"] == "http.response.body":
                message = {"type": "http.response.body", "body": b"", **_more(message)}
            await send(message)

        await self.app(dict(scope, method="GET"), receive, send_head)


def _more(message: dict) -> dict:
    """``more_body`` of a body message, when it has one (the end stays the end)."""
    return {"more_body": True} if message.get("more_body") else {}
