"""Dispatch of one client request: to a (prefill, decode) pair in PD mode, or to one mixed
worker in regular mode; streaming pass-through, merged prompt logprobs, one clear error.

PD protocol: both legs get the client's body plus ``bootstrap_host``, ``bootstrap_port``
(the prefill worker's bootstrap server) and ``bootstrap_room``; the router reserves the
request's consecutive rooms from that one (numbering: :mod:`pdserve.disagg.base`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable, Collection, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from pdserve import tracing
from pdserve.disagg.base import MAX_ROOMS_PER_REQUEST, ROOM_LIMIT, rooms_needed
from pdserve.http.client import (
    TRANSPORT_ERRORS,
    WorkerClient,
    WorkerResponse,
    WorkerStream,
)
from pdserve.http.json_fields import as_int
from pdserve.http.netutil import GRACEFUL_SHUTDOWN_S
from pdserve.http.wire import json_bytes
from pdserve.router.answer_merge import (
    merge_cached_tokens,
    merge_prompt_logprobs,
    merge_router_timing,
    merge_timing,
)
from pdserve.router.errors import error_from_worker, error_response
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import Leg, Migration, StreamState
from pdserve.router.relay import OpenStreams, PrefillWatch, StreamEnd, relay_sse, start_relay
from pdserve.router.workers import (
    NoHealthyPair,
    NoHealthyWorker,
    WorkerPool,
    WorkerState,
    bootstrap_address,
    routing_key,
)

log = logging.getLogger("pdserve.router")

_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+


class LegError(Exception):
    """One worker leg failed; ``response`` is what the client gets."""

    def __init__(
        self,
        role: str,
        reason: str,
        response: Response,
        *,
        url: str | None = None,
        transport: bool = False,
    ) -> None:
        super().__init__(reason)
        self.role = role
        self.reason = reason
        self.response = response
        self.url = url  # the worker's
        self.transport = transport  # no HTTP answer: the connection failed
        self.pair: set[str] = {url} if url else set()  # the URLs of the attempt's workers


# seconds a non-streamed request still waits for a worker ejected under it (dispatch's
# _until_ejected): a stopping worker's graceful shutdown, and as long again
EJECTED_GRACE_S = 2 * GRACEFUL_SHUTDOWN_S

# fields of the client's body that the prefill leg of a PD request does not get
_DECODE_ONLY_FIELDS = ("stream", "stream_options")


@dataclass
class Route:
    """Where one attempt of a request goes: ``target``, one worker or a (prefill, decode)
    pair; ``info``, selective PD's decision (``Dispatcher._pick_now``; None when selective
    PD is off), which goes to the trace and to the answer's timing blocks."""

    target: WorkerState | tuple[WorkerState, WorkerState]
    info: dict | None = None
    # records the prompt in the decode workers' prefix index; run once the request ended
    # well (a failed or abandoned one may never have computed its prompt there)
    held: Callable[[], None] | None = None

    @property
    def pair(self) -> tuple[WorkerState, WorkerState] | None:
        return self.target if isinstance(self.target, tuple) else None

    @property
    def worker(self) -> WorkerState:
        """The one worker (``pair`` is None)."""
        assert not isinstance(self.target, tuple)
        return self.target

    def urls(self) -> set[str]:
        """The URLs of the attempt's workers."""
        return {w.url for w in (self.target if isinstance(self.target, tuple) else (self.target,))}


@dataclass
class _PairLegs:
    """A PD request's two legs (``Dispatcher._pair_legs``): the pair, its rooms
    (``room`` .. ``room + n - 1``), decode's body and prefill's; ``handed_off``: the rooms
    are released by whoever took them over (a stream's relay), not by the block."""

    prefill: WorkerState
    decode: WorkerState
    room: int
    n: int
    decode_body: dict
    prefill_body: dict
    handed_off: bool = False


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


# bytes of prompt text per token, for selective PD's estimate (English text under a
# byte-level BPE of about 50k entries averages about 4; an underestimate of the tokens for
# other text, so such a prompt is more likely to be disaggregated than not)
BYTES_PER_TOKEN = 4


