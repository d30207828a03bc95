"""Where the skinny Triton GEMM (``triton_skinny``) beat cuBLAS in the decode step, measured:
``(kind, dtype, N, K) -> ((m, config or None), ...)``, kind ``linear`` or ``swiglu`` (the
gate/up projection with its activation), config ``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT,
num_warps, num_stages, PREFETCH)``, None = not this kernel.

Empty until an H200 measurement supports an entry (``scripts/gpu_s8_mm64.py --write``).
:data:`ON` switches the table off without emptying it (A/B in one process).
"""

from __future__ import annotations

ON = True

TABLE: dict[
    tuple[str, str, int, int],
    tuple[tuple[int, tuple[int, int, int, int, int, int, int] | None], ...],
] = {}
