"""Fused mixture-of-experts experts on CUDA (Triton): tokens grouped by expert, two grouped GEMMs.

For ``T`` tokens routed to ``k`` experts each there are ``N = T * k`` assignments (flat id
``a = t * k + j``). :func:`align` sorts the assignments by expert and pads each expert's
group to a multiple of ``BLOCK_M``, so every ``BLOCK_M`` rows of the sorted list belong to
one expert (the block's expert). Then:

1. ``_gate_up_kernel``: per (row block, column block of I) one program loads the block's
   token rows of x, multiplies them by the block expert's gate and up rows of ``w13``
   (fp32 accumulators) and writes ``silu(gate) * up`` to ``act[a]`` ``[N, I]``;
2. ``_down_kernel``: per (row block, column block of H) ``act[a] @ w2[e].T`` times the
   assignment's routing weight, written to ``out[a]`` ``[N, H]``;
3. the ``k`` rows of each token are summed (``out.view(T, k, H).sum(1)``, or
   ``_topk_sum_kernel`` when the plan says so: faster on the H200 at every decode size).

The tiles are a :class:`MoEPlan` per assignment count (:func:`pick_plan`, at decode sizes
from ``pdserve.model.moe_table``, measured by scripts/gpu_s6_moe.sh). A plan's ``persist``
runs both GEMMs as persistent kernels instead (a few programs per SM walking only the used
row blocks' tiles; see the section comment at ``_gate_up_persist_kernel``): off unless
``moe_table.PERSISTENT`` has a row.

For decode batches (up to :data:`ROUTE_ALIGN_MAX_CELLS` router logits) the routing and the
alignment are one launch (``_route_align_kernel``) instead of ~20 small torch kernels per
layer; that one program's serial rounds grow with the tokens, so :class:`RouteAlignConfig`
can also split it into the routing in many programs and the alignment in one, or take each
assignment's rank within its expert from a tensor-core product (``moe_table.ROUTE_ALIGN``
says which per token count). Each program reads its expert's weights once for up to ``BLOCK_M`` tokens, so a decode step
(few tokens per expert) reads each routed expert's weights once per column block: the
decode path is the same kernels with a small ``BLOCK_M``. Buffers are sized from ``T``,
``k`` and ``E`` only (at most ``N + min(N, E) * (BLOCK_M - 1)`` sorted rows) and the used
length stays on the device (programs past it return at once), so a step's launch has fixed
shapes for a fixed ``T`` and no host sync: CUDA-graph capturable per batch bucket.

A few tokens (at most ``moe_table.GEMV_MAX_TOKENS``, or ``PDSERVE_MOE_GEMV_MAX_TOKENS``) skip the sort: :func:`route_experts_gemv`
routes inside the gate/up GEMV and applies the routing weights and the top-k sum inside the
down GEMV (two launches, see the section below).

Tested on CPU under ``TRITON_INTERPRET=1`` against ``pdserve.model.moe.experts_loop``.

This module holds the grouped GEMMs and their plans; the routing and alignment live in
``pdserve.model.triton_moe_route``, the few-token path and the top-k sum kernels in
``pdserve.model.triton_moe_gemv`` (every name of both importable from here).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.model.fused_splitk_norm import SplitKPartials
from pdserve.model.pdl import pdl_enter
from pdserve.model.triton_act import silu_mul_rounded
from pdserve.model.triton_moe_gemv import (
    DownSum,
    GemvConfig,
    _counters,
    _down_assign_kernel,
    _down_dot_loop,
    _down_sum,
    _down_sum_dot_kernel,
    _down_sum_gemv_kernel,
    _gate_up_dot_loop,
    _last_sums_topk,
    _route_gate_up_kernel,
    _route_one,
    _topk_sum_kernel,
    gemv_config,
    gemv_fits,
    route_experts_gemv,
    topk_sum,
)
from pdserve.model.triton_moe_route import (
    ROUTE_ALIGN_MAX_CELLS,
    Alignment,
    RouteAlignConfig,
    _align_experts_kernel,
    _route_align_kernel,
    _route_kernel,
    _route_topk,
    align,
    max_rows,
    moe_pdl,
    route_align,
    route_align_config,
    route_align_fits,
    route_align_warps,
)

# the few-token path and the routing / alignment live in triton_moe_gemv and
# triton_moe_route; their names stay importable from here
__all__ = [
    "_align_experts_kernel",
    "_down_assign_kernel",
    "_down_sum",
    "_down_sum_dot_kernel",
    "_down_sum_gemv_kernel",
    "_route_align_kernel",
    "_route_gate_up_kernel",
    "_route_kernel",
    "_route_one",
    "_route_topk",
    "_topk_sum_kernel",
    "align",
    "Alignment",
    "DownSum",
    "gemv_config",
    "gemv_fits",
    "GemvConfig",
    "max_rows",
    "moe_pdl",
    "route_align",
    "route_align_config",
    "route_align_fits",
    "ROUTE_ALIGN_MAX_CELLS",
    "route_align_warps",
    "route_experts_gemv",
    "RouteAlignConfig",
    "topk_sum",
    "MoEConfig",
    "MoEPlan",
    "as_plan",
    "fused_experts",
    "grouped_experts",
    "pick_config",
    "persistent_programs",
    "pick_plan",
]


@triton.jit
def _gate_up_tile(
    x_ptr,
    w_ptr,
    act_ptr,
    ids_ptr,
    bexp_ptr,
    pid_m,
    pid_n,
    N,
    K,
    INTER,
    s_xt,
    s_we,
    s_wn,
    s_an,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One output tile of the gate/up GEMM: the first ``ROWS`` rows of row block ``pid_m``
    (``BLOCK_M`` rows of the alignment, one expert) and column block ``pid_n`` of I:
    ``act[a, n] = silu(x[a // k] . w13[e, n]) * (x[a // k] . w13[e, INTER + n])``, fp32
    accumulation in ascending K chunks, rounded to act's dtype once (torch's roundings)."""
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, ROWS)
    a_ids = tl.load(ids_ptr + rows)
    valid = a_ids < N
    tok = (a_ids // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * s_xt + ks[None, :]
    g_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
    u_ptrs = g_ptrs + INTER * s_wn
    acc_g, acc_u = _gate_up_dot_loop(
        x_ptrs, g_ptrs, u_ptrs, valid[:, None], cmask, K, ROWS, BLOCK_N, BLOCK_K, IEEE
    )
    ty = act_ptr.dtype.element_ty
    out = silu_mul_rounded(acc_g.to(ty), acc_u.to(ty))  # torch's roundings (silu(gate) * up)
    a_ptrs = act_ptr + a_ids[:, None].to(tl.int64) * s_an + cols[None, :]
    tl.store(a_ptrs, out, mask=valid[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=("N",))  # per-step sizes: no recompile
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    ids_ptr,
    bexp_ptr,
    used_ptr,
    N,
    K,
    INTER,
    s_xt,
    s_we,
    s_wn,
    s_an,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[a, n] = silu(x[a // k] . w13[e, n]) * (x[a // k] . w13[e, INTER + n]) for the
    block's rows a and columns n; fp32 accumulation, rounded to act's dtype once."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    _gate_up_tile(x_ptr, w_ptr, act_ptr, ids_ptr, bexp_ptr, pid_m, pid_n, N, K, INTER, s_xt,
                  s_we, s_wn, s_an, TOP_K, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)  # fmt: skip


@triton.jit
def _down_tile(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    bexp_ptr,
    pid_m,
    pid_n,
    N,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_on,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One output tile of the down GEMM: the first ``ROWS`` rows of row block ``pid_m``
    (``BLOCK_M`` rows of the alignment, one expert) and column block ``pid_n`` of H:
    ``out[a, n] = routing_weight[a] * (act[a] . w2[e, n])`` (fp32 accumulation in
    ascending K chunks; the product rounded to out's dtype, times the weight in fp32,
    rounded). Returns ``(a64, valid, cols, cmask)`` of the tile (the fused top-k sum's)."""
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, ROWS)
    a_ids = tl.load(ids_ptr + rows)
    valid = a_ids < N
    a64 = a_ids.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + a64[:, None] * s_an + ks[None, :]
    w_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
    acc = _down_dot_loop(a_ptrs, w_ptrs, valid[:, None], cmask, K, ROWS, BLOCK_N, BLOCK_K, IEEE)
    rw = tl.load(rw_ptr + a64, mask=valid, other=0.0)
    out = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * rw[:, None]
    o_ptrs = out_ptr + a64[:, None] * s_on + cols[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])
    return a64, valid, cols, cmask


@triton.jit(do_not_specialize=("N",))  # per-step sizes: no recompile
def _down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    bexp_ptr,
    used_ptr,
    N,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_on,
    sum_ptr,
    cnt_ptr,
    s_st,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    SUM: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[a, n] = routing_weight[a] * (act[a] . w2[e, n]) for the block's rows a and
    hidden columns n (fp32 accumulation; the product in fp32, rounded once). ``SUM``: then
    the top-k sum of each token whose last assignment this program wrote
    (``_last_sums_topk``) into ``sum [T, H]``."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    a64, valid, cols, cmask = _down_tile(act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, bexp_ptr,
                                         pid_m, pid_n, N, K, HID, s_an, s_we, s_wn, s_on,
                                         BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)  # fmt: skip
    if SUM:
        _last_sums_topk(out_ptr, sum_ptr, cnt_ptr, a64 // TOP_K, valid, cols, cmask, s_on, s_st,
                        TOP_K, BLOCK_J)  # fmt: skip


# ------------------------------------------------------------------ persistent grouped GEMMs
# The grid above is sized for the worst routing (``max_rows``: every expert used, each padded
# by BLOCK_M - 1 rows), because a CUDA graph fixes it: at 64 tokens x top 8 over 128 experts
# with 16-row blocks, 152 row blocks, of which a batch routed to 24 experts uses ~48; the
# other programs (~2/3 of the launch: ~1,250 of gate/up's, ~3,300 of down's) start, read
# ``used`` and return, interleaved with the working ones. The persistent kernels below launch
# ``P`` programs (a few per SM) that walk only the used tiles (tile ``t``: row block ``t //
# column blocks``, column block ``t % column blocks``, so programs working at the same time
# read neighbouring column blocks of the same expert): ``t = pid, pid + P, ...``, or with
# ``DYN`` the next tile from a device counter (``tl.atomic_add``, asked one tile ahead), so
# a program that finishes early takes more; the last program out zeroes the counters for
# the next launch (``_release_tiles``). With ``HALF`` (row blocks of >= 32) a block whose
# second half is padding (an expert's last block holding <= BLOCK_M / 2 rows) is
# multiplied as a tile of BLOCK_M / 2 rows: with 32-row blocks, a batch whose experts see
# ~20 rows each reads each expert's weights once (one block), and experts of a few rows
# cost the MMAs of 16-row blocks. Each output element is the same sum in the same order as
# the kernels above (``_gate_up_tile`` / ``_down_tile``).
@triton.jit
def _release_tiles(cnt_ptr):
    """End of a ``DYN`` persistent program: count it out in ``cnt_ptr[1]``; the last of the
    grid's programs (every one has taken its last tile index from ``cnt_ptr[0]`` before
    counting out: acq_rel) zeroes both counters for the next launch."""
    done = tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(cnt_ptr, 0)
        tl.store(cnt_ptr + 1, 0)


@triton.jit
def _gate_up_any_tile(
    x_ptr, w_ptr, act_ptr, ids_ptr, bexp_ptr, t, nb, N, K, INTER, s_xt, s_we, s_wn, s_an,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HALF: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Tile ``t`` of the persistent gate/up kernel (``nb`` column blocks a row block): the
    whole row block, or with ``HALF`` its first half when its row ``BLOCK_M / 2`` is padding."""
    pid_m = t // nb
    pid_n = t - pid_m * nb
    if HALF:
        if tl.load(ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) < N:
            _gate_up_tile(x_ptr, w_ptr, act_ptr, ids_ptr, bexp_ptr, pid_m, pid_n, N, K, INTER,
                          s_xt, s_we, s_wn, s_an, TOP_K, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K,
                          IEEE)  # fmt: skip
        else:
            _gate_up_tile(x_ptr, w_ptr, act_ptr, ids_ptr, bexp_ptr, pid_m, pid_n, N, K, INTER,
                          s_xt, s_we, s_wn, s_an, TOP_K, BLOCK_M, BLOCK_M // 2, BLOCK_N,
                          BLOCK_K, IEEE)  # fmt: skip
    else:
        _gate_up_tile(x_ptr, w_ptr, act_ptr, ids_ptr, bexp_ptr, pid_m, pid_n, N, K, INTER, s_xt,
                      s_we, s_wn, s_an, TOP_K, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)  # fmt: skip


@triton.jit(do_not_specialize=("N",))  # per-step sizes: no recompile
def _gate_up_persist_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    ids_ptr,
    bexp_ptr,
    used_ptr,
    cnt_ptr,
    N,
    K,
    INTER,
    s_xt,
    s_we,
    s_wn,
    s_an,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF: tl.constexpr,
    DYN: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(P,)`` persistent: ``_gate_up_kernel``'s tiles over the used row blocks only
    (``used`` rows, on the device), tile ``t`` by program ``t % P``, or with ``DYN`` as the
    counters ``cnt_ptr [2]`` int32 (zero between launches) hand them out; ``HALF``: a block
    whose row ``BLOCK_M / 2`` is padding as a tile of ``BLOCK_M / 2`` rows."""
    pdl_enter(PDL)
    nb = tl.cdiv(INTER, BLOCK_N)
    tiles = tl.load(used_ptr) // BLOCK_M * nb
    if DYN:
        t = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
        while t < tiles:
            nxt = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")  # under this tile
            _gate_up_any_tile(x_ptr, w_ptr, act_ptr, ids_ptr, bexp_ptr, t, nb, N, K, INTER,
                              s_xt, s_we, s_wn, s_an, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, HALF,
                              IEEE)  # fmt: skip
            t = nxt
        _release_tiles(cnt_ptr)
    else:
        for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _gate_up_any_tile(x_ptr, w_ptr, act_ptr, ids_ptr, bexp_ptr, t, nb, N, K, INTER,
                              s_xt, s_we, s_wn, s_an, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, HALF,
                              IEEE)  # fmt: skip


@triton.jit
def _down_any_tile(
    act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, bexp_ptr, t, nb, N, K, HID, s_an, s_we, s_wn, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """Tile ``t`` of the persistent down kernel, as ``_gate_up_any_tile`` takes its rows."""
    pid_m = t // nb
    pid_n = t - pid_m * nb
    if HALF:
        if tl.load(ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) < N:
            _down_tile(act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, bexp_ptr, pid_m, pid_n, N, K,
                       HID, s_an, s_we, s_wn, s_on, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K,
                       IEEE)  # fmt: skip
        else:
            _down_tile(act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, bexp_ptr, pid_m, pid_n, N, K,
                       HID, s_an, s_we, s_wn, s_on, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                       IEEE)  # fmt: skip
    else:
        _down_tile(act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, bexp_ptr, pid_m, pid_n, N, K, HID,
                   s_an, s_we, s_wn, s_on, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)  # fmt: skip


@triton.jit(do_not_specialize=("N",))  # per-step sizes: no recompile
def _down_persist_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    bexp_ptr,
    used_ptr,
    cnt_ptr,
    N,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF: tl.constexpr,
    DYN: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(P,)`` persistent: ``_down_kernel``'s tiles (no fused top-k sum) over the
    used row blocks only, handed out as ``_gate_up_persist_kernel`` hands them."""
    pdl_enter(PDL)
    nb = tl.cdiv(HID, BLOCK_N)
    tiles = tl.load(used_ptr) // BLOCK_M * nb
    if DYN:
        t = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
        while t < tiles:
            nxt = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")  # under this tile
            _down_any_tile(act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, bexp_ptr, t, nb, N, K, HID,
                           s_an, s_we, s_wn, s_on, BLOCK_M, BLOCK_N, BLOCK_K, HALF, IEEE)  # fmt: skip
            t = nxt
        _release_tiles(cnt_ptr)
    else:
        for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _down_any_tile(act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, bexp_ptr, t, nb, N, K, HID,
                           s_an, s_we, s_wn, s_on, BLOCK_M, BLOCK_N, BLOCK_K, HALF, IEEE)  # fmt: skip


class MoEConfig(NamedTuple):
    """Tile sizes of one launch: rows per block (``block_m``: tokens of one expert), the
    output-column and reduction tiles, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(n_assign: int, n_experts: int) -> MoEConfig:
    """The gate/up tiles of :func:`pick_plan` (its ``block_m`` is the alignment's)."""
    return pick_plan(n_assign, n_experts).up


class MoEPlan(NamedTuple):
    """How :func:`grouped_experts` runs: the gate/up kernel's tiles (``up``; its ``block_m``
    is the alignment's), the down kernel's (``down``, same ``block_m``), and ``down_sum``:
    the one-launch down projection + routing weights + top-k sum (a :data:`DownSum`; each
    token's k experts read for it alone), or None for the grouped down kernel then the
    top-k sum: in torch, or when ``triton_sum`` in ``_topk_sum_kernel`` (one small launch;
    torch's reduction kernel took 4.4 us a layer at 1 token on the H200), or when
    ``fused_sum`` inside the down kernel (``_last_sums_topk``: the program writing a token's
    last assignment of a column block sums its k rows there; the same bits, one launch
    fewer). ``persist``: ``(gate/up, down)`` programs per SM of the persistent kernels
    (``_gate_up_persist_kernel``, ``_down_persist_kernel``: only the used row blocks'
    tiles, no early-exit programs; the same bits as the kernels they replace), or None for
    the grid of every possible row block; ``half``: with ``persist`` and row blocks of >=
    32, a block whose second half is padding multiplied as a tile of half the rows;
    ``dynamic``: with ``persist``, tiles handed out by a device counter instead of
    round-robin. A persistent plan takes neither ``down_sum`` nor ``fused_sum``
    (ValueError)."""

    up: MoEConfig
    down: MoEConfig
    down_sum: DownSum | None = None
    triton_sum: bool = False
    fused_sum: bool = False
    persist: tuple[int, int] | None = None
    half: bool = True
    dynamic: bool = False


def pick_plan(n_assign: int, n_experts: int) -> MoEPlan:
    """The plan for ``n_assign`` assignments over ``n_experts``. While experts see at most 16
    tokens each (decode), ``pdserve.model.moe_table.DECODE``'s row of the smallest bound
    ``>= n_assign`` (the last row past them): tiles measured on the H200 per assignment
    count (scripts/gpu_s6_moe.sh). Larger batches: 32-row blocks up to 64 tokens an
    expert, then 64-row blocks (prefill). A ``moe_table.PERSISTENT`` row of the DECODE
    row's bound replaces its tiles by the persistent kernels' (``MoEPlan.persist``; the
    top-k sum as the DECODE row says, never fused in the down kernel)."""
    from pdserve.model import moe_table

    per_expert = n_assign / max(n_experts, 1)
    if per_expert <= 16 and moe_table.DECODE:
        row = next((r for r in moe_table.DECODE if r[0] >= n_assign), moe_table.DECODE[-1])
        plan = MoEPlan(MoEConfig(*row[1]), MoEConfig(*row[2]), *row[3:])
        for bound, up, down, up_per_sm, down_per_sm, half, *dyn in moe_table.PERSISTENT:
            if bound == row[0] and plan.down_sum is None:
                return plan._replace(up=MoEConfig(*up), down=MoEConfig(*down), fused_sum=False,
                                     persist=(up_per_sm, down_per_sm), half=half,
                                     dynamic=bool(dyn and dyn[0]))  # fmt: skip
        return plan
    if per_expert <= 64:
        c = MoEConfig(32, 64, 64, 4, 3)
    else:
        c = MoEConfig(64, 128, 64, 8, 3)
    return MoEPlan(c, c)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: MoEConfig | MoEPlan | None = None,
) -> torch.Tensor:
    """The experts' weighted sum with the two grouped-GEMM kernels (same contract as
    ``pdserve.model.moe.experts_loop``).

    x ``[T, H]`` (fp32/bf16/fp16); w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` (x's dtype, last
    dim contiguous); weights ``[T, k]`` float32; ids ``[T, k]`` int. Returns ``[T, H]`` in
    x's dtype. config: tiles of both kernels (a :class:`MoEConfig`) or a :class:`MoEPlan`
    (default :func:`pick_plan`). fp32 runs the dots in IEEE fp32 (no TF32)."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    plan = as_plan(config or pick_plan(ids.numel(), w13.shape[0]))
    al = align(ids, w13.shape[0], plan.up.block_m)
    out = grouped_experts(x, w13, w2, weights, al, plan, ids=ids)
    assert isinstance(out, torch.Tensor)
    return out


def as_plan(config: MoEConfig | MoEPlan) -> MoEPlan:
    """A :class:`MoEPlan` of ``config`` (a :class:`MoEConfig`: the same tiles for both
    kernels, no fused top-k sum)."""
    if isinstance(config, MoEPlan):
        return config
    return MoEPlan(config, config)


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    al: Alignment,
    cfg: MoEConfig | MoEPlan,
    ids: torch.Tensor | None = None,
    rows_out: bool = False,
) -> torch.Tensor | SplitKPartials:
    """The two grouped GEMMs over assignments already aligned (:func:`align` or
    :func:`route_align` with the plan's ``block_m``) and the top-k sum: x ``[T, H]``,
    weights ``[T, k]`` float32 -> ``[T, H]`` in x's dtype (see :func:`fused_experts`).
    cfg: a :class:`MoEPlan` or one :class:`MoEConfig` for both kernels. ids ``[T, k]``
    int64: the routed experts, needed by a plan's ``down_sum`` (ValueError without).
    rows_out: a plan whose top-k sum is the Triton kernel (``triton_sum``, not fused)
    returns the down kernel's weighted rows unsummed instead, a
    ``fused_splitk_norm.SplitKPartials`` (``parts [k, T, H]``) that the next add + RMSNorm
    kernel sums as that kernel would: one launch fewer."""
    plan = as_plan(cfg)
    up, dn = plan.up, plan.down
    T, H = x.shape
    inter = w13.shape[1] // 2
    k = weights.shape[1]
    N = T * k
    assert al.block_m == up.block_m == dn.block_m, "aligned to another row block"
    x = x.contiguous()
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need a contiguous last dim"
    act = torch.empty((N, inter), dtype=x.dtype, device=x.device)
    n_blocks = al.sorted_ids.numel() // up.block_m
    ieee = x.dtype == torch.float32
    opts = moe_pdl(x)
    if plan.persist is not None:
        if plan.down_sum is not None or plan.fused_sum:
            raise ValueError("a persistent plan takes neither down_sum nor fused_sum")
        return _grouped_persistent(x, w13, w2, weights, al, plan, act, rows_out)
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, up.block_n))](
        x,
        w13,
        act,
        al.sorted_ids,
        al.block_expert,
        al.used,
        N,
        H,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=k,
        BLOCK_M=up.block_m,
        BLOCK_N=up.block_n,
        BLOCK_K=up.block_k,
        IEEE=ieee,
        num_warps=up.num_warps,
        num_stages=up.num_stages,
        **opts,
    )
    if plan.down_sum is not None:
        if ids is None:
            raise ValueError("a plan with down_sum needs the routed expert ids")
        return _down_sum(act, w2, weights, ids, T, H, k, plan.down_sum)
    out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    nb = triton.cdiv(H, dn.block_n)
    fused = plan.fused_sum
    total = torch.empty((T, H), dtype=x.dtype, device=x.device) if fused else out
    cnt = _counters(T * nb, x.device) if fused else al.used
    _down_kernel[(n_blocks, nb)](
        act,
        w2,
        out,
        weights.contiguous().view(-1),
        al.sorted_ids,
        al.block_expert,
        al.used,
        N,
        inter,
        H,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        total,
        cnt,
        total.stride(0),
        BLOCK_M=dn.block_m,
        BLOCK_N=dn.block_n,
        BLOCK_K=dn.block_k,
        IEEE=ieee,
        TOP_K=k,
        BLOCK_J=triton.next_power_of_2(k),
        SUM=fused,
        num_warps=dn.num_warps,
        num_stages=dn.num_stages,
        **opts,
    )
    if fused:
        return total
    if rows_out and plan.triton_sum:
        return SplitKPartials(out.view(T, k, H).permute(1, 0, 2), None, x.dtype)
    if not plan.triton_sum:
        return out.view(T, k, H).sum(dim=1)
    return topk_sum(out, T, k, opts)


CPU_SMS = 2  # "SMs" of the persistent grid under the interpreter: a test sees several tiles each


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def persistent_programs(device: torch.device, per_sm: int, tiles: int) -> int:
    """Programs of a persistent grouped launch on ``device``: ``per_sm`` per SM (CUDA; under
    the interpreter ``CPU_SMS`` "SMs"), at most ``tiles`` (the tiles of every possible row
    block), at least one."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else CPU_SMS
    return max(1, min(per_sm * sms, tiles))


_TILE_COUNTERS: dict[torch.device, torch.Tensor] = {}  # graphs hold their pointers: kept


def _tile_counters(device: torch.device) -> torch.Tensor:
    """Four int32 zeros on ``device`` for the ``dynamic`` persistent kernels (gate/up's next
    tile and programs out, then down's), kept for the process: each launch leaves them zero
    (``_release_tiles``), so CUDA graphs share them; launches on one stream at a time."""
    if device not in _TILE_COUNTERS:
        _TILE_COUNTERS[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return _TILE_COUNTERS[device]


def _grouped_persistent(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    al: Alignment,
    plan: MoEPlan,
    act: torch.Tensor,
    rows_out: bool,
) -> torch.Tensor | SplitKPartials:
    """:func:`grouped_experts` with a ``persist`` plan: the persistent gate/up and down
    kernels (``(P,)`` grids, :func:`persistent_programs`), then the top-k sum as the plan's
    ``triton_sum`` says (or the rows unsummed for ``rows_out``)."""
    assert plan.persist is not None
    up, dn = plan.up, plan.down
    T, H = x.shape
    inter = w13.shape[1] // 2
    k = weights.shape[1]
    N = T * k
    n_blocks = al.sorted_ids.numel() // up.block_m
    ieee = x.dtype == torch.float32
    opts = moe_pdl(x)
    up_half = plan.half and up.block_m >= 32
    grid = (persistent_programs(x.device, plan.persist[0],
                                n_blocks * triton.cdiv(inter, up.block_n)),)  # fmt: skip
    cnt = _tile_counters(x.device)
    _gate_up_persist_kernel[grid](
        x, w13, act, al.sorted_ids, al.block_expert, al.used, cnt, N, H, inter, x.stride(0),
        w13.stride(0), w13.stride(1), act.stride(0), TOP_K=k, BLOCK_M=up.block_m,
        BLOCK_N=up.block_n, BLOCK_K=up.block_k, HALF=up_half, DYN=plan.dynamic, IEEE=ieee,
        num_warps=up.num_warps, num_stages=up.num_stages, **opts,
    )  # fmt: skip
    out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    grid = (persistent_programs(x.device, plan.persist[1], n_blocks * triton.cdiv(H, dn.block_n)),)
    _down_persist_kernel[grid](
        act, w2, out, weights.contiguous().view(-1), al.sorted_ids, al.block_expert, al.used,
        cnt[2:], N, inter, H, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=dn.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
        HALF=plan.half and dn.block_m >= 32, DYN=plan.dynamic, IEEE=ieee, num_warps=dn.num_warps,
        num_stages=dn.num_stages, **opts,
    )  # fmt: skip
    if rows_out and plan.triton_sum:
        return SplitKPartials(out.view(T, k, H).permute(1, 0, 2), None, x.dtype)
    if not plan.triton_sum:
        return out.view(T, k, H).sum(dim=1)
    return topk_sum(out, T, k, opts)
