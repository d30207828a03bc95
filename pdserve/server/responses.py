"""OpenAI's Responses API on a worker: ``POST /v1/responses``, ``GET /v1/responses/{id}``
and ``GET /v1/responses/{id}/input_items``.

A request is translated to the chat path (:func:`pdserve.server.openai_api.chat_job`;
the request model and the translation are in ``server/responses_input.py``):
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
from pydantic import ValidationError

from pdserve.disagg.base import Role
from pdserve.engine.core.request import RequestOutput
from pdserve.http.disconnect import cancel_on_disconnect
from pdserve.server import formatting as fmt
from pdserve.server import tools as tl
from pdserve.server.formatting import sse_response
from pdserve.server.openai_api import WorkerContext, chat_job
from pdserve.server.protocol import ChatCompletionRequest
from pdserve.server.responses_input import (
    ResponsesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    check_call_outputs,
    normalize_input,
    output_as_input,
    response_format,
)
from pdserve.server.serving import APIError

MAX_PAGE = 100  # most items of one input_items page (OpenAI's limit)


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


LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the include value that asks for them


def _message_item(
    text: str, status: str, item_id: str | None = None, logprobs: list | None = None
) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "id": item_id or _new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the output text's tokens carry logprobs: ``include`` names
    ``message.output_text.logprobs`` or ``top_logprobs`` is given (OpenAI's two ways).
    400 naming ``include`` with tools: a tool call's text is cut out of the tokens."""
    wanted = LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs is not None
    if wanted and req.tools:
        raise APIError(
            400,
            f"include {LOGPROBS_INCLUDE!r} (or top_logprobs) is not supported with tools",
            "include" if LOGPROBS_INCLUDE in (req.include or []) else "top_logprobs",
        )
    return wanted


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
        given = normalize_input(req.input)
        check_call_outputs(before, given)
        items = before + given
        if not items:
            raise APIError(400, "input must not be empty", "input")
        logprobs = wants_logprobs(req)
        chat_body = {
            "model": req.model,
            "logprobs": logprobs or None,
            "top_logprobs": req.top_logprobs if logprobs else None,
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

        logprobs = chat_req.logprobs is True
        if req.stream:
            return await _stream(request, ctx, job, plan, shape, finish, logprobs)
        outs = await cancel_on_disconnect(request, ctx.serving.collect(job))
        o = outs[0].outputs[0]
        content, calls = tl.parse_output(o.text, plan)
        status, _ = _status(o.finish_reason)
        output = []
        if content is not None or not calls:
            lp = fmt.chat_logprobs(o.logprobs or [], ctx.token_text)["content"] if logprobs else []
            output.append(_message_item(content or "", status, logprobs=lp))
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
    logprobs: bool = False,
) -> Response:
    """The typed events of one streamed response: ``response.created``,
    ``response.in_progress``, then per output item ``response.output_item.added``, (text:
    ``response.content_part.added``, ``response.output_text.delta`` ...,
    ``response.output_text.done``, ``response.content_part.done``; call:
    ``response.function_call_arguments.delta`` ..., ``...done``),
    ``response.output_item.done``, and ``response.completed`` with the whole response
    (whose ``status`` is ``incomplete`` when ``max_output_tokens`` cut it, as vLLM's).
    ``logprobs``: each text delta carries its tokens' logprobs, the done events all."""
    seq = {"n": 0}
    items: list[dict] = []  # output items in order (texts and calls filled as they stream)
    open_text: dict[str, Any] = {}  # the message item being streamed: {"item", "index"}
    open_calls: dict[int, dict] = {}  # chat tool-call index -> {"item", "index"}
    tool_stream = tl.ToolStream(plan) if plan.mode != "none" else None

    def event(kind: str, **fields: Any) -> dict:
        seq["n"] += 1
        return {"type": kind, "sequence_number": seq["n"] - 1, **fields}

    def text_event(kind: str, item: dict, index: int, **fields: Any) -> dict:
        """An event of the text part of message ``item``, output item ``index``."""
        return event(kind, item_id=item["id"], output_index=index, content_index=0, **fields)

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
            text_event("response.content_part.added", item, open_text["index"], part=part),
        ]

    def text_delta(delta: str, entries: list | None = None) -> list[dict]:
        out = open_message()
        lp = fmt.chat_logprobs(entries or [], ctx.token_text)["content"] if logprobs else []
        item = open_text["item"]
        item.setdefault("_logprobs", []).extend(lp)
        if delta:
            item.setdefault("_text", "")
            item["_text"] += delta
            out.append(
                text_event(
                    "response.output_text.delta",
                    item,
                    open_text["index"],
                    delta=delta,
                    logprobs=lp,
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
                lp = item.pop("_logprobs", [])
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lp}
                out.append(
                    text_event("response.output_text.done", item, index, text=text, logprobs=lp)
                )
                out.append(text_event("response.content_part.done", item, index, part=part))
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
            yield from text_delta(o.delta_text, o.delta_logprobs)
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
