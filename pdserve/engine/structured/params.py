"""``StructuredOutputsParams``: what one request's output must match (vLLM's names)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text.

    json: a JSON Schema (dict or JSON text); the output is one JSON value valid under it.
    json_object: the output is one JSON object (OpenAI ``response_format: json_object``).
    regex: the output matches this regular expression in full.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (GBNF style, root rule ``root``) the output must match.
    strict: with ``json``, properties and array items the schema does not name are not
        allowed (OpenAI's ``strict: true``; ``unevaluatedProperties: false`` everywhere);
        otherwise the schema's own JSON Schema meaning holds.
    field: the request field this came from, named in error messages (not part of the
        grammar: two requests with the same constraint share one compiled grammar).

    ``json`` is stored as JSON text in the schema's own key order (properties are
    generated in the order the schema lists them, as OpenAI does).  Raises ValueError naming ``field`` when not exactly one constraint is given,
    or a value has the wrong type (an unparsable schema or regex is found when compiling).
    """

    json: str | dict[str, Any] | None = None  # stored as JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    strict: bool = False
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        f = self.field
        if self.json is not None:
            value: Any = self.json
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{f} is not valid JSON: {exc}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"{f} must be a JSON Schema object, got {type(value).__name__}")
            object.__setattr__(self, "json", json.dumps(value))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"{f} must be a string (a regular expression)")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"{f} must be a non-empty string (an EBNF grammar)")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise ValueError(f"{f} must be a list of strings")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{f} must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool) or not isinstance(self.strict, bool):
            raise ValueError(f"{f}: json_object and strict must be booleans")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{f} must set exactly one of {', '.join(KINDS)}; got {given or 'none'}"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[Any, ...]:
        """Cache key of the compiled grammar (everything but ``field``)."""
        return (self.kind, getattr(self, self.kind), self.strict if self.json else False)
