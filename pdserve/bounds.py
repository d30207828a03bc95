"""The one lower-bound check of config and spec fields (a leaf: imports nothing of pdserve)."""

from __future__ import annotations

import re
from collections.abc import Mapping
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


def flag_message(exc: BaseException, args: Any, fields: Mapping[str, str] | None = None) -> str:
    """``str(exc)`` with the field names in it written as the command-line flags that set
    them: ``"page_size must be >= 1, got 0"`` -> ``"--page-size must be >= 1, got 0"``,
    ``"speculative_ngram_max (2) must be >= speculative_ngram_min (5)"`` -> the two flags,
    for names that are destinations of the parsed ``args`` (an ``argparse.Namespace``): the
    message's first word (``page_size`` or ``page-size``), and any other word with an
    underscore. ``fields``: config fields set by a flag of another name (``decode_urls``
    -> ``--decode``), written as that flag. Config and spec checks (:func:`check_min`) name
    fields; a command's user typed flags, so its error line should name those. Other words
    are left as they are."""
    dests = vars(args)
    renamed = fields or {}
    message = str(exc)

    def flag(word: str) -> str | None:
        if word in renamed:
            return renamed[word]
        key = word.replace("-", "_")
        return "--" + key.replace("_", "-") if key.isidentifier() and key in dests else None

    head = re.match(r"[A-Za-z][\w-]*", message)
    if head and not message.startswith("-") and (f := flag(head.group())):
        message = f + message[head.end() :]
        start = len(f)
    else:
        start = 0
    return message[:start] + re.sub(
        r"(?<![\w-])[a-z]\w*_\w+(?![\w-])",
        lambda m: flag(m.group()) or m.group(),
        message[start:],
    )
