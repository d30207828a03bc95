"""The one lower-bound check of config and spec fields (a leaf: imports nothing of pdserve)."""

from __future__ import annotations

from typing import Any


class CrossFieldError(ValueError):
    """A rule between two fields of one config (``speculative_model`` with
    ``speculative_algorithm`` draft, ``speculative_ngram_max`` >= ``speculative_ngram_min``,
    one of ``gpu_ids`` per rank): a flag checked alone at parse time cannot break it, so
    the per-flag check lets it pass and the whole config, built next, raises it."""


def check_min(obj: Any, low: float, *names: str, above: bool = False, unit: str = "") -> None:
    """ValueError ``"<name> must be >= <low><unit>, got <value>"`` (``>`` with ``above``)
    naming the first of the fields ``names`` of ``obj`` that is below the bound or not a
    finite number (NaN, infinity); a field that is None (unset, optional) passes."""
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if not (value > low if above else value >= low):
            raise ValueError(f"{name} must be {'>' if above else '>='} {low}{unit}, got {value}")
        if value == float("inf"):
            raise ValueError(f"{name} must be a finite number, got {value}")
