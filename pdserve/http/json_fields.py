"""How a JSON request body's integer fields read, shared by the worker's request models
(``server/body_base.py``) and the router, which counts a request's rooms from ``n`` the
way the workers read it (no engine imports)."""

from __future__ import annotations

from typing import Any


def as_int(value: Any) -> int | None:
    """``value`` as an integer field reads it: an int (not a bool), or a float of integral
    value (``2.0`` -> 2); None for anything else (``2.5``, a bool, a string)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
