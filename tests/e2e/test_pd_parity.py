"""1 prefill + 1 decode + router (KV over real NIXL on CPU) against a mixed worker on the
same tiny model: for every sampling option the router's answer — token ids, text,
finish_reason, logprobs, usage — equals the mixed worker's. Also: the official ``openai``
client against the router, bad input at the router and straight at the PD workers, and
every process healthy with its KV pages back afterwards."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from pd_compare import assert_same, fold, pair, post, sse

from pdserve_procs import (
    assert_all_healthy,
    build_eos_model,
    pd_and_mixed,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)

EOS_PROMPT = "Hello there"  # the model folder makes its greedy first token an EOS token


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eos-model")
    eos = build_eos_model(folder, EOS_PROMPT)
    logs = tmp_path_factory.mktemp("pd-logs")
    model = str(folder)
    with pd_and_mixed(logs, model) as c:
        yield {**c, "eos": eos, "model": model}


def _completion(prompt, **kw) -> dict:
    return {"prompt": prompt, "temperature": 0.0, "return_token_ids": True, "logprobs": 2, **kw}


CASES = {
    "greedy": _completion("The capital of France is", max_tokens=12),
    "max_tokens_1": _completion("Once upon a time", max_tokens=1),
    "max_tokens_2": _completion("Once upon a time", max_tokens=2),
    "eos_first": _completion(EOS_PROMPT, max_tokens=8),
    "eos_first_ignore_eos": _completion(EOS_PROMPT, max_tokens=8, ignore_eos=True),
    "eos_first_min_tokens": _completion(EOS_PROMPT, max_tokens=8, min_tokens=3),
    "min_tokens": _completion("Numbers: one two", max_tokens=6, min_tokens=6),
    "seeded": _completion(
        "A seeded story", max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234
    ),
    "seeded_min_p": _completion(
        "A seeded story", max_tokens=10, temperature=1.2, min_p=0.05, seed=7
    ),
    "n3_seeded": _completion("Three samples", max_tokens=6, temperature=1.0, n=3, seed=99),
    "n3_greedy": _completion("Three samples", max_tokens=4, n=3),
    "prompt_logprobs": _completion(
        "Check the prompt logprobs here", max_tokens=3, logprobs=5, prompt_logprobs=3
    ),
    "token_prompt": _completion([5, 17, 300, 4000, 25], max_tokens=5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_completions_equal_mixed(cluster, case):
    pd, mixed = pair(cluster, "/v1/completions", CASES[case])
    assert_same(pd, mixed)
    if case == "eos_first":
        assert mixed["choices"][0]["token_ids"] == [cluster["eos"]], (
            "premise: EOS is the first token"
        )
        assert mixed["choices"][0]["finish_reason"] == "stop"
    if case in ("eos_first_ignore_eos", "min_tokens"):
        assert len(mixed["choices"][0]["token_ids"]) in (8, 6)
    if case == "prompt_logprobs":
        choice = pd["choices"][0]
        assert (
            len(choice["prompt_logprobs"]) == len(choice["prompt_token_ids"])
            and choice["prompt_logprobs"][0] is None
        )
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) == 3


def test_stop_strings_and_stop_token_ids_hit_by_the_first_token(cluster):
    base = _completion("The capital of France is", max_tokens=12)
    _, free = pair(cluster, "/v1/completions", base)
    ids, text = free["choices"][0]["token_ids"], free["choices"][0]["text"]
    first_text = httpx.post(
        cluster["mixed"].url + "/v1/completions", json=dict(base, max_tokens=1)
    ).json()["choices"][0]["text"]
    cases = [
        dict(base, stop_token_ids=[ids[0]]),
        dict(base, stop_token_ids=[ids[min(3, len(ids) - 1)]]),
    ]
    if first_text.strip():
        cases.append(dict(base, stop=[first_text.strip()[:2]]))
    if len(text) > 6:
        cases.append(dict(base, stop=[text[4:7]]))
    for body in cases:
        pd, mixed = pair(cluster, "/v1/completions", body)
        assert_same(pd, mixed)
    assert mixed["choices"][0]["finish_reason"] == "stop"


def test_generate_with_logprobs_equals_mixed(cluster):
    body = {
        "text": "Native endpoint with logprobs",
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }
    pd, mixed = pair(cluster, "/generate", body)
    assert_same(pd, mixed)
    meta = pd["meta_info"]
    assert (
        len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
        and meta["input_token_logprobs"][0][0] is None
    )
    assert (
        len(meta["output_token_logprobs"])
        == len(pd["output_ids"])
        == meta["completion_tokens"]
        == 6
    )
    many = dict(body, sampling_params={"max_new_tokens": 3, "temperature": 0.8, "seed": 5, "n": 2})
    pd, mixed = pair(cluster, "/generate", many)
    assert_same(pd, mixed)


def test_chat_equals_mixed(cluster):
    body = {
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }
    pd, mixed = pair(cluster, "/v1/chat/completions", body)
    assert_same(pd, mixed)


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/completions",
            dict(
                _completion(
                    "Streaming now", max_tokens=7, n=2, temperature=0.7, seed=3, prompt_logprobs=2
                ),
                stream=True,
                stream_options={"include_usage": True},
            ),
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Stream please"}],
                "max_tokens": 6,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
            },
        ),
        (
            "/generate",
            {
                "text": "stream native",
                "stream": True,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            },
        ),
    ],
)
def test_streaming_equals_mixed(cluster, path, body):
    pd = fold(sse(post(cluster["router"].url, path, body)), path)
    mixed = fold(sse(post(cluster["mixed"].url, path, body)), path)
    assert_same(json.loads(json.dumps(pd)), json.loads(json.dumps(mixed)))
    assert mixed and all(
        s["finish_reason"] for k, s in mixed.items() if k != "usage" and path != "/generate"
    )
    if "prompt_logprobs" in body or body.get("logprob_start_len") == 0:
        assert all(
            (s.get("prompt_logprobs") or s.get("meta_info", {}).get("input_token_logprobs"))
            for k, s in pd.items()
            if k != "usage"
        )


def test_a_repeated_prompt_through_pd_reports_prefill_s_cached_tokens_once(cluster):
    prompt = "Every request of this test shares this fairly long opening sentence. " * 6
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    native = {"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    router, mixed = cluster["router"].url, cluster["mixed"].url
    first = post(router, "/v1/completions", body).json()
    again = post(router, "/v1/completions", body).json()
    mixed_again = [post(mixed, "/v1/completions", body).json() for _ in range(2)][-1]
    n = first["usage"]["prompt_tokens"]
    want = (n - 1) // 16 * 16  # full pages of all but the last prompt token
    assert want > 0
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": want}
    assert mixed_again["usage"]["prompt_tokens_details"] == {"cached_tokens": want}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert_same(again["choices"], mixed_again["choices"])
    chunks = sse(post(router, "/v1/completions", streamed))
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": want}
    meta = post(router, "/generate", native).json()["meta_info"]
    assert meta["cached_tokens"] == want and meta["prompt_tokens"] == n


def test_openai_client_against_the_router(cluster):
    client = openai.OpenAI(base_url=cluster["router"].url + "/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=cluster["mixed"].url + "/v1", api_key="unused", max_retries=0)
    model = cluster["model"]
    assert [m.id for m in client.models.list().data] == [model]
    kw = dict(
        model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(**kw)
    assert (
        chat.choices[0].message.content
        == direct.chat.completions.create(**kw).choices[0].message.content
    )
    assert chat.usage.completion_tokens == 8
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert text == chat.choices[0].message.content
    comp = client.completions.create(
        model=model, prompt="Say", max_tokens=5, temperature=0, logprobs=2
    )
    assert len(comp.choices[0].logprobs.token_logprobs) == 5
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Say", max_tokens=5, temperature=0, stream=True
        )
    )
    assert streamed == comp.choices[0].text
    # the openai client reads body["error"]: OpenAI's code strings (or null) pass through
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-nope", prompt="x", max_tokens=2)
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", max_tokens=-3)
    assert bad.value.code is None and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=model, prompt="x", max_tokens=10**6)
    assert long.value.code == "context_length_exceeded", long.value.body


ROUTER_BAD = [
    b"{not json",
    b"[1]",
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "max_tokens": 10**12},
    {"prompt": "x", "max_tokens": "ten"},
    {"prompt": ""},
    {"prompt": "word " * 5000},
    {"prompt": "x", "model": "unknown"},
    {"prompt": "x", "temperature": "hot"},
]


def test_bad_input_through_the_router_is_4xx_and_everyone_keeps_serving(cluster):
    for body in ROUTER_BAD:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(cluster["router"].url + "/v1/completions", timeout=60, **kw)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (
            body,
            r.status_code,
            r.text,
        )
    assert_all_healthy(cluster["procs"])
    pd, mixed = pair(cluster, "/v1/completions", CASES["greedy"])
    assert_same(pd, mixed)


def test_pd_workers_reject_missing_invalid_and_duplicate_bootstrap_fields(cluster):
    p, d = cluster["prefill"], cluster["decode"]
    port = p.get_info()["bootstrap_port"]
    assert isinstance(port, int) and port > 0
    good = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    # no bootstrap field at all: a decode worker runs the request itself (selective PD),
    # a prefill worker has no one to send its KV to
    whole = post(d.url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 2
    for worker in (p, d):
        for extra in (
            *([{}] if worker is p else []),
            {"bootstrap_room": 5},
            dict(good),
            dict(good, bootstrap_room=-1),
            dict(good, bootstrap_room="x"),
            dict(good, bootstrap_room=2**63),
            dict(good, bootstrap_port=0),
            dict(good, bootstrap_room=2**63 - 1, n=2),
        ):
            r = post(worker.url, "/v1/completions", {"prompt": "x", "max_tokens": 2, **extra})
            assert r.status_code == 400 and r.json()["error"]["message"], (
                worker.name,
                extra,
                r.text,
            )
    # A prefill room waits for a decode peer that never comes: it is live, so a second
    # request with the same room is rejected; the first is then abandoned by its client.
    room = 1234567
    body = {"prompt": "duplicate", "max_tokens": 2, **good, "bootstrap_room": room}
    holder = threading.Thread(target=lambda: _post_and_give_up(p.url, body, 3.0), daemon=True)
    holder.start()
    wait_for(
        lambda: (
            p.get_info()["engine"]["num_waiting_for_peer"] >= 1
            or p.get_info()["engine"]["num_running"] >= 1
        ),
        10,
        "the first room to be live",
    )
    r = post(p.url, "/v1/completions", body)
    assert r.status_code == 409 and "room" in r.json()["error"]["message"], r.text
    holder.join(10)
    assert_all_healthy(cluster["procs"])


def _post_and_give_up(url: str, body: dict, after: float) -> None:
    try:
        httpx.post(url + "/v1/completions", json=body, timeout=after)
    except httpx.HTTPError:
        pass


def test_health_generate_and_metrics_on_pd_workers(cluster):
    for name in ("prefill", "decode", "mixed"):
        r = httpx.get(cluster[name].url + "/health_generate", timeout=60)
        assert r.status_code == 200, (name, r.text)
    text = httpx.get(cluster["decode"].url + "/metrics").text
    assert "pdserve_kv_transfer" in text and "pdserve_engine_num_free_pages" in text


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_through_the_router_aborts_both_legs(cluster, stream):
    body = {
        "prompt": "keep going",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    decode = cluster["decode"]
    before = decode.get_info()["engine"]["generation_tokens"]
    try:
        with httpx.Client(timeout=httpx.Timeout(60, read=1.5)) as client:
            if stream:
                with client.stream(
                    "POST", cluster["router"].url + "/v1/completions", json=body
                ) as r:
                    next(r.iter_lines())  # the request is decoding; leaving closes the connection
            else:
                client.post(cluster["router"].url + "/v1/completions", json=body)
    except httpx.ReadTimeout:
        pass
    assert decode.get_info()["engine"]["generation_tokens"] > before
    for name in ("prefill", "decode"):
        proc = cluster[name]
        wait_for(
            lambda proc=proc, name=name: (
                proc.get_info()["num_free_pages"] == cluster["baseline"][name]
            ),
            30,
            f"{name} to abort the abandoned request and free its pages",
        )
    assert decode.get_info()["engine"]["num_running"] == 0
    assert httpx.get(cluster["router"].url + "/get_server_info").json()["live_bootstrap_rooms"] == 0


def test_all_processes_healthy_and_pages_back_at_baseline(cluster):
    assert_all_healthy(cluster["procs"])
    for name in ("prefill", "decode"):
        proc = cluster[name]
        wait_for(
            lambda proc=proc, name=name: (
                proc.get_info()["num_free_pages"] == cluster["baseline"][name]
            ),
            60,
            f"{name} free KV pages back at baseline {cluster['baseline'][name]}",
        )


def test_every_process_froze_its_start_up_heap(cluster):
    """Workers and the router freeze their start-up heap (pdserve/gc_watch.py): a full
    collection while serving walks only what requests allocate."""
    for name in ("prefill", "decode"):
        gc = cluster[name].get_info()["gc"]
        assert gc["frozen_objects"] > 10_000 and gc["startup_full_collection_seconds"] > 0, gc
    gc = httpx.get(cluster["router"].url + "/get_server_info").json()["gc"]
    assert gc["frozen_objects"] > 10_000, gc


def test_prefill_last_sends_post_writes_made_ahead(cluster):
    """The engine hints each one-chunk prompt's pages before its step
    (``PDFlow.expect_sends``), so prefill's last send posts a WRITE made ahead; by now
    (every test's requests done) none is left unposted or unreleased."""
    stats = cluster["prefill"].get_info()["transfer"]
    assert stats["premade_writes_posted"] > 0, stats
    wait_for(
        lambda: cluster["prefill"].get_info()["transfer"]["premade_writes"] == 0,
        30,
        "prefill to release every WRITE made ahead",
    )
