"""A request run whole on one worker: regular mode's mixed worker, or in PD mode a decode
worker for a request selective PD keeps off the pair, or while no prefill worker is
healthy (:class:`pdserve.router.picking.Picker`). One leg, the client's body as it is.

:func:`whole_on_worker` answers a non-streamed request; :func:`open_on_worker` opens a
streamed one for the relay. Retries and the outstanding count of a non-streamed attempt
are the dispatcher's; a streamed leg counts itself until its relay closes it.
"""

from __future__ import annotations

from fastapi.responses import Response

from pdserve import tracing
from pdserve.http.wire import json_bytes
from pdserve.router.answer_merge import merge_router_timing
from pdserve.router.legs import Leg, LegSender
from pdserve.router.picking import Route


async def whole_on_worker(legs: LegSender, endpoint: str, body: dict, route: Route) -> Response:
    """The worker's answer to ``body`` (``route`` has one worker, counted by the caller),
    with selective PD's decision merged into its timing blocks when it has them."""
    tracing.phase_so_far("route", route.attributes())
    resp = await legs.post(route.worker, endpoint, body, counted=True)
    if route.info is not None and body.get("return_timing") is True:
        try:
            answer = resp.json()
        except ValueError:
            return Response(resp.content, media_type="application/json")
        merge_router_timing(endpoint, answer, route.info)
        return Response(json_bytes(answer), media_type="application/json")
    return Response(resp.content, media_type="application/json")


async def open_on_worker(legs: LegSender, endpoint: str, body: dict, route: Route) -> Leg:
    """The worker's open stream of ``body`` as a :class:`Leg`; the worker is counted
    outstanding until the leg closes."""
    worker = route.worker
    tracing.phase_so_far("route", route.attributes())
    with legs.counted_if_opened(worker):
        resp = await legs.open_stream(worker, endpoint, body)

    def close() -> None:
        worker.outstanding -= 1

    return Leg(resp, worker, None, close, {worker.url}, route.info, route.held)
