"""The worker's FastAPI app: OpenAI + native endpoints, ``/health``, ``/health_generate``,
``/metrics``, ``/get_server_info``; errors in OpenAI's JSON shape."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.disagg.base import KVManager, Role
from pdserve.http.body_limit import BodySizeLimit
from pdserve.http.disconnect import ClientDisconnected
from pdserve.http.head import HeadAsGet
from pdserve.http.http_errors import error_json, http_error_message
from pdserve.http.read_timeout import timed_out
from pdserve.http.shutdown import ShutdownAnswer, ShutdownFlag
from pdserve.server.generate_api import build_generate_router
from pdserve.server.metrics import ServerMetrics
from pdserve.server.openai_api import WorkerContext, build_openai_router
from pdserve.server.responses import ResponseStore, build_responses_router
from pdserve.server.serving import APIError, AsyncEngine, Job, make_params
from pdserve.server.tokenize_api import build_tokenize_router
from pdserve.tracing import RequestContext, Tracing

_COUNTED = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/generate",
    "/tokenize",
    "/detokenize",
)


_UNKNOWN = object()


def _where(loc: tuple, body: Any, missing: bool) -> str:
    """The place of a pydantic error as the messages write it (``messages[0].role``),
    following ``loc`` through the request ``body``: a loc item that names no key of the
    value there is the tag of a union member pydantic tried (``stop.str``, ``content.
    list[TextPart]``) and is left out, except the last item of a ``missing`` error (the
    absent field's name)."""
    # _UNKNOWN: no body, or a place it does not have; a JSON null is a value (``input.str``
    # of ``"input": null`` is a union member's tag, as of ``"input": 5``)
    out, value = "", _UNKNOWN if body is None else body
    for i, key in enumerate(loc):
        if isinstance(key, int):
            out += f"[{key}]"
            value = (
                value[key]
                if isinstance(value, list) and -len(value) <= key < len(value)
                else _UNKNOWN
            )
        elif isinstance(value, dict) and key in value:
            out, value = f"{out}.{key}" if out else str(key), value[key]
        elif (missing and i == len(loc) - 1) or value is _UNKNOWN:
            out, value = f"{out}.{key}" if out else str(key), _UNKNOWN  # an absent field
        # else: a union member's tag
    return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a request's validation errors: each error as ``place: text``
    (our validators' own text as is when it starts with its place), ``param`` the place
    of the first one, as precise as its text names it (``messages[0].content`` for an
    error raised on ``messages``)."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"request body is not valid JSON: {detail}".rstrip(": "), None
        loc = tuple(err.get("loc", ()))
        # body, query (``limit`` of input_items), path: the place is the field's name
        loc = loc[1:] if loc[:1] in (("body",), ("query",), ("path",)) else loc
        where = _where(loc, exc.body, err.get("type") == "missing")
        msg = str(err.get("msg"))
        if err.get("type") == "value_error":  # our validators' ValueError, without pydantic's
            msg = str((err.get("ctx") or {}).get("error", msg))  # "Value error, " prefix
        named = where and re.match(re.escape(where) + r"((\[\d+\]|\.\w+)*)[ :]", msg)
        if named:  # the text names its place, maybe a finer one than the loc's
            where += named.group(1)
        param = param or (where or None)
        parts.append(msg if named or not where else f"{where}: {msg}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


class _RequestMetrics:
    """ASGI middleware: counts finished API requests by status and observes their latency
    (streams: until the last byte). API bodies are always JSON, so a request without a
    Content-Type (``curl -d``) is read as JSON too."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in _COUNTED:
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), {"code": 499}
        headers = scope.get("headers") or []
        if not any(k.lower() == b"content-type" and b"json" in v.lower() for k, v in headers):
            scope = dict(
                scope,
                headers=[(k, v) for k, v in headers if k.lower() != b"content-type"]
                + [(b"content-type", b"application/json")],
            )

        ended = {"body": False, "client": False}

        async def receive_wrapper():
            message = await receive()
            if message["type"] == "http.disconnect" and not ended["body"]:
                ended["client"] = True  # left before the last byte
            return message

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            try:
                await send(message)
            except OSError:  # the client is gone (starlette: ClientDisconnect)
                ended["client"] = True
                raise
            if message["type"] == "http.response.body" and not message.get("more_body"):
                ended["body"] = True

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            # a stream the client abandoned after its 200 started: 499 (client closed
            # request), as the router counts it
            code = 499 if ended["client"] and not ended["body"] else status["code"]
            if timed_out(scope):  # its body stopped arriving: answered 408
                code = 408
            self.metrics.requests.labels(path, str(code)).inc()
            self.metrics.e2e.labels(path).observe(time.perf_counter() - start)


def build_worker_app(
    ctx: WorkerContext,
    engine: AsyncEngine,
    metrics: ServerMetrics,
    *,
    kv_managers: dict[str, KVManager],
    server_info: Callable[[], dict],
    health_generate_timeout: float,
    max_request_body_bytes: int = 32 * 2**20,
    tracing: Tracing | None = None,
) -> FastAPI:
    """Return the worker app. The engine thread starts with the app's lifespan and stops
    with it; ``kv_managers`` (name -> manager) are shut down after it; a request body over
    ``max_request_body_bytes`` gets 413. Every request runs with a request id (its error
    bodies' ``request_id``, a 404 or 405 too) and, for an API request with ``tracing``, a
    span (``pdserve/tracing.py:RequestContext``); the tracer is shut down (its queued spans
    exported) last. ``HEAD`` is answered as ``GET`` without a body (``http/head.py``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            for manager in kv_managers.values():
                manager.shutdown()
            if tracing is not None:
                await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)

    app = FastAPI(title="pdserve worker", lifespan=lifespan)
    app.include_router(build_openai_router(ctx))
    app.include_router(build_responses_router(ctx, ResponseStore(ctx.responses_store_size)))
    app.include_router(build_generate_router(ctx))
    app.include_router(build_tokenize_router(ctx))
    stopping = ShutdownFlag()
    app.state.before_shutdown = stopping.set  # run by netutil.GracefulServer
    # a request cut by the graceful-shutdown timeout: 503 JSON, not uvicorn's bare 500
    app.add_middleware(ShutdownAnswer, flag=stopping, who="the worker")
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    app.add_middleware(RequestContext, tracing=tracing, paths=_COUNTED)
    app.add_middleware(_RequestMetrics, metrics=metrics)  # counts the 413s too
    app.add_middleware(HeadAsGet)  # outermost: HEAD /health (probes) answered as GET

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_json(400, message, param), status_code=400)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(
            error_json(exc.status, exc.message, exc.param, exc.code), status_code=exc.status
        )

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # exc.headers: Starlette's ``Allow`` of a 405 (RFC 9110 15.5.6 requires it)
        message = http_error_message(
            exc.status_code, str(exc.detail), request.method, request.url.path
        )
        return JSONResponse(
            error_json(exc.status_code, message), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_json(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500
        )

    def problems() -> list[str]:
        found = [] if engine.alive else [engine.error or "engine thread is not running"]
        for name, manager in kv_managers.items():
            try:
                healthy = manager.is_healthy()
            except Exception as exc:  # noqa: BLE001 a failing check means unhealthy
                healthy, name = False, f"{name} ({type(exc).__name__}: {exc})"
            if not healthy:
                found.append(f"KV transfer manager {name} is unhealthy (a background thread died)")
        return found

    @app.get("/health")
    async def health() -> JSONResponse:
        found = problems()
        if found:
            return JSONResponse(error_json(503, "; ".join(found)), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        """One real one-token generation (PD roles: through the fake transfer backend)."""
        found = problems()
        if found:
            return JSONResponse(error_json(503, "; ".join(found)), status_code=503)
        role = ctx.serving.role
        params = make_params(
            temperature=0.0, max_tokens=2 if role == Role.DECODE else 1, ignore_eos=True
        )
        job = Job(ctx.tokenizer.encode("Hello") or [0], params, fake_transfer=role != Role.MIXED)
        try:
            await asyncio.wait_for(ctx.serving.collect(job), health_generate_timeout)
        except asyncio.TimeoutError:
            return JSONResponse(
                error_json(503, f"health generation took over {health_generate_timeout:g} s"),
                status_code=503,
            )
        except APIError as exc:
            return JSONResponse(
                error_json(503, f"health generation failed: {exc.message}"), status_code=503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        return JSONResponse(server_info())

    return app
