"""The router's FastAPI app: OpenAI + native endpoints forwarded by the dispatcher, plus
``/health``, ``/metrics``, ``/get_server_info``, ``/v1/models`` (and ``/v1/models/{id}``)
and the admin API (:mod:`pdserve.router.admin`)."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from urllib.parse import quote

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route

import pdserve
from pdserve.config import RouterConfig
from pdserve.disagg.base import BOOTSTRAP_FIELDS
from pdserve.gc_watch import process_stats
from pdserve.http.body_limit import BodySizeLimit
from pdserve.http.client import WorkerClient
from pdserve.http.disconnect import ClientDisconnected, cancel_on_disconnect
from pdserve.http.front import FrontHandler, front_protocol
from pdserve.http.head import HeadAsGet
from pdserve.http.http_errors import http_error_message
from pdserve.http.read_timeout import timed_out
from pdserve.http.shutdown import ShutdownAnswer, ShutdownFlag
from pdserve.router.admin import build_admin_router, worker_json
from pdserve.router.dispatch import Dispatcher
from pdserve.router.errors import error_response
from pdserve.router.metrics import RouterMetrics
from pdserve.router.relay import RelayedStream
from pdserve.router.responses import resolve_previous, stored_get
from pdserve.router.workers import NoHealthyWorker, WorkerPool
from pdserve.tracing import RequestContext, Tracing, current_error, outgoing_headers

FORWARDED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate")
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # answered by any one worker
# bodies' `model`
WITH_MODEL = ("/v1/completions", "/v1/chat/completions", "/v1/responses", *TOKENIZER_PATHS)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class BadString(ValueError):
    """A string of the body that is not valid Unicode; ``param`` is its place
    (``messages[0].content``; None for a key of the body itself)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _check_strings(value, where: str = "body") -> None:
    """:class:`BadString` naming the place of a string that is not valid Unicode (a lone
    surrogate from a ``\\ud800`` escape), which could not be re-encoded for the workers."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadString(
                f"{where} is not valid Unicode: a lone surrogate at character {exc.start} "
                "(\\ud800-\\udfff escapes must come in pairs)",
                None if where == "body" else where,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, where)
            _check_strings(item, f"{where}.{key}" if where != "body" else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")


def _finite_float(text: str) -> float:
    """A JSON number as a float; ValueError for one out of a double's range (``1e400``
    parses to inf, which JSON cannot carry on to the workers)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text} is out of range")
    return value


