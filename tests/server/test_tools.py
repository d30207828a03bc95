"""server/tools.py and server/structured.py without an engine: the tool plan, rendering
(native template vs pdserve's default format), parsing of tool-call text, the streaming
state machine, and the mapping of request fields to structured-output params."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.server import tools as tl
from pdserve.server.protocol import ChatCompletionRequest, GenerateSamplingParams
from pdserve.server.serving import APIError
from pdserve.server.structured import structured_params

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "hi"}]


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def plan(template=None, **kw) -> tl.ToolPlan:
    return tl.plan_tools(req(**kw), template)


def test_plan_modes():
    assert plan().mode == "none"
    assert plan(tools=[WEATHER]).mode == "auto"
    assert plan(tools=[WEATHER], tool_choice="none").mode == "none"
    assert plan(tools=[WEATHER], tool_choice="required").mode == "required"
    named = plan(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert (named.mode, named.name) == ("named", "get_weather")
    assert plan("{% for t in tools %}{% endfor %}", tools=[WEATHER]).native


@pytest.mark.parametrize(
    "kw",
    [
        {"tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
    ],
)
def test_plan_errors_name_tool_choice(kw):
    with pytest.raises(APIError) as exc:
        plan(**kw)
    assert exc.value.status == 400 and exc.value.param == "tool_choice"


def test_forced_specs_are_schemas_of_the_calls():
    named = plan(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    spec = named.forced_spec()
    assert json.loads(spec.json) == WEATHER["function"]["parameters"] and spec.strict
    req_plan = plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req_plan.forced_spec().json)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    for bad in (
        [],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_time", "arguments": {}}] * 2,
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert plan(tools=[WEATHER]).forced_spec() is None


def test_default_format_renders_tools_calls_and_results():
    body = req(
        messages=[
            {"role": "system", "content": "Be brief."},
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    p = tl.plan_tools(body, "no tool support")
    messages, kwargs = tl.template_messages(body.messages, p)
    assert kwargs == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert (
        '"name": "get_weather"' in messages[0]["content"] and tl.CALL_OPEN in messages[0]["content"]
    )
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_native_template_gets_tools_and_messages_as_they_are():
    body = req(
        messages=[
            *USER,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    p = tl.plan_tools(body, "{{ tools }}")
    messages, kwargs = tl.template_messages(body.messages, p)
    assert kwargs["tools"][0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_parse_auto_named_required():
    auto = plan(tools=[WEATHER, TIME])
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = tl.parse_output(text, auto)
    assert content == "Let me check." and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    two = text + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert [c["function"]["name"] for c in tl.parse_output(two, auto)[1]] == [
        "get_weather",
        "get_time",
    ]
    for bad in (
        "plain answer",
        "<tool_call>{not json",
        '<tool_call>{"name": "nope", "arguments": {}}',
    ):
        assert tl.parse_output(bad, auto) == (bad, [])
    named = plan(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    content, calls = tl.parse_output('{"city": "Rome"}', named)
    assert content is None and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Rome"}',
    }
    assert tl.parse_output('{"city": "Ro', named) == ('{"city": "Ro', [])
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    _, calls = tl.parse_output('[{"name": "get_time", "arguments": {}}]', required)
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert tl.finish_reason("stop", calls) == "tool_calls"
    assert tl.finish_reason("length", calls) == "length" and tl.finish_reason("stop", []) == "stop"


def _run(stream: tl.ToolStream, pieces: list[str]) -> list[dict]:
    out = []
    for i, piece in enumerate(pieces):
        out += stream.feed(piece, i == len(pieces) - 1)
    return out


def test_stream_auto_holds_a_possible_tag_and_sends_calls_at_the_end():
    auto = plan(tools=[WEATHER])
    deltas = _run(
        tl.ToolStream(auto),
        [
            "Sure",
            ". <tool",
            "_call>",
            '{"name": "get_weather", ',
            '"arguments": {"city": "X"}}</tool_call>',
            "",
        ],
    )
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Sure. "
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    plain = _run(tl.ToolStream(auto), ["a <", "b", ""])
    assert "".join(d["content"] for d in plain) == "a <b"


def test_stream_named_sends_argument_deltas():
    named = plan(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    deltas = _run(tl.ToolStream(named), ['{"city"', ': "X"}', ""])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)
    assert json.loads(args) == {"city": "X"}


def test_structured_params_from_fields():
    spec = structured_params(
        req(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True},
            }
        )
    )
    assert (
        spec.kind == "json" and spec.strict and spec.field == "response_format.json_schema.schema"
    )
    assert structured_params(req(response_format={"type": "text"})) is None
    assert structured_params(req(response_format={"type": "json_object"})).kind == "json_object"
    assert structured_params(req(guided_choice=["a", "b"])).choice == ("a", "b")
    assert structured_params(req(structured_outputs={"regex": "a+"})).regex == "a+"
    sp = GenerateSamplingParams.model_validate({"ebnf": 'root ::= "x"'})
    assert structured_params(sp, prefix="sampling_params.").field == "sampling_params.ebnf"
    with pytest.raises(APIError) as exc:
        structured_params(req(guided_regex="a", response_format={"type": "json_object"}))
    assert exc.value.param == "guided_regex"
    with pytest.raises(APIError) as exc:
        structured_params(
            req(response_format={"type": "json_schema", "json_schema": {"name": "a"}})
        )
    assert exc.value.param == "response_format.json_schema"
    with pytest.raises(APIError) as exc:
        structured_params(req(guided_json="{bad"))
    assert exc.value.param == "guided_json"
