"""Fake prefill/decode/mixed workers for the router tests, whose behaviour the test sets
(answer, fail, hang until the client leaves, broken stream, event gates); they run in
``pdserve.http.netutil.ThreadedServer`` (uvicorn on a thread, joined at stop), the one
in-process server of the package and the tests."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


async def _wait_for(event: threading.Event, what: str, timeout: float = 60.0) -> None:
    """Wait on the event loop until the test sets ``event`` (a test thread's gate)."""
    deadline = time.monotonic() + timeout
    while not event.is_set():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fake worker: the test never opened the gate {what}")
        await asyncio.sleep(0.002)


# what a worker's stream sends when its request fails after the first chunk
STREAM_ERROR = {
    "error": {
        "message": "request failed in the engine (injected)",
        "type": "internal_server_error",
        "param": None,
        "code": None,
    }
}


class FakeWorker:
    """A fake worker of ``role``. ``mode``: ``ok`` | ``fail`` (500) | ``bad`` (400) |
    ``hang`` | ``stream_break`` | ``stream_error`` (the chunks, then the worker's own SSE
    error event and ``[DONE]``, as a worker whose request fails mid-stream) |
    ``drop`` (connection closed mid-answer);
    ``health``: the status of /health; ``delay``: seconds before answering (or failing);
    ``bootstrap_port`` (prefill) and ``transfer`` (the KV manager's stats, e.g. a decode's
    ``unhealthy_prefill_peers``) are what /get_server_info reports;
    a stream has ``chunks`` events ``chunk_gap`` seconds apart. Records request bodies and
    headers and client disconnects (also of a stream cut short).

    Event gates, so a test states an order instead of timing it: with ``gate`` set to a
    ``threading.Event`` the answer (or failure) waits until the test sets it;
    ``chunk_gates[i]`` (an Event per chunk) holds stream chunk ``i`` until set.
    ``answered`` is set once the answer (or failure) is on its way; ``chunks_sent`` counts
    the chunks handed to the server and ``stream_done`` is set after the stream's last
    event."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.mode = "ok"
        self.health = 200
        self.bootstrap_port: int | None = 4242 if role == "prefill" else None  # never bound
        self.transfer: dict | None = None
        self.delay = 0.0
        self.chunks = 2
        self.chunk_gap = 0.01
        self.bodies: list[dict] = []
        self.headers: list[dict] = []  # each request's headers (lower-case names)
        self.disconnects = 0
        self.gate: threading.Event | None = None
        self.chunk_gates: list[threading.Event] = []
        self.answered = threading.Event()
        self.chunks_sent = 0
        self.stream_done = threading.Event()
        self.gate: threading.Event | None = None  # when set: answers wait until it is set
        self.app = self._build()

    def answer(self, path: str, body: dict) -> dict:
        if path == "/generate":
            meta = {
                "input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]
                if self.role == "prefill"
                else None,
                "finish_reason": {"type": "length"},
            }
            return {"text": self.role, "output_ids": [7], "meta_info": meta}
        choice = {
            "index": 0,
            "text": self.role,
            "finish_reason": "length",
            "prompt_logprobs": [None, {"token_id": 2, "logprob": -0.5}]
            if self.role == "prefill"
            else None,
        }
        return {"object": "text_completion", "choices": [choice], "usage": {"prompt_tokens": 2}}

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({"status": "x"}, status_code=self.health)

        @app.get("/get_server_info")
        async def info():
            return {
                "role": self.role,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port,
                "transfer": self.transfer,
            }

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake"}]}

        async def handle(request: Request, path: str):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            while self.gate is not None and not self.gate.is_set():
                await asyncio.sleep(0.01)
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.gate is not None:
                await _wait_for(self.gate, f"of {self.role}'s answer")
            self.answered.set()
            if self.mode == "fail":
                return JSONResponse(
                    {
                        "error": {
                            "message": f"{self.role} failed: KV transfer failed (injected)",
                            "type": "internal_server_error",
                            "param": None,
                            "code": None,
                        }
                    },
                    status_code=500,
                )
            if self.mode == "bad":  # the client's request is invalid: the worker's 400
                return JSONResponse(
                    {
                        "error": {
                            "message": "max_tokens must be at least 1 (injected)",
                            "type": "invalid_request_error",
                            "param": "max_tokens",
                            "code": None,
                        }
                    },
                    status_code=400,
                )
            if self.mode == "hang":
                for _ in range(600):
                    if await request.is_disconnected():
                        self.disconnects += 1
                        return JSONResponse({}, status_code=499)
                    await asyncio.sleep(0.05)
            if self.mode == "drop":  # dies mid-answer: the connection closes without a full body

                async def cut():
                    yield b"{"
                    raise RuntimeError("worker died mid-answer")

                return StreamingResponse(cut(), media_type="application/json")
            if body.get("stream"):

                async def events():
                    for i in range(self.chunks):
                        try:
                            if i < len(self.chunk_gates):
                                await _wait_for(self.chunk_gates[i], f"of chunk {i}")
                            self.chunks_sent += 1
                            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': str(i)}]})}\n\n"
                            await asyncio.sleep(self.chunk_gap)
                        except (GeneratorExit, asyncio.CancelledError):
                            self.disconnects += 1
                            raise
                    if self.mode == "stream_break":
                        raise RuntimeError("worker died mid-stream")
                    if self.mode == "stream_error":
                        yield f"data: {json.dumps(STREAM_ERROR)}\n\n"
                    yield "data: [DONE]\n\n"
                    self.stream_done.set()

                return StreamingResponse(events(), media_type="text/event-stream")
            return self.answer(path, body)

        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):

            async def route(request: Request, _path: str = path):
                return await handle(request, _path)

            app.add_api_route(path, route, methods=["POST"])
        return app