def parse_json_body(raw: bytes):
    """Parse a client body (its bytes) strictly: RFC 8259 JSON only (no NaN/Infinity, which Python's
    parser accepts but JSON cannot carry on to the workers, and no number beyond a double's
    range), strings valid Unicode, nesting within Python's recursion limit.
    Raises ValueError with the reason (:class:`BadString` for a string, naming its place)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
        if b"\\u" in raw:  # a lone surrogate can only come from a \u escape (not UTF-8)
            _check_strings(body)
    except RecursionError:
        raise ValueError("the body is nested too deeply") from None
    return body


def body_error(exc: ValueError) -> Response:
    """The 400 of a body :func:`parse_json_body` refused: naming the string's place
    (``param``) for a :class:`BadString`, else saying the body is not valid JSON."""
    if isinstance(exc, BadString):
        return error_response(400, str(exc), param=exc.param)
    return error_response(400, f"request body is not valid JSON: {exc}")


def build_router_app(config: RouterConfig, *, rng: random.Random | None = None) -> FastAPI:
    """Return the router app for ``config``; health checks start with the app's lifespan
    (one check round runs before the first request is served)."""
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )
    roles: dict[str, Sequence[str]] = (
        {"prefill": config.prefill_urls, "decode": config.decode_urls}
        if config.pd_mode
        else {"mixed": config.worker_urls}
    )
    pool = WorkerPool(
        roles,
        policy=config.policy,
        client=client,
        check_interval=config.health_check_interval,
        check_timeout=config.health_check_timeout,
        failure_threshold=config.health_failure_threshold,
        rng=rng,
    )
    live_rooms: set[int] = set()
    legs = WorkerClient(connect_timeout=10.0)  # the client requests' worker legs
    metrics = RouterMetrics(pool, live_rooms)
    tracer = Tracing.create(config.otlp_traces_endpoint, "router")
    dispatcher = Dispatcher(
        pool,
        legs,
        metrics,
        live_rooms,
        pd_mode=config.pd_mode,
        request_timeout=config.request_timeout,
        max_migrations=config.max_migrations,
        migration_wait=config.migration_wait,
        pd_min_prefill_tokens=config.pd_min_prefill_tokens,
        rng=rng,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.check_all()
        pool.start()
        try:
            yield
        finally:
            await pool.stop()
            await legs.aclose()
            await client.aclose()
            if tracer is not None:  # its queued spans exported
                await anyio.to_thread.run_sync(tracer.shutdown)

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.pool, app.state.dispatcher, app.state.metrics = pool, dispatcher, metrics
    stopping = ShutdownFlag()

    def before_shutdown() -> None:  # run by netutil.GracefulServer
        stopping.set()
        dispatcher.streams.shutdown()

    app.state.before_shutdown = before_shutdown
    # a request cut by the graceful-shutdown timeout: 503 JSON, not uvicorn's bare 500
    app.add_middleware(ShutdownAnswer, flag=stopping, who="the router")
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    # every request's id (x-request-id, passed to the workers it asks; its error bodies'
    # request_id) and, with tracing, a span per API request
    app.add_middleware(RequestContext, tracing=tracer, paths=(*FORWARDED, *TOKENIZER_PATHS))
    app.add_middleware(HeadAsGet)  # outermost: HEAD /health (probes) answered as GET
    app.include_router(build_admin_router(pool, config.admin_token))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        """413 from the body cap, 404/405 for unknown routes/methods: OpenAI's error shape
        (a 405 keeps Starlette's ``Allow`` header, which RFC 9110 15.5.6 requires)."""
        message = http_error_message(
            exc.status_code, str(exc.detail), request.method, request.url.path
        )
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})
        return response

    async def answer(endpoint: str, raw: bytes, request: Request | None = None) -> Response:
        """The answer to a POST of ``raw`` to the forwarded ``endpoint``, not counted yet
        (``_count`` does: the app's route before it answers, the front once its answer is
        written). ``request``: the app's request, whose client leaving cancels the dispatch
        (499); None from the front (pdserve/http/front.py), whose task is cancelled
        instead."""
        try:
            body = parse_json_body(raw)
        except ValueError as exc:  # UnicodeError is a ValueError
            return body_error(exc)
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            return error_response(400, "stream must be a boolean", param="stream")
        if (field := next((f for f in BOOTSTRAP_FIELDS if f in body), None)) is not None:
            # the router's to set: from a client it would point a worker at any address
            return error_response(
                400,
                f"{field} is set by the router (the prefill worker's bootstrap server and "
                "the KV transfer's room of a PD request); a request must not carry it",
                param=field,
            )
        if (missing := unknown_model(endpoint, body)) is not None:
            return missing
        if endpoint == "/v1/responses":  # a follow-up: its conversation, from its holder
            problem = await resolve_previous(
                pool, client, config.pd_mode, body, config.health_check_timeout
            )
            if problem is not None:
                return problem
        try:
            work = dispatcher.dispatch(endpoint, body)
            return await (work if request is None else cancel_on_disconnect(request, work))
        except NoHealthyWorker as exc:
            return error_response(503, str(exc))
        except ClientDisconnected:
            return Response(status_code=499)

    async def forward(request: Request, endpoint: str) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone (or timed out: http/read_timeout.py) mid-body
            status = 408 if timed_out(request.scope) else 499
            return _count(Response(status_code=status), endpoint, time.perf_counter())
        start = time.perf_counter()
        return _count(await answer(endpoint, raw, request), endpoint, start)

    def unknown_model(endpoint: str, body: dict) -> Response | None:
        """404 ``model_not_found`` in the router's words for a ``model`` that no worker
        serves (their ``served_model_name``, from the health checks); None to forward
        (no model, not a string: the workers' 400, or no worker checked yet)."""
        model = body.get("model")
        if endpoint not in WITH_MODEL or not isinstance(model, str):
            return None
        return model_not_served(model)

    def model_not_served(model: str) -> Response | None:
        """The 404 of :func:`unknown_model` for ``model``, None when a worker serves it or
        no worker was checked yet."""
        names = [w.server_info.get("served_model_name") for w in pool.all()]
        if not names or None in names or model in names:
            return None
        served = sorted({str(name) for name in names})
        return error_response(
            404,
            f"the model '{model}' does not exist; this router serves "
            + ", ".join(f"'{name}'" for name in served),
            param="model",
            code="model_not_found",
        )

    def _count(response: Response, endpoint: str, start: float) -> Response:
        """Count the request and observe its latency; a relayed stream when it ends."""
        if isinstance(response, RelayedStream):
            response.body_iterator = _observed(response, endpoint, start)
            return response
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    async def _observed(
        response: RelayedStream, endpoint: str, start: float
    ) -> AsyncIterator[bytes]:
        """The stream's chunks; at its end (after the last byte, or when the client left)
        one request counted with the status the stream ended with (``StreamEnd``: the
        router's SSE error's status, 200 after a clean ``[DONE]``; 499 when the client
        left first, like a client gone before the answer) and one latency sample."""
        chunks = response.relay
        try:
            async for chunk in chunks:
                try:
                    yield chunk
                except GeneratorExit:  # closed between chunks: end the relay (its legs) now
                    with anyio.CancelScope(shield=True):
                        await chunks.aclose()
                    raise
        finally:
            status = response.end.status
            if status is not None and status != 200:
                current_error(f"the stream ended with an error event (HTTP {status})")
            metrics.requests.labels(endpoint, str(499 if status is None else status)).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    # the forwarded POSTs served by the front without the layers above (tracing on: by the
    # app, whose RequestContext makes the spans); ``serve_app`` uses the protocol
    app.state.http_protocol = (
        front_protocol(
            FrontHandler(
                frozenset(FORWARDED),
                answer,
                _count,
                config.max_request_body_bytes,
                stopping,
                who="the router",
            )
        )
        if tracer is None
        else None
    )

    for path in FORWARDED:

        async def handler(request: Request, _path: str = path) -> Response:
            return await forward(request, _path)

        # a plain Starlette route: the body is parsed once by forward(), so FastAPI's
        # per-request dependency solving would be work for nothing (no OpenAPI entry)
        app.router.routes.append(Route(path, handler, methods=["POST"], name=path))

    async def ask_a_worker(method: str, path: str, content: bytes | None = None) -> Response:
        """One worker's answer, as is (the endpoints every role serves alike), asked with
        this request's id (so an error body's ``request_id`` is the router's)."""
        headers = outgoing_headers()
        if content is not None:
            headers["content-type"] = "application/json"
        try:
            worker = pool.pick("decode" if config.pd_mode else "mixed")
            resp = await client.request(
                method,
                f"{worker.url}{path}",
                content=content,
                headers=headers,
                timeout=config.health_check_timeout if content is None else None,
            )
        except NoHealthyWorker as exc:
            return error_response(503, str(exc))
        except httpx.HTTPError as exc:
            return error_response(503, f"{path} failed: {type(exc).__name__}: {exc}")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return await ask_a_worker("GET", "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """``client.models.retrieve(name)``: a worker's model object; 404
        ``model_not_found`` in the router's words for an id no worker serves."""
        missing = model_not_served(model_id)
        if missing is not None:
            return missing
        return await ask_a_worker("GET", f"/v1/models/{quote(model_id, safe='')}")

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        """A stored Responses answer, from the worker that holds it."""
        path = f"/v1/responses/{quote(response_id, safe='')}"
        return await stored_get(
            pool, client, config.pd_mode, path, response_id, config.health_check_timeout
        )

    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_input_items(response_id: str, request: Request) -> Response:
        """A stored Responses answer's input items (the query passed on)."""
        path = f"/v1/responses/{quote(response_id, safe='')}/input_items"
        if request.url.query:
            path += "?" + request.url.query
        return await stored_get(
            pool, client, config.pd_mode, path, response_id, config.health_check_timeout
        )

    for path in TOKENIZER_PATHS:

        async def tokenizer_handler(request: Request, _path: str = path) -> Response:
            start = time.perf_counter()
            try:
                body = parse_json_body(raw := await request.body())
            except ValueError as exc:
                response: Response = body_error(exc)
            else:
                missing = unknown_model(_path, body) if isinstance(body, dict) else None
                response = (
                    missing if missing is not None else await ask_a_worker("POST", _path, raw)
                )
            return _count(response, _path, start)

        app.add_api_route(path, tokenizer_handler, methods=["POST"], name=path)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pdserve.__version__})

    @app.get("/health")
    async def health() -> Response:
        if pool.is_ready():
            return JSONResponse({"status": "ok"})
        missing = [role for role in pool.workers if not pool.healthy(role)]
        return error_response(503, f"no healthy {' and no healthy '.join(missing)} worker")

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(
            {
                "mode": "pd" if config.pd_mode else "regular",
                "policy": config.policy,
                "request_timeout": config.request_timeout,
                "live_bootstrap_rooms": len(live_rooms),
                "admin_api": config.admin_token is not None,
                "workers": [worker_json(pool, w) for w in pool.all()],
                "gc": process_stats(),
            }
        )

    return app
