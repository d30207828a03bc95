"""A real mixed worker (``pdserve serve``, tiny random model) over HTTP: OpenAI and native
shapes, streaming, n/seed semantics, logprob lengths, bad input as 4xx JSON, client
disconnects freeing pages, health and metrics."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from pdserve_procs import Proc, assert_all_healthy, wait_for

pytestmark = pytest.mark.timeout(300)


def post(worker: Proc, path: str, body, **kw) -> httpx.Response:
    return httpx.post(worker.url + path, json=body, timeout=60.0, **kw)


def sse_events(resp: httpx.Response) -> list:
    """The JSON payloads of an SSE body; asserts it ends with [DONE]."""
    events = [
        line[len("data: ") :] for line in resp.text.split("\n\n") if line.startswith("data: ")
    ]
    assert events and events[-1] == "[DONE]", resp.text[-300:]
    return [json.loads(e) for e in events[:-1]]


def test_num_threads_flag_sets_torch_threads(worker):
    assert worker.get_info()["num_threads"] == 1


def test_completion_shape_usage_and_token_ids(worker):
    r = post(
        worker,
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "random:tiny"
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    assert body["usage"] == {
        "prompt_tokens": len(choice["prompt_token_ids"]),
        "completion_tokens": 5,
        "total_tokens": len(choice["prompt_token_ids"]) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},  # 2 tokens: not a full page
    }
    assert isinstance(choice["text"], str) and choice["text"]


def test_a_repeated_prompt_reports_cached_tokens_and_the_same_answer(worker):
    prompt = "A long shared system prompt about nothing in particular. " * 8
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    first = post(worker, "/v1/completions", body).json()
    again = post(worker, "/v1/completions", body).json()
    streamed = sse_events(
        post(
            worker,
            "/v1/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    n = first["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (n - 1) // 16 * 16 and cached > 0  # full pages of all but the last token
    assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    lp1, lp2 = first["choices"][0]["logprobs"], again["choices"][0]["logprobs"]
    assert lp2["tokens"] == lp1["tokens"]
    # the suffix is computed in another batch shape: equal to fp32 rounding, not bit for bit
    assert lp2["token_logprobs"] == pytest.approx(lp1["token_logprobs"], abs=1e-4)
    metrics = httpx.get(worker.url + "/metrics").text
    assert "pdserve_engine_prefix_cache_hit_tokens" in metrics
    assert "pdserve_engine_prefix_cache_evicted_pages" in metrics


def test_completion_logprob_lengths(worker):
    r = post(
        worker,
        "/v1/completions",
        {
            "prompt": "Hello there friend",
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 3,
            "prompt_logprobs": 2,
            "return_token_ids": True,
        },
    )
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(top) <= 3 for top in lp["top_logprobs"])
    # greedy: the sampled token is the best one
    assert all(
        max(top.values()) == pytest.approx(t)
        for top, t in zip(lp["top_logprobs"], lp["token_logprobs"])
    )
    prompt_lps = choice["prompt_logprobs"]
    assert len(prompt_lps) == len(choice["prompt_token_ids"]) and prompt_lps[0] is None
    assert [e["token_id"] for e in prompt_lps[1:]] == choice["prompt_token_ids"][1:]
    assert all(len(e["top_logprobs"]) == 2 for e in prompt_lps[1:])


def _assert_top_has_own_token(lp: dict, k: int) -> None:
    """Each legacy ``top_logprobs`` dict holds its own token with its logprob (OpenAI:
    up to ``logprobs + 1`` entries); the first echoed prompt token's is null."""
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        if logprob is None:
            assert top is None
            continue
        assert top[token] == pytest.approx(logprob) and k <= len(top) <= k + 1, (token, top)


def test_completion_top_logprobs_always_hold_the_sampled_token(worker):
    # temperature 1.5: the sampled tokens are mostly not the model's best one
    body = {"prompt": "The sky is", "max_tokens": 8, "temperature": 1.5, "seed": 3}
    lp = post(worker, "/v1/completions", dict(body, logprobs=1)).json()["choices"][0]["logprobs"]
    _assert_top_has_own_token(lp, 1)
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # some sampled token not the best
    only = post(worker, "/v1/completions", dict(body, logprobs=0)).json()["choices"][0]
    assert [list(t) for t in only["logprobs"]["top_logprobs"]] == [[t] for t in lp["tokens"]]
    events = sse_events(post(worker, "/v1/completions", dict(body, logprobs=1, stream=True)))
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [t for s in streamed for t in s["top_logprobs"]] == lp["top_logprobs"]
    # echo: each prompt token is in its own top dict too (they are rarely the best)
    scored = post(
        worker,
        "/v1/completions",
        {"prompt": "The sky is blue today", "max_tokens": 0, "echo": True, "logprobs": 1},
    ).json()["choices"][0]["logprobs"]
    _assert_top_has_own_token(scored, 1)
    echoed = post(worker, "/v1/completions", dict(body, logprobs=1, echo=True)).json()
    _assert_top_has_own_token(echoed["choices"][0]["logprobs"], 1)


