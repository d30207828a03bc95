"""The base of every request model (``protocol``, ``structured``, ``tools``): JSON ``null``
for an optional field means its default, and integer fields take integral floats.

OpenAI's spec marks the optional request fields nullable, and the official ``openai``
client sends ``"temperature": null`` for ``temperature=None``; vLLM reads such a null as
the field's default. Python's ``json`` writes an integral float as ``2.0``, which vLLM
accepts for an integer field; a fractional one (``2.5``) stays a 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, StrictInt, model_validator

from pdserve.http.json_fields import as_int


def _integral(value: Any) -> Any:
    """An integral float (``2.0``) as its int; ValueError for a fractional one (``2.5``);
    anything else as is, for the strict int check (a bool or a string stays a 400)."""
    if isinstance(value, float):
        integer = as_int(value)
        if integer is None:
            raise ValueError(f"must be an integer, got {value!r}")
        return integer
    return value


# an integer field: a JSON integer, or a number of integral value (2.0); no bool, no string
Int = Annotated[StrictInt, BeforeValidator(_integral)]


class RequestModel(BaseModel):
    """A request body (or a part of one). A JSON ``null`` given for a field whose default
    is not null is dropped before validation, so the field takes its default, as when it
    is left out; a required field stays required (``null`` there is a 400)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic's own 400 (not an object)
        nulls = {
            key
            for name, info in cls.model_fields.items()
            if not info.is_required() and info.default is not None
            for key in {name, info.alias or name}
            if key in data and data[key] is None
        }
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data
