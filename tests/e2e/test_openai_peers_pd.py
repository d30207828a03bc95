"""What peer projects' OpenAI-server test suites check, with our own tests, through a PD
router (prefill + decode, KV over real NIXL on CPU) against a mixed worker on the same tiny
random model, greedy.

Responses API with the official ``openai`` client: plain and streamed (the
``responses.stream`` helper), instructions, a function tool with tool_choice required,
text.format json_schema parsed by ``responses.parse``, a two-turn conversation via
previous_response_id (equal to the same conversation sent in full), stored responses read
back, the store's bound, bad input as a 400 naming the field, the output text's logprobs.

Assistant prefill: a continued final message equals ``/v1/completions`` on the rendered
prompt. vLLM's extensions in vLLM's shapes: usage in chunks only with include_usage, chat
prompt_logprobs at the top level, root/parent on model objects, truncate_prompt_tokens."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pdserve_procs import SHARED_PD_STORE, assert_all_healthy

pytestmark = pytest.mark.timeout(600)

STORE = SHARED_PD_STORE  # every worker's --responses-store-size (6)
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
def cluster(shared_pd):
    """The PD + mixed deployment these tests share with other files (tests/e2e/conftest.py;
    its workers' --responses-store-size is ``STORE``)."""
    yield shared_pd
    assert_all_healthy(shared_pd["procs"])


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


def test_output_text_logprobs_through_pd_equal_mixed_and_chat(cluster):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each output
    token's logprob and top alternatives (chat's shape), through PD as on a mixed worker
    and as chat gives them; streamed, the deltas carry their tokens' and the done event
    all of them; with tools it is a 400 naming ``include``."""
    pd, mixed = clients(cluster)
    kw = dict(BASE, input="Name a colour.", include=["message.output_text.logprobs"])
    a = pd.responses.create(**kw, top_logprobs=2)
    b = mixed.responses.create(**kw, top_logprobs=2)
    lp_a, lp_b = a.output[0].content[0].logprobs, b.output[0].content[0].logprobs
    assert len(lp_a) == a.usage.output_tokens == 12 and len(lp_b) == 12
    assert "".join(x.token for x in lp_a) == a.output_text == b.output_text
    for x, y in zip(lp_a, lp_b):
        assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
        assert len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.logprob - 1e-6
    chat = mixed.chat.completions.create(
        model=MODEL,
        temperature=0.0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": kw["input"]}],
    )
    assert [x.token for x in chat.choices[0].logprobs.content] == [x.token for x in lp_b]
    assert not pd.responses.create(**BASE, input="Name a colour.").output[0].content[0].logprobs
    deltas, done = [], None
    with pd.responses.stream(**kw) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas += event.logprobs
            elif event.type == "response.output_text.done":
                done = event.logprobs
        final = stream.get_final_response()
    assert [x.token for x in deltas] == [x.token for x in done] == [x.token for x in lp_a]
    assert [x.token for x in final.output[0].content[0].logprobs] == [x.token for x in lp_a]
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError) as err:
        pd.responses.create(**kw, tools=[tool])
    assert err.value.body["param"] == "include"


def test_cached_tokens_are_prefill_s_through_pd(cluster):
    """A repeated prompt's prefix-cache hit: PD reports the prefill worker's count (merged by
    the router, plain and streamed), the same as the mixed worker's for the same prompt."""
    pd, mixed = clients(cluster)
    kw = dict(BASE, input="Cache me: " + "word " * 40, max_output_tokens=2)
    for client in (pd, mixed):
        client.responses.create(**kw)
    counts = []
    for client in (pd, mixed):
        plain = client.responses.create(**kw).usage.input_tokens_details.cached_tokens
        with client.responses.stream(**kw) as stream:
            streamed = stream.get_final_response().usage.input_tokens_details.cached_tokens
        counts.append((plain, streamed))
    assert counts[0] == counts[1] and counts[0][0] > 0, counts


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
        # pages of one item, newest first (the client follows after= from page to page)
        paged = list(client.responses.input_items.list(second.id, limit=1))
        assert [i.id for i in paged] == [i.id for i in reversed(items)]
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
        # the chat path's checks name the input: a prompt over the context limit
        limit = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
        too_long = {"input": "word " * (limit + 100), "max_output_tokens": 4}
        _error(post(too_long), 400, "input", "context")
        missing = httpx.get(url + "/v1/responses/resp_unknown", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"
        # a function_call_output answering no earlier function_call (OpenAI: a 400 too)
        orphan = {"type": "function_call_output", "call_id": "nope", "output": "12:00"}
        _error(post({"input": [orphan]}), 400, "input[0].call_id", "'nope'")
        # chat: a tool message needs the id of the call it answers, as OpenAI's
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]},
            timeout=60,
        )
        _error(chat, 400, "messages[1].tool_call_id", "required")


def test_error_bodies_have_the_request_id_and_probes_may_send_head(cluster):
    """Router and worker processes alike: an unknown path, an unknown model, a wrong method
    are OpenAI errors whose ``request_id`` is the answer's ``x-request-id``; ``HEAD`` of the
    probe paths answers like ``GET`` without a body."""
    for proc in (cluster["router"], cluster["mixed"]):
        with httpx.Client(base_url=proc.url, timeout=30) as client:
            for method, path, status in (
                ("GET", "/v1/nothing", 404),
                ("GET", "/v1/models/foo", 404),
                ("DELETE", "/v1/models", 405),
            ):
                r = client.request(method, path)
                assert r.status_code == status, (proc.name, path, r.text)
                assert r.json()["request_id"] == r.headers["x-request-id"], (proc.name, r.text)
            for path in ("/health", "/v1/models", "/metrics"):
                head = client.head(path)
                assert head.status_code == 200 and head.content == b"", (proc.name, path)


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


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


