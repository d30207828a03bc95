"""A real mixed worker (``pdserve serve``, tiny random model) over HTTP: bad input is a 4xx
with an OpenAI error body naming the field (completions, batches, chat, /generate,
/tokenize, huge prompts and bodies, lone surrogates) and the worker keeps serving; unknown
fields are ignored with a warning and counted."""

from __future__ import annotations

import httpx
import pytest
from http_calls import post, sse_events

from pdserve_procs import assert_all_healthy

pytestmark = pytest.mark.timeout(300)


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
    ({"prompt": "x", "stop_token_ids": [10**7]}, 400),
    ({"prompt": "x", "suffix": "the end"}, 400),
    ({"prompt": "x", "best_of": 3}, 400),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, 400),
    ({"prompt": "x " * 5000, "max_tokens": 1}, 400),
    ({"prompt": "x", "bootstrap_room": -1}, 400),
    ({"prompt": "x", "bootstrap_room": 2**63}, 400),
    ({"prompt": "x", "bootstrap_port": "p"}, 400),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400),
    ({"prompt": "x", "stop": [""]}, 400),
    ({"prompt": "x", "seed": 2**64}, 400),
    ({"prompt": "x", "seed": -(2**63) - 1}, 400),
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
    # param: the place the message names (prompt[1], prompt[1][0]), else prompt
    where = message.split(":")[0] if message.startswith("prompt[") else "prompt"
    assert err["message"] == message and err["param"] == where, err


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
    err = r.json()["error"]
    assert r.status_code == 413 and err["type"] == "invalid_request_error", r.text[:300]
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


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1", b"-1e-9"])
@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": %b}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": %b}',
        ),
        ("/v1/responses", b'{"input": "hi", "max_output_tokens": 2, "temperature": %b}'),
        ("/generate", b'{"text": "hi", "sampling_params": {"temperature": %b}}'),
    ],
)
def test_a_temperature_not_finite_or_negative_is_400_naming_it(worker, path, body, value):
    r = httpx.post(
        worker.url + path,
        content=body % value,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    param = "sampling_params.temperature" if path == "/generate" else "temperature"
    assert r.json()["error"]["param"] == param, r.text


def test_any_finite_temperature_is_served(worker):
    """No upper bound (SGLang's rule; OpenAI's and vLLM's is 2): a temperature fp32 cannot
    hold (1e308) samples every allowed token alike, a tiny one (1e-300, 0 in fp32) is the
    argmax; neither turns the row into NaN (which drew token 0, or failed a grammar)."""
    base = {"prompt": "Hello there", "max_tokens": 6, "min_tokens": 6, "return_token_ids": True}

    def tokens(temperature, seed=3):
        r = post(worker, "/v1/completions", {**base, "temperature": temperature, "seed": seed})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    greedy = tokens(0.0)
    assert tokens(1e-300) == tokens(1e-40) == greedy
    assert tokens(5.0) == tokens(5.0)  # > 2 accepted, seeded as any other
    wild = [tokens(t, seed) for t in (1e308, 1e39) for seed in (1, 2)]
    assert all(len(set(ids)) > 1 for ids in wild), wild  # not one id over and over (NaN's 0)
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "response_format": {"type": "json_object"},
    }
    for temperature in (1e308, 1e-300):
        r = post(worker, "/v1/chat/completions", {**chat, "temperature": temperature, "seed": 1})
        assert r.status_code == 200, r.text  # the grammar's masked tokens stay masked
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
