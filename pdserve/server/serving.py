"""The worker's request serving, from the HTTP handler down to the engine thread.

``AsyncEngine`` runs ``EngineCore.step()`` in ONE dedicated engine thread and connects it
to the asyncio event loop of the HTTP server. Requests and aborts go in through a
thread-safe queue; each engine request's outputs come back through
``loop.call_soon_threadsafe`` to a per-request callback on the event loop, so the HTTP loop
never waits on a forward pass. When idle the thread blocks on the input queue; while a step
runs the model (a prefill chunk that emits nothing counts too) or emits output, the next
step follows at once; while requests are unfinished but nothing could be scheduled (only KV
transfer rooms pending) it waits on the queue for ``idle_poll_interval`` seconds between
steps, polling the rooms without spinning; a room that moves to a state the engine acts on
(a destination arrived, the transfer ended) ends that wait at once (the KV managers'
``set_wakeup``: a ``wake`` item in the queue, one pending at a time), so the interval only
paces rooms whose manager cannot wake it (a tensor-parallel room its ranks >= 1, in other
processes, still hold back). If
the thread dies, or the engine reports a ``failure`` (a tensor-parallel rank is gone,
noticed even while idle), ``alive`` turns False (``/health`` then answers 503) and every
live request gets the error.

``Serving`` handles one client request inside the worker: validation against the model,
fan-out of ``n`` samples into single-sample engine requests (each with its own bootstrap
room in PD roles), collection / streaming of their outputs, abort on cancel, and
per-request metrics. Both live here because a request's path is one line through them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve import tracing
from pdserve.disagg.base import (
    BOOTSTRAP_FIELDS,
    ROOM_LIMIT,
    DuplicateRoomError,
    Role,
    sample_room,
)
from pdserve.engine.core.request import (
    DisaggRequestInfo,
    PromptError,
    RequestOutput,
    check_prompt,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.http.aio import get_within
from pdserve.server.metrics import ServerMetrics
from pdserve.server.phases import PhaseRecorder

log = logging.getLogger("pdserve.server")

# sink(item): called on the event loop with a RequestOutput or an Exception (add failed,
# or the engine thread died).
Sink = Callable[[Any], None]


class EngineDeadError(RuntimeError):
    """The engine thread is not running; the message says why it stopped."""


class _EngineFailed(Exception):
    """Ends the engine thread's loop: the engine reports a ``failure`` (already logged)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters published after every step (read by /health, /metrics, server info)."""

    num_free_pages: int = 0
    stats: dict | None = None
    steps: int = 0
    time: float = 0.0


