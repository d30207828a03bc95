"""The few-token MoE path on CUDA (Triton) and the kernels it shares with the grouped path,
split out of ``pdserve.model.triton_moe`` (which re-exports every name here).

:func:`route_experts_gemv`: routing fused into the gate/up launch, no sort (see the section
comment below); :func:`topk_sum` (the top-k sum kernel) and ``_down_sum`` (the one-launch
down projection + routing weights + top-k sum), used by both paths.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.model import pdl
from pdserve.model.fused_splitk_norm import SplitKPartials
from pdserve.model.pdl import pdl_enter
from pdserve.model.triton_act import silu_mul_rounded

# The one-launch down projection + routing weights + top-k sum: (kind, BLOCK_N, BLOCK_K,
# num_warps, num_stages); kind "rows" (elementwise fp32 products, all k experts' tiles in
# one load; num_stages unused) or "dot" (tensor cores, 16-row tiles, pipelined loads).
DownSum = tuple[str, int, int, int, int]


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` on tensor cores; ``IEEE``: fp32 inputs in full precision (no TF32)."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _count_forward(stats_ptr, distinct):
    """One forward that routed to ``distinct`` experts added to the float64 counters
    ``stats_ptr[0]`` (experts) and ``stats_ptr[1]`` (forwards) (one program only)."""
    tl.store(stats_ptr, tl.load(stats_ptr) + distinct)
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + 1.0)


@triton.jit
def _gate_up_dot_loop(
    x_ptrs,
    g_ptrs,
    u_ptrs,
    xrows,
    cmask,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The gate/up K loop of the MoE kernels on tensor cores (``_gate_up_kernel``,
    ``_route_gate_up_kernel``): ``[BLOCK_M, BLOCK_K]`` tiles of x (``x_ptrs``, rows
    where ``xrows`` ``[BLOCK_M, 1]``, else 0) times ``[BLOCK_K, BLOCK_N]`` tiles of the gate
    and up rows (``g_ptrs``, ``u_ptrs``: k along dim 0, columns where ``cmask``), ``K`` in
    ``BLOCK_K`` chunks. Returns the fp32 ``(gate, up)`` accumulators ``[BLOCK_M, BLOCK_N]``."""
    ks = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        xa = tl.load(x_ptrs, mask=xrows & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & cmask[None, :]
        g = tl.load(g_ptrs, mask=wmask, other=0.0)
        u = tl.load(u_ptrs, mask=wmask, other=0.0)
        acc_g = _dot(xa, g, acc_g, IEEE)
        acc_u = _dot(xa, u, acc_u, IEEE)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _down_dot_loop(
    a_ptrs,
    w_ptrs,
    arows,
    cmask,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The down projection's K loop on tensor cores (``_down_kernel``,
    ``_down_assign_kernel``): ``[BLOCK_M, BLOCK_K]`` tiles of act (rows where ``arows``)
    times ``[BLOCK_K, BLOCK_N]`` tiles of ``w2[e]`` (columns where ``cmask``). Returns the
    fp32 accumulator ``[BLOCK_M, BLOCK_N]``."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        a = tl.load(a_ptrs, mask=arows & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = _dot(a, w, acc, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


def topk_sum(out: torch.Tensor, T: int, k: int, opts: dict[str, Any]) -> torch.Tensor:
    """``out [T * k, H]`` (contiguous) summed over each token's k rows -> ``[T, H]`` in
    out's dtype (``_topk_sum_kernel``: fp32 sum, one rounding); opts: launch options
    (:func:`moe_pdl`)."""
    H = out.shape[1]
    total = torch.empty((T, H), dtype=out.dtype, device=out.device)
    block = min(1024, triton.next_power_of_2(H))
    _topk_sum_kernel[(T, triton.cdiv(H, block))](
        out, total, H, TOP_K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_H=block, num_warps=4,
        **opts,
    )  # fmt: skip
    return total


@triton.jit
def _topk_sum_kernel(
    src_ptr,
    dst_ptr,
    H,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: ``dst[t, h] = sum_j src[t * TOP_K + j, h]`` (src
    ``[T * TOP_K, H]``, dst ``[T, H]``, contiguous), summed in fp32 and rounded once, as
    torch's ``sum(dim=1)`` of the ``[T, TOP_K, H]`` view."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_K)
    mask = (j[:, None] < TOP_K) & (h[None, :] < H)
    v = tl.load(src_ptr + (t * TOP_K + j[:, None]) * H + h[None, :], mask=mask, other=0.0)
    total = tl.sum(v.to(tl.float32), axis=0)
    tl.store(dst_ptr + t * H + h, total.to(dst_ptr.dtype.element_ty), mask=h < H)


def _down_sum(
    act: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    T: int,
    H: int,
    k: int,
    tiles: DownSum,
) -> torch.Tensor:
    """The down projection, routing weights and top-k sum in one launch over act
    ``[T * k, I]`` (row ``t * k + j``) -> ``[T, H]`` in act's dtype; tiles: a
    :data:`DownSum` (``"rows"``: ``_down_sum_gemv_kernel``, ``"dot"``:
    ``_down_sum_dot_kernel``)."""
    kind, bn, bk, warps, stages = tiles
    out = torch.empty((T, H), dtype=act.dtype, device=act.device)
    args = (
        act,
        w2,
        out,
        weights.contiguous(),
        ids.contiguous(),
        act.shape[1],
        H,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
    )
    grid = (T, triton.cdiv(H, bn))
    opts = dict(TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl.launch_options(act))
    if kind == "dot":
        ieee = act.dtype == torch.float32
        _down_sum_dot_kernel[grid](*args, IEEE=ieee, num_stages=stages, **opts)
    elif kind == "rows":
        _down_sum_gemv_kernel[grid](*args, BLOCK_J=triton.next_power_of_2(k), **opts)
    else:
        raise ValueError(f"down_sum kind: 'rows' or 'dot', got {kind!r}")
    return out


# ------------------------------------------------------------------ few-token decode path
# For a handful of tokens (decode at batch 1-4) there is nothing to group: each assignment
# reads its own expert's rows. Three launches a layer instead of five (router GEMM,
# route_align, gate_up, down, top-k sum): the router GEMM (cuBLAS), then
#  1. ``_route_gate_up_kernel``: program (assignment a = t * k + j, column block of I)
#     takes token t's router logits (E values), softmax in fp32, k rounds of argmax (the
#     order of route_align), keeps the j-th expert e and weight, stores them (column block
#     0 only), then the GEMV act[a] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n]);
#  2. ``_down_sum_gemv_kernel``: program (token t, column block of H) sums over j the
#     weighted GEMVs weight[a] * (act[a] . w2[e, n]): the down projection, the routing
#     weights and the top-k sum in one kernel, each token's k experts read once.
# GEMVs as pdserve.model.triton_gemv's ``rows`` kernel does them (no tensor cores: w * x
# elementwise in fp32, one sum at the end; many programs of BLOCK_N output features so the
# weight reads fill the memory system). No sort, no padding, no host sync: CUDA-graph
# capturable, shapes fixed by T.


@triton.jit
def _route_one(
    logits_ptr, s_lt, t, j, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Token ``t``'s ``j``-th expert and its routing weight, from its router logits (row
    ``t`` of ``logits_ptr``, stride ``s_lt``, ``E`` experts): softmax in fp32, the
    ``TOP_K`` largest in order (ties to the lower id, as ``tl.argmax``), renormalised over
    them when ``RENORM``. Returns ``(expert id int32, weight fp32)``."""
    ev = tl.arange(0, BLOCK_E)
    emask = ev < E
    lg = tl.load(logits_ptr + t * s_lt + ev, mask=emask, other=-float("inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = tl.where(emask, p, 0.0)
    p = p / tl.sum(p, axis=0)
    left = tl.where(emask, p, -1.0)
    total = tl.sum(tl.zeros((BLOCK_E,), dtype=tl.float32), axis=0)  # fp32 scalars
    sel_w = total
    sel_e = tl.sum(tl.zeros((BLOCK_E,), dtype=tl.int32), axis=0)
    for jj in tl.static_range(TOP_K):
        top = tl.max(left, axis=0)
        arg = tl.argmax(left, axis=0)
        total += top
        sel_w = tl.where(j == jj, top, sel_w)
        sel_e = tl.where(j == jj, arg, sel_e)
        left = tl.where(ev == arg, -1.0, left)
    if RENORM:
        sel_w = sel_w / total
    return sel_e, sel_w


@triton.jit
def _route_gate_up_kernel(
    logits_ptr,
    x_ptr,
    w_ptr,
    act_ptr,
    rw_ptr,
    ids_ptr,
    E,
    K,
    INTER,
    s_lt,
    s_xt,
    s_we,
    s_wn,
    s_an,
    stats_ptr,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    STATS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T * TOP_K, cdiv(INTER, BLOCK_N))``: routing of token ``a // TOP_K`` (its
    ``a % TOP_K``-th expert) and ``act[a, n]`` for the block's columns ``n``, rounded as
    ``_gate_up_kernel`` rounds (torch's: gate, up, silu(gate), the product). ``DOT``: the
    products on tensor cores, x's row in a 16-row tile (rows 1-15 zero) times ``[BLOCK_K,
    BLOCK_N]`` weight tiles, the loads software-pipelined (``num_stages``; ``IEEE``: fp32
    inputs in full precision); else elementwise fp32 products summed once at the end.
    ``STATS`` (one token only): program (0, 0) adds the forward's ``TOP_K`` distinct experts
    and one forward to ``stats_ptr``'s two float64 counters (``SparseMoeBlock``'s routing
    counters, in this launch instead of their own kernels)."""
    pdl_enter(PDL)
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = a // TOP_K
    sel_e, sel_w = _route_one(logits_ptr, s_lt, t, a % TOP_K, E, TOP_K, RENORM, BLOCK_E)
    if pid_n == 0:
        tl.store(ids_ptr + a, sel_e.to(tl.int64))
        tl.store(rw_ptr + a, sel_w)
        if STATS:  # noqa: SIM102 (a constexpr, then a scalar of the program)
            if a == 0:
                _count_forward(stats_ptr, TOP_K)
    e = sel_e.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    ty = act_ptr.dtype.element_ty
    if DOT:
        rows = tl.arange(0, 16)
        first = rows[:, None] == 0
        g_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
        u_ptrs = g_ptrs + INTER * s_wn
        x_ptrs = x_ptr + t.to(tl.int64) * s_xt + ks[None, :] + rows[:, None] * 0
        acc_g, acc_u = _gate_up_dot_loop(
            x_ptrs, g_ptrs, u_ptrs, first, cmask, K, 16, BLOCK_N, BLOCK_K, IEEE
        )
        a_ptrs = act_ptr + a.to(tl.int64) * s_an + cols[None, :] + rows[:, None] * 0
        out = silu_mul_rounded(acc_g.to(ty), acc_u.to(ty))
        tl.store(a_ptrs, out, mask=first & cmask[None, :])
    else:
        g_ptrs = w_ptr + e * s_we + cols[:, None].to(tl.int64) * s_wn + ks[None, :]
        u_ptrs = g_ptrs + INTER * s_wn
        x_ptrs = x_ptr + t.to(tl.int64) * s_xt + ks
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = ks + k0 < K
            xv = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)[None, :]
            wmask = cmask[:, None] & kmask[None, :]
            acc_g += tl.load(g_ptrs, mask=wmask, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(u_ptrs, mask=wmask, other=0.0).to(tl.float32) * xv
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        out = silu_mul_rounded(tl.sum(acc_g, axis=1).to(ty), tl.sum(acc_u, axis=1).to(ty))
        tl.store(act_ptr + a.to(tl.int64) * s_an + cols, out, mask=cmask)


@triton.jit
def _down_sum_gemv_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_ot,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T, cdiv(HID, BLOCK_N))``: ``out[t, n] = sum_j rw[a] * (act[a] . w2[e_a, n])``
    over the token's assignments ``a = t * TOP_K + j``; each term rounded to out's dtype as
    _down_kernel rounds it, the k terms summed in fp32 and rounded once (the top-k sum).
    The k experts' tiles are one ``[BLOCK_J, BLOCK_N, BLOCK_K]`` load (``BLOCK_J`` = k
    rounded up to a power of two): all k weight reads in flight at once."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    js = tl.arange(0, BLOCK_J)
    jmask = js < TOP_K
    a = t.to(tl.int64) * TOP_K + js  # [BLOCK_J]
    e = tl.load(ids_ptr + a, mask=jmask, other=0)
    rw = tl.load(rw_ptr + a, mask=jmask, other=0.0)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = (
        w_ptr
        + e[:, None, None] * s_we
        + cols[None, :, None].to(tl.int64) * s_wn
        + ks[None, None, :]
    )
    a_ptrs = act_ptr + a[:, None] * s_an + ks[None, :]
    wmask = jmask[:, None, None] & cmask[None, :, None]
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        av = tl.load(a_ptrs, mask=jmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=wmask & kmask[None, None, :], other=0.0)
        acc += w.to(tl.float32) * av[:, None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    ty = out_ptr.dtype.element_ty
    term = tl.sum(acc, axis=2).to(ty).to(tl.float32) * rw[:, None]  # [BLOCK_J, BLOCK_N]
    total = tl.sum(term.to(ty).to(tl.float32), axis=0)  # padded j rows are 0
    tl.store(out_ptr + t.to(tl.int64) * s_ot + cols, total.to(ty), mask=cmask)


@triton.jit
def _down_sum_dot_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_ot,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_down_sum_gemv_kernel``'s work (same grid, roundings and stores) on tensor cores:
    one pipelined loop over the token's k experts times K chunks, the act row in a 16-row
    tile (rows 1-15 zero) times ``[BLOCK_K, BLOCK_N]`` tiles of ``w2[e_j]``; after an
    expert's last chunk its term (rounded, times its weight, rounded) joins the fp32 total."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    rows = tl.arange(0, 16)
    first = rows[:, None] == 0
    ks = tl.arange(0, BLOCK_K)
    nk = tl.cdiv(K, BLOCK_K)
    ty = out_ptr.dtype.element_ty
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for i in range(0, TOP_K * nk):
        j = i // nk
        k0 = (i - j * nk) * BLOCK_K
        a = t * TOP_K + j
        e = tl.load(ids_ptr + a)
        kmask = ks + k0 < K
        av = tl.load(
            act_ptr + a * s_an + k0 + ks[None, :] + rows[:, None] * 0,
            mask=first & kmask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + k0 + ks[:, None],
            mask=kmask[:, None] & cmask[None, :],
            other=0.0,
        )
        acc = _dot(av, w, acc, IEEE)
        flush = k0 + BLOCK_K >= K
        rw = tl.load(rw_ptr + a)
        term = (acc.to(ty).to(tl.float32) * rw).to(ty).to(tl.float32)
        total = tl.where(flush, total + term, total)
        acc = tl.where(flush, 0.0, acc)
    o_ptrs = out_ptr + t * s_ot + cols[None, :] + rows[:, None] * 0
    tl.store(o_ptrs, total.to(ty), mask=first & cmask[None, :])


@triton.jit
def _down_assign_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_on,
    sum_ptr,
    cnt_ptr,
    s_st,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SUM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T * TOP_K, cdiv(HID, BLOCK_N))``: ``out[a, n] = rw[a] * (act[a] . w2[e_a, n])``
    for assignment ``a`` (expert ``ids[a]``), rounded as ``_down_kernel`` rounds it (the
    product rounded to out's dtype, times the weight in fp32, rounded); the act row in a
    16-row tile (rows 1-15 zero) on tensor cores, ``num_stages`` pipelined loads. The
    few-token path's down projection when ``GemvConfig.down_kind == "assign"``: one program
    per (assignment, column block), so the k experts' reads spread over k times the
    programs of the one-launch down + sum; the top-k sum follows (``_topk_sum_kernel``)."""
    pdl_enter(PDL)
    a = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    rows = tl.arange(0, 16)
    first = rows[:, None] == 0
    ks = tl.arange(0, BLOCK_K)
    e = tl.load(ids_ptr + a)
    a_ptrs = act_ptr + a * s_an + ks[None, :] + rows[:, None] * 0
    w_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
    acc = _down_dot_loop(a_ptrs, w_ptrs, first, cmask, K, 16, BLOCK_N, BLOCK_K, IEEE)
    ty = out_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + a)
    o = (acc.to(ty).to(tl.float32) * rw).to(ty)
    o_ptrs = out_ptr + a * s_on + cols[None, :] + rows[:, None] * 0
    tl.store(o_ptrs, o, mask=first & cmask[None, :])
    if SUM:
        one = tl.arange(0, 1)  # the program's one token as a row vector
        _last_sums_topk(out_ptr, sum_ptr, cnt_ptr, a // TOP_K + one, one == 0, cols, cmask,
                        s_on, s_st, TOP_K, BLOCK_J)  # fmt: skip


@triton.jit
def _last_sums_topk(out_ptr, sum_ptr, cnt_ptr, tok, live, cols, cmask, s_on, s_st,
                    TOP_K: tl.constexpr, BLOCK_J: tl.constexpr):  # fmt: skip
    """The top-k sum inside a down kernel (``down_kind="assign_sum"``, a plan's
    ``fused_sum``): after a program has stored its ``out`` rows of this column block
    (``pid 1``), each of its ``live`` rows (token ``tok``, ``[BLOCK_M]``) adds one to that
    (token, column block)'s counter (``cnt_ptr``, int32, zero between launches); where it
    finds ``TOP_K - 1`` (the token's last of k) it resets the counter and sums the token's
    k rows of the block as ``_topk_sum_kernel`` does (fp32, j in one fixed order, rounded
    once) into ``sum[tok]``. No atomics on the values: the bits of ``_topk_sum_kernel``."""
    tl.debug_barrier()  # every thread's stores of the block before the release below
    c_ptrs = cnt_ptr + tok * tl.num_programs(1) + tl.program_id(1)
    seen = tl.atomic_add(c_ptrs, 1, mask=live, sem="acq_rel", scope="gpu")
    last = live & (seen == TOP_K - 1)
    tl.store(c_ptrs, 0, mask=last)
    j = tl.arange(0, BLOCK_J)
    v = tl.load(
        out_ptr + (tok[:, None, None] * TOP_K + j[None, :, None]) * s_on + cols[None, None, :],
        mask=last[:, None, None] & (j < TOP_K)[None, :, None] & cmask[None, None, :],
        other=0.0,
        cache_modifier=".cg",  # the other programs' rows: from L2, not a stale L1
    )
    total = tl.sum(v.to(tl.float32), axis=1)
    s_ptrs = sum_ptr + tok[:, None] * s_st + cols[None, :]
    tl.store(s_ptrs, total.to(sum_ptr.dtype.element_ty), mask=last[:, None] & cmask[None, :])


_COUNTERS: list[torch.Tensor] = []  # every counter buffer made (graphs hold their pointers)


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """At least ``n`` int32 zeros on ``device`` for ``_last_sums_topk`` (kept for the
    process: each launch leaves them zero again, so CUDA graphs can share them)."""
    for c in reversed(_COUNTERS):
        if c.device == device and c.numel() >= n:
            return c
    c = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    _COUNTERS.append(c)
    return c


class GemvConfig(NamedTuple):
    """Tiles of the few-token path: output features and reduction chunk per program of the
    gate/up kernel (``up_n``, ``up_k``, ``up_warps``) and of the down + sum kernel
    (``down_n``, ``down_k``, ``down_warps``); ``up_kind``: the gate/up products as
    elementwise fp32 sums (``"rows"``) or on tensor cores in 16-row tiles (``"dot"``,
    ``up_stages`` pipelined loads; ``up_n`` and ``up_k`` >= 16); ``down_kind`` and
    ``down_stages`` likewise for the down + sum kernel (see :data:`DownSum`), or
    ``"assign"``: the down projection per assignment (``_down_assign_kernel``, tensor cores,
    ``down_n`` >= 16) then the top-k sum kernel: three launches with the gate/up; or
    ``"assign_sum"``: the same down kernel summing the top-k rows itself (the last of a
    token's k programs of a column block, ``_last_sums_topk``): two launches, the same
    bits.)"""

    up_n: int = 16
    up_k: int = 512
    up_warps: int = 8
    down_n: int = 4
    down_k: int = 256
    down_warps: int = 8
    up_kind: str = "rows"
    up_stages: int = 3
    down_kind: str = "rows"
    down_stages: int = 3


def gemv_config() -> GemvConfig:
    """The few-token path's default tiles: ``moe_table.GEMV`` (a measured pick) when set,
    else :class:`GemvConfig`'s defaults."""
    from pdserve.model import moe_table

    row = getattr(moe_table, "GEMV", None)
    return GemvConfig(*row) if row else GemvConfig()


def gemv_fits(tokens: int) -> bool:
    """Whether a forward of ``tokens`` rows takes the few-token path (:func:`route_experts_gemv`):
    ``0 < tokens <= PDSERVE_MOE_GEMV_MAX_TOKENS`` when that is set, else ``<=
    moe_table.GEMV_MAX_TOKENS`` (a measured pick, 0: never). Each token's experts are read
    for it alone, so past a few tokens sharing experts the grouped kernels read fewer bytes."""
    from pdserve import envs
    from pdserve.model import moe_table

    if envs.MOE_GEMV_MAX_TOKENS.is_set():
        bound = envs.MOE_GEMV_MAX_TOKENS.get()
    else:
        bound = getattr(moe_table, "GEMV_MAX_TOKENS", 0)
    return 0 < tokens <= bound


def route_experts_gemv(
    router_logits: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: GemvConfig | None = None,
    stats: torch.Tensor | None = None,
    rows_out: bool = False,
) -> tuple[torch.Tensor | SplitKPartials, torch.Tensor, torch.Tensor]:
    """Routing and the experts' weighted sum of a few tokens in two launches (no sort).

    router_logits ``[T, E]`` (any float dtype, last dim contiguous); x ``[T, H]``
    (fp32/bf16/fp16); w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` in x's dtype, last dim
    contiguous. Returns ``(out [T, H] in x's dtype, weights [T, k] float32, ids [T, k]
    int64)``: the routing of :func:`pdserve.model.moe.route` (same ids and order, weights
    to fp32 rounding) and the sum of ``pdserve.model.moe.experts_loop`` (fp32
    accumulation, its roundings; summation order differs). Shapes fixed by T: capturable in
    a CUDA graph. stats: ``[2]`` float64 routing counters (one row of
    ``SparseMoeBlock.routing_stats``) that the gate/up launch adds this forward to; one
    token only (its k experts are distinct). rows_out: with the ``"assign"`` down kernel,
    ``out`` is its weighted rows unsummed, a ``fused_splitk_norm.SplitKPartials`` (``parts
    [k, T, H]`` in x's dtype) that the next add + RMSNorm kernel sums as ``topk_sum``
    would: one launch fewer (other down kinds ignore it)."""
    cfg = config or gemv_config()
    T, E = router_logits.shape
    H = x.shape[1]
    inter = w13.shape[1] // 2
    dev = x.device
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=dev)
    if T == 0:
        return torch.empty((0, H), dtype=x.dtype, device=dev), weights, ids
    assert router_logits.stride(1) == 1 and x.stride(1) == 1
    assert stats is None or T == 1, "routing counted in the kernel for one token only"
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need a contiguous last dim"
    act = torch.empty((T * top_k, inter), dtype=x.dtype, device=dev)
    args = (
        router_logits,
        x,
        w13,
        act,
        weights,
        ids,
        E,
        H,
        inter,
        router_logits.stride(0),
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        stats if stats is not None else weights,
    )
    grid = (T * top_k, triton.cdiv(inter, cfg.up_n))
    common = dict(
        TOP_K=top_k,
        RENORM=renormalize,
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_N=cfg.up_n,
        BLOCK_K=cfg.up_k,
        num_warps=cfg.up_warps,
        **pdl.launch_options(x),
    )
    if cfg.up_kind not in ("dot", "rows"):
        raise ValueError(f"GemvConfig.up_kind: 'rows' or 'dot', got {cfg.up_kind!r}")
    stages = dict(num_stages=cfg.up_stages) if cfg.up_kind == "dot" else {}
    _route_gate_up_kernel[grid](
        *args, DOT=cfg.up_kind == "dot", IEEE=x.dtype == torch.float32, STATS=stats is not None,
        **stages, **common,
    )  # fmt: skip
    if cfg.down_kind in ("assign", "assign_sum"):
        opts = pdl.launch_options(x)
        per = torch.empty((T * top_k, H), dtype=x.dtype, device=dev)
        fused = cfg.down_kind == "assign_sum"
        nb = triton.cdiv(H, cfg.down_n)
        total = torch.empty((T, H), dtype=x.dtype, device=dev) if fused else per
        cnt = _counters(T * nb, dev) if fused else ids
        _down_assign_kernel[(T * top_k, nb)](
            act, w2, per, weights, ids, inter, H, act.stride(0), w2.stride(0), w2.stride(1),
            per.stride(0), total, cnt, total.stride(0), TOP_K=top_k,
            BLOCK_J=triton.next_power_of_2(top_k), BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k,
            IEEE=x.dtype == torch.float32, SUM=fused, num_warps=cfg.down_warps,
            num_stages=cfg.down_stages, **opts,
        )  # fmt: skip
        if rows_out and not fused:
            rows = per.view(T, top_k, H).permute(1, 0, 2)  # [k, T, H]: the partials' layout
            return SplitKPartials(rows, None, x.dtype), weights, ids
        return (total if fused else topk_sum(per, T, top_k, opts)), weights, ids
    tiles = (cfg.down_kind, cfg.down_n, cfg.down_k, cfg.down_warps, cfg.down_stages)
    out = _down_sum(act, w2, weights, ids, T, H, top_k, tiles)
    return out, weights, ids
