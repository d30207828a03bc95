"""What a worker does with request fields it does not know.

Known fields are validated strictly by ``server/protocol.py`` (a bad value is a 400
naming the field).  An unknown field is, by default, accepted and ignored: one warning
log line per request lists them, and ``pdserve_ignored_request_fields_total{field}``
counts them (as vLLM does: clients written for other servers send extras).  With
``--strict-request-fields`` the request is a 400 naming the first unknown field instead.
Nested fields are named by their dotted path without list indices (``messages.refusal``,
``sampling_params.foo``), so the counter's label set stays small.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from pdserve.server.serving import APIError

log = logging.getLogger("pdserve.server")

MAX_FIELD_LABELS = 64  # distinct field labels of the counter; later names count as "other"


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the fields of ``model`` (and of the models nested in it, also in
    lists) that its class does not declare, in body order, each once."""
    found: list[str] = [prefix + name for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                found += unknown_fields(item, f"{prefix}{name}.")
    return list(dict.fromkeys(found))


class FieldPolicy:
    """Applies the policy to a parsed request body.

    strict: reject unknown fields (400) instead of ignoring them.
    counter: a prometheus ``Counter`` with one label, ``field``.
    """

    def __init__(self, strict: bool, counter) -> None:
        self.strict = strict
        self._counter = counter
        self._labels: set[str] = set()

    def _label(self, field: str) -> str:
        if field in self._labels or len(self._labels) < MAX_FIELD_LABELS:
            self._labels.add(field)
            return field
        return "other"  # a client sending ever new names must not grow the metrics forever

    def apply(self, body: BaseModel, endpoint: str) -> None:
        """Warn and count (default) or raise ``APIError`` 400 (strict) for the unknown
        fields of ``body``; nothing when there are none."""
        fields = unknown_fields(body)
        if not fields:
            return
        if self.strict:
            raise APIError(
                400,
                f"unknown field{'s' if len(fields) > 1 else ''} {', '.join(fields)} "
                "(this server runs with --strict-request-fields)",
                fields[0],
            )
        log.warning("%s: ignoring unknown request fields: %s", endpoint, ", ".join(fields))
        for field in fields:
            self._counter.labels(self._label(field)).inc()
