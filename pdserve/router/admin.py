"""The router's admin API: add, remove (drain) and list workers at run time, so an operator
or an orchestrator scales prefill and decode without restarting the router.

Every route needs ``Authorization: Bearer <token>`` with the token of the router's
config (``--admin-token-file`` or ``PDSERVE_ROUTER_ADMIN_TOKEN``); without a configured
token the routes answer 403 (admin API off). Errors have OpenAI's error shape.

- ``GET /admin/workers``: every worker per role, with health, draining, outstanding.
- ``POST /admin/workers`` ``{"url": ..., "role": ...}``: add a worker; it is probed at
  once (the same checks as the periodic health check) and takes requests as soon as it is
  healthy. 201 with its state; 400 for a bad role or URL, 409 for a URL already present.
- ``DELETE /admin/workers?url=...&wait_s=...``: drain a worker (no new requests; the ones
  in flight finish) and remove it when its last request ended. 200 ``{"removed": true}``
  when that happened within ``wait_s`` seconds (default 0), else 202 ``{"removed":
  false}`` (it stays listed as draining until its requests end); 404 for an unknown URL.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.disagg.base import Role
from pdserve.router.errors import error_response
from pdserve.router.workers import WorkerPool, WorkerState, unhealthy_prefill_peers

MAX_WAIT_S = 3600.0


def worker_json(pool: WorkerPool, w: WorkerState) -> dict:
    """The admin/server-info view of one worker (a decode's also lists the prefill
    bootstrap addresses it reports unhealthy: the router pairs it with none of them)."""
    view = {
        "url": w.url,
        "role": w.role,
        "healthy": w.healthy,
        "draining": w.url in pool.draining,
        "outstanding": w.outstanding,
        "last_error": w.last_error,
    }
    if w.role == Role.DECODE:
        view["unhealthy_prefill_peers"] = unhealthy_prefill_peers(w)
    return view


def build_admin_router(pool: WorkerPool, token: str | None) -> APIRouter:
    """The ``/admin/workers`` routes over ``pool``, guarded by ``token`` (None = off)."""
    router = APIRouter()

    def denied(request: Request) -> Response | None:
        if token is None:
            return error_response(
                403,
                "the admin API is off: start the router with --admin-token-file or "
                "PDSERVE_ROUTER_ADMIN_TOKEN",
            )
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            value.strip().encode(), token.encode()
        ):
            return error_response(401, "admin API: missing or wrong bearer token")
        return None

    @router.get("/admin/workers")
    async def list_workers(request: Request) -> Response:
        if (no := denied(request)) is not None:
            return no
        return JSONResponse(
            {role: [worker_json(pool, w) for w in ws] for role, ws in pool.workers.items()}
        )

    @router.post("/admin/workers")
    async def add_worker(request: Request) -> Response:
        if (no := denied(request)) is not None:
            return no
        try:
            body = await request.json()
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        url, role = body.get("url"), body.get("role")
        for name, value in (("url", url), ("role", role)):
            if not isinstance(value, str) or not value:
                return error_response(400, f"{name} must be a non-empty string", param=name)
        assert isinstance(url, str) and isinstance(role, str)
        if pool.find(url) is not None:
            return error_response(409, f"url {url.rstrip('/')} is already a worker", param="url")
        try:
            worker = await pool.add(url, role)
        except ValueError as exc:
            param = "role" if str(exc).startswith("role") else "url"
            return error_response(400, str(exc), param=param)
        return JSONResponse(worker_json(pool, worker), status_code=201)

    @router.delete("/admin/workers")
    async def remove_worker(request: Request, url: str = "", wait_s: float = 0.0) -> Response:
        if (no := denied(request)) is not None:
            return no
        if not 0 <= wait_s <= MAX_WAIT_S:
            return error_response(400, f"wait_s must be in [0, {MAX_WAIT_S:g}]", param="wait_s")
        worker = pool.find(url) if url else None
        if worker is None:
            return error_response(404, f"no worker with url {url!r}", param="url")
        removed = await pool.drain(worker, timeout_s=wait_s)
        return JSONResponse(
            dict(worker_json(pool, worker), removed=removed), status_code=200 if removed else 202
        )

    return router
