"""The one lower-bound check of config and spec fields (a leaf: imports nothing of pdserve)."""

from __future__ import annotations

from typing import Any


def check_min(obj: Any, low: float, *names: str, above: bool = False, unit: str = "") -> None:
    """ValueError ``"<name> must be >= <low><unit>, got <value>"`` (``>`` with ``above``)
    naming the first of the fields ``names`` of ``obj`` that is below the bound; a field
    that is None (unset, optional) passes."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (value > low if above else value >= low):
            raise ValueError(f"{name} must be {'>' if above else '>='} {low}{unit}, got {value}")
