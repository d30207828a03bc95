"""The OpenAI surface users' clients send, through a real PD deployment (prefill +
decode + router, KV over real NIXL on CPU) against a mixed worker on the same tiny model:
penalties and logit_bias (greedy and seeded), echo with prompt logprobs (also the
loglikelihood request of evaluation harnesses), continuous usage stats, unknown and
no-op fields, /tokenize, /detokenize, /version and /v1/models (its created time), the
first chunk of streams, unknown models, JSON nulls and integral floats of the official
client, models.retrieve. Every answer — tokens,
text, logprobs, finish_reason, usage — equals the mixed worker's."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
from pd_compare import assert_same, fold, pair, post, sse

from pdserve_procs import assert_all_healthy

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def c(shared_pd):
    """The PD + mixed deployment these tests share with other files (tests/e2e/conftest.py)."""
    return shared_pd


def streams(c, path: str, body: dict) -> tuple[dict, dict, list]:
    """Folded PD and mixed streams of ``body`` (+ the PD stream's raw chunks)."""
    chunks = sse(post(c["router"].url, path, body))
    mixed = fold(sse(post(c["mixed"].url, path, body)))
    return fold(chunks), mixed, chunks


PENALTIES = {
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.5},
    "repetition": {"repetition_penalty": 4.0},
    "all": {"presence_penalty": -0.5, "frequency_penalty": 0.8, "repetition_penalty": 1.3},
    "bias": {"logit_bias": {"17": 5.0, "42": -100, "99": 2.5}},
}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalties_and_bias_through_pd_equal_mixed(c, name, sampling):
    body = {
        "prompt": "one two one two one two",
        "max_tokens": 16,
        "ignore_eos": True,
        "logprobs": 2,
        "return_token_ids": True,
        "temperature": 0.0,
        **PENALTIES[name],
    }
    if sampling == "seeded":
        body.update(temperature=1.0, top_p=0.95, seed=4321)
    pd, mixed = pair(c, "/v1/completions", body)
    assert_same(pd, mixed)
    if sampling == "seeded":  # a near-uniform random model rarely redraws a seen token
        return
    plain = {k: v for k, v in body.items() if k not in PENALTIES[name]}
    unpenalised = post(c["mixed"].url, "/v1/completions", plain).json()
    assert unpenalised["choices"][0]["token_ids"] != mixed["choices"][0]["token_ids"], (
        "premise: the penalty changes the output"
    )
    if name == "bias":
        assert 42 not in mixed["choices"][0]["token_ids"]


def test_penalties_on_chat_generate_and_streams_equal_mixed(c):
    chat = {
        "messages": [{"role": "user", "content": "Repeat after me: la la la"}],
        "max_tokens": 10,
        "temperature": 0,
        "frequency_penalty": 1.0,
        "presence_penalty": 0.5,
        "logit_bias": {"7": 3},
        "logprobs": True,
        "top_logprobs": 2,
    }
    assert_same(*pair(c, "/v1/chat/completions", chat))
    gen = {
        "text": "la la la la",
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 10,
            "temperature": 0.8,
            "seed": 9,
            "repetition_penalty": 1.5,
            "logit_bias": {"3": 100},
            "ignore_eos": True,
        },
    }
    pd, mixed = pair(c, "/generate", gen)
    assert_same(pd, mixed)
    assert set(mixed["output_ids"]) == {3}  # a +100 bias wins every draw
    stream = dict(chat, stream=True, stream_options={"include_usage": True})
    pd, mixed, _ = streams(c, "/v1/chat/completions", stream)
    assert_same(pd, mixed)


