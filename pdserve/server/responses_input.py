"""The Responses API's request and its translation to the chat path (``server/responses.py``
serves the routes): the request model (:class:`ResponsesRequest`), ``input`` (a string or
a list of ``message``, ``function_call`` and ``function_call_output`` items) normalised to
stored input items and turned into chat messages after ``instructions``, function
``tools``/``tool_choice`` into chat tools, ``text.format`` into ``response_format``, and a
finished response's output into the input items a follow-up continues from.

Unsupported parts are an :class:`~pdserve.server.serving.APIError` (a 400) naming the
item: built-in tools, image/file/audio content, other input item types; so is a
``function_call_output`` that answers no earlier ``function_call``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictFloat

from pdserve.engine.sampling_params import SEED_MAX, SEED_MIN
from pdserve.server.body_base import Int, RequestModel
from pdserve.server.protocol import MAX_TOP_LOGPROBS, Bootstrap
from pdserve.server.serving import APIError

INPUT_TYPES = ("message", "function_call", "function_call_output")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


class _Fields(RequestModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponseTextFormat(_Fields):
    """``text.format``: ``text`` (no constraint), ``json_object``, or ``json_schema``
    (``name``, ``schema``, ``strict``, ``description`` flat in the object)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseText(_Fields):
    """``text``: the output's ``format``."""

    format: ResponseTextFormat | None = None


class ResponsesRequest(Bootstrap):
    """``POST /v1/responses`` (OpenAI's Responses API; see the module docstring)."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0.0, allow_inf_nan=False)  # finite; no upper bound
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponseText | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    previous_items: list[Any] | None = None
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    background: StrictBool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def _content_text(content: Any, where: str, roles_text: tuple[str, ...] = TEXT_PARTS) -> str:
    """The text of a message's ``content``: a string, or a list of text parts
    (``input_text`` / ``output_text``) concatenated; 400 naming any other part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
            raise APIError(400, f"{where}[{j}] must be a content part object", f"{where}[{j}]")
        kind = part.get("type")
        if kind not in roles_text:
            raise APIError(
                400,
                f"{where}[{j}].type {kind!r} is not supported: only text parts "
                f"({', '.join(roles_text)}) are (no images, files or audio)",
                f"{where}[{j}].type",
            )
        out.append(part.get("text", ""))
    return "".join(out)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{name} must be a string", f"{where}.{name}")
    return value


def normalize_input(value: str | list[Any], field: str = "input") -> list[dict]:
    """Input items in one form (``{"type": "message", "role", "content": text}``,
    ``function_call`` with ``call_id``/``name``/``arguments``, ``function_call_output`` with
    ``call_id``/``output``); 400 naming ``field[i]`` for an item that is not supported."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items = []
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an input item object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise APIError(
                    400,
                    f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
                    f"{where}.role",
                )
            text = _content_text(item.get("content"), f"{where}.content")
            items.append({"type": "message", "role": role, "content": text})
        elif kind == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": _field(item, "call_id", where),
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                }
            )
        elif kind == "function_call_output":
            output = item.get("output")
            text = _content_text(output, f"{where}.output")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": _field(item, "call_id", where),
                    "output": text,
                }
            )
        elif kind is None:
            raise APIError(400, f"{where}.type is required", f"{where}.type")
        else:
            raise APIError(
                400,
                f"{where}.type {kind!r} is not supported: input items are {', '.join(INPUT_TYPES)}",
                f"{where}.type",
            )
    return items


def check_call_outputs(before: list[dict], items: list[dict], field: str = "input") -> None:
    """400 naming ``field[i].call_id`` for a ``function_call_output`` item of ``items`` (the
    request's normalized input) without a ``function_call`` of that ``call_id`` before it:
    earlier in ``items``, or in ``before`` (the conversation ``previous_response_id``
    continues). OpenAI's API refuses such an output too: no call of the conversation asked
    for it, and the chat template would render an answer to nothing."""
    calls = {item["call_id"] for item in before if item["type"] == "function_call"}
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            where = f"{field}[{i}].call_id"
            raise APIError(
                400,
                f"{where}: no function call with call_id {item['call_id']!r} comes before "
                "this function_call_output (earlier in input, or in the output of the response "
                "previous_response_id names)",
                where,
            )


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Chat messages of normalized input items: ``instructions`` first as a system message;
    ``function_call`` items as the ``tool_calls`` of the assistant message just before them
    (one made when there is none: the turn's text and calls are one message); a
    ``function_call_output`` as a ``tool`` message."""
    out: list[dict] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        if item["type"] == "message":
            out.append({"role": item["role"], "content": item["content"]})
            continue
        if item["type"] == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            continue
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":  # the same turn's calls
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return out


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Function tools in the chat shape; 400 naming ``tools[i].type`` for a built-in tool."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where} must be a tool object", where)
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"{where}.type {tool.get('type')!r} is not supported: only function tools "
                "are (no built-in tools)",
                f"{where}.type",
            )
        fn = {"name": _field(tool, "name", where)}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """``tool_choice`` in the chat shape; 400 for a built-in tool's choice."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(
            400,
            f"tool_choice type {choice.get('type')!r} is not supported: give none, auto, "
            'required or {"type": "function", "name": ...}',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: ResponseText | None) -> dict | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema is required for type json_schema", "text.format")
    return {
        "type": "json_schema",
        "json_schema": {
            "name": fmt.name or "response",
            "schema": fmt.schema_,
            "strict": fmt.strict,
        },
    }


def output_as_input(response: dict) -> list[dict]:
    """A stored response's output items as input items (the assistant's turn)."""
    items: list[dict] = []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content") or [])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
    return items
