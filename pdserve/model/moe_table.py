"""Tiles of the fused MoE kernels at decode sizes (``pdserve.model.triton_moe.pick_plan``).

``DECODE``: rows ``(n_assign, up, down, down_sum, triton_sum)`` ascending in ``n_assign``
(tokens x top-k): a batch of at most ``n_assign`` assignments (experts seeing <= 16 tokens
each) runs the gate/up kernel at ``up`` and the down kernel at ``down`` (``(block_m,
block_n, block_k, num_warps, num_stages)``, the same ``block_m``), or, when ``down_sum`` is
``(kind, BLOCK_N, BLOCK_K, num_warps, num_stages)`` (``triton_moe.DownSum``), the down
projection, routing weights and top-k sum in one launch; ``triton_sum``: the top-k sum
after the grouped down kernel in Triton instead of torch. ``ROUTE_ALIGN_WARPS``: ``(router
logits T x E up to, warps)`` of ``route_align``'s one program.

Written by ``scripts/gpu_s6_moe.py --write-table SWEEP.json`` from an H200 sweep; first
values: main's untuned tiles (16, 64, 128, 4, 3) everywhere, until that run.
"""

from __future__ import annotations

Tiles = tuple[int, int, int, int, int]
DownSum = tuple[str, int, int, int, int]

DECODE: tuple[tuple[int, Tiles, Tiles, DownSum | None, bool], ...] = (
    (2048, (16, 64, 128, 4, 3), (16, 64, 128, 4, 3), None, False),
)
ROUTE_ALIGN_WARPS: tuple[tuple[int, int], ...] = ()
