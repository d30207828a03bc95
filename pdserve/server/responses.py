"""OpenAI's Responses API on a worker: ``POST /v1/responses``, ``GET /v1/responses/{id}``
and ``GET /v1/responses/{id}/input_items``.

A request is translated to the chat path (:func:`pdserve.server.openai_api.chat_job`):
``instructions`` becomes a first system message, ``input`` (a string, or a list of input
items: messages, ``function_call`` and ``function_call_output`` items) becomes the chat
messages, function ``tools`` and ``tool_choice`` become chat tools (server/tools.py),
``text.format`` becomes ``response_format`` (the structured-output path), and
``max_output_tokens`` becomes ``max_tokens``. The answer is a ``response`` object whose
``output`` holds one assistant ``message`` item (``output_text`` content) and/or the
``function_call`` items parsed from the output; ``stream`` sends OpenAI's typed events
(``response.created`` ... ``response.completed``) as server-sent events.

Unsupported parts are a 400 naming the item: built-in tools (``web_search_preview``,
``file_search``, ...), image/file/audio content, input item types other than the three
above, ``background``.

Storage: with ``store`` (the default, as OpenAI's) a finished response is kept in a
bounded in-memory store of the worker that answered (:class:`ResponseStore`, its size
``serve --responses-store-size``; the least recently stored is dropped first; a prefill
worker stores nothing, its answer is only the first token). ``previous_response_id``
continues a stored conversation: its input items and output come before the new
``input`` (its ``instructions`` do not carry over, as OpenAI's). A router resolves a
follow-up itself and sends the conversation so far as ``previous_items`` (an extension),
so both legs of a PD pair, or any worker, can serve it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field, StrictBool, StrictFloat, ValidationError

from pdserve.disagg.base import Role
from pdserve.engine.core.request import RequestOutput
from pdserve.engine.sampling_params import SEED_MAX, SEED_MIN
from pdserve.http.disconnect import cancel_on_disconnect
from pdserve.server import tools as tl
from pdserve.server.body_base import Int, RequestModel
from pdserve.server.formatting import sse_response
from pdserve.server.openai_api import WorkerContext, chat_job
from pdserve.server.protocol import Bootstrap, ChatCompletionRequest
from pdserve.server.serving import APIError

INPUT_TYPES = ("message", "function_call", "function_call_output")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
MAX_PAGE = 100  # most items of one input_items page (OpenAI's limit)


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
    temperature: StrictFloat = Field(1.0, ge=0.0)
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
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ResponseStore:
    """Finished responses by id, at most ``size`` of them (0: none kept); storing one more
    drops the oldest. Each entry: the response object and the conversation's input items
    (the previous responses' and this one's, in order)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, input_items: list[dict]) -> None:
        """Keep ``response`` (its ``id`` the key) with its conversation's ``input_items``."""
        if self.size == 0:
            return
        self._items[response["id"]] = (response, input_items)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        """``(response, input items)`` of a stored id, else None."""
        return self._items.get(response_id)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _unsupported(where: str, kind: Any, what: str) -> APIError:
    return APIError(400, f"{where}: {what} type {kind!r} is not supported", where)


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


def _as_listed(item: dict) -> dict:
    """A stored input item as ``input_items`` lists it: a message's text as one content
    part (``output_text`` for the assistant's, else ``input_text``)."""
    if item["type"] != "message":
        return item
    if item["role"] == "assistant":
        part = {"type": "output_text", "text": item["content"], "annotations": []}
    else:
        part = {"type": "input_text", "text": item["content"]}
    return dict(item, content=[part], status="completed")


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {
        "id": item_id or _new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "id": item_id or _new_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


class _Shape:
    """What a response object repeats of its request."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req, self.id, self.model = req, response_id, model
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict],
        usage: dict | None = None,
        incomplete: str | None = None,
    ) -> dict:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None and fmt.type != "text":
            text_format = {"type": fmt.type}
            if fmt.type == "json_schema":
                text_format.update(
                    name=fmt.name or "response",
                    schema=fmt.schema_,
                    strict=fmt.strict,
                    description=fmt.description,
                )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _usage(prompt_tokens: int, out: RequestOutput) -> dict:
    completion = len(out.outputs[0].token_ids)
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": min(out.num_cached_tokens, prompt_tokens)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion,
    }


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """(response status, incomplete reason) of an engine finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


# chat field (as the chat path's errors name it) -> the Responses request's field; the
# longest first. ``messages`` are the input items (and ``instructions``): "input".
_CHAT_NAMES = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
    ("tool_choice.function", "tool_choice"),
)
_CHAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\b")


