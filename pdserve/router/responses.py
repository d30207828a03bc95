"""The router's side of OpenAI's Responses API: where a stored response lives, and a
follow-up (``previous_response_id``) made servable by any worker or PD pair.

A worker keeps the responses it answered (``server/responses.py``; in PD mode the decode
worker, a prefill worker keeps none). ``GET /v1/responses/{id}`` (and ``.../input_items``)
is asked of each worker that may hold it (decode or mixed) until one has it. A
``POST /v1/responses`` with ``previous_response_id`` gets the stored conversation from
the worker that holds it (its input items and its output, as input items) and carries it
in the body as ``previous_items``, so both legs of any pair render the same prompt; the
workers' answer still names ``previous_response_id``. An id no worker holds is a 400
naming ``previous_response_id``.
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi.responses import Response

from pdserve.router.errors import error_from_worker, error_response
from pdserve.router.workers import WorkerPool
from pdserve.tracing import outgoing_headers

PAGE = 100  # items per input_items page asked of a worker (its most)


def holders(pool: WorkerPool, pd_mode: bool) -> list[Any]:
    """The workers that may hold a stored response: every decode (or mixed) worker."""
    role = "decode" if pd_mode else "mixed"
    return [w for w in pool.all() if w.role == role]


async def ask_holders(
    pool: WorkerPool, client: httpx.AsyncClient, pd_mode: bool, path: str, timeout: float
) -> httpx.Response | None:
    """The first answer other than 404 to ``GET path`` from a worker that may hold the
    response (workers that cannot be reached are skipped), asked with the request's id;
    None when every one said 404 or none answered."""
    for worker in holders(pool, pd_mode):
        try:
            resp = await client.get(worker.url + path, headers=outgoing_headers(), timeout=timeout)
        except httpx.HTTPError:
            continue
        if resp.status_code != 404:
            return resp
    return None


async def stored_get(
    pool: WorkerPool,
    client: httpx.AsyncClient,
    pd_mode: bool,
    path: str,
    response_id: str,
    timeout: float,
) -> Response:
    """A stored response (or its input items page) as the worker holding it answers;
    404 naming ``response_id`` when no worker holds it."""
    resp = await ask_holders(pool, client, pd_mode, path, timeout)
    if resp is None:
        return error_response(
            404,
            f"no worker holds a stored response with id {response_id!r} (unknown, stored "
            "with store false, or dropped from a worker's bounded store)",
            param="response_id",
        )
    if resp.status_code != 200:
        return error_from_worker(resp.status_code, resp.content, "worker")
    return Response(resp.content, media_type="application/json")


def _as_input(output: list[Any]) -> list[dict]:
    """A response's output items as input items (the assistant's turn)."""
    items: list[dict] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            text = "".join(str(p.get("text", "")) for p in item.get("content") or [])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            items.append({k: item.get(k) for k in ("type", "call_id", "name", "arguments")})
    return items


async def resolve_previous(
    pool: WorkerPool, client: httpx.AsyncClient, pd_mode: bool, body: dict, timeout: float
) -> Response | None:
    """Put the conversation of ``body["previous_response_id"]`` into ``body`` as
    ``previous_items`` (in place); None when done or when there is nothing to resolve
    (no id, or ``previous_items`` already given), else the client's error response."""
    response_id = body.get("previous_response_id")
    if not isinstance(response_id, str) or body.get("previous_items") is not None:
        return None
    missing = error_response(
        400,
        f"previous_response_id {response_id!r} is not stored on any worker: unknown, "
        "stored with store false, or dropped from a worker's bounded store "
        "(serve --responses-store-size)",
        param="previous_response_id",
        code="previous_response_not_found",
    )
    if "/" in response_id or not response_id:
        return missing
    resp = await ask_holders(pool, client, pd_mode, f"/v1/responses/{response_id}", timeout)
    if resp is None:
        return missing
    if resp.status_code != 200:
        return error_from_worker(resp.status_code, resp.content, "worker")
    holder = str(resp.request.url).split("/v1/responses/")[0]
    items: list[dict] = []
    after: str | None = None
    while True:  # every page of the stored conversation, oldest first
        params = {"order": "asc", "limit": str(PAGE)} | ({"after": after} if after else {})
        try:
            page_resp = await client.get(
                f"{holder}/v1/responses/{response_id}/input_items",
                params=params,
                headers=outgoing_headers(),
                timeout=timeout,
            )
        except httpx.HTTPError as exc:
            return error_response(502, f"worker {holder} failed: {type(exc).__name__}: {exc}")
        if page_resp.status_code != 200:
            return error_from_worker(page_resp.status_code, page_resp.content, holder)
        page = page_resp.json()
        for item in page.get("data") or []:
            items.append({k: v for k, v in item.items() if k not in ("id", "status")})
        if not page.get("has_more"):
            break
        after = page.get("last_id")
    body["previous_items"] = items + _as_input(resp.json().get("output") or [])
    return None
