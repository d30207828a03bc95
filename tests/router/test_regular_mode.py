"""Regular mode: the router load-balances two real mixed workers (no disaggregation) with
the same answers as a worker asked directly, spreads the load, and ejects a dead worker."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve_procs import (
    assert_all_healthy,
    start_router,
    start_worker,
    stop,
    wait_for,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("regular-logs")
    workers = [start_worker(f"mixed-{i}", "mixed", logs) for i in range(2)]
    router = start_router(
        "router",
        logs,
        workers=workers,
        extra=["--policy", "round_robin", "--health-failure-threshold", "1"],
    )
    try:
        wait_healthy(workers + [router])
        # the router answers /health once one worker passes its probe: wait until its pool
        # has both (else round robin's requests all go to the first, as seen under load)
        wait_for(lambda: _healthy_in_router(router) == 2, 60, "both workers healthy in the router")
        yield workers, router
    finally:
        stop([router, *workers])


def _healthy_in_router(router) -> int:
    """How many workers the router's pool holds healthy (its /metrics gauge)."""
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(
        line.rstrip().endswith(" 1.0")
        for line in text.splitlines()
        if line.startswith("pdserve_router_worker_healthy{")
    )


def _finished(worker) -> int:
    return worker.get_info()["engine"]["finished_requests"]


def test_same_answers_as_a_worker_and_load_is_spread(procs):
    workers, router = procs
    before = [_finished(w) for w in workers]
    body = {
        "prompt": "Tell me a story",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
        "return_token_ids": True,
    }
    direct = httpx.post(workers[0].url + "/v1/completions", json=body, timeout=60).json()
    for _ in range(4):
        routed = httpx.post(router.url + "/v1/completions", json=body, timeout=60).json()
        assert routed["choices"] == direct["choices"] and routed["usage"] == direct["usage"]
    after = [_finished(w) for w in workers]
    assert (
        after[0] - before[0] >= 3 and after[1] - before[1] == 2
    )  # round robin: 2 routed each (+1 direct)

    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    r = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=60)
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
    whole = httpx.post(
        workers[1].url + "/v1/chat/completions", json=dict(chat, stream=False), timeout=60
    ).json()
    assert streamed == whole["choices"][0]["message"]["content"]

    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert_all_healthy(workers + [router])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_relayed_streams_keep_openai_s_null_usage_and_opening_chunk(procs, path):
    """The relayed stream (``include_usage``) is OpenAI's: ``"usage": null`` in every chunk
    before the last, which has ``choices: []`` and the usage; chat opens with ``delta:
    {"role": "assistant", "content": "", "refusal": null}``."""
    _, router = procs
    body: dict = {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(router.url + path, json=body, timeout=60)
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", r.text
    *chunks, last = [json.loads(e) for e in events[:-1]]
    assert chunks and all("usage" in ch and ch["usage"] is None for ch in chunks), chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3, last
    if path == "/v1/chat/completions":
        opening = chunks[0]["choices"][0]["delta"]
        assert opening == {"role": "assistant", "content": "", "refusal": None}, chunks[0]


def test_the_openai_clients_nulls_and_models_retrieve_through_the_router(procs):
    """The official client's ``None`` arguments (JSON null; the router reads ``stream``
    itself) and ``client.models.retrieve``, through the router as from a worker."""
    workers, router = procs
    routed = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=workers[0].url + "/v1", api_key="x", max_retries=0)
    served = direct.models.list().data[0].id
    kw = dict(model=served, prompt="Tell me", max_tokens=4, temperature=0, stream=None, n=None)
    a, b = routed.completions.create(**kw), direct.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    # the router forwards to one of the workers: its object is that worker's (``created``
    # is each worker's start time, so it may differ between the two)
    answers = [
        openai.OpenAI(base_url=w.url + "/v1", api_key="x", max_retries=0).models.retrieve(served)
        for w in workers
    ]
    assert routed.models.retrieve(served) in answers, answers
    with pytest.raises(openai.NotFoundError) as missing:
        routed.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found", missing.value.body


def test_dead_worker_is_ejected_and_the_other_serves(procs):
    workers, router = procs
    stop([workers[1]])
    wait_for(
        lambda: (
            not [
                w
                for w in httpx.get(router.url + "/get_server_info").json()["workers"]
                if w["url"] == workers[1].url
            ][0]["healthy"]
        ),
        10,
        "the dead worker's ejection",
    )
    assert httpx.get(router.url + "/health").status_code == 200  # one mixed worker is enough
    for _ in range(3):
        r = httpx.post(
            router.url + "/generate",
            json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    assert (
        f'pdserve_router_worker_healthy{{role="mixed",url="{workers[1].url}"}} 0.0'
        in httpx.get(router.url + "/metrics").text
    )


def test_cache_aware_routes_a_shared_prefix_to_the_worker_that_cached_it(procs, tmp_path):
    workers, _ = procs
    router = start_router(
        "router-cache", tmp_path, workers=workers, extra=["--policy", "cache_aware"]
    )
    try:
        wait_healthy([router])
        hits = []
        for round_ in range(3):
            for group in ("alpha", "beta"):
                system = f"You are the {group} assistant of this test, answer briefly. " * 6
                body = {"prompt": system + f"Question {round_}?", "max_tokens": 2, "temperature": 0}
                r = httpx.post(router.url + "/v1/completions", json=body, timeout=60).json()
                hits.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        # the first request of each group computes its prompt; every later one finds it
        # cached on the worker it is routed to (round robin would send half elsewhere)
        assert hits[:2] == [0, 0] and all(h >= 64 for h in hits[2:]), hits
    finally:
        stop([router])