def _responses_names(text: str) -> str:
    """``text`` with the chat request's field names as the Responses request's."""
    text = _CHAT_TOOL.sub(r"tools[\1]", text)
    for chat, ours in _CHAT_NAMES:
        text = re.sub(rf"(?<![\w.]){re.escape(chat)}\b", ours, text)
    return text


def responses_error(exc: APIError) -> APIError:
    """A chat-path error of a translated Responses request, its ``param`` and message
    naming the Responses request's fields (``max_output_tokens``, ``text.format.schema``,
    ``tools[0].parameters``, ``input`` for the messages)."""
    param = exc.param
    if param is not None:
        param = "input" if param.startswith("messages") else _responses_names(param)
    return APIError(exc.status, _responses_names(exc.message), param, exc.code)


def build_responses_router(ctx: WorkerContext, store: ResponseStore) -> APIRouter:
    """The Responses endpoints of a worker, bound to ``ctx`` and ``store``."""
    api = APIRouter()
    keeps = ctx.serving.role != Role.PREFILL  # a prefill leg's answer is one token only

    def conversation(req: ResponsesRequest) -> list[dict]:
        """The input items before this request's: ``previous_items`` when the router sent
        them, else the stored conversation of ``previous_response_id``."""
        if req.previous_items is not None:
            return normalize_input(req.previous_items, "previous_items")
        if req.previous_response_id is None:
            return []
        found = store.get(req.previous_response_id)
        if found is None:
            raise APIError(
                400,
                f"previous_response_id {req.previous_response_id!r} is not stored here: "
                "unknown, stored with store false, or dropped from the bounded store "
                "(serve --responses-store-size)",
                "previous_response_id",
                code="previous_response_not_found",
            )
        response, items = found
        return items + output_as_input(response)

    @api.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Response:
        ctx.accept(req, "/v1/responses")
        if req.background:
            raise APIError(400, "background is not supported", "background")
        before = conversation(req)
        items = before + normalize_input(req.input)
        if not items:
            raise APIError(400, "input must not be empty", "input")
        chat_body = {
            "model": req.model,
            "messages": chat_messages(items, req.instructions),
            "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format(req.text),
            "max_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "stream": req.stream,
            "continue_final_message": False,  # a final assistant item: a new turn, as OpenAI's
            "bootstrap_host": req.bootstrap_host,
            "bootstrap_port": req.bootstrap_port,
            "bootstrap_room": req.bootstrap_room,
        }
        try:
            chat_req = ChatCompletionRequest.model_validate(chat_body)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise APIError(400, f"invalid input: {first.get('msg')}", "input") from None
        try:
            return await run(req, request, chat_req, items)
        except APIError as exc:  # the chat path's errors, in the Responses request's names
            raise responses_error(exc) from None

    async def run(
        req: ResponsesRequest, request: Request, chat_req: ChatCompletionRequest, items: list
    ) -> Response:
        job, plan, prompt_ids, _ = await chat_job(ctx, chat_req)
        job.prompt_field = "input"  # the engine's checks (context limit) name it too
        shape = _Shape(req, _new_id("resp"), ctx.model_name)

        def finish(output: list[dict], out: RequestOutput) -> dict:
            status, reason = _status(out.outputs[0].finish_reason)
            response = shape.response(status, output, _usage(len(prompt_ids), out), reason)
            if req.store and keeps:
                store.put(response, items)
            return response

        if req.stream:
            return await _stream(request, ctx, job, plan, shape, finish)
        outs = await cancel_on_disconnect(request, ctx.serving.collect(job))
        o = outs[0].outputs[0]
        content, calls = tl.parse_output(o.text, plan)
        status, _ = _status(o.finish_reason)
        output = []
        if content is not None or not calls:
            output.append(_message_item(content or "", status))
        output += [_call_item(c) for c in calls]
        return JSONResponse(finish(output, outs[0]))

    def stored(response_id: str) -> tuple[dict, list[dict]]:
        found = store.get(response_id)
        if found is None:
            raise APIError(
                404,
                f"no stored response with id {response_id!r} on this worker",
                "response_id",
            )
        return found

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        """A stored response object; 404 for an id not (or no longer) stored."""
        return JSONResponse(stored(response_id)[0])

    @api.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        order: Literal["asc", "desc"] = "desc",
        limit: int = Query(20, ge=1, le=MAX_PAGE),
        after: str | None = None,
    ) -> JSONResponse:
        """The input items of a stored response's conversation (OpenAI's list page:
        ``order`` desc by default, ``limit`` 1..100, ``after`` an item id)."""
        _, items = stored(response_id)
        rows = [dict(_as_listed(item), id=f"item_{i}") for i, item in enumerate(items)]
        if order == "desc":
            rows.reverse()
        if after is not None:
            ids = [r["id"] for r in rows]
            if after not in ids:
                raise APIError(400, f"after {after!r} is not an item of this response", "after")
            rows = rows[ids.index(after) + 1 :]
        page = rows[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(rows) > limit,
            }
        )

    return api


