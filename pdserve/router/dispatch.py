"""Dispatch of one client request: the router's entry point after the app's checks
(:meth:`Dispatcher.dispatch`), and what happens when a worker fails under it.

A request is tried in attempts. Each attempt picks a route (:mod:`pdserve.router.picking`:
one worker, or a (prefill, decode) pair) and runs it with the flow that fits
(:mod:`pdserve.router.one_worker`, :mod:`pdserve.router.pd_pair`; the legs' HTTP in
:mod:`pdserve.router.legs`). A non-streamed request that failed on a worker (its
transport, or a 5xx) is sent again whole to another, as is a stream whose first leg did
not open; a stream that breaks later is continued by its relay (:mod:`pdserve.router.relay`,
:mod:`pdserve.router.migration`). A request gets ``--max-migrations`` of them (a stream's
reopenings and its relay's continuations together); a worker whose connection failed is
ejected at once, and a failed attempt's workers are picked again only when there is no
other. The request's deadline (``--request-timeout``) gives 504.

Reading order for a newcomer: :meth:`Dispatcher.dispatch`, then ``_whole`` or ``_stream``,
then the flow modules.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi.responses import Response

from pdserve.disagg.base import MAX_ROOMS_PER_REQUEST
from pdserve.http.client import WorkerClient
from pdserve.http.netutil import GRACEFUL_SHUTDOWN_S
from pdserve.router.errors import error_response
from pdserve.router.legs import Leg, LegError, LegSender, failed_urls
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import Migration, StreamState
from pdserve.router.one_worker import open_on_worker, whole_on_worker
from pdserve.router.pd_pair import LiveRooms, open_on_pair, whole_on_pair
from pdserve.router.picking import Picker, Route
from pdserve.router.relay import OpenStreams, StreamEnd, relay_sse, start_relay
from pdserve.router.request_facts import num_samples
from pdserve.router.workers import NoHealthyWorker, WorkerPool

log = logging.getLogger("pdserve.router")

_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+

# seconds a non-streamed request still waits for a worker ejected under it (dispatch's
# _until_ejected): a stopping worker's graceful shutdown, and as long again
EJECTED_GRACE_S = 2 * GRACEFUL_SHUTDOWN_S

T = TypeVar("T")


class _Budget(Protocol):
    """Attempts allowed after the first (``budget``) and made (``done``): a non-streamed
    request's :class:`_Tries`, or a stream's ``Migration`` (its relay's continuations draw
    on the same budget)."""

    budget: int
    done: int


@dataclass
class _Tries:
    budget: int
    done: int = 0


@contextmanager
def _naming(route: Route) -> Iterator[None]:
    """A LegError of the block names the workers of ``route`` in its ``pair`` (avoided
    by the next attempt's pick)."""
    try:
        yield
    except LegError as exc:
        exc.pair = route.urls()
        raise


class Dispatcher:
    """Sends client requests to workers; owns the set of live bootstrap rooms (``rooms``)
    and the relays now running (``streams``)."""

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
        self.metrics = metrics
        self.pd_mode = pd_mode
        self.request_timeout = request_timeout
        self.max_migrations = max_migrations  # per request (--max-migrations)
        self.migration_wait = migration_wait  # s, for a healthy worker (--migration-wait)
        self.legs = LegSender(client, pool, metrics)
        self.picker = Picker(
            pool,
            metrics,
            pd_mode=pd_mode,
            pd_min_prefill_tokens=pd_min_prefill_tokens,  # selective PD; 0 = off
            wait_s=migration_wait,
        )
        self.rooms = LiveRooms(live_rooms, rng)
        self.streams = OpenStreams()  # relays now running; ended by the router's shutdown

    # --- entry point -------------------------------------------------------------------
    async def dispatch(self, endpoint: str, body: dict) -> Response:
        """Serve one client request (``endpoint`` is the worker path, e.g. ``/generate``).
        Errors become OpenAI-shaped JSON responses; the deadline gives 504."""
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        stream = body.get("stream") is True
        try:
            if self.pd_mode:
                n = num_samples(endpoint, body)
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

    # --- attempts ------------------------------------------------------------------------
    async def _retried(
        self,
        attempt: Callable[[bool], Awaitable[T]],
        tries: _Budget,
        avoid: set[str],
        *,
        again: str,
        kind: str,
    ) -> T:
        """``attempt(wait)`` until it succeeds: ``wait`` is False for the first (its pick
        raises NoHealthyWorker at once: the client's 503) and True after a failure (its
        pick waits for a healthy worker). A retryable LegError (``LegError.retryable``)
        within ``tries`` is logged (``again``), counted (``kind``, the migrations'
        reason label), its failed workers ejected and its workers added to ``avoid``;
        any other is raised, as is the last failure when no worker came for the next."""
        last: LegError | None = None
        while True:
            try:
                return await attempt(last is not None)
            except NoHealthyWorker:
                if last is None:
                    raise
                raise last from None  # the client gets the failure, not the wait
            except LegError as exc:
                if tries.done >= tries.budget or not exc.retryable:
                    raise
                tries.done += 1
                last = exc
                log.warning("%s (%d of %d): %s", again, tries.done, tries.budget, exc.reason)
                self._eject(failed_urls(exc))
                avoid |= exc.pair
                self._count(kind)

    def _count(self, kind: str) -> None:
        """Count one migration (``kind``: the reason label)."""
        self.metrics.migrations.labels(kind).inc()

    def _eject(self, failed: set[str]) -> None:
        """Take the workers at ``failed`` out of picking now (their connection failed)."""
        for url in failed:
            self.pool.eject(url, "its connection failed under a request")

    # --- a non-streamed request --------------------------------------------------------
    async def _whole(self, endpoint: str, body: dict, deadline: float) -> Response:
        """A non-streamed request; one that failed on a worker (transport or 5xx) is sent
        again whole to another, at most ``max_migrations`` times. Each attempt counts its
        workers outstanding from its pick on (``LegSender.counted``)."""
        avoid: set[str] = set()  # workers of the failed attempts, not picked again if avoidable

        async def attempt(wait: bool) -> Response:
            route = await self.picker.pick(endpoint, body, avoid, wait=wait, deadline=deadline)
            with self.legs.counted(route.workers()):
                answer = await self._whole_once(endpoint, body, route)
            if route.held is not None:
                route.held()
            return answer

        return await self._retried(
            attempt,
            _Tries(self.max_migrations),
            avoid,
            again="sending a request again whole",
            kind="retry_whole",
        )

    async def _whole_once(self, endpoint: str, body: dict, route: Route) -> Response:
        """One attempt of a non-streamed request on ``route``."""
        if route.pair is None:
            work = whole_on_worker(self.legs, endpoint, body, route)
        else:
            work = whole_on_pair(self.legs, self.rooms, endpoint, body, route)
        with _naming(route):
            return await self._until_ejected(work, route)

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
        attempt = asyncio.ensure_future(work)
        watches = {asyncio.ensure_future(w.ejected.wait()): w for w in route.workers()}
        try:
            done, _ = await asyncio.wait({attempt, *watches}, return_when=asyncio.FIRST_COMPLETED)
            if attempt not in done:
                done, _ = await asyncio.wait({attempt}, timeout=EJECTED_GRACE_S)
            if attempt in done:
                return attempt.result()
            gone = next(w for f, w in watches.items() if f.done() and not f.cancelled())
            raise LegError.broken(
                gone,
                f"{gone.role} worker {gone.url} was ejected ({gone.last_error or 'unhealthy'}) "
                "before it answered",
            )
        finally:
            for watch in watches:
                watch.cancel()
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)

    # --- a streamed request ------------------------------------------------------------
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
        migrates = self.max_migrations > 0
        leg = await self._retried(
            lambda wait: self._open_leg(
                endpoint,
                state.first_body() if migrates else body,
                deadline,
                wait=wait,
                avoid=avoid,
            ),
            migration,
            avoid,
            again="opening a stream again",
            kind="open_failed",
        )
        end = StreamEnd()
        return await start_relay(
            end,
            relay_sse(
                leg,
                endpoint,
                deadline=deadline,
                timeout_s=self.request_timeout,
                metrics=self.metrics,
                streams=self.streams,
                end=end,
                migration=migration if migrates else None,
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
        route = await self.picker.pick(endpoint, body, avoid, wait=wait, deadline=deadline)
        with _naming(route):
            if route.pair is None:  # one worker runs the whole request
                return await open_on_worker(self.legs, endpoint, body, route)
            return await open_on_pair(self.legs, self.rooms, endpoint, body, route)
