"""Servers the bench/eval tests talk to.

``FakeOpenAI``: a small FastAPI app imitating an OpenAI-compatible server (models,
completions, chat completions, SSE streaming with a usage chunk, ``ignore_eos``), run by
``pdserve.http.netutil.ThreadedServer`` (uvicorn on a thread, joined at teardown). Its answers are
deterministic in the prompt, so accuracy accounting can be checked exactly.
``pdserve_url``: a real ``pdserve serve`` worker (``pdserve_procs``, the tests' one
process launcher). Both run under the harness of every test folder.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.http.netutil import ThreadedServer
from pdserve_procs import start_worker, stop, wait_healthy


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


# Fixtures, imported by the conftest of tests/bench and tests/eval.
@pytest.fixture(scope="module")
def pdserve_url(tmp_path_factory):
    """Base URL of a mixed ``pdserve serve --model random:tiny`` worker (one per module)."""
    worker = start_worker("worker", "mixed", tmp_path_factory.mktemp("bench-worker"))
    try:
        wait_healthy([worker])
        yield worker.url
    finally:
        stop([worker])


@pytest.fixture(scope="module")
def fake_urls():
    """Two fake OpenAI servers: a healthy one, and one that answers differently and
    fails every third request (HTTP 500)."""
    servers = [
        ThreadedServer(build_app(variant=0)),
        ThreadedServer(build_app(variant=1, fail_every=3)),
    ]
    for s in servers:
        s.start()
    yield [s.url for s in servers]
    for s in servers:
        s.stop()
