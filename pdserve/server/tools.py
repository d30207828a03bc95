"""Tools (function calling) on ``/v1/chat/completions``, as OpenAI defines them; behaviour
and default tool format: docs/reference.md, its "Tools" paragraph.

Rendering: a chat template that knows tools (its source mentions ``tools``) gets them
through ``apply_chat_template(tools=...)`` with the messages as they are; any other (the
embedded SmolLM2's) gets the default format: a system message listing the functions and
asking for ``<tool_call>`` blocks, assistant ``tool_calls`` as such blocks, ``tool``
messages as ``<tool_response>`` user turns. ``tool_choice``: ``none`` renders and parses
nothing; ``auto`` parses ``<tool_call>`` blocks out of the text; ``required`` and a named
function force the output with the structured-output grammar.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, StrictBool

from pdserve.engine.structured.params import StructuredOutputsParams
from pdserve.server.body_base import RequestModel

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class _Fields(RequestModel):
    model_config = ConfigDict(extra="allow")


class FunctionDef(_Fields):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Fields):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Fields):
    name: str


class NamedToolChoice(_Fields):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Fields):
    name: str
    arguments: str


class ToolCall(_Fields):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(_Fields):
    """``tools`` and ``tool_choice`` of a chat request."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class ToolMessageFields(_Fields):
    """What a message may carry besides role and content."""

    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools.

    mode: ``none`` (no tools, or ``tool_choice: none``), ``auto``, ``required`` or
    ``named``; tools: the request's tools (as dicts); name: the forced function
    (``named``); native: the chat template renders tools itself.
    """

    mode: str
    tools: tuple[dict, ...] = ()
    name: str | None = None
    native: bool = False
    parallel: bool = True

    def forced_spec(self) -> StructuredOutputsParams | None:
        """The grammar that forces ``required`` / ``named`` output, else ``None``."""
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return StructuredOutputsParams(
                json=json.dumps(_params_schema(fn)), strict=True, field="tool_choice"
            )
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t["function"]["name"]},
                        "arguments": _params_schema(t["function"]),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(
                json=json.dumps(schema), strict=True, field="tool_choice"
            )
        return None


def _params_schema(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _check_tools(tools: tuple[dict, ...]) -> None:
    """400 naming ``tools[i].function.name`` for a function name given twice (OpenAI's
    API refuses it: a call could not say which one it means) and
    ``tools[i].function.parameters`` for parameters that are not valid JSON Schema, whatever
    ``tool_choice`` is (the schema reaches the prompt even when no grammar is built)."""
    from pdserve.engine.structured.backend import json_schema_problem
    from pdserve.server.serving import APIError

    first: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] in first:
            raise APIError(
                400,
                f"tools[{i}].function.name {fn['name']!r} is also tools[{first[fn['name']]}]'s: "
                "function names must be unique",
                f"tools[{i}].function.name",
            )
        first[fn["name"]] = i
        problem = None if "parameters" not in fn else json_schema_problem(fn["parameters"])
        if problem is not None:
            raise APIError(
                400,
                f"tools[{i}].function.parameters of {fn['name']!r} is not a valid JSON "
                f"schema: {problem}",
                f"tools[{i}].function.parameters",
            )


def plan_tools(req: Any, chat_template: str | None) -> ToolPlan:
    """The :class:`ToolPlan` of a parsed chat request; 400 naming ``tool_choice`` for a
    choice without tools or naming an unknown function, and naming the tool for a repeated
    function name or parameters that are not JSON Schema (:func:`_check_tools`)."""
    from pdserve.server.serving import APIError

    tools = tuple(t.model_dump(exclude_none=True) for t in (req.tools or []))
    _check_tools(tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = req.parallel_tool_calls is not False
    if choice == "none" or (not tools and choice == "auto"):
        return ToolPlan("none")
    if not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    native = "tools" in (chat_template or "")
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not in "
                f"tools ({', '.join(names)})",
                "tool_choice",
            )
        return ToolPlan("named", tools, choice.function.name, native, parallel)
    return ToolPlan(choice, tools, None, native, parallel)


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def default_system_prompt(tools: tuple[dict, ...]) -> str:
    """pdserve's default tool prompt (for templates without a tool format)."""
    lines = [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    return (
        "You can call these functions (JSON Schema parameters), one per line:\n"
        + "\n".join(lines)
        + f"\nTo call a function, answer only with\n{CALL_OPEN}\n"
        + '{"name": "<function name>", "arguments": <JSON object of arguments>}\n'
        + f"{CALL_CLOSE}\n(one block per call). Otherwise answer normally."
    )


def template_messages(messages: list[Any], plan: ToolPlan) -> tuple[list[dict], dict]:
    """The chat template's messages and extra keyword arguments (``tools=`` for a native
    template) for ``messages`` (parsed ``ChatMessage``s)."""
    out: list[dict] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content = m.text()
        calls = getattr(m, "tool_calls", None) or []
        if plan.native:
            d: dict[str, Any] = {"role": role, "content": content}
            if calls:
                d["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments_object(c.function.arguments),
                        },
                    }
                    for c in calls
                ]
            if getattr(m, "tool_call_id", None):
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
            out.append(d)
            continue
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        blocks = [
            f"{CALL_OPEN}\n"
            + json.dumps(
                {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)},
                ensure_ascii=False,
            )
            + f"\n{CALL_CLOSE}"
            for c in calls
        ]
        out.append({"role": role, "content": "\n".join([content, *blocks] if content else blocks)})
    if plan.mode == "none" or not plan.tools:
        return out, {}
    if plan.native:
        return out, {"tools": list(plan.tools)}
    prompt = default_system_prompt(plan.tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parse_output(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a finished output.  ``named``: the text is the
    arguments; ``required``: a JSON array of calls; ``auto``: ``<tool_call>`` blocks (text
    before the first is the content; a block that does not parse as a call of a known
    function leaves the whole text as content).  No calls: ``(text, [])``."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [_call(plan.name or "", text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
            return None, [_call(c["name"], c["arguments"]) for c in items]
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []
    if plan.mode != "auto" or CALL_OPEN not in text:
        return text, []
    names = {t["function"]["name"] for t in plan.tools}
    head, _, rest = text.partition(CALL_OPEN)
    calls = []
    for block in rest.split(CALL_OPEN):
        body = block.split(CALL_CLOSE, 1)[0].strip()
        try:
            obj = json.loads(body)
            if obj["name"] not in names or not isinstance(obj.get("arguments", {}), dict):
                return text, []
            calls.append(_call(obj["name"], obj.get("arguments", {})))
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []
    return (head.strip() or None), calls


def openai_finish_reason(reason: str | None) -> str | None:
    """An engine finish reason as OpenAI's: ``length`` stays, any other end is ``stop``;
    ``None`` (not finished) stays ``None``."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def finish_reason(engine_reason: str | None, calls: list[dict]) -> str | None:
    """OpenAI's finish_reason: ``tool_calls`` when calls were parsed from an output that
    ended by itself; a ``length`` cut stays ``length``."""
    reason = openai_finish_reason(engine_reason)
    return "tool_calls" if calls and reason == "stop" else reason


class ToolStream:
    """Turns one sample's text deltas into chat ``delta`` objects for a tool plan.

    ``named``: the first delta opens the call (id, name, ``arguments: ""``), every text
    delta is an ``arguments`` delta.  ``required``: the text is held and the calls are sent
    when the output ends.  ``auto``: content streams until ``<tool_call>`` starts (a text
    tail that could be its beginning is held), then the rest is held and sent as calls
    at the end (as content when it does not parse).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.in_call = False
        self.calls: list[dict] = []
        self.call_id = new_call_id()

    def feed(self, delta: str, finished: bool) -> list[dict]:
        """The delta objects (without ``role``) for new text ``delta``."""
        self.text += delta
        mode = self.plan.mode
        out: list[dict[str, Any]]
        if mode == "named":
            out = []
            if not self.calls:
                self.calls = [{"id": self.call_id}]
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": self.call_id,
                                "type": "function",
                                "function": {"name": self.plan.name, "arguments": ""},
                            }
                        ]
                    }
                )
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if mode == "required":
            return self._final() if finished else []
        # auto
        if not self.in_call:
            at = self.text.find(CALL_OPEN, self.sent)
            if at >= 0:
                self.in_call = True
                upto = at
            else:
                upto = len(self.text) if finished else _safe_end(self.text, self.sent)
            out = [{"content": self.text[self.sent : upto]}] if upto > self.sent else []
            self.sent = upto
            if finished:
                out += self._final()
            return out
        return self._final() if finished else []

    def _final(self) -> list[dict]:
        content, calls = parse_output(self.text, self.plan)
        self.calls = calls
        if not calls:
            rest = self.text[self.sent :]
            self.sent = len(self.text)
            return [{"content": rest}] if rest else []
        return [
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": c["id"],
                        "type": "function",
                        "function": c["function"],
                    }
                ]
            }
            for i, c in enumerate(calls)
        ]


def _safe_end(text: str, start: int) -> int:
    """End of the text that can be sent as content: all of it but a tail that is a
    prefix of ``<tool_call>``."""
    for k in range(min(len(CALL_OPEN) - 1, len(text) - start), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
