"""Servers the bench/eval tests talk to.

``FakeOpenAI``: a small FastAPI app imitating an OpenAI-compatible server (models,
completions, chat completions, SSE streaming with a usage chunk, ``ignore_eos``), run by
uvicorn on a free port in a thread that is joined at teardown. Its answers are
deterministic in the prompt, so accuracy accounting can be checked exactly.
``PdserveProcess``: a real ``pdserve serve`` worker in a subprocess on a free port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def fake_answer(prompt_text: str, variant: int) -> str:
    """The fake model's answer: a number derived from the prompt (and ``variant``)."""
    return str(zlib.crc32(prompt_text.encode()) % 7 + variant)


def build_app(variant: int = 0, token_delay_s: float = 0.002, fail_every: int = 0) -> FastAPI:
    """The fake server. ``fail_every=k`` answers every k-th request with HTTP 500."""
    app = FastAPI()
    counter = {"n": 0}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": f"fake-{variant}", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        counter["n"] += 1
        if fail_every and counter["n"] % fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        if "max_tokens" in body and body["max_tokens"] < 1:
            return JSONResponse({"error": {"message": "max_tokens must be >= 1"}}, status_code=400)
        prompt = json.dumps(body["messages"]) if chat else body["prompt"]
        prompt_tokens = len(prompt.split())
        max_tokens = body.get("max_tokens", 16)
        words = f"Let me think. #### {fake_answer(prompt, variant)}".split()
        if body.get("ignore_eos"):
            words = [words[i % len(words)] for i in range(max_tokens)]
        words = words[:max_tokens]
        pieces = [(" " if i else "") + w for i, w in enumerate(words)]
        finish = "length" if len(pieces) == max_tokens else "stop"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(pieces),
            "total_tokens": prompt_tokens + len(pieces),
        }
        if not body.get("stream"):
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(pieces)},
                    "finish_reason": finish,
                }
                if chat
                else {"index": 0, "text": "".join(pieces), "finish_reason": finish}
            )
            return {
                "id": "x",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [choice],
                "usage": usage,
            }

        async def events():
            if chat:  # a role-only first chunk, as OpenAI sends; it must not count as TTFT
                yield (
                    "data: "
                    + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    + "\n\n"
                )
            for i, piece in enumerate(pieces):
                await asyncio.sleep(token_delay_s)
                last = i == len(pieces) - 1
                choice = {"index": 0, "finish_reason": finish if last else None}
                choice.update({"delta": {"content": piece}} if chat else {"text": piece})
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class ThreadedServer:
    """Runs an ASGI app with uvicorn on 127.0.0.1, port chosen by the OS; ``stop()`` joins."""

    def __init__(self, app: FastAPI) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        """Start and wait until listening; returns the base URL."""
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def free_port() -> int:
    """A port that was free a moment ago (the server binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PdserveProcess:
    """A real ``pdserve serve`` worker in a subprocess on a free port; ``stop()`` ends it."""

    def __init__(self, *args: str, startup_timeout_s: float = 90.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.startup_timeout_s = startup_timeout_s

    def start(self) -> str:
        """Wait until ``/v1/models`` answers; returns the base URL. Raises with the log on failure."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if (
                    httpx.get(f"{self.url}/v1/models", timeout=1.0, trust_env=False).status_code
                    == 200
                ):
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        self.log.seek(0)
        raise RuntimeError(
            f"pdserve serve did not start:\n{self.log.read().decode(errors='replace')[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# Fixtures, imported by the conftest of tests/bench and tests/eval.
@pytest.fixture(scope="module")
def pdserve_url():
    """Base URL of a mixed ``pdserve serve --model random:tiny`` worker (one per module)."""
    proc = PdserveProcess("--model", "random:tiny")
    url = proc.start()
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def fake_urls():
    """Two fake OpenAI servers: a healthy one, and one that answers differently and
    fails every third request (HTTP 500)."""
    servers = [
        ThreadedServer(build_app(variant=0)),
        ThreadedServer(build_app(variant=1, fail_every=3)),
    ]
    urls = [s.start() for s in servers]
    yield urls
    for s in servers:
        s.stop()
