"""The router's SSE pass-through of one worker stream to the client, optionally watching
the prefill leg of a PD request while decode's chunks are relayed as they arrive.

One reader task pumps the worker's SSE events into a queue; the prefill leg's completion
is posted into the same queue, so the relay reacts to whichever comes first: a decode
chunk is forwarded at once, a prefill failure cancels decode and ends the stream with one
SSE error event and ``data: [DONE]``. Each relayed chunk gets the prefill leg's fields
merged in (:mod:`pdserve.router.answer_merge`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi.responses import Response, StreamingResponse

from pdserve.http.aio import get_within
from pdserve.http.client import WorkerStream
from pdserve.http.http_errors import error_status
from pdserve.http.wire import SSE_DONE, sse_event
from pdserve.router.answer_merge import (
    is_final_chunk,
    merge_cached_tokens,
    merge_prompt_logprobs,
    merge_router_timing,
    merge_timing,
    timing_blocks,
)
from pdserve.router.errors import sse_error
from pdserve.router.legs import Leg, LegError, failed_urls
from pdserve.router.metrics import RouterMetrics
from pdserve.router.migration import Migration
from pdserve.router.workers import NoHealthyWorker

log = logging.getLogger("pdserve.router")

DONE = SSE_DONE


class OpenStreams:
    """The queues of the relays now running; ``shutdown()`` (router shutting down, on the
    event loop) tells each to end its stream with an SSE error event and ``[DONE]``."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue] = set()
        self.stopping = False

    def add(self, queue: asyncio.Queue) -> None:
        self._queues.add(queue)
        if self.stopping:
            queue.put_nowait((None, "shutdown", None))

    def discard(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    def shutdown(self) -> None:
        self.stopping = True
        for queue in self._queues:
            queue.put_nowait((None, "shutdown", None))


@dataclass
class StreamEnd:
    """How a relayed stream ended, for the router's metrics: ``status`` is the HTTP status
    of the SSE error event the relay sent last (502 broken, 503 shutdown, 504 timeout, a
    failed prefill leg's own, the one a worker's own error event stands for:
    ``http_errors.error_status``), 200 for a stream that ended with ``[DONE]`` and no error,
    None while it runs (and for a stream the client left before its end)."""

    status: int | None = None


class RelayedStream(StreamingResponse):
    """The client's SSE response from ``relay_sse``; ``end`` is how the stream ended (the
    router's metrics read it once the last byte is sent)."""

    def __init__(self, end: StreamEnd, chunks: AsyncGenerator[bytes, None]) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.end = end
        self.relay = chunks


async def _after(first: bytes, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """``first``, then the rest of ``chunks``; closing this closes ``chunks``."""
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()


async def start_relay(end: StreamEnd, chunks: AsyncGenerator[bytes, None]) -> Response:
    """The client's response for a relay (``relay_sse``'s generator, whose outcome goes to
    ``end``), once its first bytes are known: an error before any data chunk (a prefill
    leg that failed while decode's first chunk was held for its answer, a broken or timed
    out stream, a worker's error event first) is answered with that status and the JSON
    error body, as a worker's error before the first byte of its stream; otherwise the
    stream, 200, starting with those bytes. Cancellation closes the relay (both legs)."""
    try:
        first = await chunks.__anext__()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()
        raise
    if end.status is None or end.status == 200:
        return RelayedStream(end, _after(first, chunks))
    with anyio.CancelScope(shield=True):
        await chunks.aclose()
    body = first.split(b"\n\n", 1)[0].removeprefix(b"data: ")
    return Response(body, status_code=end.status, media_type="application/json")


def _sse_from_error(exc: BaseException) -> tuple[int, bytes]:
    """(HTTP status, one SSE error event + [DONE]) from a failed leg (``LegError.response``
    holds an OpenAI error body and its status) or any other exception (502)."""
    if isinstance(exc, LegError) and exc.response.body:
        body = bytes(exc.response.body)
        return exc.response.status_code, b"data: " + body + b"\n\n" + DONE
    return 502, sse_error(502, f"prefill leg failed: {type(exc).__name__}: {exc}")


async def _pump(resp: WorkerStream, queue: asyncio.Queue, tag: int) -> None:
    """Read SSE events until the stream ends; every item goes to ``queue`` as
    ``(tag, "event", ServerSentEvent)``, then ``(tag, "end", None)`` or
    ``(tag, "broken", exc)``."""
    try:
        async for event in resp.aiter_sse():
            queue.put_nowait((tag, "event", event))
        queue.put_nowait((tag, "end", None))
    except Exception as exc:  # noqa: BLE001 - WorkerConnectionError mostly; any failure ends the relay
        queue.put_nowait((tag, "broken", exc))


async def _settle(task: asyncio.Future | None) -> None:
    """Cancel ``task`` if still running and wait for it, swallowing its outcome."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled or failed: either way it is over
        pass


HEALTH_POLL_S = 0.5  # how often a migratable relay looks at its worker's health


@dataclass
class _LegRun:
    """The relay's view of the leg now streaming (``tag`` marks its queue items, so a
    late item of a leg given up is ignored)."""

    leg: Leg
    tag: int
    pump: asyncio.Future
    answer: Any = None  # prefill's parsed JSON answer, once arrived
    prefill_over: bool = True
    merged: set[int] = field(default_factory=set)
    held: list[str] = field(default_factory=list)  # data chunks held for prefill's answer
    decode_done: bool = False
    closed: bool = False

    @property
    def task(self) -> asyncio.Future | None:
        return self.leg.prefill.task if self.leg.prefill is not None else None

    async def close(self) -> None:
        """End this leg: its pump, its response, its prefill task; then its on_close
        (once, however often it is called)."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            await _settle(self.pump)
            await self.leg.resp.aclose()
            await _settle(self.task)
            self.leg.on_close()


def _start_leg(leg: Leg, queue: asyncio.Queue, tag: int) -> _LegRun:
    run = _LegRun(leg, tag, asyncio.ensure_future(_pump(leg.resp, queue, tag)))
    task = run.task
    if task is not None:
        run.prefill_over = False
        task.add_done_callback(lambda t: queue.put_nowait((tag, "prefill", t)))
    return run


async def relay_sse(
    leg: Leg,
    endpoint: str,
    *,
    deadline: float,
    timeout_s: float,
    metrics: RouterMetrics,
    streams: OpenStreams | None = None,
    end: StreamEnd | None = None,
    migration: Migration | None = None,
) -> AsyncGenerator[bytes, None]:
    """Yield the client's SSE bytes from ``leg.resp`` (an open 200 stream of ``leg.worker``).

    deadline: loop time (s) by which the whole request must end (then a 504 SSE error);
    timeout_s: the router's request timeout, for the message. ``leg.prefill``: PD only; its
    failure before decode's ``[DONE]`` cancels decode (the stream is closed, so the decode
    worker aborts) and yields one SSE error event + ``[DONE]``. Prompt logprobs from
    prefill's answer are merged into decode's chunks once it has arrived; when they were
    asked for, the first chunk is held until then (only that one: later chunks come
    after it, so the answer is already there). A stream that breaks or ends early yields
    a 502 SSE error; a worker's own SSE error event (its request failed mid-stream) is
    relayed as is, with the ``[DONE]`` that follows it. ``streams``: registry whose
    ``shutdown()`` ends the stream with a 503 SSE error ("router shutting down") +
    ``[DONE]``. ``leg.on_close`` runs once at the end, after both legs ended. ``end``: gets the stream's outcome (see ``StreamEnd``).

    migration: when given, a failure of the leg (its stream broke or ended before
    ``[DONE]``, a worker's 5xx error event, the prefill leg's failure, the worker ejected
    by its health checks) is not the end: the leg is closed and the stream goes on with
    the next one that ``migration.reopen`` opens for ``migration.state``'s continued
    body, at most ``migration.budget`` times (then the failure's SSE error, saying so);
    every chunk goes through ``migration.state.rewrite`` (:mod:`pdserve.router.migration`).

    ``leg.route``: selective PD's decision for the leg, added to the chunks' timing blocks (:func:`merge_router_timing`); every timing block
    also gets ``"relay": {"first_chunk_in_unix", "first_chunk_out_unix"}``, when the relay
    took the worker's first data chunk off its connection and when it rendered it for the
    client (Unix seconds; ``bench serve --phase-timing`` splits ``stream_back`` by them).
    ``leg.held``: run when the stream ends with ``[DONE]`` and no error (the last leg's):
    the prompt is then recorded as held by the decode worker.
    """
    end = end if end is not None else StreamEnd()
    state = migration.state if migration is not None else None

    def error(status: int, message: str) -> bytes:
        end.status = status
        return sse_error(status, message)

    def done() -> bytes:
        if end.status is None:
            end.status = 200
            if run.leg.held is not None:  # the decode worker now holds the prompt's KV
                run.leg.held()
        return DONE

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    if streams is not None:
        streams.add(queue)
    run = _start_leg(leg, queue, 0)

    # when the relay took the leg's first data chunk and when it handed it on (Unix
    # seconds): the timing blocks' "relay" entry, for the TTFT stages of bench serve
    relay_times: dict[str, float] = {}

    def render(data: str) -> bytes | None:
        route = run.leg.route
        relay_times.setdefault("first_chunk_out_unix", time.time())
        timed = '"timing"' in data
        if run.answer is None and state is None and not timed:
            return f"data: {data}\n\n".encode()
        try:
            chunk = json.loads(data)
        except ValueError:
            return f"data: {data}\n\n".encode()
        if run.answer is not None:
            chunk = merge_prompt_logprobs(endpoint, chunk, run.answer, run.merged)
            chunk = merge_timing(endpoint, chunk, run.answer)
            chunk = merge_cached_tokens(endpoint, chunk, run.answer)
        if route is not None:
            chunk = merge_router_timing(endpoint, chunk, route)
        if timed:
            for block in timing_blocks(endpoint, chunk).values():
                block["relay"] = dict(relay_times)
        if state is not None:
            chunk = state.rewrite(chunk)
            if chunk is None:
                return None
        return sse_event(chunk)

    def worker_error(data: str) -> int | None:
        """A worker's own SSE error event's status (its request failed mid-stream;
        ``[DONE]`` follows), None for any other chunk."""
        if '"error"' not in data:  # cheap pre-check: only an error body has that key
            return None
        try:
            return error_status(json.loads(data))
        except ValueError:
            return None

    def is_final(data: str) -> bool:
        try:
            return is_final_chunk(endpoint, json.loads(data))
        except ValueError:
            return False

    def flush_held():
        for data in run.held:
            if (out := render(data)) is not None:
                yield out
        run.held.clear()

    async def migrate(kind: str, reason: str, failed: set[str]) -> bool:
        """Close the failed leg and open the next; False when no migration is left, the
        stream cannot continue or no healthy worker came within ``migration.wait_s`` (the
        caller then ends it with the failure). ``kind``: the metrics' reason label;
        ``failed``: URLs of workers to eject at once (their connection failed: the health
        checks bring them back)."""
        nonlocal run
        if migration is None or state is None:
            return False
        while migration.done < migration.budget:
            body = state.continued_body()
            if body is None:
                return False
            migration.done += 1
            migration.eject(failed)
            migration.avoid |= run.leg.urls
            log.warning(
                "%s: continuing the stream on another worker (migration %d of %d, %d tokens sent)",
                reason,
                migration.done,
                migration.budget,
                len(state.sent_ids),
            )
            await run.close()
            run.held.clear()
            try:
                leg = await migration.reopen(body)
            except NoHealthyWorker:
                migration.note = f"no healthy worker to continue on within {migration.wait_s:g} s"
                return False
            except Exception as exc:  # noqa: BLE001 - LegError: another try, within the budget
                log.warning("the stream's next leg failed to open: %s", exc)
                if isinstance(exc, LegError):
                    migration.avoid |= exc.pair
                kind, reason = "reopen_failed", f"reopening failed: {exc}"
                failed = failed_urls(exc)
                continue
            migration.count(kind)
            run = _start_leg(leg, queue, run.tag + 1)
            return True
        return False

    def budget_note() -> str:
        if migration is None or not migration.done:
            return ""
        done = f"after {migration.done} migration{'s' * (migration.done != 1)}"
        return f" ({done}{'; ' + migration.note if migration.note else ''})"

    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError
            try:
                tag, kind, item = await get_within(
                    queue, min(remaining, HEALTH_POLL_S) if migration else remaining
                )
            except asyncio.TimeoutError:
                if loop.time() >= deadline:
                    raise
                w = run.leg.worker
                if (
                    not w.healthy
                    and not run.decode_done
                    and state is not None
                    and not state.finished
                    and state.can_continue()
                    and migration is not None
                    and migration.done < migration.budget
                ):
                    # ejected by its health checks while its stream is silent: continue
                    # elsewhere (a stream that could not continue keeps its worker: an
                    # ejection is no proof of death)
                    reason = f"{w.role} worker {w.url} failed its health checks: {w.last_error}"
                    if not await migrate("unhealthy", reason, {w.url}):
                        yield error(502, reason + budget_note())
                        return
                continue
            if tag is not None and tag != run.tag:
                continue  # a leg given up
            w = run.leg.worker
            if kind == "shutdown":
                yield error(
                    503, "server shutting down: the router was stopped while this request ran"
                )
                return
            elif kind == "prefill":
                run.prefill_over = True
                try:
                    run.answer = item.result().json()
                except ValueError:  # a 200 that is not JSON: nothing to merge
                    run.answer = None
                except BaseException as exc:  # noqa: BLE001 - LegError, or anything unforeseen
                    if not run.decode_done:
                        failed = failed_urls(exc)
                        if await migrate("prefill_failed", f"prefill leg failed: {exc}", failed):
                            continue
                        end.status, event = _sse_from_error(exc)
                        yield event
                        return
                    # decode's answer is complete (its KV arrived): the client keeps it
                    log.warning("prefill leg failed after decode finished: %s", exc)
                for out in flush_held():
                    yield out
                if run.decode_done:
                    yield done()
                    return
            elif kind == "event":
                relay_times.setdefault("first_chunk_in_unix", time.time())
                if item.data == "[DONE]":
                    if run.prefill_over:
                        yield done()
                        return
                    run.decode_done = True  # end once prefill answered (its room is live)
                    continue
                status = worker_error(item.data)
                if status is not None and status >= 500:
                    metrics.leg_failures.labels(w.role, "stream_error").inc()
                    if not (state is not None and state.finished) and await migrate(
                        "worker_error", f"{w.role} worker {w.url} sent: {item.data[:300]}", set()
                    ):
                        continue
                if status is not None:
                    end.status = status
                if (
                    run.leg.prefill is not None
                    and not run.prefill_over
                    and (run.leg.prefill.hold_first or run.held or is_final(item.data))
                ):
                    # Prompt logprobs asked for: the first chunk waits for prefill's answer
                    # to merge them in (with any chunk that arrives meanwhile, keeping the
                    # order); the chunk with the counts waits too (cached_tokens are
                    # prefill's); once prefill answered, nothing is held.
                    run.held.append(item.data)
                elif (out := render(item.data)) is not None:
                    yield out
            elif run.decode_done:
                continue  # decode's stream closing after its [DONE]: expected
            else:  # "end" before [DONE], or "broken"
                if kind == "end":
                    reason = f"{w.role} worker {w.url} ended its stream before [DONE]"
                else:
                    metrics.leg_failures.labels(w.role, "stream").inc()
                    reason = f"{w.role} worker {w.url} stream broke: {type(item).__name__}: {item}"
                if state is not None and state.finished:  # every token is there: end it
                    for out in flush_held():
                        yield out
                    yield done()
                    return
                if await migrate(f"stream_{kind}", reason, {w.url}):
                    continue
                yield error(502, reason + budget_note())
                return
    except asyncio.TimeoutError:
        prefill_watch = run.leg.prefill
        if run.decode_done and (not run.held or not (prefill_watch and prefill_watch.hold_first)):
            # only prefill's late answer is missing (held chunks waited only for its counts)
            for out in flush_held():
                yield out
            yield done()
        else:
            yield error(504, f"request timed out after {timeout_s:g} s (router --request-timeout)")
    finally:
        with anyio.CancelScope(shield=True):
            if streams is not None:
                streams.discard(queue)
            await run.close()
