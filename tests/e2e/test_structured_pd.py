"""Structured outputs and tools through PD (prefill + decode + router, KV over real NIXL on
CPU) against a mixed worker on the same tiny model: the same tokens, text, logprobs,
finish_reason, usage, and every finished output valid for its constraint (``jsonschema``),
greedy and seeded-sampled; tool calls forced by tool_choice parse into message.tool_calls
(also streamed as tool_calls deltas); bad schemas/regexes are a 400 naming the field; the
official openai client's ``parse`` helper returns a parsed pydantic object via the router."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_pd_parity import assert_same

from pdserve_procs import assert_all_healthy

pytestmark = pytest.mark.timeout(600)

# Bounded (maxLength, maximum, maxItems) so a random model's output ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rain": {"type": "boolean"},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "rain", "temp", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(shared_pd):
    """The PD + mixed deployment these tests share with other files (tests/e2e/conftest.py)."""
    return shared_pd


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=300.0)


def pair(c, path, body):
    pd, mixed = post(c["router"].url, path, body), post(c["mixed"].url, path, body)
    assert pd.status_code == 200, pd.text
    assert mixed.status_code == 200, mixed.text
    return pd.json(), mixed.json()


def chat(temperature=0.0, **kw):
    return {
        "messages": USER,
        "temperature": temperature,
        "seed": 5,
        "max_tokens": 60,
        "logprobs": True,
        "top_logprobs": 2,
        **kw,
    }


def json_schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": strict}}


# name -> (path, body, check(text) for a finished output)
CASES = {
    "response_format_json_schema": (
        "/v1/chat/completions",
        chat(response_format=json_schema_format(SCHEMA)),
        lambda t: jsonschema.validate(json.loads(t), SCHEMA),
    ),
    "response_format_json_object": (
        "/v1/chat/completions",
        chat(response_format={"type": "json_object"}, max_tokens=24),
        lambda t: isinstance(json.loads(t), dict) or pytest.fail(t),
    ),
    "guided_regex": (
        "/v1/completions",
        {
            "prompt": "My email is",
            "temperature": 0.0,
            "max_tokens": 30,
            "logprobs": 2,
            "guided_regex": r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)",
        },
        lambda t: re.fullmatch(r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)", t) or pytest.fail(t),
    ),
    "guided_choice_sampled": (
        "/v1/completions",
        {
            "prompt": "The sky is",
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 8,
            "guided_choice": ["blue", "grey", "dark"],
        },
        lambda t: t in ("blue", "grey", "dark") or pytest.fail(t),
    ),
    "guided_json_sampled": (
        "/v1/chat/completions",
        chat(temperature=0.9, guided_json=SCHEMA),
        lambda t: jsonschema.validate(json.loads(t), SCHEMA),
    ),
    "guided_grammar": (
        "/v1/completions",
        {
            "prompt": "Sum:",
            "temperature": 0.0,
            "max_tokens": 20,
            "guided_grammar": 'root ::= [0-9] [0-9]? " + " [0-9] [0-9]?',
        },
        lambda t: re.fullmatch(r"\d\d? \+ \d\d?", t) or pytest.fail(t),
    ),
    "generate_json_schema": (
        "/generate",
        {
            "text": "Weather:",
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": 60,
                "json_schema": json.dumps(SCHEMA),
            },
            "return_logprob": True,
        },
        lambda t: jsonschema.validate(json.loads(t), SCHEMA),
    ),
    "generate_regex_sampled": (
        "/generate",
        {
            "text": "Code:",
            "sampling_params": {
                "temperature": 0.8,
                "seed": 9,
                "max_new_tokens": 20,
                "regex": "[A-Z]{2}-[0-9]{4}",
            },
        },
        lambda t: re.fullmatch("[A-Z]{2}-[0-9]{4}", t) or pytest.fail(t),
    ),
}


def _text_and_reason(path, body):
    if path == "/generate":
        return body["text"], body["meta_info"]["finish_reason"]["type"]
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"]


@pytest.mark.parametrize("case", list(CASES))
def test_structured_output_pd_equals_mixed_and_is_valid(cluster, case):
    path, body, check = CASES[case]
    pd, mixed = pair(cluster, path, body)
    assert_same(pd, mixed)
    text, reason = _text_and_reason(path, mixed)
    if case == "response_format_json_object" and reason == "length":
        assert text.startswith("{")  # a random model may write one string until max_tokens
    else:
        assert reason == "stop", text
        check(text)


def test_max_tokens_cut_is_length(cluster):
    pd, mixed = pair(
        cluster,
        "/v1/chat/completions",
        chat(response_format=json_schema_format(SCHEMA), max_tokens=4),
    )
    assert_same(pd, mixed)
    choice = mixed["choices"][0]
    assert choice["finish_reason"] == "length" and mixed["usage"]["completion_tokens"] == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_tool_choice_is_a_valid_call(cluster, temperature):
    body = chat(
        temperature,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    pd, mixed = pair(cluster, "/v1/chat/completions", body)
    assert_same(pd, mixed)
    choice = mixed["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_required_tool_choice_calls_a_given_function(cluster):
    body = chat(
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=80
    )
    pd, mixed = pair(cluster, "/v1/chat/completions", body)
    assert_same(pd, mixed)
    choice = mixed["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


def test_tool_conversation_is_accepted_and_auto_equals_mixed(cluster):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    body = {"messages": messages, "tools": [WEATHER], "temperature": 0.0, "max_tokens": 12}
    pd, mixed = pair(cluster, "/v1/chat/completions", body)
    assert_same(pd, mixed)
    assert mixed["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def _stream(url, body):
    chunks = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=300.0
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_streamed_named_tool_call_is_tool_call_deltas(cluster):
    body = chat(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    got = {}
    for name in ("router", "mixed"):
        chunks = _stream(cluster[name].url, body)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert all("content" not in d or not d["content"] for d in deltas)
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
        args = "".join(tc["function"].get("arguments", "") for tc in calls)
        jsonschema.validate(json.loads(args), SCHEMA)
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        got[name] = args
    assert got["router"] == got["mixed"]


def test_streamed_required_tool_call_sends_no_empty_chunks(cluster):
    """A required (or auto) call is held back until it is whole: the tokens held send no
    chunk (they sent one empty ``delta`` each before), then the call comes, finished."""
    body = chat(tools=[WEATHER], tool_choice="required", logprobs=False)
    del body["top_logprobs"]  # (with logprobs each token's chunk carries its logprobs)
    for name in ("mixed", "router"):
        chunks = [c for c in _stream(cluster[name].url, body) if c["choices"]]
        opening, rest = chunks[0], chunks[1:]
        assert opening["choices"][0]["delta"]["role"] == "assistant"
        shown = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in rest]
        assert rest and all(delta or reason for delta, reason in shown), (name, shown)
        calls = [tc for c in rest for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        assert calls and calls[0]["function"]["name"] == "get_weather", rest
        assert rest[-1]["choices"][0]["finish_reason"] == "tool_calls", rest


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            chat(response_format=json_schema_format({"type": "objectx"})),
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", {"prompt": "x", "guided_regex": "(a"}, "guided_regex"),
        (
            "/generate",
            {
                "text": "x",
                "sampling_params": {"json_schema": '{"type": "object", "required": "a"}'},
            },
            "sampling_params.json_schema",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
        ),
        (
            "/v1/chat/completions",
            chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
    ],
)
def test_invalid_constraint_is_400_naming_the_field(cluster, path, body, param):
    for name in ("router", "mixed"):
        r = post(cluster[name].url, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=10)
    rain: bool
    unit: Literal["C", "F"]


def test_openai_parse_helper_returns_the_object(cluster):
    client = openai.OpenAI(base_url=cluster["router"].url + "/v1", api_key="none")
    completion = client.chat.completions.parse(
        model="random:tiny",
        messages=USER,
        response_format=Weather,
        temperature=0.0,
        max_tokens=60,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather), completion
    assert completion.choices[0].finish_reason == "stop"


def test_all_healthy_and_pages_back(cluster):
    assert_all_healthy(cluster["procs"])
    for p in (cluster["prefill"], cluster["decode"]):
        assert p.get_info()["num_free_pages"] == cluster["baseline"][p.name]
