"""OpenAI's Responses API with the official ``openai`` client, through a PD router
(prefill + decode, KV over real NIXL on CPU) against a mixed worker on the same tiny
random model, greedy: plain and streamed (the ``responses.stream`` helper), instructions,
a function tool with tool_choice required, text.format json_schema parsed by
``responses.parse``, a two-turn conversation via previous_response_id (equal to the same
conversation sent in full), stored responses read back, the store's bound, and bad input
as a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pdserve_procs import assert_all_healthy, pd_and_mixed

pytestmark = pytest.mark.timeout(600)

STORE = 6  # every worker's --responses-store-size
MODEL = "random:tiny"
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "description": "Time",
    "parameters": TIME_PARAMS,
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    rain: bool
    temp: int = pydantic.Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pd_and_mixed(
        tmp_path_factory.mktemp("responses-logs"),
        worker_extra=["--responses-store-size", str(STORE), "--num-threads", "1"],
    ) as procs:
        yield procs
        assert_all_healthy(procs["procs"])


def clients(c):
    return (
        openai.OpenAI(base_url=c["router"].url + "/v1", api_key="x", max_retries=0),
        openai.OpenAI(base_url=c["mixed"].url + "/v1", api_key="x", max_retries=0),
    )


BASE = {"model": MODEL, "temperature": 0.0, "max_output_tokens": 12}


def test_plain_equals_mixed_and_chat(cluster):
    pd, mixed = clients(cluster)
    kw = dict(BASE, input="Name three colours.", instructions="Answer briefly.")
    a, b = pd.responses.create(**kw), mixed.responses.create(**kw)
    assert a.output_text == b.output_text and a.output_text
    assert (
        a.id.startswith("resp_") and a.object == "response" and a.instructions == kw["instructions"]
    )
    assert (a.status, a.usage.input_tokens, a.usage.output_tokens) == (
        b.status,
        b.usage.input_tokens,
        b.usage.output_tokens,
    )
    assert a.usage.output_tokens == 12 and a.status == "incomplete"  # cut by max_output_tokens
    assert a.incomplete_details.reason == "max_output_tokens"
    # the translation: instructions = a system message, input = the user's
    chat = mixed.chat.completions.create(
        model=MODEL,
        temperature=0.0,
        max_tokens=12,
        messages=[
            {"role": "system", "content": kw["instructions"]},
            {"role": "user", "content": kw["input"]},
        ],
    )
    assert chat.choices[0].message.content == a.output_text
    assert chat.usage.prompt_tokens == a.usage.input_tokens
    # temperature / top_p reach the sampler: seeded sampling agrees PD vs mixed, differs greedy
    sampled = dict(kw, temperature=1.5, top_p=0.9)
    s1 = httpx.post(
        cluster["router"].url + "/v1/responses", json=dict(sampled, seed=7), timeout=120
    )
    s2 = httpx.post(cluster["mixed"].url + "/v1/responses", json=dict(sampled, seed=7), timeout=120)
    t1 = s1.json()["output"][0]["content"][0]["text"]
    assert t1 == s2.json()["output"][0]["content"][0]["text"]
    assert s1.json()["temperature"] == 1.5 and s1.json()["top_p"] == 0.9


def test_streamed_with_helper(cluster):
    pd, mixed = clients(cluster)
    kw = dict(BASE, input="Tell me a story.", instructions="Be brief.")
    plain = mixed.responses.create(**kw)
    for client in (pd, mixed):
        kinds, deltas = [], []
        with client.responses.stream(**kw) as stream:
            for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = stream.get_final_response()
        assert final.output_text == plain.output_text == "".join(deltas)
        # (cached_tokens: each worker's own prefix-cache hit, which differs)
        assert (final.usage.input_tokens, final.usage.output_tokens) == (
            plain.usage.input_tokens,
            plain.usage.output_tokens,
        )
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        # a streamed response is stored too
        assert client.responses.retrieve(final.id).output_text == plain.output_text


def test_function_tool_required(cluster):
    pd, mixed = clients(cluster)
    kw = dict(
        BASE,
        input="What time is it?",
        tools=[TIME_TOOL],
        tool_choice="required",
        max_output_tokens=60,
    )
    a, b = pd.responses.create(**kw), mixed.responses.create(**kw)
    calls = [o for o in a.output if o.type == "function_call"]
    assert a.status == "completed", a.output
    assert calls and calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), TIME_PARAMS)
    assert [(o.name, o.arguments) for o in calls] == [
        (o.name, o.arguments) for o in b.output if o.type == "function_call"
    ]
    # named function choice, streamed: argument deltas add up to the arguments
    named = dict(kw, tool_choice={"type": "function", "name": "get_time"})
    with pd.responses.stream(**named) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_time"
    assert "".join(deltas) == call.arguments
    assert call.arguments == mixed.responses.create(**named).output[0].arguments
    # the tool's answer as a function_call_output item continues the conversation
    follow = dict(
        BASE,
        input=[
            {"role": "user", "content": "What time is it?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": "get_time",
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"},
        ],
        tools=[TIME_TOOL],
        tool_choice="none",
    )
    assert pd.responses.create(**follow).output_text == mixed.responses.create(**follow).output_text


def test_parse_json_schema(cluster):
    pd, mixed = clients(cluster)
    kw = dict(BASE, input="Weather in Paris?", text_format=City, max_output_tokens=80)
    a, b = pd.responses.parse(**kw), mixed.responses.parse(**kw)
    assert isinstance(a.output_parsed, City)
    assert a.output_parsed == b.output_parsed
    assert a.text.format.type == "json_schema"


def test_previous_response_id(cluster):
    pd, mixed = clients(cluster)
    first_kw = dict(BASE, input="Hi, I am Ann.", instructions="Be kind.")
    answers = {}
    for name, client in (("pd", pd), ("mixed", mixed)):
        first = client.responses.create(**first_kw)
        second = client.responses.create(
            **BASE, input="What is my name?", previous_response_id=first.id
        )
        assert second.previous_response_id == first.id
        answers[name] = (first, second)
        # the stored conversation, oldest first: both inputs and the first answer
        items = list(client.responses.input_items.list(second.id, order="asc"))
        assert [i.role for i in items] == ["user", "assistant", "user"]
        assert client.responses.retrieve(second.id).output_text == second.output_text
    assert answers["pd"][1].output_text == answers["mixed"][1].output_text
    # the same conversation sent in full (instructions not carried over, as OpenAI's)
    first = answers["mixed"][0]
    full = mixed.responses.create(
        **BASE,
        input=[
            {"role": "user", "content": "Hi, I am Ann."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
    )
    assert full.output_text == answers["mixed"][1].output_text
    assert full.usage.input_tokens == answers["pd"][1].usage.input_tokens


def _error(resp: httpx.Response, status: int, param: str, *words: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    for word in words:
        assert word in err["message"], err


def test_bad_input(cluster):
    for url in (cluster["router"].url, cluster["mixed"].url):

        def post(body, url=url):
            return httpx.post(url + "/v1/responses", json=dict(model=MODEL, **body), timeout=60)

        _error(post({}), 400, "input", "input")
        _error(
            post({"input": [{"type": "web_search_call", "id": "x"}]}),
            400,
            "input[0].type",
            "web_search_call",
        )
        _error(
            post({"input": "x", "tools": [{"type": "web_search_preview"}]}),
            400,
            "tools[0].type",
            "web_search_preview",
        )
        image = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
        _error(post({"input": [image]}), 400, "input[0].content[0].type", "input_image")
        _error(
            post({"input": "x", "previous_response_id": "resp_unknown"}),
            400,
            "previous_response_id",
            "resp_unknown",
        )
        missing = httpx.get(url + "/v1/responses/resp_unknown", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


def test_store_is_bounded_and_optional(cluster):
    for url in (cluster["router"].url, cluster["mixed"].url):
        ids = []
        for i in range(STORE + 1):
            body = dict(BASE, input=f"Count {i}", max_output_tokens=2)
            ids.append(httpx.post(url + "/v1/responses", json=body, timeout=60).json()["id"])
        assert httpx.get(f"{url}/v1/responses/{ids[0]}", timeout=30).status_code == 404
        for rid in ids[1:]:
            assert httpx.get(f"{url}/v1/responses/{rid}", timeout=30).status_code == 200
        unstored = httpx.post(
            url + "/v1/responses",
            json=dict(BASE, input="x", max_output_tokens=2, store=False),
            timeout=60,
        ).json()
        assert httpx.get(f"{url}/v1/responses/{unstored['id']}", timeout=30).status_code == 404