class AsyncEngine:
    """Owns the engine thread of one worker. ``core`` is an ``EngineCore`` (only ever
    touched from the engine thread after :meth:`start`)."""

    def __init__(self, core: Any, *, idle_poll_interval: float = 0.002) -> None:
        self.core = core
        self._idle = idle_poll_interval
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._wake_pending = False  # a "wake" item is in the inbox (one is enough)
        self._error: str | None = None
        self.snapshot = EngineSnapshot(num_free_pages=core.num_free_pages, stats=_safe_stats(core))

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``loop``."""
        self._loop = loop
        set_wakeup = getattr(self.core, "set_kv_wakeup", None)
        if set_wakeup is not None:
            set_wakeup(self.wake)
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to finish and join it, then shut the engine's ranks down
        (``core.shutdown``: a tensor-parallel engine's rank processes); idempotent."""
        self._stopping = True
        self._inbox.put(("stop",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        shutdown = getattr(self.core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    @property
    def error(self) -> str | None:
        """Why the engine does not serve (its thread died, or a tensor-parallel rank is
        gone: ``core.failure``), or None."""
        return self._error or getattr(self.core, "failure", None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # --- requests (called on the event loop) --------------------------------------------
    def add(
        self, request_id: str, prompt_token_ids: list[int], params: Any, disagg: Any, sink: Sink
    ) -> None:
        """Queue one single-sample engine request; ``sink`` gets its outputs (or the
        ValueError / DuplicateRoomError of ``add_request``) on the event loop.
        Raises EngineDeadError at once if the engine thread is not running."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error or 'not started'}")
        self._inbox.put(("add", request_id, prompt_token_ids, params, disagg, sink))

    def abort(self, request_id: str) -> None:
        """Abort one engine request (no-op if it already finished)."""
        self._inbox.put(("abort", request_id))

    def wake(self) -> None:
        """End the engine thread's idle wait now (any thread; never blocks): a KV room
        changed state (``KVManager.set_wakeup``). One wake-up pending at a time."""
        if not self._wake_pending:
            self._wake_pending = True
            self._inbox.put(("wake",))

    # --- engine thread ------------------------------------------------------------------
    def _deliver(self, sink: Sink, item: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(sink, item)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, disagg, sink = command
            try:
                self.core.add_request(request_id, prompt, params, disagg=disagg)
            except Exception as exc:  # noqa: BLE001 ValueError / DuplicateRoomError: that request only
                self._deliver(sink, exc)
                return
            self._sinks[request_id] = sink
        elif kind == "abort":
            if self._sinks.pop(command[1], None) is not None:
                self.core.abort_request(command[1])
        elif kind == "wake":  # the step that follows polls the rooms
            self._wake_pending = False
        elif kind == "stop":
            self._stopping = True

    def _drain(self, timeout: float | None) -> None:
        """Handle every queued command; block up to ``timeout`` (None = forever) for the first."""
        try:
            self._handle(
                self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _run(self) -> None:
        progressed = True
        try:
            while not self._stopping:
                if not self.core.has_unfinished_requests():
                    self._drain(None)  # idle: sleep until a request (or stop) arrives
                else:
                    self._drain(0 if progressed else self._idle)
                if self._stopping:
                    break
                steps_before = self.core.num_steps
                outputs = self.core.step()
                stats = _safe_stats(self.core)
                # A chunked-prefill step emits nothing while work remains: the model having run
                # (EngineCore.num_steps moved) is progress too, so no idle wait.
                progressed = bool(outputs) or self.core.num_steps != steps_before
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is None:
                        continue  # aborted by the client
                    if out.finished:
                        del self._sinks[out.request_id]
                    self._deliver(sink, out)
                self.snapshot = EngineSnapshot(
                    self.core.num_free_pages, stats, self.snapshot.steps + 1, time.time()
                )
                failure = getattr(self.core, "failure", None)
                if failure is not None:  # a rank is gone: its requests ended with an error
                    raise _EngineFailed(failure)
        except BaseException as exc:  # the worker turns unhealthy; every caller learns why
            # A rank that is gone is the cause (core.failure names it); else the exception.
            self._error = getattr(self.core, "failure", None) or (
                f"engine thread died: {type(exc).__name__}: {exc}"
            )
            if not isinstance(exc, _EngineFailed):  # the executor logged its failure once
                log.exception("engine thread died")
            for sink in self._sinks.values():
                self._deliver(sink, EngineDeadError(self.error))
            self._sinks.clear()
        finally:
            self._abort_all_on_stop()

    def _abort_all_on_stop(self) -> None:
        reason = self.error or "worker is shutting down"
        while True:  # requests still queued get an answer too
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._deliver(command[5], EngineDeadError(reason))
        if self.error is None:
            for request_id, sink in list(self._sinks.items()):
                try:
                    self.core.abort_request(request_id)
                except Exception:  # noqa: BLE001 shutting down: best effort
                    pass
                self._deliver(sink, EngineDeadError("worker is shutting down"))
            self._sinks.clear()


def _safe_stats(core: Any) -> dict | None:
    try:
        return dict(core.stats())
    except Exception:  # noqa: BLE001 stats are best effort
        return None


class APIError(Exception):
    """An error answer: HTTP ``status`` and a message (``param`` names the field, ``code``
    is OpenAI's string for the error where it has one: ``http_errors.error_json``)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _sink(inbox: asyncio.Queue[tuple[int, Any]], index: int) -> Callable[[Any], None]:
    """The engine callback of sample ``index``: puts ``(index, item)`` into ``inbox``."""
    return lambda item: inbox.put_nowait((index, item))


@dataclass
class Job:
    """One validated client request: the prompt, the (possibly n > 1) sampling params and
    the disaggregation fields (``None`` on a mixed worker)."""

    prompt_ids: list[int]
    params: SamplingParams
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None  # the request's; rooms: disagg.base.sample_room
    prompt_index: int = 0  # which prompt of a /v1/completions batch this job is
    fake_transfer: bool = False  # /health_generate in PD roles
    prompt_field: str = "prompt"  # the request field errors about the prompt name
    # engine id: the API request's id (x-request-id) and a unique suffix
    request_id: str = field(default_factory=tracing.engine_request_id)
    arrival: float = field(default_factory=time.perf_counter)
    # a stream's first SSE chunk handed to the server (perf_counter; 0.0: none yet, or
    # not streamed): the timing block's ``first_chunk_unix`` (server/formatting.py)
    first_chunk_at: float = 0.0


def make_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams, with its ValueError turned into a 400 naming the field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc


class Serving:
    """Runs jobs on the engine of one worker (``role``: mixed, prefill or decode)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        role: str | Role,
        max_model_len: int,
        vocab_size: int,
        metrics: ServerMetrics,
        phases: PhaseRecorder | None = None,
    ) -> None:
        self.engine = engine
        self.phases = phases  # per-phase timings of finished samples (server/phases.py)
        self.role = Role(role)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics

    # --- validation ---------------------------------------------------------------------
    def check(self, job: Job) -> None:
        """400 for an empty/over-long prompt, ids outside the vocabulary, or missing/invalid
        bootstrap fields in a PD role."""
        try:
            max_tokens = job.params.max_tokens or 1
            check_prompt(
                job.prompt_ids,
                job.params,
                self.vocab_size,
                self.max_model_len,
                output_tokens=max_tokens,
            )
        except PromptError as exc:
            field = job.prompt_field if exc.field == "prompt" else exc.field
            raise APIError(400, str(exc), field, code=exc.code) from None
        if self.role == Role.MIXED or job.fake_transfer or self._runs_whole(job):
            return
        for name in BOOTSTRAP_FIELDS:
            if getattr(job, name) in (None, ""):
                raise APIError(
                    400,
                    f"{name} is required on a {self.role} worker "
                    f"(send requests through the router)",
                    name,
                )
        room, n = job.bootstrap_room, job.params.n
        assert room is not None  # checked just above
        if sample_room(room, job.prompt_index, n, n - 1) >= ROOM_LIMIT:
            raise APIError(
                400,
                "bootstrap_room + n (times the prompts of a batch) must be <= 2**63 (sample i "
                "of prompt p uses room bootstrap_room + p * n + i)",
                "bootstrap_room",
            )

    def _runs_whole(self, job: Job) -> bool:
        """A decode worker prefills a request that names no bootstrap field at all itself,
        as a mixed worker would (the router's selective PD: a prompt too short to be
        worth a transfer); a prefill worker never does (it has no one to send to)."""
        return self.role == Role.DECODE and (
            job.bootstrap_host is None and job.bootstrap_port is None and job.bootstrap_room is None
        )

    def _disagg(self, job: Job, index: int) -> DisaggRequestInfo | None:
        if self.role == Role.MIXED or self._runs_whole(job):
            return None
        if job.fake_transfer:
            return DisaggRequestInfo(self.role, "127.0.0.1", 1, job.bootstrap_room or 0, fake=True)
        host, port, room = job.bootstrap_host, job.bootstrap_port, job.bootstrap_room
        assert host is not None and port is not None and room is not None  # check() ran first
        room = sample_room(room, job.prompt_index, job.params.n, index)
        return DisaggRequestInfo(self.role, host, port, room)

    # --- running --------------------------------------------------------------------------
    async def stream(self, job: Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Submit ``job`` and yield ``(sample index, output)`` as the engine produces them,
        until every sample finished. Raises APIError (400 bad input, 409 duplicate room,
        500 failed request / KV transfer, 503 engine down: a request the engine was running
        when it went down too, e.g. a tensor-parallel rank gone). Closing the iterator early (client
        gone, cancellation) aborts every unfinished sample, which frees its pages."""
        self.check(job)
        samples = job.params.fan_out(job.request_id)
        inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        live: dict[str, int] = {}
        last_token_time: dict[int, float] = {}
        first_out: dict[int, float] = {}  # when each sample's first token reached this loop
        # with tracing on: when each sample's tokens arrived (its span's decode events)
        tokens: dict[int, list[tuple[float, int]]] | None = (
            None if tracing.CURRENT_SPAN.get() is None else {}
        )
        try:
            for index, (rid, params) in enumerate(samples):
                live[rid] = index
                self.engine.add(
                    rid,
                    list(job.prompt_ids),
                    params,
                    self._disagg(job, index),
                    _sink(inbox, index),
                )
            while live:
                try:
                    index, item = await get_within(inbox, 1.0)
                except asyncio.TimeoutError:
                    if not self.engine.alive:
                        raise EngineDeadError(self.engine.error or "engine stopped") from None
                    continue
                if isinstance(item, Exception):
                    raise item
                if index not in first_out and item.outputs[0].delta_token_ids:
                    first_out[index] = time.perf_counter()
                if tokens is not None:
                    tokens.setdefault(index, []).append(
                        (time.perf_counter(), len(item.outputs[0].delta_token_ids))
                    )
                if item.finished and self.phases is not None:
                    self._phases(job, index, item, tokens, first_out.get(index, 0.0))
                if item.error is not None or any(o.finish_reason == "error" for o in item.outputs):
                    if not self.engine.alive:  # the engine cannot serve (a rank is gone):
                        raise EngineDeadError(item.error or self.engine.error or "engine stopped")
                    raise APIError(500, item.error or "request failed in the engine")
                self._observe(job, index, item, last_token_time)
                if item.finished:
                    live.pop(item.request_id, None)
                yield index, item
        except DuplicateRoomError as exc:
            self.metrics.failures.labels("duplicate_room").inc()
            raise APIError(409, str(exc), "bootstrap_room") from exc
        except ValueError as exc:
            self.metrics.failures.labels("invalid").inc()
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from exc
        except EngineDeadError as exc:
            self.metrics.failures.labels("engine_dead").inc()  # (the engine logged why, once)
            raise APIError(503, str(exc)) from exc
        except APIError as exc:
            cause = "kv_transfer" if self.role != Role.MIXED else "engine"
            self.metrics.failures.labels(cause).inc()
            # the client (often the router, which retries) gets the message; the worker's
            # own log keeps why it failed, under the request's id
            log.warning("request failed (%s): HTTP %d: %s", cause, exc.status, exc.message)
            raise
        finally:
            for rid in live:
                self.engine.abort(rid)

    async def stream_all(
        self, jobs: Sequence[Job]
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run several jobs at once (a batch of prompts, each with the same ``n``) and yield
        ``(p * n + sample index, output)`` for job ``p``, interleaved as the engine produces
        them (vLLM's and SGLang's numbering of a batch's choices). Every job is checked
        before any starts; the first failure (an APIError as :meth:`stream`) ends them all,
        and so does closing the iterator (every unfinished sample is aborted)."""
        if len(jobs) == 1:
            async for item in self.stream(jobs[0]):
                yield item
            return
        for p, job in enumerate(jobs):
            try:
                self.check(job)
            except APIError as exc:  # a prompt of the batch: name it
                if exc.param not in ("prompt", "max_tokens"):
                    raise
                raise APIError(
                    exc.status, f"prompt[{p}]: {exc.message}", exc.param, exc.code
                ) from None
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(p: int, job: Job) -> None:
            try:
                async for index, out in self.stream(job):
                    queue.put_nowait((p * job.params.n + index, out))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
                queue.put_nowait((-1, exc))
                return
            queue.put_nowait((-1, None))  # job p is done

        tasks = [asyncio.ensure_future(pump(p, job)) for p, job in enumerate(jobs)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if index < 0:
                    if item is not None:
                        raise item
                    running -= 1
                    continue
                yield index, item
        finally:
            for task in tasks:
                task.cancel()  # each job's stream aborts its unfinished samples
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, job: Job | Sequence[Job]) -> list[RequestOutput]:
        """Run ``job`` (or a batch: :meth:`stream_all`) to the end; the final output of
        each sample, in index order."""
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.stream_all([job] if isinstance(job, Job) else job):
            if out.finished:
                finals[index] = out
        return [finals[i] for i in sorted(finals)]

    def _phases(
        self,
        job: Job,
        index: int,
        out: RequestOutput,
        tokens: dict[int, list[tuple[float, int]]] | None,
        first_out: float,
    ) -> None:
        """Hand finished sample ``index`` to the phase recorder (its room and peer in PD;
        ``first_out``: when its first token reached the event loop, 0.0 if none did)."""
        assert self.phases is not None
        info = self._disagg(job, index) if job.bootstrap_room is not None else None
        self.phases.finished(
            out,
            arrival=job.arrival,
            room=None if info is None else info.bootstrap_room,
            peer=None if info is None else f"{info.bootstrap_host}:{info.bootstrap_port}",
            tokens=None if tokens is None else tokens.get(index),
            first_out=first_out,
            first_chunk=job.first_chunk_at,
        )

    def _observe(self, job: Job, index: int, out: RequestOutput, last: dict[int, float]) -> None:
        now = time.perf_counter()
        new = sum(len(o.delta_token_ids) for o in out.outputs)
        if new:
            if index not in last:
                self.metrics.ttft.observe(now - job.arrival)
                new -= 1
                last[index] = now
            if new > 0:
                gap = (now - last[index]) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
                last[index] = now
        if out.finished:
            if index == 0:
                self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            self.metrics.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
