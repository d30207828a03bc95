"""A real mixed worker (``pdserve serve``, tiny random model) over HTTP, as a fresh user's
official ``openai`` client and curl reach it: an explicit JSON ``null`` for an optional
field means its default (chat, completions, /generate), integer fields take integral
floats (``2.0``) and reject fractional ones, ``GET /v1/models/{id}`` serves OpenAI's model
object, 400s name the field as their message does (``stop``, ``messages[0].role``), and
the 413 is rendered like every other error body."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from http_calls import post

from pdserve_procs import assert_all_healthy

pytestmark = pytest.mark.timeout(300)

PROMPT = "one two three four"
MESSAGES = [{"role": "user", "content": "Say something"}]

# every optional field the trial found rejected as null (chat: these + logprobs; the
# completions endpoint: these + echo)
NULLABLE = (
    "temperature",
    "top_p",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "return_token_ids",
)


def _client(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="x", max_retries=0)


def test_null_optional_fields_mean_their_defaults_through_the_openai_client(worker):
    client = _client(worker)
    nulls = {name: None for name in NULLABLE if name not in ("temperature", "top_p", "n")}
    kw = dict(model=worker.get_info()["served_model_name"], seed=11, max_tokens=6)
    chat = client.chat.completions.create(
        messages=MESSAGES,
        temperature=None,
        top_p=None,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
        stream=None,
        extra_body={k: v for k, v in nulls.items() if k not in ("presence_penalty", "stream")},
        **kw,
    )
    plain = client.chat.completions.create(messages=MESSAGES, **kw)
    # seeded sampling at the defaults (temperature 1, top_p 1): the same tokens
    assert chat.choices[0].message.content == plain.choices[0].message.content
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    done = client.completions.create(
        prompt=PROMPT,
        temperature=None,
        top_p=None,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        echo=None,
        logprobs=None,
        stream=None,
        extra_body={k: v for k, v in nulls.items() if k not in ("presence_penalty", "stream")},
        **kw,
    )
    assert done.choices[0].text == client.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert not done.choices[0].text.startswith(PROMPT)  # echo null = false
    assert_all_healthy([worker])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_null_field_is_accepted_by_curl(worker, path):
    base = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": PROMPT}
    nulls = dict.fromkeys(NULLABLE)
    nulls.update(logprobs=None, stream_options=None, stop=None, seed=None, max_tokens=None)
    if path == "/v1/completions":
        nulls.update(echo=None, best_of=None, suffix=None, prompt_logprobs=None)
    else:
        nulls.update(top_logprobs=None, max_completion_tokens=None, add_generation_prompt=None)
        nulls.update(tools=None, tool_choice=None, response_format=None)
    r = post(worker, path, {**base, **nulls, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_null_max_tokens_is_the_endpoints_default(worker):
    # /v1/completions: 16, OpenAI's default (it used to run to the context limit)
    r = post(worker, "/v1/completions", {"prompt": PROMPT, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text[:300]
    # chat: as omitted (to the context limit), so the same answer as without the field
    body = {"messages": MESSAGES, "temperature": 0, "ignore_eos": True}
    null = post(worker, "/v1/chat/completions", {**body, "max_tokens": None}).json()
    omitted = post(worker, "/v1/chat/completions", body).json()
    assert null["usage"] == omitted["usage"] and null["choices"][0]["finish_reason"] == "length"
    # /generate: sampling_params null, and its fields null, are their defaults (128 tokens)
    r = post(
        worker,
        "/generate",
        {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": None,
                "temperature": None,
                "ignore_eos": True,
                "n": None,
                "top_k": None,
            },
            "return_logprob": None,
            "top_logprobs_num": None,
            "logprob_start_len": None,
            "stream": None,
        },
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 128, r.text
    r = post(worker, "/generate", {"text": PROMPT, "sampling_params": None})
    assert r.status_code == 200, r.text


def test_a_required_field_given_as_null_is_still_a_400(worker):
    for path, body, param in [
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/chat/completions", {"messages": None}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": None, "content": "x"}]}, None),
    ]:
        r = post(worker, path, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == (param or "messages[0].role"), r.text


def test_integral_floats_are_integers_and_fractions_a_clear_400(worker):
    ints = {"max_tokens": 2, "n": 2, "seed": 5, "logprobs": 1, "top_k": 3, "min_tokens": 1}
    body = {"prompt": PROMPT, "ignore_eos": True}
    r = post(worker, "/v1/completions", {**body, **{k: float(v) for k, v in ints.items()}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 4
    as_ints = post(worker, "/v1/completions", {**body, **ints}).json()
    assert r.json()["choices"] == as_ints["choices"]  # seeded: the same samples
    r = post(
        worker,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 3.0, "logprobs": True, "top_logprobs": 2.0},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    r = post(worker, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2.0}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 2, r.text
    for body, field in [
        ({"prompt": PROMPT, "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": PROMPT, "n": 1.5}, "n"),
        ({"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
    ]:
        r = post(worker, "/v1/completions", body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field, r.text
        assert err["message"].startswith(f"{field}: "), err
    r = post(worker, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2.5})
    assert r.json()["error"]["message"] == "max_tokens: must be an integer, got 2.5"


def test_models_retrieve_is_openai_s_model_object_and_a_404_for_another_id(worker):
    client = _client(worker)
    name = worker.get_info()["served_model_name"]
    model = client.models.retrieve(name)
    listed = client.models.list().data[0]
    assert (model.id, model.object, model.created) == (name, "model", listed.created)
    assert model.owned_by == listed.owned_by
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    assert missing.value.body["type"] == "invalid_request_error"


def test_400s_name_the_field_as_their_message_does(worker):
    cases = [
        ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "bob", "content": "x"}]}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None),
    ]
    for path, body, param in cases:
        r = post(worker, path, body)
        err = r.json()["error"]
        param = param or ("messages[0].role" if "bob" in str(body) else "messages[0].content")
        assert r.status_code == 400 and err["param"] == param, (body, err)
        assert err["message"].startswith(param), (body, err)
        assert ".0." not in err["message"] and ".str" not in err["message"], err


def test_the_413_is_rendered_like_every_other_error(worker):
    r = httpx.post(
        worker.url + "/generate", content=b'{"text": "' + b"a" * (33 * 2**20) + b'"}', timeout=60
    )
    bad = post(worker, "/v1/completions", {"prompt": PROMPT, "n": 0})
    assert r.status_code == 413 and bad.status_code == 400
    for resp in (r, bad):  # starlette's JSONResponse: compact separators
        err = resp.json()["error"]
        assert resp.content == json.dumps(resp.json(), separators=(",", ":")).encode()
        assert set(err) == {"message", "type", "param", "code"}
    assert r.json()["error"]["type"] == "invalid_request_error", r.text


def test_responses_errors_name_the_responses_fields(worker):
    """The Responses API runs on the chat path: its errors name max_output_tokens and
    text.format, not chat's max_tokens and response_format."""
    r = post(worker, "/v1/responses", {"input": "hi", "max_output_tokens": 10**30})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_output_tokens", err
    assert "max_tokens" not in err["message"], err
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}
    r = post(worker, "/v1/responses", {"input": "hi", "text": fmt})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "text.format.schema", err
    assert "response_format" not in err["message"], err


def test_a_null_for_a_union_field_names_the_field_not_pydantic_s_members(worker):
    for path, body in [
        ("/v1/responses", {"input": None}),
        ("/v1/completions", {"prompt": None}),
    ]:
        r = post(worker, path, body)
        err = r.json()["error"]
        field = next(iter(body))
        assert r.status_code == 400 and err["param"] == field, (body, err)
        assert f"{field}." not in err["message"], (body, err)


def test_a_bad_query_parameter_is_named_as_is(worker):
    r = post(worker, "/v1/responses", {"input": "hi", "max_output_tokens": 1})
    rid = r.json()["id"]
    r = httpx.get(f"{worker.url}/v1/responses/{rid}/input_items?limit=1000", timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "limit", err


def test_a_seed_outside_int64_is_a_400_naming_seed(worker):
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT, "seed": 2**64}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2**63}),
        ("/v1/responses", {"input": "hi", "seed": -(2**63) - 1}),
        ("/generate", {"text": PROMPT, "sampling_params": {"seed": 2**64}}),
    ]:
        r = post(worker, path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] in ("seed", "sampling_params.seed"), (path, err)
    ok = post(worker, "/v1/completions", {"prompt": PROMPT, "seed": 2**63 - 1, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
