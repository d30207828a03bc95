"""A real mixed worker (``pdserve serve``, tiny random model) over HTTP: chat input errors
name the chat's own fields (``messages``, not ``prompt``, ``tools[i]...``), a content part
other than text is one clear 400, null content only for assistant messages, a tool message
needs its tool_call_id and a Responses function_call_output its function_call; /metrics
gives every family a meaning, and a stream the client abandoned is counted 499."""

from __future__ import annotations

import httpx
import pytest
from http_calls import post
from prometheus_client.parser import text_string_to_metric_families

from pdserve_procs import Proc, assert_all_healthy, wait_for

pytestmark = pytest.mark.timeout(300)

CHAT = "/v1/chat/completions"


def error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_an_over_long_chat_names_messages_and_a_completion_names_prompt(worker):
    n = worker.get_info()["max_model_len"]
    long = "hi " * n  # fewer characters than the cheap bound, more tokens than the limit
    err = error(post(worker, CHAT, {"messages": [{"role": "user", "content": long}]}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    err = error(post(worker, "/v1/completions", {"prompt": long, "max_tokens": 1}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err


def test_a_content_part_other_than_text_is_one_clear_400(worker):
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    err = error(post(worker, CHAT, {"messages": messages, "max_tokens": 1}))
    assert err["message"] == (
        "messages[1].content[1]: content part type 'image_url' is not supported by this "
        "model; only 'text' parts are"
    ), err
    assert err["param"] == "messages[1].content[1]", err  # the place the message names
    ok = post(worker, CHAT, {"messages": [{"role": "user", "content": parts[:1]}], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("tool_choice", [None, "none", "required"])
def test_a_tool_with_a_bad_schema_or_a_repeated_name_is_400_naming_the_tool(worker, tool_choice):
    good = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "g", "parameters": {"type": "bogus"}}}
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    if tool_choice is not None:
        base["tool_choice"] = tool_choice
    err = error(post(worker, CHAT, {**base, "tools": [good, bad]}))
    assert err["param"] == "tools[1].function.parameters", err
    assert err["message"].startswith(
        "tools[1].function.parameters of 'g' is not a valid JSON schema: 'bogus' is not valid"
    ), err
    err = error(post(worker, CHAT, {**base, "tools": [good, good]}))
    assert err["param"] == "tools[1].function.name", err
    assert "function names must be unique" in err["message"], err
    assert post(worker, CHAT, {**base, "tools": [good]}).status_code == 200  # still serving


@pytest.mark.parametrize("role", ["user", "system"])
def test_null_content_is_400_except_for_an_assistant_message(worker, role):
    messages = [{"role": role, "content": None}, {"role": "user", "content": "hi"}][
        : 1 if role == "user" else 2
    ]
    err = error(post(worker, CHAT, {"messages": messages, "max_tokens": 1}))
    assert err["param"] == "messages[0].content", err  # the place the message names
    assert err["message"].startswith(f"messages[0].content must not be null for a {role}"), err
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = post(
        worker,
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "call f"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
                {"role": "user", "content": "thanks"},
            ],
            "max_tokens": 1,
        },
    )
    assert ok.status_code == 200, ok.text


def test_a_tool_message_without_tool_call_id_is_400_naming_it(worker):
    """OpenAI requires ``tool_call_id`` on a tool message (the call it answers); a missing
    or null one is a 400 naming ``messages[i].tool_call_id``, and the worker keeps
    serving. An assistant message with tool calls and no content stays accepted."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    for tool in (
        {"role": "tool", "content": "r"},
        {"role": "tool", "content": "r", "tool_call_id": None},
    ):
        err = error(post(worker, CHAT, {"messages": [*turns, tool], "max_tokens": 1}))
        assert err["param"] == "messages[2].tool_call_id", err
        assert err["message"].startswith("messages[2].tool_call_id is required"), err
    ok = {"role": "tool", "content": "r", "tool_call_id": "c1"}
    assert post(worker, CHAT, {"messages": [*turns, ok], "max_tokens": 1}).status_code == 200


TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}},
}


def test_a_function_call_output_without_its_call_is_400_naming_its_call_id(worker):
    """A Responses ``function_call_output`` needs a ``function_call`` of its ``call_id``
    before it: earlier in ``input``, or in the output of the response
    ``previous_response_id`` continues (as OpenAI's API); else a 400 naming
    ``input[i].call_id``."""
    output = {"type": "function_call_output", "call_id": "nope", "output": "12:00"}
    base = {"max_output_tokens": 4, "temperature": 0.0}
    r = post(worker, "/v1/responses", {**base, "input": [output]})
    err = error(r)
    assert err["param"] == "input[0].call_id" and "'nope'" in err["message"], err
    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "12:00"}
    # its call after it does not count; before it, it does
    err = error(post(worker, "/v1/responses", {**base, "input": [answer, call]}))
    assert err["param"] == "input[0].call_id", err
    ok = post(worker, "/v1/responses", {**base, "input": [call, answer]})
    assert ok.status_code == 200, ok.text
    # the call made by the previous response: its output answers it in the follow-up
    first = post(
        worker,
        "/v1/responses",
        {
            **base,
            "input": "What time is it?",
            "tools": [TIME_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,  # one call, then the answer ends
            "max_output_tokens": 40,
        },
    ).json()
    call_id = next(o["call_id"] for o in first["output"] if o["type"] == "function_call")
    follow = {**base, "previous_response_id": first["id"]}
    answered = dict(answer, call_id=call_id)
    r = post(worker, "/v1/responses", {**follow, "input": [answered]})
    assert r.status_code == 200, r.text
    err = error(
        post(
            worker,
            "/v1/responses",
            {**follow, "input": [{"role": "user", "content": "hi"}, output]},
        )
    )
    assert err["param"] == "input[1].call_id", err


def _families(worker: Proc) -> dict:
    text = httpx.get(worker.url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _requests(worker: Proc, endpoint: str, status: str) -> float:
    fam = _families(worker)["pdserve_requests"]
    return sum(
        s.value
        for s in fam.samples
        if s.name == "pdserve_requests_total"
        and s.labels == {"endpoint": endpoint, "status": status}
    )


def test_every_metric_has_a_meaning(worker):
    assert post(worker, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    fams = {n: f for n, f in _families(worker).items() if n.startswith("pdserve_")}
    assert "pdserve_engine_num_held_pages" in fams
    for name, fam in fams.items():
        key = name.removeprefix("pdserve_engine_")
        assert fam.documentation not in (name, key) and "(from " not in fam.documentation, (
            name,
            fam.documentation,
        )


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_an_abandoned_stream_is_counted_499(worker, path):
    body = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    body.update(
        {"prompt": "go on"} if path != CHAT else {"messages": [{"role": "user", "content": "go"}]}
    )
    before = _requests(worker, path, "499"), _requests(worker, path, "200")
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", worker.url + path, json=body) as r,
    ):
        assert r.status_code == 200
        for _ in r.iter_lines():
            break  # the stream runs; leaving closes the connection
    wait_for(lambda: _requests(worker, path, "499") == before[0] + 1, 60, "the 499 to be counted")
    assert _requests(worker, path, "200") == before[1]
    wait_for(lambda: worker.get_info()["engine"]["num_running"] == 0, 60, "the abort")
    # a stream read to its end still counts 200
    done = post(worker, path, dict(body, max_tokens=2))
    assert done.status_code == 200 and done.text.rstrip().endswith("[DONE]")
    wait_for(lambda: _requests(worker, path, "200") == before[1] + 1, 30, "the 200")
    assert_all_healthy([worker])