def prompt_tokens_estimate(endpoint: str, body: dict) -> int | None:
    """The prompt's length in tokens, estimated without a tokenizer: exact for token ids
    (``/generate``'s ``input_ids``, a ``/v1/completions`` prompt of ids), else the UTF-8
    bytes of the text (a chat's message contents) over ``BYTES_PER_TOKEN``; None for a
    batch of prompts or a shape the workers will reject."""
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        text = routing_key(endpoint, body) or ""
        return len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN
    prompt = (
        body.get("input_ids", body.get("text")) if endpoint == "/generate" else body.get("prompt")
    )
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return None


class Dispatcher:
    """Sends client requests to workers; owns the set of live bootstrap rooms."""

    def __init__(
        self,
        pool: WorkerPool,
        client: WorkerClient,
        metrics: RouterMetrics,
        live_rooms: set[int],
        *,
        pd_mode: bool,
        request_timeout: float,
        max_migrations: int = 2,
        migration_wait: float = 30.0,
        pd_min_prefill_tokens: int = 0,
        rng: random.Random | None = None,
    ) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.live_rooms = live_rooms
        self.pd_mode = pd_mode
        self.request_timeout = request_timeout
        self.max_migrations = max_migrations  # per request (--max-migrations)
        self.migration_wait = migration_wait  # s, for a healthy worker (--migration-wait)
        self.pd_min_prefill_tokens = pd_min_prefill_tokens  # selective PD; 0 = off
        # rooms only need to differ between routers sharing a prefill: a generator seeded
        # from os.urandom (random.Random's default) is as good as SystemRandom's syscall
        # per draw, which cost ~4 % of the router's CPU a request
        self._rng = rng or random.Random()
        self.streams = OpenStreams()  # relays now running; ended by the router's shutdown
        # [reason, requests] of the outage now served without prefill (None: none)
        self._fallback: list | None = None

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
        return LegError(worker.role, msg, error_response(502, msg), url=worker.url, transport=True)

    def _http_error(self, worker: WorkerState, status: int, content: bytes) -> LegError:
        """The client's error from a worker's non-200 answer. A 5xx counts as a failed leg;
        a 4xx is the worker rejecting the client's request (bad input, unknown model): no
        worker failure (the client's status is in ``pdserve_router_requests_total``), and
        neither marks the worker unhealthy (only probes and transport errors do)."""
        if status >= 500 or status < 400:
            self.metrics.leg_failures.labels(worker.role, f"http_{status}").inc()
        who = f"{worker.role} worker {worker.url}"
        return LegError(
            worker.role,
            f"{who} answered HTTP {status}",
            error_from_worker(status, content, who),
            url=worker.url,
        )

    async def _post(
        self, worker: WorkerState, endpoint: str, body: dict, *, counted: bool = False
    ) -> WorkerResponse:
        """POST to one worker; returns the 200 response, else raises LegError. The POST
        counts in ``worker.outstanding`` while it runs, unless ``counted``: the caller
        counted it from the pick on (:meth:`_counted`, :meth:`_post_task`)."""
        if not counted:
            worker.outstanding += 1
        try:
            resp = await self.client.post(worker.url + endpoint, body, tracing.outgoing_headers())
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(worker, exc) from exc
        finally:
            if not counted:
                worker.outstanding -= 1
        if resp.status_code != 200:
            raise self._http_error(worker, resp.status_code, resp.content)
        return resp

    def _post_task(self, worker: WorkerState, endpoint: str, body: dict) -> asyncio.Future:
        """:meth:`_post` as a task, counted in ``worker.outstanding`` from now until the
        task ends (not from its first step, a loop iteration later: ``WorkerPool.drain``
        must see every request that picked the worker before it was marked draining)."""
        worker.outstanding += 1
        task = asyncio.ensure_future(self._post(worker, endpoint, body, counted=True))

        def uncount(_: asyncio.Future) -> None:
            worker.outstanding -= 1

        task.add_done_callback(uncount)
        return task

    @contextmanager
    def _counted(self, route: Route) -> Iterator[None]:
        """Every worker of ``route`` counted in ``outstanding`` for the block (a
        non-streamed attempt, from its pick on: its legs run in tasks started iterations
        later, which ``WorkerPool.drain`` would not wait for)."""
        workers = route.pair if route.pair is not None else (route.worker,)
        for w in workers:
            w.outstanding += 1
        try:
            yield
        finally:
            for w in workers:
                w.outstanding -= 1

    async def _open_stream(self, worker: WorkerState, endpoint: str, body: dict) -> WorkerStream:
        """Open a streaming POST; returns the open 200 response (caller closes it)."""
        try:
            resp = await self.client.open(worker.url + endpoint, body, tracing.outgoing_headers())
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(worker, exc) from exc
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            except TRANSPORT_ERRORS as exc:
                raise self._transport_error(worker, exc) from exc
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
            if self.pd_mode:
                n = _num_samples(endpoint, body)
                if n > MAX_ROOMS_PER_REQUEST:
                    return error_response(
                        400,
                        f"a request may have at most {MAX_ROOMS_PER_REQUEST} samples in PD "
                        f"mode (prompts x n), this one has {n}",
                        param="prompt",
                    )
            work = (
                self._stream(endpoint, body, deadline)
                if stream
                else self._whole(endpoint, body, deadline)
            )
            if _timeout is None:  # Python 3.10
                return await asyncio.wait_for(work, self.request_timeout)
            async with _timeout(self.request_timeout):  # no task of its own, unlike wait_for
                return await work
        except LegError as exc:
            return exc.response
        except asyncio.TimeoutError:
            return error_response(
                504,
                f"request timed out after {self.request_timeout:g} s (router --request-timeout)",
            )

    # --- migration -----------------------------------------------------------------------
    def _count(self, kind: str) -> None:
        """Count one migration (``kind``: the reason label)."""
        self.metrics.migrations.labels(kind).inc()

    def _eject(self, failed: set[str]) -> None:
        """Take the workers at ``failed`` out of picking now (their connection failed)."""
        for url in failed:
            self.pool.eject(url, "its connection failed under a request")

    @staticmethod
    def _failed(exc: LegError) -> set[str]:
        return {exc.url} if exc.transport and exc.url else set()

    @staticmethod
    def _retryable(exc: LegError) -> bool:
        """A failure another worker may not have: the transport, or a 5xx answer (a 4xx
        is the client's request, which any worker would refuse alike)."""
        return exc.transport or exc.response.status_code >= 500

    async def _picked(self, pick, deadline: float):
        """``pick()``, waiting for a healthy worker (pair) when the pool has none now (a
        worker that failed under a request was ejected; its restart or next good probe
        brings it back), at most ``migration_wait`` seconds and not past ``deadline``;
        NoHealthyWorker after that."""
        loop = asyncio.get_running_loop()
        until = min(deadline, loop.time() + self.migration_wait)
        while True:
            try:
                return pick()
            except NoHealthyWorker:
                if loop.time() + 0.1 >= until:
                    raise
                await asyncio.sleep(0.1)

    async def _whole(self, endpoint: str, body: dict, deadline: float) -> Response:
        """A non-streamed request; one that failed on a worker (transport or 5xx) is sent
        again whole to another, at most ``max_migrations`` times."""
        avoid: set[str] = set()  # workers of the failed attempts, not picked again if avoidable
        pick = lambda: self._pick_now(endpoint, body, avoid)  # noqa: E731
        attempt, last = 0, None
        while True:
            if last is None:
                picked = pick()
            else:
                try:
                    picked = await self._picked(pick, deadline)
                except NoHealthyWorker:
                    raise last from None  # the client gets the failure, not the wait
            try:
                with self._counted(picked):
                    answer = await self._whole_once(endpoint, body, picked)
                if picked.held is not None:
                    picked.held()
                return answer
            except LegError as exc:
                if attempt >= self.max_migrations or not self._retryable(exc):
                    raise
                attempt, last = attempt + 1, exc
                log.warning(
                    "sending a request again whole (%d of %d): %s",
                    attempt,
                    self.max_migrations,
                    exc.reason,
                )
                self._eject(self._failed(exc))
                avoid |= exc.pair
                self._count("retry_whole")

    def _pick_now(self, endpoint: str, body: dict, avoid: Collection[str] = ()) -> Route:
        """Where the request goes now: one worker (regular mode; a decode worker for a
        request PD does not pay for) or a (prefill, decode) pair; workers in ``avoid`` only
        when there is no other (``WorkerPool.healthy``).

        Selective PD (``pd_min_prefill_tokens`` > 0): the prompt's uncached part is its
        length (:func:`prompt_tokens_estimate`) times the share of its leading blocks that
        the decode workers' prefix index (``WorkerPool.decode_prefixes``: the prompts sent
        to each decode worker) does not hold, for the decode worker holding the most; under
        the threshold the request runs on that decode worker alone (on the policy's pick
        when none holds any), else on a pair. The decision is counted, set on the trace
        and returned in ``Route.info``.

        A PD request with no pair to go to (no healthy prefill worker, e.g. while
        ``pdserve up`` restarts a dead one) runs whole on a decode worker
        (:meth:`_without_prefill`; ``Route.info`` says ``decode_fallback``) rather than
        get 503; NoHealthyWorker only when no decode worker is healthy either."""
        key = routing_key(endpoint, body)
        if not self.pd_mode:
            return Route(self.pool.pick("mixed", key, avoid))
        index = self.pool.decode_prefixes
        keys = index.keys(key)
        info = None
        if self.pd_min_prefill_tokens:
            estimate = prompt_tokens_estimate(endpoint, body)
            best, held = None, 0
            for d in self.pool.healthy("decode", avoid):  # the one holding the most
                n = index.matched(d.url, keys)
                if n and (
                    best is None or n > held or (n == held and d.outstanding < best.outstanding)
                ):
                    best, held = d, n
            share = held / len(keys) if keys else 0.0
            uncached = None if estimate is None else round(estimate * (1.0 - share))
            whole = uncached is not None and uncached < self.pd_min_prefill_tokens
            decision = "decode_only" if whole else "pd"
            info = {
                "pd_decision": decision,
                "prompt_tokens_estimate": estimate,
                "decode_cached_share": round(share, 3),
                "uncached_tokens_estimate": uncached,
                "pd_min_prefill_tokens": self.pd_min_prefill_tokens,
            }
            if whole:
                decode = best if best is not None else self.pool.pick("decode", key, avoid)
                self.metrics.pd_decisions.labels(decision).inc()  # once picked: not a poll
                return Route(decode, info, functools.partial(index.record, decode.url, keys))
        try:
            pair = self.pool.pick_pair(key, avoid)
        except NoHealthyWorker as exc:
            decode, reason = self._without_prefill(key, avoid, exc)
            info = {**(info or {}), "pd_decision": "decode_fallback", "pd_fallback": reason}
            return Route(decode, info, functools.partial(index.record, decode.url, keys))
        if self._fallback is not None:
            log.warning(
                "a prefill/decode pair is usable again: PD requests go through pairs again "
                "(%d served whole on decode workers meanwhile)",
                self._fallback[1],
            )
            self._fallback = None
        if info is not None:
            self.metrics.pd_decisions.labels(info["pd_decision"]).inc()
        return Route(pair, info, functools.partial(index.record, pair[1].url, keys))

    def _without_prefill(
        self, key: str | None, avoid: Collection[str], exc: NoHealthyWorker
    ) -> tuple[WorkerState, str]:
        """The decode worker that serves a PD request whole when no pair can (``exc``, from
        ``pick_pair``), and why (the counter's ``reason``): ``no_healthy_prefill``, no
        prefill worker passes its health checks (dead, restarting, drained). A decode
        worker runs a request whole as a mixed worker does (selective PD's path), so the
        output is the same; it only pays the prefill itself. Re-raises ``exc`` when no
        decode worker is healthy either (the client's 503), and for NoHealthyPair (healthy
        prefills that every decode reports unhealthy: a 503 naming the reports, the
        quarantine's own signal). Counted, and warned about once an outage (until a pair
        is picked again)."""
        if isinstance(exc, NoHealthyPair) or not self.pool.healthy("decode", avoid):
            raise exc
        reason = "no_healthy_prefill"
        decode = self.pool.pick("decode", key, avoid)
        self.metrics.pd_fallbacks.labels(reason).inc()
        if self._fallback is None:
            self._fallback = [reason, 0]
            log.warning(
                "%s: serving PD requests whole on decode workers until a prefill worker is "
                "healthy again (counted in pdserve_router_pd_fallbacks_total)",
                exc,
            )
        self._fallback[1] += 1
        return decode, reason

    def _route_attributes(self, route: Route) -> dict:
        """The trace attributes of ``route`` (the ``route`` phase and the request span)."""
        attrs: dict = {}
        if route.info is not None:
            attrs = {f"pdserve.{k}": v for k, v in route.info.items() if v is not None}
        if route.pair is None:
            return {"pdserve.worker": route.worker.url, **attrs}
        return attrs

    async def _whole_once(self, endpoint: str, body: dict, route: Route) -> Response:
        try:
            return await self._until_ejected(self._whole_picked(endpoint, body, route), route)
        except LegError as exc:
            exc.pair = route.urls()
            raise

    async def _until_ejected(self, work: Coroutine[Any, Any, Response], route: Route) -> Response:
        """``work`` (one attempt of a non-streamed request on ``route``), stopped when one
        of the route's workers was ejected and has not answered :data:`EJECTED_GRACE_S`
        later: a LegError (transport, 502) that sends the request again whole to another
        worker. A worker hung with its connection open (a stopped process, a wedged GPU)
        answers nothing until ``--request-timeout``; its health checks eject it in a few
        seconds, and nothing of a non-streamed answer has reached the client yet. The
        grace lets a worker that is shutting down (its probes fail at once) answer what it
        still runs, or say 503 itself. The attempt's legs are cancelled (the workers see
        their clients leave), as when the client leaves."""
        workers = route.pair if route.pair is not None else (route.worker,)
        attempt = asyncio.ensure_future(work)
        watches = {asyncio.ensure_future(w.ejected.wait()): w for w in workers}
        try:
            done, _ = await asyncio.wait({attempt, *watches}, return_when=asyncio.FIRST_COMPLETED)
            if attempt not in done:
                done, _ = await asyncio.wait({attempt}, timeout=EJECTED_GRACE_S)
            if attempt in done:
                return attempt.result()
            gone = next(w for f, w in watches.items() if f.done() and not f.cancelled())
            reason = (
                f"{gone.role} worker {gone.url} was ejected ({gone.last_error or 'unhealthy'}) "
                "before it answered"
            )
            raise LegError(
                gone.role, reason, error_response(502, reason), url=gone.url, transport=True
            )
        finally:
            for watch in watches:
                watch.cancel()
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)

    async def _whole_picked(self, endpoint: str, body: dict, route: Route) -> Response:
        if route.pair is None:  # one worker runs the whole request
            tracing.phase_so_far("route", self._route_attributes(route))
            resp = await self._post(route.worker, endpoint, body, counted=True)
            if route.info is not None and body.get("return_timing") is True:
                try:
                    answer = resp.json()
                except ValueError:
                    return Response(resp.content, media_type="application/json")
                merge_router_timing(endpoint, answer, route.info)
                return Response(json_bytes(answer), media_type="application/json")
            return Response(resp.content, media_type="application/json")
        with self._pair_legs(endpoint, body, route) as pd:
            p_task = asyncio.ensure_future(
                self._post(pd.prefill, endpoint, pd.prefill_body, counted=True)
            )
            d_task = asyncio.ensure_future(
                self._post(pd.decode, endpoint, pd.decode_body, counted=True)
            )
            await self._legs((p_task, d_task))
            answer = d_task.result().json()
            prefill_answer = p_task.result().json()
            merge_prompt_logprobs(endpoint, answer, prefill_answer)
            merge_timing(endpoint, answer, prefill_answer)
            if route.info is not None:
                merge_router_timing(endpoint, answer, route.info)
            return Response(
                json_bytes(merge_cached_tokens(endpoint, answer, prefill_answer)),
                media_type="application/json",
            )

    @contextmanager
    def _pair_legs(self, endpoint: str, body: dict, route: Route) -> Iterator[_PairLegs]:
        """The two legs' bodies of a PD request on ``route``'s pair, with its bootstrap
        rooms reserved (and traced) for the block; released at its end unless the block
        set ``handed_off`` (then whoever took them over releases them)."""
        assert route.pair is not None
        prefill, decode = route.pair
        host, port = bootstrap_address(prefill)
        n = _num_samples(endpoint, body)
        room = self.reserve_rooms(n)
        tracing.phase_so_far(
            "route",
            {
                "pdserve.prefill": prefill.url,
                "pdserve.decode": decode.url,
                "pdserve.room": room,
                "pdserve.rooms": n,
                **self._route_attributes(route),
            },
        )
        legs = dict(body, bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
        # The prefill leg's answer serves only for prompt logprobs, counts and errors.
        prefill_body = {k: v for k, v in legs.items() if k not in _DECODE_ONLY_FIELDS}
        pd = _PairLegs(prefill, decode, room, n, legs, prefill_body)
        try:
            yield pd
        finally:
            if not pd.handed_off:
                self.release_rooms(room, n)

    async def _stream(self, endpoint: str, body: dict, deadline: float) -> Response:
        """A streamed request: its first leg opened (again whole on another worker when
        that fails, within the budget), then relayed; a leg failing mid-stream continues
        on another (:mod:`pdserve.router.migration`)."""
        state = StreamState(endpoint, body)
        avoid: set[str] = set()  # workers of failed legs, not picked again if avoidable
        migration = Migration(
            state,
            self.max_migrations,
            lambda b: self._open_leg(endpoint, b, deadline, wait=True, avoid=avoid),
            self._eject,
            self._count,
            wait_s=self.migration_wait,
            avoid=avoid,
        )
        first = state.first_body() if self.max_migrations > 0 else body
        last: LegError | None = None
        while True:
            try:
                leg = await self._open_leg(
                    endpoint, first, deadline, wait=last is not None, avoid=avoid
                )
                break
            except NoHealthyWorker:
                if last is None:
                    raise
                raise last from None  # the client gets the failure, not the wait
            except LegError as exc:
                if migration.done >= migration.budget or not self._retryable(exc):
                    raise
                migration.done += 1
                last = exc
                log.warning(
                    "opening a stream again (%d of %d): %s",
                    migration.done,
                    migration.budget,
                    exc.reason,
                )
                self._eject(self._failed(exc))
                avoid |= exc.pair
                self._count("open_failed")
                first = state.first_body()
        end = StreamEnd()
        return await start_relay(
            end,
            relay_sse(
                leg.resp,
                leg.worker,
                endpoint,
                deadline=deadline,
                timeout_s=self.request_timeout,
                metrics=self.metrics,
                on_close=leg.on_close,
                prefill=leg.prefill,
                streams=self.streams,
                end=end,
                migration=migration if self.max_migrations > 0 else None,
                route=leg.route,
                held=leg.held,
            ),
        )

    async def _open_leg(
        self,
        endpoint: str,
        body: dict,
        deadline: float,
        *,
        wait: bool,
        avoid: Collection[str] = (),
    ) -> Leg:
        """Open one streamed leg of ``body``: a mixed worker's stream, or a PD pair's (the
        prefill task running beside decode's open stream). ``wait``: wait for a healthy
        worker until ``deadline`` rather than raise NoHealthyWorker at once; ``avoid``:
        URLs picked only when there is no other. A LegError names the leg's workers in
        its ``pair``."""
        pick = lambda: self._pick_now(endpoint, body, avoid)  # noqa: E731
        route = await self._picked(pick, deadline) if wait else pick()
        try:
            return await self._open_picked(endpoint, body, route)
        except LegError as exc:
            exc.pair = route.urls()
            raise

    async def _open_picked(self, endpoint: str, body: dict, route: Route) -> Leg:
        if route.pair is None:  # one worker runs the whole request
            worker = route.worker
            tracing.phase_so_far("route", self._route_attributes(route))
            worker.outstanding += 1
            try:
                resp = await self._open_stream(worker, endpoint, body)
            except BaseException:
                worker.outstanding -= 1
                raise

            def close_regular() -> None:
                worker.outstanding -= 1

            return Leg(resp, worker, None, close_regular, {worker.url}, route.info, route.held)
        with self._pair_legs(endpoint, body, route) as pd:
            decode = pd.decode
            prefill_body = {k: v for k, v in pd.prefill_body.items() if k != "return_token_ids"}
            p_task = self._post_task(pd.prefill, endpoint, prefill_body)
            decode.outstanding += 1
            d_task = asyncio.ensure_future(self._open_stream(decode, endpoint, pd.decode_body))
            try:  # until decode's stream is open; prefill keeps running (the relay watches it)
                await self._legs((p_task, d_task), until=d_task)
            except BaseException:
                decode.outstanding -= 1
                raise

            def close_pd() -> None:
                decode.outstanding -= 1
                self.release_rooms(pd.room, pd.n)

            pd.handed_off = True
            watch = PrefillWatch(p_task, hold_first=_wants_prompt_logprobs(endpoint, body))
            return Leg(
                d_task.result(),
                decode,
                watch,
                close_pd,
                {pd.prefill.url, decode.url},
                route.info,
                route.held,
            )

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
                if isinstance(result, (WorkerResponse, WorkerStream)):
                    await result.aclose()
            raise