async def _stream(
    request: Request,
    ctx: WorkerContext,
    job: Any,
    plan: tl.ToolPlan,
    shape: _Shape,
    finish: Any,
) -> Response:
    """The typed events of one streamed response: ``response.created``,
    ``response.in_progress``, then per output item ``response.output_item.added``, (text:
    ``response.content_part.added``, ``response.output_text.delta`` ...,
    ``response.output_text.done``, ``response.content_part.done``; call:
    ``response.function_call_arguments.delta`` ..., ``...done``),
    ``response.output_item.done``, and ``response.completed`` with the whole response
    (whose ``status`` is ``incomplete`` when ``max_output_tokens`` cut it, as vLLM's)."""
    seq = {"n": 0}
    items: list[dict] = []  # output items in order (texts and calls filled as they stream)
    open_text: dict[str, Any] = {}  # the message item being streamed: {"item", "index"}
    open_calls: dict[int, dict] = {}  # chat tool-call index -> {"item", "index"}
    tool_stream = tl.ToolStream(plan) if plan.mode != "none" else None

    def event(kind: str, **fields: Any) -> dict:
        seq["n"] += 1
        return {"type": kind, "sequence_number": seq["n"] - 1, **fields}

    def open_message() -> list[dict]:
        if open_text:
            return []
        item = _message_item("", "in_progress")
        item["content"] = []
        open_text.update(item=item, index=len(items))
        items.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            event("response.output_item.added", output_index=open_text["index"], item=dict(item)),
            event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=open_text["index"],
                content_index=0,
                part=part,
            ),
        ]

    def text_delta(delta: str) -> list[dict]:
        out = open_message()
        if delta:
            item = open_text["item"]
            item.setdefault("_text", "")
            item["_text"] += delta
            out.append(
                event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=open_text["index"],
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            )
        return out

    def call_delta(call: dict) -> list[dict]:
        out = []
        index = call.get("index", 0)
        fn = call.get("function") or {}
        if index not in open_calls:
            item = _call_item(
                {
                    "id": call.get("id") or tl.new_call_id(),
                    "function": {"name": fn.get("name"), "arguments": ""},
                },
                "in_progress",
            )
            open_calls[index] = {"item": item, "index": len(items)}
            items.append(item)
            out.append(
                event("response.output_item.added", output_index=len(items) - 1, item=dict(item))
            )
        state = open_calls[index]
        delta = fn.get("arguments") or ""
        if delta:
            state["item"]["arguments"] += delta
            out.append(
                event(
                    "response.function_call_arguments.delta",
                    item_id=state["item"]["id"],
                    output_index=state["index"],
                    delta=delta,
                )
            )
        return out

    def close(status: str) -> list[dict]:
        out: list[dict] = []
        if not items:  # nothing came: one empty message, as the plain answer has
            out += open_message()
        for index, item in enumerate(items):
            if item["type"] == "message":
                text = item.pop("_text", "")
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                out.append(
                    event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=text,
                        logprobs=[],
                    )
                )
                out.append(
                    event(
                        "response.content_part.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
                item.update(status=status, content=[part])
            else:
                out.append(
                    event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
                item["status"] = "completed"
            out.append(event("response.output_item.done", output_index=index, item=item))
        return out

    def chunks(index: int, out: RequestOutput):
        o = out.outputs[0]
        if seq["n"] == 0:
            opening = shape.response("in_progress", [])
            yield event("response.created", response=opening)
            yield event("response.in_progress", response=opening)
        if tool_stream is None:
            yield from text_delta(o.delta_text)
        else:
            for delta in tool_stream.feed(o.delta_text, o.finished):
                if delta.get("content"):
                    yield from text_delta(delta["content"])
                for call in delta.get("tool_calls") or []:
                    yield from call_delta(call)
        if o.finished:
            status, _ = _status(o.finish_reason)
            yield from close(status)
            response = finish(list(items), out)
            # response.completed also for an incomplete one (its status says so), as vLLM:
            # the official client's stream helper ends only on that event
            yield event("response.completed", response=json.loads(json.dumps(response)))

    return await sse_response(request, ctx.serving, job, chunks)
