"""FP8 linear paths measured on a GPU: ``(device name, N, K) -> ((largest M, (kind,
config)), ...)`` ascending in M, the form of :data:`pdserve.model.fp8.PATHS`. A shape listed
here for the card the model loads on is not timed at start (:func:`pdserve.model.fp8.choose_paths`
copies the entry), so every process on that kind of card takes the same paths (a prefill and a
decode worker compute the same numbers as a mixed one); a shape not listed is timed.

Written by ``scripts/gpu_fp8_kernels2.py`` on NVIDIA H200 (torch 2.11.0+cu130, Triton
3.6.0; every timing in its ``fp8_kernels2.json``), but for the 64-row entries of (4096, 4096)
and (4096, 14336), rewritten by ``scripts/gpu_s8_fp8g.py --write-table
docs/figures/h200_s8/fp8g2.json --keep "4096,4096:64;4096,14336:64"`` (the split-2 tile:
its sweep and the engine's 64-row step, docs/benchmarks.md row S8-FP8G); do not edit by hand.
"""

from __future__ import annotations

from typing import Any

TABLE: dict[tuple[str, int, int], tuple[tuple[int, tuple[str, Any]], ...]] = {
    ("NVIDIA H200", 6144, 4096): (
        (1, ("gemv", ("gemv", 8, 512, 4, 1))),
        (2, ("w8a8", ("w8a8", 16, 64, 256, 1, True, 4, 4))),
        (4, ("w8a8", ("w8a8", 16, 64, 256, 1, True, 4, 4))),
        (8, ("w8a8", ("w8a8", 16, 64, 256, 1, True, 4, 4))),
        (16, ("w8a8", ("w8a8", 16, 64, 256, 1, True, 4, 4))),
        (32, ("w8a8", ("w8a8", 32, 64, 256, 1, True, 4, 4))),
        (64, ("w8a8", ("w8a8", 64, 64, 256, 1, True, 4, 4))),
        (128, ("scaled_mm", None)),
        (256, ("scaled_mm", None)),
        (1024, ("scaled_mm", None)),
    ),
    ("NVIDIA H200", 4096, 4096): (
        (1, ("gemv", ("gemv", 8, 1024, 4, 1))),
        (2, ("w8a8", ("w8a8", 16, 64, 128, 4, True, 4, 4))),
        (4, ("w8a8", ("w8a8", 16, 64, 128, 4, True, 4, 4))),
        (8, ("w8a8", ("w8a8", 16, 64, 128, 4, True, 4, 4))),
        (16, ("w8a8", ("w8a8", 16, 64, 256, 1, True, 4, 4))),
        (32, ("w8a8", ("w8a8", 32, 64, 256, 1, True, 4, 4))),
        (64, ("w8a8", ("w8a8", 64, 64, 256, 2, True, 4, 4))),
        (128, ("w8a8", ("w8a8", 64, 128, 128, 4, True, 4, 4))),
        (256, ("scaled_mm", None)),
        (1024, ("scaled_mm", None)),
    ),
    ("NVIDIA H200", 28672, 4096): (
        (1, ("w8a8", ("w8a8", 16, 64, 128, 1, True, 4, 4))),
        (2, ("w8a8", ("w8a8", 16, 64, 128, 1, True, 4, 4))),
        (4, ("w8a8", ("w8a8", 16, 64, 128, 1, True, 4, 4))),
        (8, ("w8a8", ("w8a8", 16, 64, 128, 1, True, 4, 4))),
        (16, ("w8a8", ("w8a8", 16, 64, 128, 1, True, 4, 4))),
        (32, ("w8a8", ("w8a8", 32, 64, 128, 1, True, 4, 4))),
        (64, ("w8a8", ("w8a8", 64, 128, 128, 1, True, 4, 4))),
        (128, ("scaled_mm", None)),
        (256, ("scaled_mm", None)),
        (1024, ("scaled_mm", None)),
    ),
    ("NVIDIA H200", 4096, 14336): (
        (1, ("gemv", ("gemv", 8, 1024, 4, 1))),
        (2, ("w8a8", ("w8a8", 16, 64, 256, 4, True, 4, 4))),
        (4, ("w8a8", ("w8a8", 16, 64, 256, 4, True, 4, 4))),
        (8, ("w8a8", ("w8a8", 16, 64, 256, 4, True, 4, 4))),
        (16, ("w8a8", ("w8a8", 16, 64, 256, 4, True, 4, 4))),
        (32, ("w8a8", ("w8a8", 32, 64, 256, 4, True, 4, 4))),
        (64, ("w8a8", ("w8a8", 64, 64, 256, 2, True, 4, 4))),
        (128, ("w8a8", ("w8a8", 64, 128, 128, 4, False, 4, 4))),
        (256, ("scaled_mm", None)),
        (1024, ("scaled_mm", None)),
    ),
}
