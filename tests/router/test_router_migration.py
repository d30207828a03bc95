"""Migration in the router against stub mixed workers (in-process servers, joined at
teardown) whose "model" is a fixed function of the token ids, so a continued request's
tokens are checkable: a stream cut after k tokens continues on the other worker from
prompt + k ids, ``max_tokens`` reduced, with one opening chunk, one id, the client's
``text_offset`` and usage; budget exhausted -> one clean SSE error naming it; stop strings
-> not continued (the error, as before); a non-streamed request is sent again whole; a
4xx is never retried. The real-process tests under ``pdserve up`` are in
tests/e2e/test_up_migration.py."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.config import RouterConfig
from pdserve.http.netutil import ThreadedServer
from pdserve.router import dispatch
from pdserve.router.app import build_router_app
from pdserve.router.migration import StreamState, mid_stream_refusal

pytestmark = pytest.mark.timeout(60)


def next_token(ids: list[int]) -> int:
    """The stub model: the next token of a sequence."""
    return (sum(ids) * 31 + len(ids)) % 997


def pieces(prompt: list[int], out: list[int]) -> list[str]:
    """The stub's detokenizer: each output token's text, ``t{id} `` except that a token
    divisible by 5 is a character's first part: its text (``t{id}+``) comes with the next
    token's. Primed with a prompt that ends in such a part it garbles its first piece, as
    ``tokenizers``' DecodeStream does with half a character."""
    texts, held = [], ""
    for t in out:
        if t % 5 == 0:
            held += f"t{t}+"
            texts.append("")
        else:
            texts.append(held + f"t{t} ")
            held = ""
    if texts:
        texts[-1] += held
        if prompt and prompt[-1] % 5 == 0:
            texts[0] = "GARBLED" + texts[0]
    return texts


def chat_prompt(messages: list[dict]) -> list[int]:
    """The stub's "chat template": each content's bytes, then 1001."""
    return [b for m in messages for b in m["content"].encode()] + [1001]


# the next streams (of either worker) die after these many tokens, one entry each
DEATHS: list[int] = []
# the next streams hang after these many tokens (the worker then fails its health checks)
HANGS: list[int] = []


class StubWorker:
    """A mixed worker whose stream dies (the connection cut) after ``DEATHS[0]`` tokens
    (the entry used up), or ``always_die_after``; records the bodies."""

    def __init__(self) -> None:
        self.always_die_after: int | None = None  # every stream dies there
        self.status = 200
        self.health = 200  # of a non-streamed answer
        self.bodies: list[dict] = []
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({"status": "ok" if self.health == 200 else "hung"}, self.health)

        @app.get("/get_server_info")
        async def info():
            return {"role": "mixed", "served_model_name": "stub"}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.bodies.append(body)
            if chat:
                prompt = body.get("prompt_token_ids") or chat_prompt(body["messages"])
                limit = body.get("max_completion_tokens") or body.get("max_tokens")
            else:
                prompt = (
                    body["prompt"]
                    if isinstance(body["prompt"], list)
                    else list(body["prompt"].encode())
                )
                limit = body.get("max_tokens", 16)
            ids = list(prompt)
            out = []
            for _ in range(limit):
                out.append(next_token(ids))
                ids.append(out[-1])
            head = {"id": f"x-{len(self.bodies)}", "created": len(self.bodies), "model": "stub"}
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "total_tokens": len(prompt) + len(out),
            }
            if not body.get("stream"):
                if HANGS:  # hung: its probes fail, its answer never comes
                    HANGS.pop(0)
                    self.health = 500
                    await asyncio.sleep(3600)
                if self.status != 200:
                    return JSONResponse({"error": {"message": "boom"}}, status_code=self.status)
                text = "".join(f"t{t} " for t in out)
                return {**head, "choices": [{"index": 0, "text": text}], "usage": usage}
            die = DEATHS.pop(0) if DEATHS else self.always_die_after
            hang = HANGS.pop(0) if HANGS else None
            ids_too = body.get("return_token_ids")

            texts = pieces(prompt, out)

            def choice(i: int, t: int, offset: int) -> dict:
                piece = texts[i]
                c: dict = {"index": 0, "finish_reason": "length" if i == len(out) - 1 else None}
                if chat:
                    c["delta"] = {"content": piece}
                else:
                    c["text"] = piece
                    c["logprobs"] = {"tokens": [f"t{t} "], "text_offset": [offset]}
                if ids_too:
                    c["token_ids"] = [t]
                return c

            async def events():
                if chat:
                    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    if ids_too:
                        opening |= {"token_ids": [], "prompt_token_ids": prompt}
                    yield f"data: {json.dumps({**head, 'choices': [opening]})}\n\n"
                offset = 0
                for i, t in enumerate(out):
                    if die is not None and i == die:
                        raise RuntimeError("stub worker dies mid-stream")
                    if hang is not None and i == hang:
                        self.health = 500  # hung: its probes fail, its stream stays open
                        await asyncio.sleep(3600)
                    c = choice(i, t, offset)
                    if not chat and i == 0 and ids_too:
                        c["prompt_token_ids"] = prompt
                    offset += len(f"t{t} ")
                    yield f"data: {json.dumps({**head, 'choices': [c]})}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, False)

        return app