def test_chat_logprobs_and_generate_logprobs(worker):
    r = post(
        worker,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert (
        body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    )
    assert len(content) == body["usage"]["completion_tokens"] == 3
    assert all(
        len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content
    )

    r = post(
        worker,
        "/generate",
        {
            "input_ids": [5, 6, 7, 8, 9],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 2,
        },
    )
    meta = r.json()["meta_info"]
    assert (
        len(r.json()["output_ids"]) == meta["completion_tokens"] == 3 and meta["prompt_tokens"] == 5
    )
    assert [row[1] for row in meta["input_token_logprobs"]] == [6, 7, 8, 9]
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    r = post(
        worker,
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    )
    assert (
        r.json()["meta_info"]["input_token_logprobs"][0][0] is None
    )  # nothing predicts the first token


def test_n_samples_follow_seed_plus_index(worker):
    """Sample i of an n-sample request with seed s is the n=1 request with seed s + i
    (SamplingParams.fan_out), so the router can split/merge consistently."""
    base = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 1.0,
        "return_token_ids": True,
    }
    many = post(worker, "/v1/completions", dict(base, n=3, seed=11)).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    for i in range(3):
        one = post(worker, "/v1/completions", dict(base, seed=11 + i)).json()["choices"][0]
        assert one["token_ids"] == many["choices"][i]["token_ids"]
    assert many["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in many["choices"])


def test_streaming_equals_non_streaming(worker):
    base = {"prompt": "The weather today", "max_tokens": 7, "temperature": 0, "logprobs": 1}
    full = post(worker, "/v1/completions", base).json()
    r = post(
        worker, "/v1/completions", dict(base, stream=True, stream_options={"include_usage": True})
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    lps = [x for c in chunks if c["choices"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == pytest.approx(full["choices"][0]["logprobs"]["token_logprobs"])
    assert (
        chunks[-1]["usage"] == full["usage"]
        and chunks[-2]["choices"][0]["finish_reason"] == "length"
    )

    chat = {
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    full = post(worker, "/v1/chat/completions", chat).json()
    chunks = sse_events(post(worker, "/v1/chat/completions", dict(chat, stream=True)))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        == full["choices"][0]["message"]["content"]
    )
    gen = sse_events(
        post(
            worker,
            "/generate",
            {
                "text": "abc",
                "stream": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            },
        )
    )
    assert (
        len(gen[-1]["output_ids"]) == 4
        and gen[-1]["meta_info"]["finish_reason"]["type"] == "length"
    )


def test_stop_strings_and_stop_token_ids(worker):
    base = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    free = post(worker, "/v1/completions", base).json()["choices"][0]
    ids = free["token_ids"]
    k = next(
        i for i in range(1, len(ids)) if ids[i] not in ids[:i]
    )  # first new token after the first
    stopped = post(worker, "/v1/completions", dict(base, stop_token_ids=[ids[k]])).json()[
        "choices"
    ][0]
    assert stopped["token_ids"] == ids[: k + 1] and stopped["finish_reason"] == "stop"
    word = free["text"].split()[1] if len(free["text"].split()) > 1 else free["text"][1:3]
    by_string = post(worker, "/v1/completions", dict(base, stop=[word])).json()["choices"][0]
    assert word not in by_string["text"] and by_string["finish_reason"] == "stop"


BAD_BODIES = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (b'"text"', 400),
    ({"prompt": "x", "max_tokens": -1}, 400),
    ({"prompt": "x", "max_tokens": 10**12}, 400),
    ({"prompt": "x", "max_tokens": "many"}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": []}, 400),
    ({"prompt": "x", "temperature": -1.0}, 400),
    ({"prompt": "x", "top_p": 0}, 400),
    ({"prompt": "x", "n": 0}, 400),
    ({"prompt": "x", "logprobs": 50}, 400),
    ({"prompt": [10**9]}, 400),
    ({"prompt": "x", "model": "no-such-model"}, 404),
    ({"prompt": "x", "presence_penalty": 2.5}, 400),
    ({"prompt": "x", "frequency_penalty": "1"}, 400),
    ({"prompt": "x", "repetition_penalty": 0}, 400),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400),
    ({"prompt": "x", "logit_bias": {str(10**7): 1}}, 400),
    ({"prompt": "x", "logit_bias": [1, 2]}, 400),
    ({"prompt": "x", "suffix": "the end"}, 400),
    ({"prompt": "x", "best_of": 3}, 400),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, 400),
    ({"prompt": "x " * 5000, "max_tokens": 1}, 400),
    ({"prompt": "x", "bootstrap_room": -1}, 400),
    ({"prompt": "x", "bootstrap_room": 2**63}, 400),
    ({"prompt": "x", "bootstrap_port": "p"}, 400),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400),
    ({"prompt": "x", "stop": [""]}, 400),
]


@pytest.mark.parametrize("body,status", BAD_BODIES, ids=[str(b)[:40] for b, _ in BAD_BODIES])
def test_bad_completion_input_is_4xx_json(worker, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        worker.url + "/v1/completions",
        timeout=30.0,
        headers={"content-type": "application/json"},
        **kw,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error", err  # 404 model_not_found too, as OpenAI
    # OpenAI's code: a string where it names one, else null
    code = "context_length_exceeded" if "context limit" in err["message"] else None
    assert err["code"] == ("model_not_found" if status == 404 else code), err


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_400_naming_it(worker, stream):
    # OpenAI and vLLM refuse it too; stream_options null is fine
    extra = {} if stream is None else {"stream": stream}
    opts = {"stream_options": {"include_usage": True}, **extra}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", chat),
    ):
        r = post(worker, path, dict(body, **opts))
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "stream_options" and err["type"] == "invalid_request_error", err
        assert err["message"] == "stream_options is only allowed when stream is true"
        assert post(worker, path, dict(body, stream_options=None, **extra)).status_code == 200
        streamed = sse_events(post(worker, path, {**body, **opts, "stream": True}))
        assert streamed[-1]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "prompt,message",
    [
        (["ok", 5], "prompt[1]: must be a string like the others (prompt is a list of strings)"),
        (
            ["ok", [1, 2]],
            "prompt[1]: must be a string like the others (prompt is a list of strings)",
        ),
        ([[1, 2], [3, "a"]], "prompt[1][1]: must be a token id (an integer)"),
        (
            [[1, 2], 5],
            "prompt[1]: must be a list of token ids like the others "
            "(prompt is a list of token-id lists)",
        ),
        (
            [1, "a"],
            "prompt[1]: must be a token id (an integer) like the others "
            "(prompt is a list of token ids)",
        ),
        (
            5,
            "prompt must be a string, a list of token ids, a list of strings or a list of "
            "token-id lists",
        ),
    ],
)
def test_a_bad_batch_element_is_one_clear_400_naming_its_index(worker, prompt, message):
    r = post(worker, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == message and err["param"] == "prompt", err


def test_an_over_long_batch_element_is_named_by_its_index(worker):
    n = worker.get_info()["max_model_len"]
    r = post(worker, "/v1/completions", {"prompt": [[5, 6], [7] * n, [8]], "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("prompt[1]: this model's context limit is"), err
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
    r = post(worker, "/v1/completions", {"prompt": [[5, 6], [7, 10**9]], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[1]: "), r.text
    assert_all_healthy([worker])


def test_bad_chat_and_generate_input(worker):
    cases = [
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "x"}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        ),
        ("/generate", {}),
        ("/generate", {"text": "a", "input_ids": [1]}),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}}),
        ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}),
        ("/generate", {"text": "a", "sampling_params": {"presence_penalty": 9}}),
        ("/generate", {"text": "a", "sampling_params": {"logit_bias": {"1": "x"}}}),
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}),
        ("/detokenize", {"tokens": [10**9]}),
        ("/detokenize", {"tokens": "abc"}),
    ]
    for path, body in cases:
        r = post(worker, path, body)
        assert r.status_code == 400 and "error" in r.json(), (path, body, r.text)
    r = httpx.post(
        worker.url + "/v1/completions",
        content=b'{"prompt": "\xff\xfe"}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and "error" in r.json()
    assert_all_healthy([worker])


def _engine(worker: Proc) -> dict:
    return worker.get_info()


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_and_frees_pages(worker, stream):
    baseline = _engine(worker)["num_total_pages"]
    body = {
        "prompt": "go on",
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    with httpx.Client(timeout=60) as client:
        if stream:
            with client.stream("POST", worker.url + "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    break  # first chunk seen: request is running; leaving closes the connection
        else:

            def cancel_once_running():  # leave once the engine runs the request
                wait_for(lambda: _engine(worker)["engine"]["num_running"] >= 1, 60, "it to run")
                client.close()

            threading.Thread(target=cancel_once_running, daemon=True).start()
            with pytest.raises(httpx.HTTPError):
                client.post(worker.url + "/v1/completions", json=body)
    wait_for(
        lambda: (
            _engine(worker)["engine"]["num_running"] == 0
            and _engine(worker)["num_free_pages"] == baseline
        ),
        30,
        "the aborted request to release its pages",
    )
    generated = _engine(worker)["engine"]["generation_tokens"]
    # Nothing is still decoding: a probe request runs through the engine after the abort,
    # and the token counter then moved by exactly the probe's tokens.
    probe = post(worker, "/v1/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    n = probe.json()["usage"]["completion_tokens"]
    wait_for(
        lambda: _engine(worker)["engine"]["generation_tokens"] >= generated + n,
        30,
        "the probe's tokens to be counted",
    )
    assert _engine(worker)["engine"]["generation_tokens"] == generated + n


def test_health_metrics_models_and_pd_fields_ignored(worker):
    assert httpx.get(worker.url + "/health_generate", timeout=30).status_code == 200
    models = httpx.get(worker.url + "/v1/models").json()
    assert models["data"][0]["id"] == "random:tiny"
    r = post(
        worker,
        "/v1/completions",
        {
            "prompt": "x",
            "max_tokens": 2,
            "bootstrap_host": "h",
            "bootstrap_port": 1234,
            "bootstrap_room": 7,
        },
    )
    assert r.status_code == 200  # a mixed worker ignores the PD fields
    text = httpx.get(worker.url + "/metrics").text
    for name in (
        "pdserve_requests_total",
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_prompt_tokens_total",
        "pdserve_generation_tokens_total",
        "pdserve_engine_num_running",
        "pdserve_engine_num_waiting",
        "pdserve_engine_num_free_pages",
        "pdserve_request_latency_seconds_bucket",
    ):
        assert name in text, name
    info = worker.get_info()
    assert (
        info["role"] == "mixed"
        and info["layout"]["page_size"] == 16
        and info["bootstrap_port"] is None
    )


def test_huge_prompt_is_rejected_fast_and_huge_body_gets_413(worker):
    max_len = worker.get_info()["max_model_len"]
    r = post(
        worker, "/v1/completions", {"prompt": "hello world " * 1_500_000, "max_tokens": 1}
    )  # 18 MB
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    message = r.json()["error"]["message"]
    # not tokenized: the character bound rejects it first (its message, not the token
    # count's "the request needs N" one)
    assert "characters long" in message and f"context limit of {max_len} tokens" in message
    r = post(
        worker,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi " * 4_000_000}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    r = httpx.post(
        worker.url + "/generate", content=b'{"text": "' + b"a" * (33 * 2**20) + b'"}', timeout=30
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text[:300]
    assert_all_healthy([worker])


def test_lone_surrogate_is_400_naming_the_field(worker):
    cases = [
        ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 1}', "prompt"),
        ("/generate", b'{"text": "\\udfff"}', "text"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "ok"}, '
            b'{"role": "user", "content": "x\\ud800"}]}',
            "messages[1].content",
        ),
    ]
    for path, content, field in cases:
        r = httpx.post(
            worker.url + path,
            content=content,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text)
    assert_all_healthy([worker])


def test_unknown_fields_are_ignored_with_a_warning_and_counted(worker):
    base = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    want = post(worker, "/v1/completions", base).json()["choices"][0]["text"]
    noop = dict(
        base,
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=True,
        reasoning_effort="low",
    )
    r = post(worker, "/v1/completions", noop)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    odd = dict(
        base,
        some_new_option=1,
        stream=True,
        stream_options={"include_usage": True, "x_future": 2},
    )
    events = sse_events(post(worker, "/v1/completions", odd))
    assert "".join(ch["text"] for e in events for ch in e["choices"]) == want
    r = post(
        worker, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
    )
    assert r.status_code == 200, r.text
    metrics = httpx.get(worker.url + "/metrics").text
    for field in ("some_new_option", "stream_options.x_future", "sampling_params.bogus"):
        assert f'pdserve_ignored_request_fields_total{{field="{field}"}} 1.0' in metrics, field
    assert 'field="user"' not in metrics and 'field="metadata"' not in metrics
    log = worker.log_path.read_text()
    assert "ignoring unknown request fields: some_new_option, stream_options.x_future" in log


def test_tokenize_detokenize_version_and_models(worker):
    r = post(worker, "/tokenize", {"prompt": "Hello there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == worker.get_info()["max_model_len"]
    comp = post(
        worker,
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert body["tokens"] == comp["choices"][0]["prompt_token_ids"]
    back = post(worker, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello there"}
    msgs = [{"role": "user", "content": "Hi!"}]
    chat = post(worker, "/tokenize", {"messages": msgs}).json()
    chat_comp = post(
        worker,
        "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert chat["tokens"] == chat_comp["choices"][0]["prompt_token_ids"]
    assert chat["token_strs"] is None
    assert httpx.get(worker.url + "/version").json()["version"] == worker.get_info()["version"]
    model = httpx.get(worker.url + "/v1/models").json()["data"][0]
    assert model["max_model_len"] == worker.get_info()["max_model_len"]
