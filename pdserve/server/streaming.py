"""SSE responses for a running job: the first engine output is awaited before the 200 is
sent (so errors before the first token keep their HTTP status); later errors become a
well-formed SSE error event followed by ``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from pdserve.engine.core.request import RequestOutput
from pdserve.http.disconnect import cancel_on_disconnect
from pdserve.http.http_errors import error_json
from pdserve.server.serving import APIError, Job, Serving

ChunkFn = Callable[[int, RequestOutput], Iterable[dict]]


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def sse_response(
    request: Request,
    serving: Serving,
    job: Job | Sequence[Job],
    chunks: ChunkFn,
    tail: Callable[[], Iterable[dict]] = lambda: (),
) -> StreamingResponse:
    """Start ``job`` (or a batch of jobs, numbered as ``Serving.stream_all``) and stream
    ``chunks(index, output)`` for each engine output, then ``tail()`` (e.g. the usage
    chunk), then ``[DONE]``. Raises APIError if the job fails before its first output."""
    jobs = [job] if isinstance(job, Job) else job
    it: AsyncGenerator[Any, None] = serving.stream_all(jobs)  # its own async iterator
    try:
        first = await cancel_on_disconnect(request, it.__anext__())
    except BaseException:
        await it.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            item = first
            while True:
                for chunk in chunks(*item):
                    yield sse(chunk)
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    break
            for chunk in tail():
                yield sse(chunk)
        except APIError as exc:
            yield sse(error_json(exc.status, exc.message, exc.param, exc.code))
        finally:
            with anyio.CancelScope(shield=True):
                await it.aclose()  # aborts unfinished samples when the client went away
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