@pytest.fixture(scope="module")
def setup():
    workers = [StubWorker(), StubWorker()]
    servers = [ThreadedServer(w.app) for w in workers]
    for s in servers:
        s.start()
    config = RouterConfig(
        worker_urls=tuple(s.url for s in servers),
        policy="round_robin",
        health_check_interval=0.1,
        health_check_timeout=1.0,
        max_migrations=2,
    )
    router = ThreadedServer(build_router_app(config))
    router.start()
    try:
        yield workers, router.url
    finally:
        router.stop()
        for s in servers:
            s.stop()


@pytest.fixture(autouse=True)
def reset(setup):
    for w in setup[0]:
        w.always_die_after, w.status, w.health = None, 200, 200
        w.bodies.clear()
    DEATHS.clear()
    HANGS.clear()
    # a worker ejected by the last test is back after its next good probe (0.1 s apart)
    deadline = time.monotonic() + 10
    while not all(w["healthy"] for w in httpx.get(setup[1] + "/get_server_info").json()["workers"]):
        assert time.monotonic() < deadline, "the stub workers never became healthy again"
        time.sleep(0.05)


def _stream(url: str, path: str, body: dict) -> tuple[list[dict], list[dict]]:
    """(data chunks, error chunks) of a stream, checking it ends with one [DONE]."""
    chunks, errors, done = [], [], 0
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                assert done == 0, "a chunk after [DONE]"
                chunk = json.loads(line[6:])
                (errors if "error" in chunk else chunks).append(chunk)
    assert done == 1
    return chunks, errors


def _expected(prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(ids))
        ids.append(out[-1])
    return out


def _metric(url: str, reason: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'pdserve_router_migrations_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 12,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_chat_stream_cut_continues_on_the_other_worker(setup):
    workers, url = setup
    DEATHS.append(5)  # whichever gets it dies after 5 tokens
    before = _metric(url, "stream_broken")
    chunks, errors = _stream(url, "/v1/chat/completions", CHAT)
    assert not errors
    prompt = chat_prompt(CHAT["messages"])
    want = _expected(prompt, 12)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "".join(pieces([], want))
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}  # the first leg's id throughout
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1
    assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"])  # not asked
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "length"
    bodies = [b for w in workers for b in w.bodies]
    assert len(bodies) == 2
    resumed = next(b for b in bodies if "prompt_token_ids" in b)
    assert resumed["prompt_token_ids"] == prompt + want[:5] and resumed["max_tokens"] == 7
    assert resumed["messages"] == CHAT["messages"] and resumed["return_token_ids"] is True
    assert _metric(url, "stream_broken") == before + 1


def test_completions_stream_offsets_ids_and_usage_across_the_seam(setup):
    workers, url = setup
    DEATHS.append(3)
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    chunks, errors = _stream(url, "/v1/completions", body)
    assert not errors
    want = _expected([5, 6, 7], 9)
    got = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert got == want
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks if c["choices"]][:2] == [
        [5, 6, 7],
        None,
    ]
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks if c["choices"]]
    # text_offset counts the tokens' strings (``t{id} `` here), as the workers do
    assert offsets == [sum(len(f"t{t} ") for t in want[:i]) for i in range(len(want))]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}


def test_budget_exhausted_ends_with_one_clean_error(setup):
    workers, url = setup
    for w in workers:
        w.always_die_after = 2
    chunks, errors = _stream(url, "/v1/chat/completions", CHAT)
    assert len(errors) == 1
    message = errors[0]["error"]["message"]
    assert "stream broke" in message and "(after 2 migrations)" in message, message
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    want = _expected(chat_prompt(CHAT["messages"]), 6)  # 2 tokens from each of 3 legs
    assert text == "".join(pieces([], want))
    assert len([b for w in workers for b in w.bodies]) == 3


def test_stop_strings_are_not_continued(setup):
    workers, url = setup
    DEATHS.append(4)
    chunks, errors = _stream(url, "/v1/chat/completions", dict(CHAT, stop=["zz"]))
    assert len(errors) == 1 and "stream broke" in errors[0]["error"]["message"]
    assert len([b for w in workers for b in w.bodies]) == 1
    assert mid_stream_refusal("/v1/chat/completions", {"stop": ["zz"]}) is not None
    assert mid_stream_refusal("/v1/chat/completions", {"n": 1, "stop": None}) is None
    assert mid_stream_refusal("/generate", {}) is not None


