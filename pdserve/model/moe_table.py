"""Tiles of the fused MoE kernels at decode sizes (``pdserve.model.triton_moe.pick_plan``).

``DECODE``: rows ``(n_assign, up, down, down_sum, triton_sum[, fused_sum])`` ascending in
``n_assign`` (tokens x top-k): a batch of at most ``n_assign`` assignments (experts seeing
<= 16 tokens each) runs the gate/up kernel at ``up`` and the down kernel at ``down``
(``(block_m, block_n, block_k, num_warps, num_stages)``, the same ``block_m``), or, when
``down_sum`` is ``(kind, BLOCK_N, BLOCK_K, num_warps, num_stages)`` (``triton_moe.DownSum``),
the down projection, routing weights and top-k sum in one launch; ``triton_sum``: the top-k
sum after the grouped down kernel in Triton instead of torch; ``fused_sum``: inside the down
kernel. ``ROUTE_ALIGN_WARPS``: ``(router logits T x E up to, warps)`` of ``route_align``'s
one program.

Written by ``scripts/gpu_s6_moe.py --write-table SWEEP.json`` from an H200 sweep
(NVIDIA H200, 2026-12-03; the timings: docs/figures/h200_s6/moe_s6_sweep.json).

``ROUTE_ALIGN`` written by ``scripts/gpu_s7_moe.py --write-table JSON`` (NVIDIA H200,
2026-12-03; the timings: docs/figures/h200_s7/moe_s7.json); its 64-token row from session
9's H200 round (the alignment in one program per expert; see the comment at the table).
"""

from __future__ import annotations

Tiles = tuple[int, int, int, int, int]
DownSum = tuple[str, int, int, int, int]

Row = tuple[int, Tiles, Tiles, DownSum | None, bool] | tuple[int, Tiles, Tiles, DownSum | None, bool, bool]  # fmt: skip
DECODE: tuple[Row, ...] = (
    (8, (16, 32, 256, 4, 3), (16, 64, 128, 4, 3), None, True),
    (16, (16, 32, 128, 4, 3), (16, 64, 128, 4, 3), None, True),
    (32, (16, 32, 256, 4, 3), (16, 64, 128, 4, 3), None, True),
    (64, (16, 32, 128, 4, 5), (16, 64, 128, 4, 3), None, True),
    (128, (16, 32, 128, 4, 3), (16, 32, 128, 4, 3), None, True),
    (512, (16, 64, 128, 4, 3), (16, 64, 128, 4, 3), None, True),
)
ROUTE_ALIGN_WARPS: tuple[tuple[int, int], ...] = (
    (128, 1),
    (256, 2),
    (512, 4),
    (1024, 4),
    (2048, 4),
)
# (tokens up to, RouteAlignConfig fields (kind, num_warps, rank_dot, tokens_per_program,
# align_warps[, align_kind])) of route_align; past the rows (or none): one program,
# ROUTE_ALIGN_WARPS. 17-64 tokens since session 9: the alignment in one program per expert
# (scripts/gpu_s9_moe9.py, NVIDIA H200: the layer at 64 tokens, uniform / 24 experts routed,
# 294.3 / 100.0 -> 279.4 / 84.9 us, the same bits; the engine's 64x200 step 16.702 ->
# 15.964 ms; docs/figures/h200_s9/moe9.json)
RouteAlign = tuple[str, int, bool, int, int] | tuple[str, int, bool, int, int, str]
ROUTE_ALIGN: tuple[tuple[int, RouteAlign], ...] = (
    (8, ("split", 1, False, 1, 8)),
    (16, ("split", 1, True, 1, 8)),
    (64, ("split", 1, True, 1, 4, "experts")),
)
# PDL on the grouped path's kernels (route_align's, gate/up, down, top-k sum: launched with
# programmatic dependent launch on sm_90+, see pdserve.model.pdl); the few-token path's
# bound (forwards of at most GEMV_MAX_TOKENS tokens take route_experts_gemv unless
# PDSERVE_MOE_GEMV_MAX_TOKENS is set; 0: never) and its tiles (GemvConfig fields; None:
# GemvConfig's defaults). Picks of scripts/gpu_s8_moe8.py (NVIDIA H200, 2026-12-03; the
# layer at 1 token 31.8 -> 28.3 us, the engine's 1x200 step 2.912 -> 2.850 ms, greedy
# tokens unchanged: docs/figures/h200_s8/moe8_output.txt); the gate/up in 1 warp instead of
# 4 from session 9's two H200 rounds (the layer at 1 token: 4 -> 2 warps 28.6 -> 27.3 us,
# the engine's 1x200 step 2.830 -> 2.788 ms; 2 -> 1 warp 27.6 -> 27.0 us; the same bits;
# docs/figures/h200_s9/moe9.json, moe92.json).
PDL: bool = True
GEMV_MAX_TOKENS: int = 1
GEMV: tuple[int, int, int, int, int, int, str, int, str, int] | None = (32, 256, 1, 64, 128, 4, "dot", 3, "assign", 3)  # fmt: skip
# The persistent grouped GEMMs (``triton_moe.MoEPlan.persist``): rows ``(n_assign, up, down,
# gate/up programs per SM, down programs per SM, half[, dynamic])``; a row whose ``n_assign``
# is a DECODE row's bound replaces that row's tiles (its ``block_m`` is the alignment's).
# Empty (off): measured on the H200 (scripts/gpu_s11_moegemm.sh; docs/figures/h200_s13/
# moegemm.json, the layer at 64 tokens, µs): they win only where few experts are routed,
# and lose where a trained router spreads the tokens. Routed uniformly (126 experts) the
# committed grid kernels 287.0, every persistent plan slower (p32-dyn 289.3, p16 312.3, p64
# 343.0); from a pool of 15 experts (the random preset's concentrated routing in bench
# offline's 64-prompt steps) p64 54.4 against 71.7, of 24 p32-64 78.5 against 84.5. Session
# 12's engine A/B (random:qwen3-30b-a3b, 64 rows: p64 5.457 vs 5.905 ms a step, the same
# greedy tokens; its JSON did not survive that session) measured that random routing, not a
# checkpoint's: at uniform routing p64 would cost a 48-layer step ~2.7 ms.
Persistent = tuple[int, Tiles, Tiles, int, int, bool] | tuple[int, Tiles, Tiles, int, int, bool, bool]  # fmt: skip
PERSISTENT: tuple[Persistent, ...] = ()
