"""Dispatch of one client request: to a (prefill, decode) pair in PD mode, or to one mixed
worker in regular mode; streaming pass-through, merged prompt logprobs, one clear error.

PD protocol: both legs get the client's body plus ``bootstrap_host``, ``bootstrap_port``
(the prefill worker's bootstrap server) and ``bootstrap_room``; the router reserves the
request's consecutive rooms from that one (numbering: :mod:`pdserve.disagg.base`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
from fastapi.responses import Response

from pdserve.disagg.base import MAX_ROOMS_PER_REQUEST, ROOM_LIMIT, rooms_needed
from pdserve.http.json_fields import as_int
from pdserve.router.errors import error_from_worker, error_response
from pdserve.router.metrics import RouterMetrics
from pdserve.router.relay import (
    OpenStreams,
    PrefillWatch,
    StreamEnd,
    merge_cached_tokens,
    merge_prompt_logprobs,
    relay_sse,
    start_relay,
)
from pdserve.router.workers import WorkerPool, WorkerState, bootstrap_address, routing_key

log = logging.getLogger("pdserve.router")


class LegError(Exception):
    """One worker leg failed; ``response`` is what the client gets."""

    def __init__(self, role: str, reason: str, response: Response) -> None:
        super().__init__(reason)
        self.role = role
        self.reason = reason
        self.response = response


def _int(value: object, default: int) -> int | None:
    """A body's integer field as the workers read it (``http.json_fields.as_int``); ``default``
    for null or absent; None for anything else (which the workers reject with a 400)."""
    return default if value is None else as_int(value)


def _wants_prompt_logprobs(endpoint: str, body: dict) -> bool:
    """Whether the client asked for prompt logprobs (which only the prefill leg has),
    also as the logprobs of an echoed prompt."""
    if endpoint == "/generate":
        start = _int(body.get("logprob_start_len"), -1)
        return body.get("return_logprob") is True and start is not None and start >= 0
    if (
        endpoint == "/v1/completions"
        and body.get("echo") is True
        and body.get("logprobs") is not None
    ):
        return True  # the echoed prompt's tokens carry their logprobs
    return body.get("prompt_logprobs") is not None


def _num_prompts(endpoint: str, body: dict) -> int:
    """Prompts of the request: the length of a ``/v1/completions`` batch, else 1."""
    prompt = body.get("prompt") if endpoint == "/v1/completions" else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _num_samples(endpoint: str, body: dict) -> int:
    """Rooms the request needs: ``n`` per prompt (null: 1; 1 for an invalid ``n``, which
    the workers reject with a 400)."""
    params = body.get("sampling_params") if endpoint == "/generate" else body
    n = _int(params.get("n") if isinstance(params, dict) else None, 1)
    if n is None or not 1 <= n <= MAX_ROOMS_PER_REQUEST:
        n = 1
    return rooms_needed(_num_prompts(endpoint, body), n)


class Dispatcher:
    """Sends client requests to workers; owns the set of live bootstrap rooms."""

    def __init__(
        self,
        pool: WorkerPool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        live_rooms: set[int],
        *,
        pd_mode: bool,
        request_timeout: float,
        rng: random.Random | None = None,
    ) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.live_rooms = live_rooms
        self.pd_mode = pd_mode
        self.request_timeout = request_timeout
        self._rng = rng or random.SystemRandom()
        self.streams = OpenStreams()  # relays now running; ended by the router's shutdown

    # --- rooms -------------------------------------------------------------------------
    def reserve_rooms(self, n: int) -> int:
        """Draw a random room R with R .. R+n-1 all free and below ``ROOM_LIMIT``; mark
        them live."""
        while True:
            room = self._rng.randrange(0, ROOM_LIMIT - n + 1)
            if not any(room + i in self.live_rooms for i in range(n)):
                self.live_rooms.update(range(room, room + n))
                return room

    def release_rooms(self, room: int, n: int) -> None:
        self.live_rooms.difference_update(range(room, room + n))

    # --- one leg -----------------------------------------------------------------------
    def _transport_error(self, worker: WorkerState, exc: Exception) -> LegError:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.pool.record_failure(worker, reason)
        self.metrics.leg_failures.labels(worker.role, "connect").inc()
        msg = f"{worker.role} worker {worker.url} failed: {reason}"
        # 502 like a stream that breaks: the worker failed while serving (503 is kept for
        # "no healthy worker to pick")
        return LegError(worker.role, msg, error_response(502, msg))

    def _http_error(self, worker: WorkerState, status: int, content: bytes) -> LegError:
        """The client's error from a worker's non-200 answer. A 5xx counts as a failed leg;
        a 4xx is the worker rejecting the client's request (bad input, unknown model): no
        worker failure (the client's status is in ``pdserve_router_requests_total``), and
        neither marks the worker unhealthy (only probes and transport errors do)."""
        if status >= 500 or status < 400:
            self.metrics.leg_failures.labels(worker.role, f"http_{status}").inc()
        who = f"{worker.role} worker {worker.url}"
        return LegError(
            worker.role, f"{who} answered HTTP {status}", error_from_worker(status, content, who)
        )

    async def _post(self, worker: WorkerState, endpoint: str, body: dict) -> httpx.Response:
        """POST to one worker; returns the 200 response, else raises LegError."""
        worker.outstanding += 1
        try:
            resp = await self.client.post(worker.url + endpoint, json=body)
        except httpx.HTTPError as exc:
            raise self._transport_error(worker, exc) from exc
        finally:
            worker.outstanding -= 1
        if resp.status_code != 200:
            raise self._http_error(worker, resp.status_code, resp.content)
        return resp

    async def _open_stream(self, worker: WorkerState, endpoint: str, body: dict) -> httpx.Response:
        """Open a streaming POST; returns the open 200 response (caller closes it)."""
        request = self.client.build_request("POST", worker.url + endpoint, json=body)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._transport_error(worker, exc) from exc
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
            raise self._http_error(worker, resp.status_code, content)
        return resp

    # --- entry point -------------------------------------------------------------------
    async def dispatch(self, endpoint: str, body: dict) -> Response:
        """Serve one client request (``endpoint`` is the worker path, e.g. ``/generate``).
        Errors become OpenAI-shaped JSON responses; the deadline gives 504."""
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        stream = body.get("stream") is True
        try:
            work = (
                self._pd(endpoint, body, stream, deadline)
                if self.pd_mode
                else self._regular(endpoint, body, stream, deadline)
            )
            return await asyncio.wait_for(work, self.request_timeout)
        except LegError as exc:
            return exc.response
        except asyncio.TimeoutError:
            return error_response(
                504,
                f"request timed out after {self.request_timeout:g} s (router --request-timeout)",
            )

    async def _regular(self, endpoint: str, body: dict, stream: bool, deadline: float) -> Response:
        worker = self.pool.pick("mixed", routing_key(endpoint, body))
        if not stream:
            resp = await self._post(worker, endpoint, body)
            return Response(resp.content, media_type="application/json")
        worker.outstanding += 1
        try:
            resp = await self._open_stream(worker, endpoint, body)
        except BaseException:
            worker.outstanding -= 1
            raise

        def on_close() -> None:
            worker.outstanding -= 1

        end = StreamEnd()
        return await start_relay(
            end,
            relay_sse(
                resp,
                worker,
                endpoint,
                deadline=deadline,
                timeout_s=self.request_timeout,
                metrics=self.metrics,
                on_close=on_close,
                streams=self.streams,
                end=end,
            ),
        )

    async def _pd(self, endpoint: str, body: dict, stream: bool, deadline: float) -> Response:
        key = routing_key(endpoint, body)
        prefill, decode = self.pool.pick_pair(key)
        host, port = bootstrap_address(prefill)
        n = _num_samples(endpoint, body)
        if n > MAX_ROOMS_PER_REQUEST:
            return error_response(
                400,
                f"a request may have at most {MAX_ROOMS_PER_REQUEST} samples in PD mode "
                f"(prompts x n), this one has {n}",
                param="prompt",
            )
        room = self.reserve_rooms(n)
        handed_off = False
        try:
            legs = dict(body, bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
            # The prefill leg's answer serves only for prompt logprobs and errors: no stream.
            prefill_body = {k: v for k, v in legs.items() if k not in ("stream", "stream_options")}
            p_task = asyncio.ensure_future(self._post(prefill, endpoint, prefill_body))
            if not stream:
                d_task = asyncio.ensure_future(self._post(decode, endpoint, legs))
                await self._legs((p_task, d_task))
                answer = d_task.result().json()
                prefill_answer = p_task.result().json()
                merge_prompt_logprobs(endpoint, answer, prefill_answer)
                return Response(
                    json.dumps(merge_cached_tokens(endpoint, answer, prefill_answer)),
                    media_type="application/json",
                )
            decode.outstanding += 1
            d_task = asyncio.ensure_future(self._open_stream(decode, endpoint, legs))
            try:  # until decode's stream is open; prefill keeps running (the relay watches it)
                await self._legs((p_task, d_task), until=d_task)
            except BaseException:
                decode.outstanding -= 1
                raise

            def on_close() -> None:
                decode.outstanding -= 1
                self.release_rooms(room, n)

            handed_off = True
            watch = PrefillWatch(p_task, hold_first=_wants_prompt_logprobs(endpoint, body))
            end = StreamEnd()
            return await start_relay(
                end,
                relay_sse(
                    d_task.result(),
                    decode,
                    endpoint,
                    deadline=deadline,
                    timeout_s=self.request_timeout,
                    metrics=self.metrics,
                    on_close=on_close,
                    prefill=watch,
                    streams=self.streams,
                    end=end,
                ),
            )
        finally:
            if not handed_off:
                self.release_rooms(room, n)

    @staticmethod
    async def _legs(tasks: tuple[asyncio.Future, ...], until: asyncio.Future | None = None) -> None:
        """Wait for every leg (or only until ``until`` is done); the first failure cancels
        the others (closing a stream one may have opened, so the worker sees the
        disconnect and aborts) and is raised."""
        pending = set(tasks)
        try:
            while pending and not (until is not None and until.done()):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # raises the leg's error
        except BaseException:
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, httpx.Response):
                    await result.aclose()
            raise
