"""Where the persistent TMA matmul (``triton_mm``) beat cuBLAS at 65+ rows, measured:
``(dtype, N, K) -> ((m, config or None), ...)``; config ``(kind, BLOCK_N, BLOCK_K,
num_warps, num_stages)``, None = cuBLAS; the entry of the smallest m >= M decides.

Written by ``scripts/gpu_s7_mm_sweep.py --write-table`` from a GPU sweep; empty until a
sweep finds a kernel beating ``F.linear`` by >= 3 %. Do not edit by hand.
"""

from __future__ import annotations

TABLE: dict[
    tuple[str, int, int], tuple[tuple[int, tuple[str, int, int, int, int] | None], ...]
] = {}
