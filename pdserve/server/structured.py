"""Structured-output request fields and their translation to
:class:`~pdserve.engine.structured.params.StructuredOutputsParams`.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``strict``),
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
``structured_outputs`` object, SGLang's ``json_schema`` / ``regex`` / ``ebnf``, and
``choice``: on both OpenAI endpoints and in ``/generate``'s ``sampling_params`` (there
without ``response_format``).  At most one may be given; each error names its field.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from pdserve.engine.structured.params import StructuredOutputsParams
from pdserve.server.body_base import RequestModel


class _Fields(RequestModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class JSONSchemaFormat(_Fields):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Fields):
    """``response_format``: ``text`` (no constraint), ``json_object``, ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsObject(_Fields):
    """vLLM's ``structured_outputs`` object: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class GuidedFields(_Fields):
    """The native extensions (vLLM and SGLang names), shared by the OpenAI bodies and
    ``/generate``'s ``sampling_params``."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsObject | None = None
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None


class ResponseFormatField(_Fields):
    """OpenAI's ``response_format`` (the OpenAI endpoints only)."""

    response_format: ResponseFormat | None = None


# request field -> StructuredOutputsParams keyword
_NATIVE = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("json_schema", "json"),
    ("regex", "regex"),
    ("ebnf", "grammar"),
    ("choice", "choice"),
)


def _make(field: str, **kwargs: Any) -> StructuredOutputsParams:
    from pdserve.server.serving import APIError  # serving imports protocol, which imports us

    try:
        return StructuredOutputsParams(field=field, **kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), field) from exc


def structured_params(body: BaseModel, prefix: str = "") -> StructuredOutputsParams | None:
    """The constraint a parsed body asks for, or ``None``; ``prefix`` is the body's path in
    the request (``"sampling_params."``).  400 naming the field for two constraints at
    once, or a value of the wrong shape (schemas are checked when compiled:
    :func:`compile_or_400`)."""
    from pdserve.server.serving import APIError

    found: list[StructuredOutputsParams] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(_make(f"{prefix}response_format", json_object=True))
    elif rf is not None and rf.type == "json_schema":
        field = f"{prefix}response_format.json_schema"
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, f"{field}.schema is required for type json_schema", field)
        found.append(
            _make(
                f"{field}.schema",
                json=rf.json_schema.schema_,
                strict=bool(rf.json_schema.strict),
            )
        )
    for name, kind in _NATIVE:
        value = getattr(body, name, None)
        if value is not None:
            found.append(_make(prefix + name, **{kind: value}))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        given = {
            k: v
            for k, v in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            )
            if v is not None
        }
        found.append(_make(f"{prefix}structured_outputs", **given))
    if len(found) > 1:
        raise APIError(
            400,
            f"{found[1].field}: only one structured-output constraint per request "
            f"(also given: {found[0].field})",
            found[1].field,
        )
    return found[0] if found else None


async def compile_or_400(engine_core: Any, spec: StructuredOutputsParams | None) -> None:
    """Compile ``spec`` (cached) in a worker thread, so an invalid schema, regex or grammar
    is a 400 naming its field before the request is queued, and the engine thread finds
    the grammar compiled.  Nothing for ``None`` or an engine without structured outputs."""
    from pdserve.server.serving import APIError

    manager = getattr(engine_core, "structured", None)
    if spec is None or manager is None:
        return
    try:
        await asyncio.to_thread(manager.compile, spec)
    except ValueError as exc:
        raise APIError(400, str(exc), spec.field) from exc
