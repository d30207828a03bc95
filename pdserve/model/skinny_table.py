"""Where the skinny Triton GEMM (``triton_skinny``) runs in the decode step, measured:
``(kind, dtype, N, K) -> ((m, config or None), ...)``, kind ``linear`` or ``swiglu`` (the
gate/up projection with its activation), config ``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT,
num_warps, num_stages, PREFETCH)``, None = not this kernel; the entry of the smallest
``m`` >= the rows decides (``triton_skinny.pick``).

The entries: Llama-3.1-8B's o projection and gate/up + SwiGLU at 64 rows (the 64-row graph
bucket only). Session 8 put qkv, o, gate/up + SwiGLU and down in together, on the H200's
64x200 decode step with all four on vs off (``scripts/gpu_s8_mm64.sh``; docs/benchmarks.md
row S8-MM64); session 9 switched each back to what the engine runs without it, interleaved
with the four in one decode session (``scripts/gpu_s9_bf16row.sh``, row S9-BF16ROW): the
step was faster without qkv's and without down's entry (cuBLAS qkv; down on the split-K
Triton GEMV of ``gemv_table``, the same greedy tokens), slower without o's, and the set
without the two faster than the four; written by ``scripts/s8_skinny_table.py --s9``.
:data:`ON` switches the table off without emptying it (A/B in one process).
"""

from __future__ import annotations

ON = True

TABLE: dict[
    tuple[str, str, int, int],
    tuple[tuple[int, tuple[int, int, int, int, int, int, int] | None], ...],
] = {
    ("linear", "bfloat16", 4096, 4096): ((48, None), (64, (64, 64, 128, 2, 4, 4, 4))),
    ("swiglu", "bfloat16", 28672, 4096): ((48, None), (64, (64, 128, 64, 1, 8, 4, 4))),
}