def test_non_streamed_is_sent_again_whole_and_a_4xx_is_not(setup):
    workers, url = setup
    workers[0].status = workers[1].status = 500
    before = _metric(url, "retry_whole")
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=30)
    assert r.status_code == 500  # both failed: 1 + 2 attempts, then the worker's error
    assert len([b for w in workers for b in w.bodies]) == 3
    assert _metric(url, "retry_whole") == before + 2
    for w in workers:
        w.bodies.clear()
    workers[0].status = 500
    workers[1].status = 200
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    for w in workers:
        w.bodies.clear()
    workers[0].status = workers[1].status = 400
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=30)
    assert r.status_code == 400 and len([b for w in workers for b in w.bodies]) == 1


def test_stream_state_counts_down_and_rewrites_usage():
    state = StreamState("/v1/chat/completions", {"messages": [], "max_completion_tokens": 5})
    assert state.first_body()["return_token_ids"] is True
    opening = {
        "id": "a",
        "created": 1,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant"},
                "token_ids": [],
                "prompt_token_ids": [9, 9],
            }
        ],
    }
    assert "prompt_token_ids" not in state.rewrite(opening)["choices"][0]
    state.rewrite(
        {
            "id": "a",
            "created": 1,
            "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [4, 5]}],
        }
    )
    body = state.continued_body()
    assert body["prompt_token_ids"] == [9, 9, 4, 5] and body["max_completion_tokens"] == 3
    assert (
        state.rewrite(
            {
                "id": "b",
                "created": 2,
                "choices": [{"index": 0, "delta": {"role": "assistant"}, "token_ids": []}],
            }
        )
        is None
    )
    usage = state.rewrite(
        {
            "id": "b",
            "created": 2,
            "choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        }
    )
    assert usage["id"] == "a" and usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 5,
        "total_tokens": 7,
    }


def test_a_seam_inside_a_character_is_generated_again(setup):
    workers, url = setup
    prompt = chat_prompt(CHAT["messages"])
    want = _expected(prompt, 40)
    cut = next(i for i in range(3, 40) if want[i - 1] % 5 == 0 and want[i - 2] % 5)
    DEATHS.append(cut)  # the last token sent is a character's first part
    body = dict(CHAT, max_tokens=40, temperature=0, return_token_ids=True)
    chunks, errors = _stream(url, "/v1/chat/completions", body)
    assert not errors
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "".join(pieces([], want)) and "GARBLED" not in text
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == want
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    resumed = next(b for w in workers for b in w.bodies if "prompt_token_ids" in b)
    assert resumed["prompt_token_ids"] == prompt + want[: cut - 1]
    assert resumed["max_tokens"] == 40 - (cut - 1)
    # sampled, the same tokens would not come again: the stream ends with the error
    for w in workers:
        w.bodies.clear()
    DEATHS.append(cut)
    chunks, errors = _stream(url, "/v1/chat/completions", dict(body, temperature=1.0))
    assert len(errors) == 1 and len([b for w in workers for b in w.bodies]) == 1


def test_a_hung_worker_ejected_by_its_health_checks_is_left(setup):
    workers, url = setup
    HANGS.append(4)  # the stream stops after 4 tokens; that worker's /health fails then
    before = _metric(url, "unhealthy")
    chunks, errors = _stream(url, "/v1/chat/completions", CHAT)
    assert not errors
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "".join(pieces([], _expected(chat_prompt(CHAT["messages"]), 12)))
    assert _metric(url, "unhealthy") == before + 1
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_a_non_streamed_request_on_a_hung_worker_is_sent_again_once_it_is_ejected(
    setup, monkeypatch
):
    """A worker that stops answering with its connection open (SIGSTOP, a wedged GPU):
    its health checks eject it within a second here, and the request waiting on it is
    sent again whole to the other worker once the ejected worker's grace has passed,
    not at --request-timeout (600 s)."""
    workers, url = setup
    monkeypatch.setattr(dispatch, "EJECTED_GRACE_S", 0.5)  # the router runs in this process
    HANGS.append(0)
    before = _metric(url, "retry_whole")
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "".join(f"t{t} " for t in _expected([1, 2], 3))
    assert time.monotonic() - t0 < 10
    assert _metric(url, "retry_whole") == before + 1
    assert len([b for w in workers for b in w.bodies]) == 2  # the hung one's, then the other's


def test_workers_a_request_failed_on_are_picked_only_when_no_other_is():
    from pdserve.router.workers import WorkerPool

    pool = WorkerPool(
        {"prefill": ["http://p0", "http://p1"], "decode": ["http://d0"]},
        policy="round_robin",
        client=None,  # type: ignore[arg-type]  # no probe runs here
        check_interval=1.0,
        check_timeout=1.0,
        failure_threshold=2,
    )
    for w in pool.all():
        w.healthy = True
    for _ in range(4):  # p0 failed under this request: p1 always, d0 the only decode
        prefill, decode = pool.pick_pair(None, {"http://p0", "http://d0"})
        assert (prefill.url, decode.url) == ("http://p1", "http://d0")
    pool.eject("http://p1", "gone")
    assert not pool.find("http://p1").healthy
    assert pool.pick_pair(None, {"http://p0"})[0].url == "http://p0"  # no other left
