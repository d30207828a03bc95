"""Where the skinny Triton GEMM (``triton_skinny``) runs in the decode step, measured:
``(kind, dtype, N, K) -> ((m, config or None), ...)``, kind ``linear`` or ``swiglu`` (the
gate/up projection with its activation), config ``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT,
num_warps, num_stages, PREFETCH)``, None = not this kernel; the entry of the smallest
``m`` >= the rows decides (``triton_skinny.pick``).

The entries: Llama-3.1-8B's four linear layers at 64 rows (the 64-row graph bucket only),
kept together on the H200 measurement of the engine's 64x200 decode step with all four on
vs off in one process (``scripts/gpu_s8_mm64.sh``; docs/benchmarks.md row S8-MM64). Alone
(each in a CUDA graph of launches) only the gate/up + SwiGLU kernel beat cuBLAS + the
activation kernel; qkv, o and down are in as the measured set was, not one by one.
:data:`ON` switches the table off without emptying it (A/B in one process).
"""

from __future__ import annotations

ON = True

TABLE: dict[
    tuple[str, str, int, int],
    tuple[tuple[int, tuple[int, int, int, int, int, int, int] | None], ...],
] = {
    ("linear", "bfloat16", 6144, 4096): ((48, None), (64, (64, 64, 128, 2, 4, 3, 4))),
    ("linear", "bfloat16", 4096, 4096): ((48, None), (64, (64, 64, 128, 2, 4, 4, 4))),
    ("swiglu", "bfloat16", 28672, 4096): ((48, None), (64, (64, 128, 64, 1, 8, 4, 4))),
    ("linear", "bfloat16", 4096, 14336): ((48, None), (64, (64, 64, 128, 2, 4, 4, 4))),
}
