"""The router's SSE pass-through of one worker stream to the client, optionally watching
the prefill leg of a PD request while decode's chunks are relayed as they arrive, and the
merging of the prefill leg's answer into decode's (whole answers and single chunks).

One reader task pumps the worker's SSE events into a queue; the prefill leg's completion
is posted into the same queue, so the relay reacts to whichever comes first: a decode
chunk is forwarded at once, a prefill failure cancels decode and ends the stream with one
SSE error event and ``data: [DONE]``.

Merging: the decode worker never ran the prompt, so its answer has no prompt logprobs and
no prefix-cache count; the prefill worker's answer has them. Field names, per endpoint:
``/generate``: ``meta_info.input_token_logprobs`` and ``meta_info.input_top_logprobs``;
OpenAI endpoints: ``choices[i].prompt_logprobs`` (chat: top-level ``prompt_logprobs``,
vLLM's extensions); and on
``/v1/completions`` with ``echo``, the echoed prompt's entries of ``choices[i].logprobs``
(``token_logprobs`` / ``top_logprobs``, which the decode worker leaves null for the
prompt's ``usage.prompt_tokens`` positions; the prefill leg has them).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from httpx_sse import EventSource

from pdserve.http.aio import get_within
from pdserve.http.http_errors import error_status
from pdserve.router.errors import sse_error
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerState

log = logging.getLogger("pdserve.router")

DONE = b"data: [DONE]\n\n"


class OpenStreams:
    """The queues of the relays now running; ``shutdown()`` (router shutting down, on the
    event loop) tells each to end its stream with an SSE error event and ``[DONE]``."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue] = set()
        self.stopping = False

    def add(self, queue: asyncio.Queue) -> None:
        self._queues.add(queue)
        if self.stopping:
            queue.put_nowait(("shutdown", None))

    def discard(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    def shutdown(self) -> None:
        self.stopping = True
        for queue in self._queues:
            queue.put_nowait(("shutdown", None))


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


@dataclass
class PrefillWatch:
    """The prefill leg of a PD stream. ``task`` resolves to the worker's 200
    ``httpx.Response`` or raises ``LegError`` (whose ``response`` is the JSON error);
    ``hold_first``: the client asked for prompt logprobs, which only prefill has."""

    task: asyncio.Future
    hold_first: bool


def _sse_from_error(exc: BaseException) -> tuple[int, bytes]:
    """(HTTP status, one SSE error event + [DONE]) from a failed leg (``LegError.response``
    holds an OpenAI error body and its status) or any other exception (502)."""
    response = getattr(exc, "response", None)
    body = getattr(response, "body", None)
    if isinstance(body, (bytes, bytearray)) and body:
        return int(getattr(response, "status_code", 502)), b"data: " + bytes(body) + b"\n\n" + DONE
    return 502, sse_error(502, f"prefill leg failed: {type(exc).__name__}: {exc}")


async def _pump(resp: httpx.Response, queue: asyncio.Queue) -> None:
    """Read SSE events until the stream ends; every item goes to ``queue`` as
    ``("event", ServerSentEvent)``, then ``("end", None)`` or ``("broken", exc)``."""
    try:
        async for event in EventSource(resp).aiter_sse():
            queue.put_nowait(("event", event))
        queue.put_nowait(("end", None))
    except Exception as exc:  # noqa: BLE001 - httpx.HTTPError mostly; any failure ends the relay
        queue.put_nowait(("broken", exc))


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


async def relay_sse(
    resp: httpx.Response,
    worker: WorkerState,
    endpoint: str,
    *,
    deadline: float,
    timeout_s: float,
    metrics: RouterMetrics,
    on_close: Callable[[], None],
    prefill: PrefillWatch | None = None,
    streams: OpenStreams | None = None,
    end: StreamEnd | None = None,
) -> AsyncGenerator[bytes, None]:
    """Yield the client's SSE bytes from ``resp`` (an open 200 stream of ``worker``).

    deadline: loop time (s) by which the whole request must end (then a 504 SSE error);
    timeout_s: the router's request timeout, for the message. prefill: PD only; its
    failure before decode's ``[DONE]`` cancels decode (the stream is closed, so the decode
    worker aborts) and yields one SSE error event + ``[DONE]``. Prompt logprobs from
    prefill's answer are merged into decode's chunks once it has arrived; when they were
    asked for, the first chunk is held until then (only that one: later chunks come
    after it, so the answer is already there). A stream that breaks or ends early yields
    a 502 SSE error; a worker's own SSE error event (its request failed mid-stream) is
    relayed as is, with the ``[DONE]`` that follows it. ``streams``: registry whose
    ``shutdown()`` ends the stream with a 503 SSE error ("router shutting down") +
    ``[DONE]``. ``on_close`` runs once at the end,
    after both legs ended. ``end``: gets the stream's outcome (see ``StreamEnd``).
    """
    end = end if end is not None else StreamEnd()

    def error(status: int, message: str) -> bytes:
        end.status = status
        return sse_error(status, message)

    def done() -> bytes:
        if end.status is None:
            end.status = 200
        return DONE

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    if streams is not None:
        streams.add(queue)
    pump = asyncio.ensure_future(_pump(resp, queue))
    task = prefill.task if prefill is not None else None
    if task is not None:
        task.add_done_callback(lambda t: queue.put_nowait(("prefill", t)))
    answer: Any = None  # prefill's parsed JSON answer, once arrived
    prefill_over = task is None
    merged: set[int] = set()
    held: list[str] = []  # the first data chunk, held while prompt logprobs are pending
    decode_done = False

    def render(data: str) -> bytes:
        if answer is not None:
            try:
                chunk = merge_prompt_logprobs(endpoint, json.loads(data), answer, merged)
                data = json.dumps(merge_cached_tokens(endpoint, chunk, answer))
            except ValueError:
                pass
        return f"data: {data}\n\n".encode()

    def note_error(data: str) -> None:
        """A worker's own SSE error event (its request failed mid-stream; ``[DONE]``
        follows): the stream ends with that error's status (a 5xx counts as the leg's
        failure, as before the first byte)."""
        if '"error"' not in data:  # cheap pre-check: only an error body has that key
            return
        try:
            status = error_status(json.loads(data))
        except ValueError:
            return
        if status is not None:
            end.status = status
            if status >= 500:
                metrics.leg_failures.labels(worker.role, "stream_error").inc()

    def is_final(data: str) -> bool:
        try:
            return is_final_chunk(endpoint, json.loads(data))
        except ValueError:
            return False

    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError
            kind, item = await get_within(queue, remaining)
            if kind == "shutdown":
                yield error(
                    503, "server shutting down: the router was stopped while this request ran"
                )
                return
            elif kind == "prefill":
                prefill_over = True
                try:
                    answer = item.result().json()
                except ValueError:  # a 200 that is not JSON: nothing to merge
                    answer = None
                except BaseException as exc:  # noqa: BLE001 - LegError, or anything unforeseen
                    if not decode_done:
                        end.status, event = _sse_from_error(exc)
                        yield event
                        return
                    # decode's answer is complete (its KV arrived): the client keeps it
                    log.warning("prefill leg failed after decode finished: %s", exc)
                for data in held:
                    yield render(data)
                held.clear()
                if decode_done:
                    yield done()
                    return
            elif kind == "event":
                if item.data == "[DONE]":
                    if prefill_over:
                        yield done()
                        return
                    decode_done = True  # end once prefill answered (its room is live till then)
                    continue
                note_error(item.data)
                if (
                    prefill is not None
                    and not prefill_over
                    and (prefill.hold_first or held or is_final(item.data))
                ):
                    # Prompt logprobs asked for: the first chunk waits for prefill's answer
                    # to merge them in (with any chunk that arrives meanwhile, keeping the
                    # order); the chunk with the counts waits too (cached_tokens are
                    # prefill's); once prefill answered, nothing is held.
                    held.append(item.data)
                else:
                    yield render(item.data)
            elif decode_done:
                continue  # decode's stream closing after its [DONE]: expected
            elif kind == "end":
                yield error(
                    502, f"{worker.role} worker {worker.url} ended its stream before [DONE]"
                )
                return
            else:  # broken
                metrics.leg_failures.labels(worker.role, "stream").inc()
                yield error(
                    502,
                    f"{worker.role} worker {worker.url} stream broke: "
                    f"{type(item).__name__}: {item}",
                )
                return
    except asyncio.TimeoutError:
        if decode_done and (not held or not (prefill and prefill.hold_first)):
            # only prefill's late answer is missing (held chunks waited only for its counts)
            for data in held:
                yield render(data)
            yield done()
        else:
            yield error(504, f"request timed out after {timeout_s:g} s (router --request-timeout)")
    finally:
        with anyio.CancelScope(shield=True):
            if streams is not None:
                streams.discard(queue)
            await _settle(pump)
            await resp.aclose()
            await _settle(task)
            on_close()


# Merging the prefill leg's answer into decode's.

GENERATE_PROMPT_KEYS = ("input_token_logprobs", "input_top_logprobs")
OPENAI_PROMPT_KEY = "prompt_logprobs"


def _generate_items(answer: Any) -> list[dict]:
    if isinstance(answer, dict):
        return [answer]
    if isinstance(answer, list):
        return [a for a in answer if isinstance(a, dict)]
    return []


def _prefill_generate_meta(prefill: Any) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for pos, item in enumerate(_generate_items(prefill)):
        meta = item.get("meta_info") or {}
        out[int(item.get("index", pos))] = {
            k: meta[k] for k in GENERATE_PROMPT_KEYS if meta.get(k) is not None
        }
    return out


def _prefill_openai(prefill: Any, key: str) -> dict[int, Any]:
    out: dict[int, Any] = {}
    if isinstance(prefill, dict):
        for choice in prefill.get("choices") or []:
            if isinstance(choice, dict) and choice.get(key) is not None:
                out[int(choice.get("index", 0))] = choice[key]
    return out


def _fill_echo(decode_lp: Any, prefill_lp: Any, num_prompt: int) -> None:
    """Fill the null prompt entries of a completions ``logprobs`` object in place."""
    if not isinstance(decode_lp, dict) or not isinstance(prefill_lp, dict):
        return
    for key in ("token_logprobs", "top_logprobs"):
        mine, theirs = decode_lp.get(key), prefill_lp.get(key)
        if not isinstance(mine, list) or not isinstance(theirs, list):
            continue
        for j in range(min(num_prompt, len(mine), len(theirs))):
            if mine[j] is None:
                mine[j] = theirs[j]


def _merge_chat_prompt_logprobs(decode: Any, prefill: Any) -> None:
    """Chat: the top-level ``prompt_logprobs`` (vLLM's place) of prefill's answer into a
    decode answer or chunk that has the key (its first chunk of a sample)."""
    if (
        isinstance(decode, dict)
        and isinstance(prefill, dict)
        and OPENAI_PROMPT_KEY in decode
        and prefill.get(OPENAI_PROMPT_KEY) is not None
    ):
        decode[OPENAI_PROMPT_KEY] = prefill[OPENAI_PROMPT_KEY]


def merge_prompt_logprobs(
    endpoint: str, decode: Any, prefill: Any, done: set[int] | None = None
) -> Any:
    """Copy prompt logprobs from ``prefill`` (the prefill leg's full answer) into ``decode``
    (a full answer or one stream chunk), in place; returns ``decode``.

    ``done``: OpenAI streams only: sample indices already given their prompt logprobs (only
    the first chunk of each sample carries them); updated in place. ``/generate`` stream
    chunks are cumulative, so each one gets them.
    """
    done = set() if done is None else done
    if endpoint == "/generate":
        source = _prefill_generate_meta(prefill)
        for pos, item in enumerate(_generate_items(decode)):
            index = int(item.get("index", pos))
            if source.get(index):
                item.setdefault("meta_info", {}).update(source[index])
    elif endpoint == "/v1/chat/completions":
        _merge_chat_prompt_logprobs(decode, prefill)
    else:
        source = _prefill_openai(prefill, OPENAI_PROMPT_KEY)
        echoed = _prefill_openai(prefill, "logprobs") if endpoint == "/v1/completions" else {}
        usage = prefill.get("usage") if isinstance(prefill, dict) else None
        num_prompt = usage.get("prompt_tokens", 0) if isinstance(usage, dict) else 0
        if isinstance(decode, dict):
            for choice in decode.get("choices") or []:
                index = int(choice.get("index", 0)) if isinstance(choice, dict) else -1
                if index in done or (index not in source and index not in echoed):
                    continue
                if index in source:
                    choice[OPENAI_PROMPT_KEY] = source[index]
                if index in echoed:
                    _fill_echo(choice.get("logprobs"), echoed[index], num_prompt)
                done.add(index)
    return decode


def _cached_of(endpoint: str, answer: Any) -> dict[int, int] | int | None:
    if endpoint == "/generate":
        out: dict[int, int] = {}
        for pos, item in enumerate(_generate_items(answer)):
            value = (item.get("meta_info") or {}).get("cached_tokens")
            if isinstance(value, int):
                out[int(item.get("index", pos))] = value
        return out
    if isinstance(answer, dict):
        usage = _usage_of(endpoint, answer) or {}
        details = usage.get(_DETAILS.get(endpoint, "prompt_tokens_details")) or {}
        value = details.get("cached_tokens")
        return value if isinstance(value, int) else None
    return None


_DETAILS = {"/v1/responses": "input_tokens_details"}  # else OpenAI's prompt_tokens_details


def _usage_of(endpoint: str, answer: dict) -> Any:
    """The ``usage`` of an OpenAI answer or chunk; a Responses stream event carries it in
    its ``response`` (``response.completed``)."""
    if endpoint == "/v1/responses" and isinstance(answer.get("response"), dict):
        return answer["response"].get("usage")
    return answer.get("usage")


def merge_cached_tokens(endpoint: str, decode: Any, prefill: Any) -> Any:
    """Report the prefill leg's cached prompt tokens (its prefix-cache hit, the prompt
    compute it saved) in ``decode`` (a full answer or one stream chunk), in place; returns
    ``decode``.  ``/generate``: ``meta_info.cached_tokens`` per sample; OpenAI endpoints:
    ``usage.prompt_tokens_details.cached_tokens`` where decode's answer has a usage
    (``/v1/responses``: ``usage.input_tokens_details``, in a stream event's ``response``).  So
    the client sees one count, the prefill worker's, never a sum of both legs."""
    source = _cached_of(endpoint, prefill)
    if endpoint == "/generate":
        assert isinstance(source, dict)
        for pos, item in enumerate(_generate_items(decode)):
            index = int(item.get("index", pos))
            meta = item.get("meta_info")
            if isinstance(meta, dict) and index in source:
                meta["cached_tokens"] = source[index]
    elif isinstance(source, int) and isinstance(decode, dict):
        usage = _usage_of(endpoint, decode)
        if isinstance(usage, dict):
            key = _DETAILS.get(endpoint, "prompt_tokens_details")
            usage.setdefault(key, {})["cached_tokens"] = source
    return decode


def is_final_chunk(endpoint: str, chunk: Any) -> bool:
    """Whether a stream chunk carries the answer's counts: an OpenAI usage chunk (a
    Responses ``response.completed`` event), or a ``/generate`` chunk with a finish reason
    (its counts should be prefill's)."""
    if endpoint == "/generate":
        return any(
            (item.get("meta_info") or {}).get("finish_reason") is not None
            for item in _generate_items(chunk)
        )
    return isinstance(chunk, dict) and _usage_of(endpoint, chunk) is not None
