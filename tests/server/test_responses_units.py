"""Units of server/responses.py and server/responses_input.py: the bounded store, input items -> chat messages, tools and
text.format translation, and the 400s naming the unsupported item (no processes)."""

from __future__ import annotations

import pytest

from pdserve.server import responses as r
from pdserve.server import responses_input as ri
from pdserve.server.serving import APIError


def _response(i: int) -> dict:
    return {"id": f"resp_{i}", "output": []}


def test_store_keeps_at_most_its_size_and_drops_the_oldest():
    store = r.ResponseStore(3)
    for i in range(5):
        store.put(_response(i), [{"type": "message", "role": "user", "content": str(i)}])
    assert len(store) == 3
    assert store.get("resp_0") is None and store.get("resp_1") is None
    assert [store.get(f"resp_{i}")[1][0]["content"] for i in (2, 3, 4)] == ["2", "3", "4"]
    none = r.ResponseStore(0)
    none.put(_response(0), [])
    assert len(none) == 0 and none.get("resp_0") is None
    with pytest.raises(ValueError, match="size"):
        r.ResponseStore(-1)


def _param(call) -> str:
    with pytest.raises(APIError) as exc:
        call()
    assert exc.value.status == 400
    return exc.value.param


def test_unsupported_input_items_parts_and_tools_are_named():
    assert _param(lambda: ri.normalize_input([{"type": "reasoning"}])) == "input[0].type"
    assert _param(lambda: ri.normalize_input(["text"])) == "input[0]"
    assert _param(lambda: ri.normalize_input([{"role": "tool", "content": "x"}])) == "input[0].role"
    image = {
        "role": "user",
        "content": [{"type": "input_text", "text": "a"}, {"type": "input_file", "file_id": "f"}],
    }
    assert _param(lambda: ri.normalize_input([image])) == "input[0].content[1].type"
    call = {"type": "function_call", "call_id": "c", "name": "f"}  # no arguments
    assert _param(lambda: ri.normalize_input([call])) == "input[0].arguments"
    tools = [{"type": "function", "name": "f"}, {"type": "file_search"}]
    assert _param(lambda: ri.chat_tools(tools)) == "tools[1].type"
    assert _param(lambda: ri.chat_tool_choice({"type": "web_search_preview"})) == "tool_choice"


def test_input_items_become_chat_messages():
    items = ri.normalize_input(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Time "},
                    {"type": "input_text", "text": "and date?"},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "time", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "date", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
            {"type": "function_call_output", "call_id": "c2", "output": "May 1"},
            {"type": "message", "role": "developer", "content": "Answer in English."},
        ]
    )
    messages = ri.chat_messages(items, "Be brief.")
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "developer",
    ]
    assert messages[1]["content"] == "Time and date?"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
    assert ri.normalize_input("hi") == [{"type": "message", "role": "user", "content": "hi"}]


def test_a_stored_output_continues_as_the_assistant_s_turn():
    response = {
        "output": [
            {"type": "message", "content": [{"type": "output_text", "text": "Let me check."}]},
            {
                "type": "function_call",
                "call_id": "c",
                "name": "f",
                "arguments": "{}",
                "id": "fc_1",
                "status": "completed",
            },
        ]
    }
    assert ri.output_as_input(response) == [
        {"type": "message", "role": "assistant", "content": "Let me check."},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ]
    # and back through the chat translation: the call joins the assistant's text turn
    messages = ri.chat_messages(ri.normalize_input(ri.output_as_input(response)), None)
    assert len(messages) == 1 and messages[0]["tool_calls"][0]["id"] == "c"


def test_text_format_and_tool_choice_translate_to_chat_fields():
    fmt = ri.ResponseText.model_validate(
        {
            "format": {
                "type": "json_schema",
                "name": "w",
                "schema": {"type": "object"},
                "strict": True,
            }
        }
    )
    assert ri.response_format(fmt) == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert ri.response_format(None) is None
    assert ri.response_format(ri.ResponseText.model_validate({"format": {"type": "text"}})) is None
    no_schema = ri.ResponseText.model_validate({"format": {"type": "json_schema"}})
    assert _param(lambda: ri.response_format(no_schema)) == "text.format"
    assert ri.chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    assert ri.chat_tool_choice("required") == "required"


def test_chat_path_errors_are_renamed_to_the_responses_fields():
    cases = [
        ("max_tokens", "need 5 of max_tokens", "max_output_tokens", "need 5 of max_output_tokens"),
        (
            "response_format.json_schema.schema",
            "response_format.json_schema.schema: bad",
            "text.format.schema",
            "text.format.schema: bad",
        ),
        (
            "tools[1].function.parameters",
            "tools[1].function.parameters: bad",
            "tools[1].parameters",
            "tools[1].parameters: bad",
        ),
        ("tool_choice.function.name", "x", "tool_choice.name", "x"),
        ("messages[2].content", "x", "input", "x"),
        ("temperature", "temperature must be", "temperature", "temperature must be"),
    ]
    for param, message, want_param, want_message in cases:
        exc = r.responses_error(APIError(400, message, param, code="c"))
        assert (exc.param, exc.message, exc.code) == (want_param, want_message, "c")


def test_a_function_call_output_needs_its_call_before_it():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    ri.check_call_outputs([], [call, out])  # in the input, before it
    ri.check_call_outputs([call], [out])  # in the conversation it continues
    assert _param(lambda: ri.check_call_outputs([], [out])) == "input[0].call_id"
    assert _param(lambda: ri.check_call_outputs([], [out, call])) == "input[0].call_id"
    other = dict(out, call_id="c2")
    assert _param(lambda: ri.check_call_outputs([call], [out, other])) == "input[1].call_id"