def _echo(prompt, **kw) -> dict:
    return {"prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0, **kw}


ECHO = {
    # the loglikelihood request of evaluation harnesses: score the prompt, generate nothing
    "loglikelihood_text": _echo("The quick brown fox jumps over the lazy dog", max_tokens=0),
    "loglikelihood_ids": _echo([5, 17, 300, 4000, 25, 99, 7], max_tokens=0, seed=1234),
    "loglikelihood_max_tokens_1": _echo("Question: 2+2? Answer: 4", max_tokens=1),
    "echo_generate": _echo("Echo me and go on", max_tokens=6, logprobs=3, ignore_eos=True),
    "echo_no_logprobs": {"prompt": "Echo me", "echo": True, "max_tokens": 4, "temperature": 0},
    "echo_seeded_n2": _echo(
        "Sampled echo", max_tokens=5, temperature=1.0, seed=5, n=2, ignore_eos=True
    ),
}


@pytest.mark.parametrize("case", list(ECHO))
def test_echo_through_pd_equals_mixed(c, case):
    body = ECHO[case]
    pd, mixed = pair(c, "/v1/completions", body)
    assert_same(pd, mixed)
    ids = httpx.post(
        c["mixed"].url + "/v1/completions", json=dict(body, max_tokens=1, return_token_ids=True)
    ).json()["choices"][0]["prompt_token_ids"]
    prompt_text = body["prompt"]
    if not isinstance(prompt_text, str):
        prompt_text = post(c["mixed"].url, "/detokenize", {"tokens": ids}).json()["prompt"]
    for choice in pd["choices"]:
        assert choice["text"].startswith(prompt_text)
        lp = choice["logprobs"]
        if body.get("logprobs") is None:
            assert lp is None
            continue
        generated = body["max_tokens"]
        assert len(lp["tokens"]) == len(ids) + generated == len(lp["token_logprobs"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        # each top dict: the k best and its own token (OpenAI: up to logprobs + 1 entries)
        k = body["logprobs"]
        assert all(
            k <= len(top) <= k + 1 and top[t] == pytest.approx(x)
            for t, x, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:])
        ), lp
        assert lp["text_offset"][0] == 0
    if body["max_tokens"] == 0:
        assert pd["usage"]["completion_tokens"] == 0
        assert pd["choices"][0]["finish_reason"] == "length"
        assert pd["choices"][0]["text"] == mixed["choices"][0]["text"]
    # the echoed logprobs are the prompt logprobs (the vLLM extension) of the same request
    ext = post(c["router"].url, "/v1/completions", dict(body, prompt_logprobs=1)).json()
    if body.get("logprobs") is not None:
        choice = ext["choices"][0]
        want = [None] + [e["logprob"] for e in choice["prompt_logprobs"][1:]]
        got = choice["logprobs"]["token_logprobs"][: len(want)]
        assert got[0] is None and all(abs(a - b) < 1e-6 for a, b in zip(got[1:], want[1:]))


def test_echo_streams_and_continuous_usage_equal_mixed(c):
    body = dict(
        _echo("Stream the echo", max_tokens=6, logprobs=2, ignore_eos=True),
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    pd, mixed, chunks = streams(c, "/v1/completions", body)
    assert_same(pd, mixed)
    # the same request unstreamed (stream_options is a 400 without stream)
    whole_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    non_stream = post(c["mixed"].url, "/v1/completions", whole_body).json()
    assert pd[0]["text"] == non_stream["choices"][0]["text"]
    assert_same(pd[0]["logprobs"], non_stream["choices"][0]["logprobs"])
    assert pd["usage"] == non_stream["usage"]
    with_choices = [ch for ch in chunks if ch["choices"]]
    assert with_choices and all("usage" in ch for ch in chunks)
    done = [ch["usage"]["completion_tokens"] for ch in with_choices]
    assert done == sorted(done) and done[-1] == 6
    assert {ch["usage"]["prompt_tokens"] for ch in chunks} == {non_stream["usage"]["prompt_tokens"]}
    # chat too; continuous_usage_stats alone adds no usage (vLLM: only with include_usage)
    chat = {
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    pd, mixed, chunks = streams(c, "/v1/chat/completions", chat)
    assert_same(pd, mixed)
    assert chunks and all(ch["choices"] and "usage" not in ch for ch in chunks)
    chat["stream_options"]["include_usage"] = True
    pd, mixed, chunks = streams(c, "/v1/chat/completions", chat)
    assert_same(pd, mixed)
    assert all("usage" in ch for ch in chunks) and not chunks[-1]["choices"]
    assert [ch["usage"]["completion_tokens"] for ch in chunks][-2:] == [5, 5]
    assert pd["usage"]["completion_tokens"] == 5


def test_unknown_and_noop_fields_pass_the_router_and_are_counted(c):
    base = {"prompt": "Fields", "max_tokens": 5, "temperature": 0}
    want = post(c["mixed"].url, "/v1/completions", base).json()["choices"][0]["text"]
    body = dict(
        base,
        user="someone",
        metadata={"a": "b"},
        store=True,
        service_tier="default",
        parallel_tool_calls=False,
        reasoning_effort="high",
        a_field_from_the_future={"x": 1},
    )
    pd, mixed = pair(c, "/v1/completions", body)
    assert_same(pd, mixed)
    assert pd["choices"][0]["text"] == want
    for name in ("prefill", "decode", "mixed"):
        text = httpx.get(c[name].url + "/metrics").text
        line = 'pdserve_ignored_request_fields_total{field="a_field_from_the_future"}'
        assert line in text, name
        assert 'field="user"' not in text and 'field="store"' not in text
    r = post(c["router"].url, "/v1/completions", dict(base, suffix="tail"))
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"], r.text
    r = post(c["router"].url, "/v1/completions", dict(base, logit_bias={"1": 500}))
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text


def test_tokenizer_endpoints_version_and_models_through_the_router(c):
    router, mixed = c["router"].url, c["mixed"].url
    for body in (
        {"prompt": "Tokenize this, please", "return_token_strs": True},
        {"prompt": "no specials", "add_special_tokens": False},
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
    ):
        pd, direct = pair(c, "/tokenize", body)
        assert pd == direct and pd["count"] == len(pd["tokens"]) > 0
        back = post(router, "/detokenize", {"tokens": pd["tokens"]}).json()
        assert back == post(mixed, "/detokenize", {"tokens": pd["tokens"]}).json()
        if "prompt" in body:
            assert back["prompt"] == body["prompt"]
    r = post(router, "/detokenize", {"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    version = httpx.get(router + "/version").json()["version"]
    assert (
        version
        == httpx.get(mixed + "/version").json()["version"]
        == c["mixed"].get_info()["version"]
    )
    models = httpx.get(router + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == c["decode"].get_info()["max_model_len"] > 0


def test_openai_client_echo_scoring_and_penalties_through_the_router(c):
    pd = openai.OpenAI(base_url=c["router"].url + "/v1", api_key="x", max_retries=0)
    mx = openai.OpenAI(base_url=c["mixed"].url + "/v1", api_key="x", max_retries=0)
    model = pd.models.list().data[0].id
    kw = dict(model=model, prompt="Score this sentence.", echo=True, logprobs=1, temperature=0)
    a, b = pd.completions.create(**kw, max_tokens=0), mx.completions.create(**kw, max_tokens=0)
    assert a.choices[0].text == b.choices[0].text == "Score this sentence."
    la, lb = a.choices[0].logprobs, b.choices[0].logprobs
    assert la.tokens == lb.tokens and la.token_logprobs[0] is None
    assert all(abs(x - y) < 2e-4 for x, y in zip(la.token_logprobs[1:], lb.token_logprobs[1:]))
    assert a.usage.completion_tokens == 0
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Say hi hi hi"}],
        max_tokens=8,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={"11": 4},
        user="u",
        metadata={"k": "v"},
        store=False,
        extra_body={"repetition_penalty": 1.2},
    )
    x, y = pd.chat.completions.create(**kw), mx.chat.completions.create(**kw)
    assert x.choices[0].message.content == y.choices[0].message.content
    assert x.usage.completion_tokens == y.usage.completion_tokens
    chunks = list(
        pd.completions.create(
            model=model,
            prompt="usage please",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(ch.usage is not None for ch in chunks) and chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError):
        pd.completions.create(model=model, prompt="x", suffix="y", max_tokens=2)
    assert_all_healthy(c["procs"])


def test_wrong_model_and_wrong_method_are_openai_errors_in_the_routers_words(c):
    pd = openai.OpenAI(base_url=c["router"].url + "/v1", api_key="x", max_retries=0)
    served = pd.models.list().data[0].id
    with pytest.raises(openai.NotFoundError) as missing:
        pd.completions.create(model="gpt-nope", prompt="x", max_tokens=2)
    err = missing.value.body
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    assert err["message"] == f"the model 'gpt-nope' does not exist; this router serves '{served}'"
    with pytest.raises(openai.NotFoundError) as chat_missing:
        pd.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert "this router serves" in chat_missing.value.body["message"]
    tok = httpx.post(c["router"].url + "/tokenize", json={"model": "gpt-nope", "prompt": "x"})
    assert tok.status_code == 404 and tok.json()["error"]["code"] == "model_not_found"
    assert "this router serves" in tok.json()["error"]["message"]
    # the worker itself still speaks for itself; the served name passes the router
    direct = httpx.post(
        c["mixed"].url + "/v1/completions", json={"model": "gpt-nope", "prompt": "x"}
    )
    assert direct.status_code == 404 and "this worker serves" in direct.json()["error"]["message"]
    ok = pd.completions.create(model=served, prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    for url in (c["router"].url, c["mixed"].url):  # 405: an OpenAI type, as every 4xx
        r = httpx.get(url + "/v1/completions")
        assert r.status_code == 405, r.text
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.headers["allow"].split(", ") == ["POST"], r.headers  # RFC 9110 15.5.6
    r = httpx.post(c["mixed"].url + "/health")  # a GET-only route
    assert r.status_code == 405 and "GET" in r.headers["allow"].split(", "), (r.headers, r.text)
    assert_all_healthy(c["procs"])


GREEDY_STREAMS = {
    "/v1/completions": {"prompt": "Say something", "max_tokens": 5, "ignore_eos": True},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 5,
        "ignore_eos": True,
    },
    "/generate": {
        "text": "Say something",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    },
}


@pytest.mark.parametrize("path", list(GREEDY_STREAMS))
@pytest.mark.parametrize("where", ["router", "mixed"])
def test_the_first_content_chunk_carries_exactly_the_first_token(c, where, path):
    """The client's TTFT is the first token's: in PD, decode streams prefill's first token
    as soon as its KV arrived, not together with the token of its first step; mixed, the
    prefill step's token alone. (Greedy: the tokens are the unstreamed answer's.)"""
    body = dict(GREEDY_STREAMS[path])
    if path != "/generate":
        body.update(temperature=0, return_token_ids=True)
    whole = post(c["mixed"].url, path, body).json()
    want = whole["output_ids"] if path == "/generate" else whole["choices"][0]["token_ids"]
    assert len(want) == 5, whole
    chunks = sse(post(c[where].url, path, dict(body, stream=True)))
    if path == "/generate":  # cumulative chunks
        assert [ch["output_ids"] for ch in chunks][:2] == [want[:1], want[:2]], chunks
        return
    content = [ch["choices"][0] for ch in chunks if ch["choices"]]
    if path == "/v1/chat/completions":
        opening = content.pop(0)
        assert opening["delta"] == {"role": "assistant", "content": "", "refusal": None}, opening
        assert opening["token_ids"] == [] and opening["finish_reason"] is None
    assert [ch["token_ids"] for ch in content] == [[t] for t in want], content


@pytest.mark.parametrize("where", ["router", "mixed"])
def test_chat_streams_open_with_the_assistant_role_and_empty_content(c, where):
    """OpenAI's first chat chunk of each choice is ``delta: {"role": "assistant",
    "content": ""}``; the content follows in later chunks, with no role."""
    client = openai.OpenAI(base_url=c[where].url + "/v1", api_key="x", max_retries=0)
    kw: dict = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Tell me something"}],
        max_tokens=6,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw)
    for n in (1, 2):
        chunks = [ch for ch in client.chat.completions.create(**kw, n=n, stream=True)]
        for index in range(n):
            mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == index]
            opening, rest = mine[0], mine[1:]
            assert (opening.delta.role, opening.delta.content) == ("assistant", ""), opening
            assert opening.finish_reason is None
            assert rest and all(ch.delta.role is None for ch in rest), rest
            text = "".join(ch.delta.content or "" for ch in rest)
            assert text == whole.choices[0].message.content
            assert rest[-1].finish_reason == "length"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("where", ["router", "mixed"])
def test_stream_chunks_are_openai_s_role_refusal_and_null_usage_until_the_usage_chunk(
    c, where, path
):
    """OpenAI's stream with ``include_usage``: every chunk before the last has ``"usage":
    null``, the last one ``choices: []`` and the request's usage; a chat choice's first
    chunk is ``delta: {"role": "assistant", "content": "", "refusal": null}`` (read with
    the official client, whose models record which fields the JSON had). Through the PD
    router (decode's chunks with prefill's counts merged) as from the worker."""
    client = openai.OpenAI(base_url=c[where].url + "/v1", api_key="x", max_retries=0)
    kw: dict = dict(
        model="random:tiny",
        max_tokens=4,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    if path == "/v1/completions":
        chunks = list(client.completions.create(prompt="Count with me", **kw))
    else:
        chunks = list(
            client.chat.completions.create(
                messages=[{"role": "user", "content": "Count with me"}], **kw
            )
        )
    *body, last = chunks
    assert body and all(ch.choices for ch in body), chunks
    assert all("usage" in ch.model_fields_set and ch.usage is None for ch in body), body
    assert last.choices == [] and last.usage is not None, last
    assert last.usage.completion_tokens == 8, last.usage
    if path == "/v1/chat/completions":
        whole = client.chat.completions.create(
            messages=[{"role": "user", "content": "Count with me"}],
            **dict(kw, stream=False, stream_options=None),
        )
        message = whole.choices[0].message  # OpenAI's message has "refusal": null too
        assert {"role", "content", "refusal"} <= message.model_fields_set, message
        assert message.refusal is None, message
        for index in (0, 1):
            first = next(ch.choices[0] for ch in body if ch.choices[0].index == index)
            assert first.delta.model_dump(exclude_unset=True) == {
                "role": "assistant",
                "content": "",
                "refusal": None,
            }, first


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_openai_s_404_on_the_router_and_every_worker(c, stream):
    """OpenAI's answer to a model it does not serve: HTTP 404, ``error.type``
    ``invalid_request_error``, ``error.code`` ``model_not_found`` (streamed or not); the
    router and each worker alike, each in its own words."""
    requests = {
        "/v1/completions": {"prompt": "x", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    }
    for name in ("router", "mixed", "prefill", "decode"):
        who = "router" if name == "router" else "worker"
        for path, body in requests.items():
            r = post(c[name].url, path, dict(body, model="gpt-nope", stream=stream))
            assert r.status_code == 404, (name, path, r.text)
            assert r.headers["content-type"] == "application/json", (name, path, r.headers)
            err = r.json()["error"]
            assert (err["type"], err["code"], err["param"]) == (
                "invalid_request_error",
                "model_not_found",
                "model",
            ), (name, path, err)
            assert f"this {who} serves 'random:tiny'" in err["message"], (name, err)
        client = openai.OpenAI(base_url=c[name].url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="gpt-nope", prompt="x", max_tokens=2, stream=stream)
        assert (missing.value.type, missing.value.code) == (
            "invalid_request_error",
            "model_not_found",
        )
    r = httpx.get(c["router"].url + "/v1/no-such-route")  # an unknown URL: OpenAI's type too
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert_all_healthy(c["procs"])


def _process_start(pid: int) -> float:
    """Unix time (s) process ``pid`` started: boot time + its start in clock ticks."""
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def test_models_list_the_time_the_model_was_loaded(c):
    """``/v1/models``' ``created``: Unix seconds when the worker loaded its model (after
    its process started, before now), the same on every call; the router lists its
    decode worker's."""
    started = {name: _process_start(c[name].pid) for name in ("mixed", "decode")}
    seen = {}
    for name, owner in (("mixed", "mixed"), ("router", "decode"), ("decode", "decode")):
        client = openai.OpenAI(base_url=c[name].url + "/v1", api_key="x", max_retries=0)
        (model,) = client.models.list().data
        assert (model.id, model.object, model.owned_by) == ("random:tiny", "model", "pdserve")
        assert int(started[owner]) <= model.created <= time.time(), (name, model, started)
        assert client.models.list().data[0].created == model.created
        seen[name] = model.created
    assert seen["router"] == seen["decode"], seen


@pytest.mark.parametrize("where", ["router", "mixed"])
def test_a_stream_that_fails_before_its_first_byte_is_the_workers_status_and_json(c, where):
    """A streamed request the worker rejects before any output gets the worker's HTTP
    status and JSON error body (through the PD router too), never a 200 with an error
    event; the official client raises the matching error."""
    body = {"prompt": "x", "max_tokens": 10**6, "stream": True}
    r = post(c[where].url, "/v1/completions", body)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    client = openai.OpenAI(base_url=c[where].url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="random:tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=10**6,
            stream=True,
        )
    assert bad.value.code == "context_length_exceeded"


def test_null_fields_and_integral_floats_through_the_pd_router_equal_mixed(c):
    """The official client's ``None`` arguments (sent as JSON null) and Python's ``2.0``
    for an integer, through the PD router (which reads ``stream`` and ``n`` itself) as on
    the mixed worker: each null is its field's default, ``n: 2.0`` two samples (rooms)."""
    pd = openai.OpenAI(base_url=c["router"].url + "/v1", api_key="x", max_retries=0)
    mx = openai.OpenAI(base_url=c["mixed"].url + "/v1", api_key="x", max_retries=0)
    model = pd.models.list().data[0].id
    nulls = {"top_k": None, "min_p": None, "ignore_eos": None, "return_token_ids": None}
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=5,
        seed=3,
        temperature=None,
        top_p=None,
        n=None,
        presence_penalty=None,
        logprobs=None,
        stream=None,
        extra_body=nulls,
    )
    x, y = pd.chat.completions.create(**kw), mx.chat.completions.create(**kw)
    assert x.choices[0].message.content == y.choices[0].message.content and len(x.choices) == 1
    body = {"prompt": "one two", "max_tokens": None, "n": 2.0, "seed": 9.0, "stream": None}
    body.update(echo=None, ignore_eos=True, logprobs=1.0)
    a, b = pair(c, "/v1/completions", body)
    assert_same(a, b)
    assert len(a["choices"]) == 2 and a["usage"]["completion_tokens"] == 2 * 16  # null: 16
    gen = {"text": "one two", "sampling_params": {"n": 2.0, "max_new_tokens": 3.0, "seed": 1}}
    a, b = pair(c, "/generate", {**gen, "stream": None, "return_logprob": None})
    assert_same(a, b)
    assert len(a) == 2 and all(g["meta_info"]["completion_tokens"] <= 3 for g in a), a
    assert_all_healthy(c["procs"])


def test_models_retrieve_on_the_router_and_every_worker(c):
    served = c["mixed"].get_info()["served_model_name"]
    listed = httpx.get(c["router"].url + "/v1/models").json()["data"][0]
    for name in ("router", "prefill", "decode", "mixed"):
        client = openai.OpenAI(base_url=c[name].url + "/v1", api_key="x", max_retries=0)
        model = client.models.retrieve(served)
        assert (model.id, model.object, model.owned_by) == (served, "model", "pdserve"), name
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("org/no-such-model")
        assert (missing.value.code, missing.value.param) == ("model_not_found", "model"), name
        assert "'org/no-such-model' does not exist" in missing.value.message, name
    assert httpx.get(f"{c['router'].url}/v1/models/{served}").json() == listed
