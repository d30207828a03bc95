"""A thin async client of OpenAI-compatible servers, measuring what a user sees.

TTFT is the time to the first chunk carrying text, ITL the gaps between later
text-carrying chunks (a chunk that holds several tokens counts as one gap, as in vLLM's
benchmark). Token counts come from the final ``usage`` chunk
(``stream_options.include_usage``), falling back to the number of text chunks when the
server sends no usage.

Streamed requests to ``http://`` URLs from a :func:`make_client` client go over pooled
keep-alive connections parsed by httptools (``pdserve.http.client``, the router's worker
legs), and each chunk's time is when its bytes came off the socket (stamped in the
connection's ``data_received``), not when this coroutine got to it. One event loop reads
every stream of a load point (at an H200's pace ~5-10 streams × 100-200 chunks/s, each
decode step's chunks in one burst); ``httpx`` + ``httpx-sse`` timed a chunk when parsed,
some loop iterations after its bytes came, one more when the response head came with
the first chunk (a router's relay) than when it came first (a worker), and the TTFT
counted that as the server's (the H200's ``to_client``, the server's write → the client
having it, was 9.6 ms for PD and 5.5 ms for mixed at the median: docs/benchmarks.md).
``https://`` URLs (and a plain ``httpx.AsyncClient``, or ``--stream-client httpx``) go
through ``httpx`` + ``httpx-sse``, timed when the chunk is parsed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse

from pdserve.http.client import TRANSPORT_ERRORS, WorkerClient

_ERROR_CHARS = 300  # an error message kept in the report is cut to this length


def normalize_base_url(url: str) -> str:
    """``http://host:port[/v1][/]`` → ``http://host:port``; ``ValueError`` naming ``url``
    when it is not an http(s) URL."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


class BenchClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` (for the non-streamed calls) that also holds ``streams``,
    the pooled httptools connections :func:`stream_request` streams ``http://`` answers
    on (``None``: streamed through httpx too), and ``timeout_s``, the seconds one
    streamed request may take in all (its connection, every chunk); closing the client
    closes both."""

    def __init__(self, timeout_s: float, socket_streams: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeout_s = timeout_s
        self.streams = (
            WorkerClient(connect_timeout=min(timeout_s, 30.0)) if socket_streams else None
        )

    async def aclose(self) -> None:
        """Close the streamed connections and httpx's."""
        if self.streams is not None:
            await self.streams.aclose()
        await super().aclose()


def make_client(timeout_s: float, socket_streams: bool = True) -> BenchClient:
    """A client without a connection cap (the benchmark sets the concurrency) that
    ignores proxy environment variables (targets are usually on this host);
    ``timeout_s``: seconds allowed per request; ``socket_streams``: stream ``http://``
    answers on httptools connections (else through httpx; ``--stream-client``)."""
    return BenchClient(
        timeout_s,
        socket_streams,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id listed by ``GET {base_url}/v1/models``.

    Raises ``RuntimeError`` naming the URL when the server cannot be reached or lists
    no model.
    """
    url = f"{base_url}/v1/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"could not list models at {url}: {type(exc).__name__}: {exc}") from exc
    if not models or "id" not in models[0]:
        raise RuntimeError(f"{url} lists no model")
    return str(models[0]["id"])


def endpoint_url(base_url: str, endpoint: str) -> str:
    """URL of the ``chat`` or ``completions`` endpoint."""
    return f"{base_url}/v1/chat/completions" if endpoint == "chat" else f"{base_url}/v1/completions"


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]


@dataclass
class StreamResult:
    """What one streamed request gave. Times in seconds (``perf_counter`` clock).

    ttft: to the first text chunk (``None`` if none came); itl: gaps between text chunks;
    latency: request sent → ``[DONE]`` arrived (streamed on a socket) or the stream
    closed; output_tokens: from usage, else text chunks.
    cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens the server
    found in its prefix cache), ``None`` when the server does not say.
    timing: the finished choice's timing block (pdserve's ``return_timing``: role ->
        ``{"phases": {name: seconds}, ...}``), ``None`` when the server sent none.
    start_unix: when the request was sent, Unix seconds (to place the timing block's
        ``start_unix`` against it).
    first_event: to the first SSE event of any kind (``None`` if none came): before
        ``ttft`` when the stream's first chunks carried no text.
    """

    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int | None = None
    timing: dict[str, Any] | None = None
    start_unix: float = 0.0
    first_event: float | None = None


class _StreamState:
    """What :func:`stream_request` gathers while the chunks come."""

    def __init__(self, result: StreamResult, endpoint: str) -> None:
        self.result = result
        self.endpoint = endpoint
        self.pieces: list[str] = []
        self.completion_tokens: int | None = None
        self.last = result.start
        self.end: float | None = None  # perf_counter when [DONE] arrived (socket path)

    def event(self, data: str, now: float) -> bool:
        """One SSE event's data that arrived at ``now`` (perf_counter); False at
        ``[DONE]``. Raises ``ValueError`` (not JSON) or ``RuntimeError`` (an error chunk)."""
        result = self.result
        if result.first_event is None:
            result.first_event = now - result.start
        if data.strip() == "[DONE]":
            return False
        chunk = json.loads(data)
        if chunk.get("error"):
            raise RuntimeError(f"server error in stream: {json.dumps(chunk['error'])}")
        usage = chunk.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
        for choice in chunk.get("choices") or []:
            piece = (
                (choice.get("delta") or {}).get("content")
                if self.endpoint == "chat"
                else choice.get("text")
            )
            if piece:
                if result.ttft is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - self.last)
                self.last = now
                self.pieces.append(piece)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
            if isinstance(choice.get("timing"), dict):
                result.timing = choice["timing"]
        return True


async def _stream_httpx(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], state: _StreamState
) -> None:
    async with aconnect_sse(client, "POST", url, json=body) as source:
        resp = source.response
        if resp.status_code != 200:
            await resp.aread()
            state.result.error = f"HTTP {resp.status_code}: {resp.text}"[:_ERROR_CHARS]
            return
        async for event in source.aiter_sse():
            if not state.event(event.data, time.perf_counter()):
                break


async def _stream_lean(
    streams: WorkerClient, url: str, body: dict[str, Any], state: _StreamState
) -> None:
    resp = await streams.open(url, body, {"accept": "text/event-stream"})
    try:
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")
            state.result.error = f"HTTP {resp.status_code}: {text}"[:_ERROR_CHARS]
            return
        events = resp.aiter_sse_timed()
        async for at, event in events:
            if not state.event(event.data, at):
                state.end = at  # the stream's end as the client saw it: [DONE] arrived
                break
        else:
            return
        # the body's end (the chunked terminator, often a write after [DONE]) lets the
        # connection be reused, so no request pays a connect in its TTFT; a server that
        # keeps the body open after [DONE] only loses the connection
        drain = asyncio.ensure_future(_drain(events))
        try:
            await asyncio.wait({drain}, timeout=_DRAIN_S)
        finally:
            drain.cancel()
            # a connection broken after [DONE] is no error of the request: seen, dropped
            drain.add_done_callback(lambda t: t.cancelled() or t.exception())
    finally:
        await resp.aclose()


_DRAIN_S = 1.0  # seconds a stream's body may take to end after its [DONE]


async def _drain(events: Any) -> None:
    async for _ in events:
        pass


_STREAM_ERRORS: tuple[type[BaseException], ...] = (
    httpx.HTTPError,
    SSEError,
    ValueError,
    RuntimeError,
    AttributeError,
    TimeoutError,
    *TRANSPORT_ERRORS,
)


async def _within(work: Any, timeout_s: float | None) -> None:
    """Await the coroutine ``work`` as a task of its own for at most ``timeout_s`` seconds
    (``None``: no limit); ``TimeoutError`` when it took longer (it is cancelled), and it
    is cancelled when the caller is."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancelled (or failed as it was): over
            pass
        raise TimeoutError(f"the request took over {timeout_s:g} s")
    task.result()


async def stream_request(
    client: httpx.AsyncClient, base_url: str, endpoint: str, body: dict[str, Any]
) -> StreamResult:
    """POST ``body`` (``stream`` and ``include_usage`` are set here) and time the stream
    (module docstring: a :class:`BenchClient` streams ``http://`` answers on its
    httptools connections, chunks timed as they come off the socket).

    Never raises for server or network errors: they come back as ``ok=False`` with the
    first ``_ERROR_CHARS`` characters of the message; a :class:`BenchClient`'s stream
    that takes over its ``timeout_s`` ends as ``TimeoutError``.
    """
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult(start=time.perf_counter(), start_unix=time.time())
    state = _StreamState(result, endpoint)
    url = endpoint_url(base_url, endpoint)
    streams = getattr(client, "streams", None)
    try:
        if isinstance(streams, WorkerClient) and url.startswith("http://"):
            await _within(
                _stream_lean(streams, url, body, state), getattr(client, "timeout_s", None)
            )
        else:
            await _stream_httpx(client, url, body, state)
    except _STREAM_ERRORS as exc:
        result.error = _error_text(exc)
    result.latency = (state.end or time.perf_counter()) - result.start
    result.text = "".join(state.pieces)
    result.output_tokens = (
        state.completion_tokens if state.completion_tokens is not None else len(state.pieces)
    )
    if result.error is None and result.ttft is None and result.output_tokens == 0:
        result.error = "stream ended without any output"
    result.ok = result.error is None
    return result


async def chat_completion(
    client: httpx.AsyncClient, base_url: str, body: dict[str, Any]
) -> tuple[str | None, str | None, dict[str, Any]]:
    """Non-streaming chat completion: ``(text, error, usage)``; exactly one of text/error
    is ``None``. Never raises for server or network errors."""
    try:
        resp = await client.post(endpoint_url(base_url, "chat"), json={**body, "stream": False})
        if resp.status_code != 200:
            return None, f"HTTP {resp.status_code}: {resp.text}"[:_ERROR_CHARS], {}
        data = resp.json()
        text = data["choices"][0]["message"]["content"] or ""
        return text, None, data.get("usage") or {}
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        return None, _error_text(exc), {}