PREFILL = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "My favourite colour is"},
]


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": False},
    ],
)
def test_assistant_prefill_continues_the_final_message(cluster, flags):
    mixed = cluster["mixed"].url
    rendered = post(mixed, "/tokenize", {"messages": PREFILL, **flags})["tokens"]
    text = post(mixed, "/detokenize", {"tokens": rendered})["prompt"]
    assert text.endswith("My favourite colour is"), text  # no end of turn, no new turn
    want = post(mixed, "/v1/completions", {"prompt": rendered, "max_tokens": 10, "temperature": 0})[
        "choices"
    ][0]
    for url in (cluster["router"].url, mixed):
        got = post(
            url,
            "/v1/chat/completions",
            {"messages": PREFILL, "max_tokens": 10, "temperature": 0, **flags},
        )
        assert got["choices"][0]["message"]["content"] == want["text"]
        assert got["usage"]["prompt_tokens"] == len(rendered)


def test_assistant_prefill_off_and_conflicts(cluster):
    mixed = cluster["mixed"].url
    cont = post(mixed, "/tokenize", {"messages": PREFILL})["tokens"]
    new_turn = post(mixed, "/tokenize", {"messages": PREFILL, "continue_final_message": False})
    # the same text, then its end of turn and a new assistant turn
    assert len(new_turn["tokens"]) > len(cont) and new_turn["tokens"][: len(cont)] == cont
    body = {"messages": PREFILL, "max_tokens": 6, "temperature": 0}
    a = post(cluster["router"].url, "/v1/chat/completions", dict(body, add_generation_prompt=True))
    assert a["usage"]["prompt_tokens"] == len(new_turn["tokens"])  # explicit: a new turn
    # /v1/responses gives a final assistant item a new turn too, as OpenAI's
    resp = post(cluster["router"].url, "/v1/responses", dict(BASE, input=PREFILL))
    assert resp["usage"]["input_tokens"] == len(new_turn["tokens"])
    for url in (cluster["router"].url, mixed):
        r = httpx.post(
            url + "/v1/chat/completions",
            json=dict(body, continue_final_message=True, add_generation_prompt=True),
            timeout=60,
        )
        _error(r, 400, "continue_final_message", "add_generation_prompt")


def _sse(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_usage_chunks_only_with_include_usage(cluster):
    body = {"prompt": "Count", "max_tokens": 4, "temperature": 0, "stream": True}
    for url in (cluster["router"].url, cluster["mixed"].url):
        alone = _sse(
            url, "/v1/completions", dict(body, stream_options={"continuous_usage_stats": True})
        )
        assert alone and all("usage" not in ch for ch in alone)
        both = _sse(
            url,
            "/v1/completions",
            dict(body, stream_options={"continuous_usage_stats": True, "include_usage": True}),
        )
        assert [ch["usage"]["completion_tokens"] for ch in both if ch["choices"]] == [1, 2, 3, 4]
        assert both[-1]["choices"] == [] and both[-1]["usage"]["completion_tokens"] == 4
        plain = _sse(url, "/v1/completions", dict(body, stream_options={"include_usage": True}))
        assert all(ch["usage"] is None for ch in plain[:-1]) and plain[-1]["usage"]


def test_chat_prompt_logprobs_at_the_top_level(cluster):
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 3,
        "temperature": 0,
        "prompt_logprobs": 2,
    }
    pd = post(cluster["router"].url, "/v1/chat/completions", body)
    mixed = post(cluster["mixed"].url, "/v1/chat/completions", body)
    assert "prompt_logprobs" not in pd["choices"][0]
    plp = pd["prompt_logprobs"]
    assert plp[0] is None and len(plp) == pd["usage"]["prompt_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in plp[1:])
    assert [e["token_id"] for e in plp[1:]] == [e["token_id"] for e in mixed["prompt_logprobs"][1:]]
    assert all(
        abs(a["logprob"] - b["logprob"]) < 1e-4
        for a, b in zip(plp[1:], mixed["prompt_logprobs"][1:])
    )
    # streamed: in the first chunk, at its top level, merged from prefill through PD
    chunks = _sse(cluster["router"].url, "/v1/chat/completions", dict(body, stream=True))
    assert [e and e["token_id"] for e in chunks[0]["prompt_logprobs"]] == [
        e and e["token_id"] for e in plp
    ]
    assert all("prompt_logprobs" not in ch for ch in chunks[1:])
    assert all("prompt_logprobs" not in c for ch in chunks for c in ch["choices"])


def test_model_objects_have_root_and_parent(cluster):
    pd, mixed = clients(cluster)
    for client in (pd, mixed):
        (card,) = client.models.list().data
        assert card.root == MODEL and card.parent is None
        assert client.models.retrieve(card.id).root == MODEL


def test_truncate_prompt_tokens_keeps_the_last_tokens(cluster):
    mixed = cluster["mixed"].url
    prompt = "one two three four five six seven eight nine ten"
    ids = post(mixed, "/tokenize", {"prompt": prompt})["tokens"]
    keep = 4
    want = post(
        mixed, "/v1/completions", {"prompt": ids[-keep:], "max_tokens": 6, "temperature": 0}
    )
    for url in (cluster["router"].url, mixed):
        got = post(
            url,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": keep},
        )
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["prompt_tokens"] == keep
        chat = post(
            url,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 3,
                "temperature": 0,
                "truncate_prompt_tokens": keep,
            },
        )
        assert chat["usage"]["prompt_tokens"] == keep
    r = httpx.post(mixed + "/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 0})
    _error(r, 400, "truncate_prompt_tokens", "truncate_prompt_tokens")
