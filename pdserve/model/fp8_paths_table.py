"""FP8 linear paths measured on a GPU: ``(device name, N, K) -> ((largest M, (kind,
config)), ...)`` ascending in M, the form of :data:`pdserve.model.fp8.PATHS`. A shape listed
here for the card the model loads on is not timed at start (:func:`pdserve.model.fp8.choose_paths`
copies the entry), so every process on that kind of card takes the same paths (a prefill and a
decode worker compute the same numbers as a mixed one); a shape not listed is timed.

Written by ``scripts/gpu_fp8_kernels2.py`` (``$OUT/fp8_paths_table.py``, its picks) from a
GPU measurement; empty until one is copied here.
"""

from __future__ import annotations

from typing import Any

TABLE: dict[tuple[str, int, int], tuple[tuple[int, tuple[str, Any]], ...]] = {}
