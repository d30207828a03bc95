"""One leg of a request: the router's HTTP exchange with one worker, its failure as one
:class:`LegError` (the client's answer), and its place in ``WorkerState.outstanding``.

:class:`LegSender` posts a leg for a whole answer or opens it as a stream; the flows
(:mod:`pdserve.router.one_worker`, :mod:`pdserve.router.pd_pair`) call it, the dispatcher
retries what it raises. Counting matters for ``WorkerPool.drain``, which removes a worker
once its ``outstanding`` count is 0 after one loop iteration: a leg is counted from the
loop step that picked its worker, not from its task's first step (:meth:`LegSender.counted`,
``post(counted=True)``, :meth:`LegSender.post_task`, :meth:`LegSender.counted_if_opened`).
:class:`Leg` and :class:`PrefillWatch` are a streamed attempt's open legs, which the relay
(:mod:`pdserve.router.relay`) reads until they end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi.responses import Response

from pdserve import tracing
from pdserve.http.client import TRANSPORT_ERRORS, WorkerClient, WorkerResponse, WorkerStream
from pdserve.router.errors import error_from_worker, error_response
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerPool, WorkerState


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

    @classmethod
    def broken(cls, worker: WorkerState, reason: str) -> LegError:
        """``worker`` failed while serving (its connection, or it was ejected before it
        answered): 502 like a stream that breaks (503 is kept for "no healthy worker to
        pick"), a transport failure."""
        return cls(worker.role, reason, error_response(502, reason), url=worker.url, transport=True)

    @property
    def retryable(self) -> bool:
        """A failure another worker may not have: the transport, or a 5xx answer (a 4xx
        is the client's request, which any worker would refuse alike)."""
        return self.transport or self.response.status_code >= 500


def failed_urls(exc: BaseException) -> set[str]:
    """The URLs of workers to eject at once after ``exc``: a leg's worker whose connection
    failed (a :class:`LegError` of the transport); none for anything else."""
    if isinstance(exc, LegError) and exc.transport and exc.url:
        return {exc.url}
    return set()


@dataclass
class PrefillWatch:
    """The prefill leg of a PD stream. ``task`` resolves to the worker's 200
    ``WorkerResponse`` or raises :class:`LegError` (whose ``response`` is the JSON error);
    ``hold_first``: the client asked for prompt logprobs, which only prefill has."""

    task: asyncio.Future
    hold_first: bool


@dataclass
class Leg:
    """One attempt at a streamed request: the worker's open 200 SSE response, that
    worker, the PD prefill leg (None on one worker) and what to run when it ends."""

    resp: WorkerStream
    worker: WorkerState
    prefill: PrefillWatch | None
    on_close: Callable[[], None]
    urls: set[str] = field(default_factory=set)  # its workers' (decode and prefill)
    route: dict | None = None  # selective PD's decision for it (picking.Route.info)
    held: Callable[[], None] | None = None  # run once its stream ended well (Route.held)


class LegSender:
    """Sends legs to workers over ``client``; a failure is counted in ``metrics`` and
    raised as :class:`LegError` (a transport failure also recorded in ``pool``)."""

    def __init__(self, client: WorkerClient, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.client = client
        self.pool = pool
        self.metrics = metrics

    def _transport_error(self, worker: WorkerState, exc: Exception) -> LegError:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.pool.record_failure(worker, reason)
        self.metrics.leg_failures.labels(worker.role, "connect").inc()
        return LegError.broken(worker, f"{worker.role} worker {worker.url} failed: {reason}")

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

    async def post(
        self, worker: WorkerState, endpoint: str, body: dict, *, counted: bool = False
    ) -> WorkerResponse:
        """POST to one worker; returns the 200 response, else raises LegError. The POST
        counts in ``worker.outstanding`` while it runs, unless ``counted``: the caller
        counted it from the pick on (:meth:`counted`, :meth:`post_task`)."""
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

    def post_task(self, worker: WorkerState, endpoint: str, body: dict) -> asyncio.Future:
        """:meth:`post` as a task, counted in ``worker.outstanding`` from now until the
        task ends (not from its first step, a loop iteration later: ``WorkerPool.drain``
        must see every request that picked the worker before it was marked draining)."""
        worker.outstanding += 1
        task = asyncio.ensure_future(self.post(worker, endpoint, body, counted=True))

        def uncount(_: asyncio.Future) -> None:
            worker.outstanding -= 1

        task.add_done_callback(uncount)
        return task

    @staticmethod
    @contextmanager
    def counted(workers: tuple[WorkerState, ...]) -> Iterator[None]:
        """Every one of ``workers`` (an attempt's) counted in ``outstanding`` for the block
        (a non-streamed attempt, from its pick on: its legs run in tasks started iterations
        later, which ``WorkerPool.drain`` would not wait for)."""
        for w in workers:
            w.outstanding += 1
        try:
            yield
        finally:
            for w in workers:
                w.outstanding -= 1

    @staticmethod
    @contextmanager
    def counted_if_opened(worker: WorkerState) -> Iterator[None]:
        """``worker`` counted in ``outstanding`` from now (the block opens its stream):
        still counted after a block that ended well (the stream's ``Leg.on_close``
        uncounts it), uncounted at once when the block raises."""
        worker.outstanding += 1
        try:
            yield
        except BaseException:
            worker.outstanding -= 1
            raise

    async def open_stream(self, worker: WorkerState, endpoint: str, body: dict) -> WorkerStream:
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


async def wait_legs(tasks: tuple[asyncio.Future, ...], until: asyncio.Future | None = None) -> None:
    """Wait for every leg (or only until ``until`` is done); the first failure cancels
    the others (closing a stream one may have opened, so the worker sees the disconnect
    and aborts) and is raised."""
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
