"""Router units of the Responses API: prefill's cached-token count in decode's answer and
stream event, and a stored output turned back into input items (no processes)."""

from __future__ import annotations

from pdserve.router import responses as rr
from pdserve.router.answer_merge import is_final_chunk, merge_cached_tokens

PATH = "/v1/responses"


def _usage(cached: int) -> dict:
    return {
        "input_tokens": 40,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": 2,
        "total_tokens": 42,
    }


def test_prefill_s_cached_tokens_replace_decode_s():
    prefill = {"object": "response", "usage": _usage(32)}
    answer = {"object": "response", "usage": _usage(0)}
    assert merge_cached_tokens(PATH, answer, prefill)["usage"]["input_tokens_details"] == {
        "cached_tokens": 32
    }
    completed = {"type": "response.completed", "response": {"usage": _usage(0)}}
    merged = merge_cached_tokens(PATH, completed, prefill)
    assert merged["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 32
    # only the event with the counts waits for prefill's answer
    assert is_final_chunk(PATH, completed)
    assert not is_final_chunk(PATH, {"type": "response.created", "response": {"usage": None}})
    assert not is_final_chunk(PATH, {"type": "response.output_text.delta", "delta": "x"})


def test_a_stored_output_becomes_the_assistant_s_input_items():
    output = [
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Hi ", "annotations": []},
                {"type": "output_text", "text": "Ann"},
            ],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "f",
            "arguments": "{}",
            "status": "completed",
        },
        "not an item",
    ]
    assert rr._as_input(output) == [
        {"type": "message", "role": "assistant", "content": "Hi Ann"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
