"""FP8 linears with per-channel (one-group) e4m3 weights, in Triton, CUDA: the kernels that
issue 26's H200 figures asked for (the CPU tests run them under ``TRITON_INTERPRET=1``).

``quantize_rows``  dynamic per-token e4m3 quantization of activations ``x [M, K]`` in one
          launch (one program a row): ``amax`` of the row, ``scale = max(amax, 1e-12) *
          fp32(1 / 448)``, ``q = clamp(x / scale, -448, 448)`` (IEEE division) rounded to
          e4m3, ties to even; the same arithmetic as
          :func:`pdserve.model.fp8.quantize_rows` (its torch form, ~8 kernels), so the same
          bits on the CPU interpreter. Graph-safe: no host syncs, outputs allocated before
          the launch.
``w8a8``  ``xq [M, K] e4m3 @ w [N, K] e4m3 .T`` on the FP8 tensor cores (``tl.dot`` of two
          e4m3 tiles, fp32 accumulation), ``* x_scale[m] * w_scale[n]`` (+ bias) in the
          epilogue, written in the output dtype. ``SWAP`` computes the transposed tile
          ``w_tile @ xq_tile.T`` (``[BLOCK_N, BLOCK_M]``: the weight rows are the MMA's M
          side, so a few tokens still fill Hopper's 64-row wgmma; both operands stay
          K-contiguous, as FP8 wgmma wants). K may be cut into ``SPLIT`` slices whose fp32
          partials a second kernel sums in slice order (deterministic) when the tiles alone
          leave SMs idle.
``w8a16`` (:func:`linear_w8a16`) the same tiles on bf16/fp16 activations, not quantized:
          the weight tile is converted to their dtype in registers (16-bit tensor cores).
``gemv``  one row, bf16/fp16/fp32 activations (no activation quantization): each program
          owns ``BLOCK_N`` weight rows, walks K in ``BLOCK_K`` tiles read as e4m3 (unmasked
          along K when ``BLOCK_K`` divides K, so the loads stay 16-byte wide), multiplies in
          fp32 and applies the per-channel scale once at the end: the structure of the bf16
          GEMV of :mod:`pdserve.model.triton_gemv` on half the bytes. Under PDL its first
          weight tile is read before the wait for the kernel before it
          (:data:`GEMV_EARLY_WEIGHTS`; the w8a8 kernel asks for its first tiles in L2,
          :data:`W8A8_PREFETCH`): weights are never written during a step.

Which kernel and tile runs for which shape and row count is chosen when the model loads by
:func:`pdserve.model.fp8.choose_paths` (timed on the card); this module only runs what it is
given.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.model import pdl
from pdserve.model.pdl import pdl_enter, prefetch_l2
from pdserve.model.triton_gemv_parts import REDUCE_BLOCK, _load_x, _splitk_reduce_kernel

# (tl.constexpr: a @triton.jit function may read no other module global when compiled)
FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # rounded to fp32 where used, in the kernel and torch
AMAX_FLOOR = tl.constexpr(1e-12)  # an all-zero row: scale 1e-12 / 448, its values stay 0
# (kind "w8a8", BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, SWAP, num_warps, num_stages)
W8a8Config = tuple[str, int, int, int, int, bool, int, int]
# (kind "gemv", BLOCK_N, BLOCK_K, num_warps, num_stages)
GemvConfig = tuple[str, int, int, int, int]
MIN_BLOCK = 16  # tl.dot's smallest tile side on CUDA
# Triton's CPU interpreter runs the e4m3 tl.dot (and fp16's) right but not bf16's (errors
# of 1e8 on unit-sized inputs, triton 3.9): there the bf16 tiles of linear_w8a16 are upcast
# to fp32 and multiplied in IEEE fp32 (the same products: bf16 x bf16 is exact in fp32).
# Read once: the interpreter is chosen per process.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_e4m3(v):
    """``v`` (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32
    arithmetic: adding and taking away ``1.5 * 2**23`` e4m3 ulps of v's binade rounds at that
    ulp (fp32 addition rounds to nearest even). The e4m3 cast of the result is exact, whatever
    rounding the cast itself does (Triton's CPU interpreter rounds some values wrongly)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    ulp_exp = tl.maximum(exp, 127 - 6) - 3  # e4m3: 3 mantissa bits, subnormal below 2**-6
    c = (((ulp_exp + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    a = tl.abs(v)
    r = (a + c) - c
    return tl.where(bits < 0, -r, r)  # the sign bit: -0 stays -0, as the cast keeps it


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    s_xm,
    s_qm,
    BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(M,)``: row ``m`` of ``x`` -> ``q[m, :]`` e4m3 and ``s[m]`` fp32. ``ONE_TILE``:
    K <= BLOCK_K, the row is read once; else twice (amax, then quantize)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    xr = x_ptr + row * s_xm
    qr = q_ptr + row * s_qm
    if ONE_TILE:
        x = tl.load(xr + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        amax_v = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            v = tl.load(xr + kk, mask=kk < K, other=0.0).to(tl.float32)
            amax_v = tl.maximum(amax_v, tl.abs(v))
        amax = tl.max(amax_v, 0)
    # times the fp32 reciprocal of 448, as the torch reference computes it (torch's CUDA
    # division by a scalar multiplies by its reciprocal; a product is the same everywhere)
    scale = tl.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX
    tl.store(s_ptr + row, scale)
    if ONE_TILE:
        q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX))
        tl.store(qr + rk, q.to(q_ptr.dtype.element_ty), mask=rk < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            v = tl.load(xr + kk, mask=kk < K, other=0.0).to(tl.float32)
            q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(v, scale), -FP8_MAX), FP8_MAX))
            tl.store(qr + kk, q.to(q_ptr.dtype.element_ty), mask=kk < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of ``x [M, K]`` (any float dtype, last dim contiguous)
    in one launch: ``(xq [M, K] float8_e4m3fn, scale [M, 1] fp32)`` with ``x ≈ xq.float() *
    scale``, ``scale = max(amax(|row|), 1e-12) * fp32(1 / 448)``."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    block = min(8192, triton.next_power_of_2(max(K, 16)))
    _quant_rows_kernel[(M,)](
        x,
        q,
        s,
        K,
        x.stride(0),
        q.stride(0),
        BLOCK_K=block,
        ONE_TILE=block >= K,
        num_warps=8 if block >= 4096 else 4,
        **pdl.launch_options(x),
    )
    return q, s


@triton.jit
def _w8a8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    o_ptr,
    M,
    N,
    K,
    K_SPLIT,
    s_xm,
    s_wn,
    s_om,
    s_os,
    HAS_BIAS: tl.constexpr,
    A8: tl.constexpr,
    PARTIAL: tl.constexpr,
    SWAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), splits)``: ``o[m, n] = (sum_k x[m, k]
    w[n, k]) * xs[m] * ws[n] (+ b[n])`` over K slice ``program_id(2)`` (``K_SPLIT`` columns,
    a multiple of BLOCK_K). ``A8``: x is e4m3 with per-row scales xs; else x is bf16/fp16
    (no xs: 1), the weight tile converted to x's dtype in registers. ``PARTIAL``: store the
    scaled fp32 sum at ``o + slice * s_os`` (no bias; the reduce kernel adds it).
    ``EVEN_K``: BLOCK_K divides K (no K masks). ``PREFETCH`` > 0 (CUDA, under PDL): the
    first ``PREFETCH`` 128-byte lines of each of the program's weight rows in its K slice
    are asked for in L2 before the PDL wait (weights are never written by a step)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_s * K_SPLIT
    if PREFETCH > 0:
        lines = tl.minimum(k_lo + tl.arange(0, PREFETCH) * 128, K - 1)
        rows = tl.minimum(rn, N - 1).to(tl.int64) * s_wn
        prefetch_l2(w_ptr + rows[:, None] + lines[None, :])
    pdl_enter(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_xm  # [BLOCK_M, 1]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=nmask[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=mmask[:, None], other=0.0)
        else:
            kmask = kk < k_hi
            w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if EMULATE:  # the interpreter, bf16 activations: fp32 tiles (see _INTERPRET)
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        elif not A8:
            w = w.to(x.dtype)
        if A8:
            # e4m3 dots on Hopper accumulate with fewer bits than fp32 inside the MMA: each
            # K tile's sum is added to the fp32 accumulator (as _scaled_mm does without its
            # fast-accumulation option)
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K)
        elif SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    ws = tl.load(ws_ptr + rn, mask=nmask, other=0.0)
    if A8:
        xs = tl.load(xs_ptr + rm, mask=mmask, other=0.0)
    else:
        xs = tl.full([BLOCK_M], 1.0, tl.float32)
    if SWAP:
        out = acc * ws[:, None] * xs[None, :]  # [BLOCK_N, BLOCK_M]
        offs = rm[None, :] * s_om + rn[:, None]
        omask = nmask[:, None] & mmask[None, :]
        if HAS_BIAS and not PARTIAL:
            out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
    else:
        out = acc * xs[:, None] * ws[None, :]  # [BLOCK_M, BLOCK_N]
        offs = rm[:, None] * s_om + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
        if HAS_BIAS and not PARTIAL:
            out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if PARTIAL:
        tl.store(o_ptr + pid_s * s_os + offs, out, mask=omask)
    else:
        tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=omask)


# Whether the w8a8 kernel under PDL asks for its first weight tiles in L2 before the wait
# (see _w8a8_kernel's PREFETCH). On: the H200's one-row FP8 step under PDL 2.737 ms with
# it, 2.745 without (scripts/gpu_s7_fp8row.sh).
W8A8_PREFETCH = True


def default_w8a8_config(m: int, n: int, k: int) -> W8a8Config:
    """A w8a8 tile for ``m`` rows of an ``[n, k]`` weight where none was measured: swapped
    ``[64, BLOCK_M]`` tiles up to 64 rows (BLOCK_M the power of two >= m, at least 16),
    else ``[64, 128]`` row tiles; BLOCK_K 128; K split (:func:`_split_for`) when the tiles
    make fewer than 264 programs (two per SM of an H200)."""
    if m <= 64:
        bm, bn, swap = max(MIN_BLOCK, triton.next_power_of_2(m)), 64, True
    else:
        bm, bn, swap = 64, 128, False
    split = _split_for(triton.cdiv(n, bn) * triton.cdiv(m, bm), k, 128)
    return ("w8a8", bm, bn, 128, split, swap, 4, 4)


def _split_for(programs: int, k: int, bk: int) -> int:
    """K slices for a grid of ``programs`` tiles: 1 from 264 programs (two per SM of an H200)
    or under 4 K tiles, else the power of two <= ``264 / programs`` (rounded up), at most 8
    and at most ``k / (2 bk)`` (each slice two K tiles at least)."""
    if programs >= 264 or k < 4 * bk:
        return 1
    want = min(8, -(-264 // programs), k // (2 * bk))
    return 1 << (want.bit_length() - 1)


def candidate_configs(m: int, n: int, k: int) -> list[W8a8Config]:
    """The w8a8 tiles :func:`pdserve.model.fp8.choose_paths` times for ``m`` rows of an
    ``[n, k]`` weight: up to 64 rows swapped tiles ``[64 | 128 weight rows, BLOCK_M]``
    (BLOCK_M the power of two >= m, at least 16; BLOCK_K 128, and 256 for the 64-row tile),
    each whole and split along K when the tiles leave SMs idle; from 65 rows ``[64 | 128,
    128]`` row tiles and a swapped ``[128, 64]`` tile, likewise."""
    out: list[W8a8Config] = []
    if m <= 64:
        bm = max(MIN_BLOCK, triton.next_power_of_2(m))
        tiles = [(bm, 64, 128, True, 4), (bm, 128, 128, True, 4), (bm, 64, 256, True, 4)]
    else:
        tiles = [(64, 128, 128, False, 4), (128, 128, 128, False, 8), (64, 128, 128, True, 4)]
    for bm, bn, bk, swap, warps in tiles:
        programs = triton.cdiv(n, bn) * triton.cdiv(m, bm)
        stages = 4 if bm * bn * bk <= 64 * 64 * 256 else 3
        for split in sorted({1, _split_for(programs, k, bk)}):
            out.append(("w8a8", bm, bn, bk, split, swap, warps, stages))
    return out


def w8a8(
    xq: torch.Tensor,
    x_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: W8a8Config | None = None,
) -> torch.Tensor:
    """``(xq [M, K] e4m3 * x_scale [M, 1]) @ (w [N, K] e4m3 * w_scale [N] or [N, 1]).T +
    bias [N]`` -> ``[M, N]`` in ``out_dtype``, on the FP8 tensor cores (fp32 accumulation;
    the scales and the bias applied in fp32 before the one rounding). With ``x_scale``
    None, xq is bf16/fp16 activations (not quantized) and the weight tiles are converted
    to their dtype in registers (16-bit tensor cores: :func:`linear_w8a16`). config: a
    :data:`W8a8Config` (default :func:`default_w8a8_config`). ValueError for a tile under
    16 (Triton cannot build that ``tl.dot`` on CUDA) or a kind other than ``w8a8``."""
    M, K = xq.shape
    N = w.shape[0]
    kind, bm, bn, bk, split, swap, warps, stages = config or default_w8a8_config(M, N, K)
    if kind != "w8a8" or min(bm, bn, bk) < MIN_BLOCK:
        raise ValueError(f"w8a8: config {config} is not a w8a8 tile of sides >= {MIN_BLOCK}")
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_split)
    dst = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=xq.device)
    b = bias if bias is not None else w_scale
    opts = pdl.launch_options(xq)
    # under PDL: the weight lines of the first num_stages K tiles (the pipeline's prologue)
    ahead = triton.next_power_of_2(max(1, stages * bk * w.element_size() // 128))
    prefetch = ahead if W8A8_PREFETCH and opts.get("PDL") else 0
    _w8a8_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm), split)](
        xq,
        x_scale if x_scale is not None else w_scale,
        w,
        w_scale,
        b,
        dst,
        M,
        N,
        K,
        k_split,
        xq.stride(0),
        w.stride(0),
        N,
        M * N,
        HAS_BIAS=bias is not None,
        A8=x_scale is not None,
        PARTIAL=split > 1,
        SWAP=swap,
        EVEN_K=K % bk == 0,
        EMULATE=_INTERPRET and x_scale is None and xq.dtype == torch.bfloat16,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PREFETCH=prefetch,
        num_warps=warps,
        num_stages=stages,
        **opts,
    )
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            dst,
            b,
            out,
            N,
            M * N,
            HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=REDUCE_BLOCK,
            num_warps=4,
            **opts,
        )
    return out


def linear_w8a8(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: W8a8Config | None = None,
) -> torch.Tensor:
    """``x [M, K] @ (w [N, K] e4m3 * w_scale).T + bias`` with x quantized per token
    (:func:`quantize_rows`, one launch) and :func:`w8a8` (one launch, two with split-K):
    ``[M, N]`` in x's dtype."""
    xq, xs = quantize_rows(x)
    return w8a8(xq, xs, w, w_scale, bias, x.dtype, config)


def linear_w8a16(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: W8a8Config | None = None,
) -> torch.Tensor:
    """``x [M, K] bf16/fp16 @ (w [N, K] e4m3 * w_scale).T + bias`` with the :func:`w8a8`
    kernel's tiles, x not quantized (the weight tile converted to x's dtype in registers;
    swapped tiles put the weight on the MMA's 64-row side): ``[M, N]`` in x's dtype."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"linear_w8a16 takes bf16/fp16 activations, got {x.dtype}")
    return w8a8(x, None, w, w_scale, bias, x.dtype, config)


@triton.jit
def _gemv_w(w_rows, kk, nmask, K, EVEN_K: tl.constexpr):
    """The e4m3 weight tile ``w[n, kk]`` ``[BLOCK_N, BLOCK_K]`` (zeros past N and K)."""
    if EVEN_K:
        return tl.load(w_rows + kk[None, :], mask=nmask[:, None], other=0.0)
    return tl.load(w_rows + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _gemv_x(x_ptr, kk, K, EVEN_K: tl.constexpr, SILU: tl.constexpr):
    """x at ``kk`` in fp32 (zeros past K); ``SILU``: ``silu(gate) * up`` of ``[gate | up]``."""
    if SILU:
        x = _load_x(x_ptr, kk, kk < K, K, True)
    elif EVEN_K:
        x = tl.load(x_ptr + kk)
    else:
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    o_ptr,
    N,
    K,
    s_wn,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU: tl.constexpr,
    W_EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N),)``, one row: ``o[n] = (sum_k w[n, k] x[k]) * s[n] (+ b[n])``
    with w e4m3 and the sum in fp32. ``EVEN_K``: BLOCK_K divides K. ``SILU``: the row is
    ``[gate | up]`` (2K wide) and ``x = silu(gate) * up``, computed as it is loaded
    (``triton_gemv_parts._load_x``: ``fused_ops.silu_mul``'s rounding). ``W_EARLY``: the
    first weight tile is read before the PDL wait (a weight is never written by the kernels
    before this one, so under PDL its read overlaps their tail); the same sums either way."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    if W_EARLY:
        w0 = _gemv_w(w_rows, rk, nmask, K, EVEN_K)
        pdl_enter(PDL)
    else:
        pdl_enter(PDL)
        w0 = _gemv_w(w_rows, rk, nmask, K, EVEN_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc += w0.to(tl.float32) * _gemv_x(x_ptr, rk, K, EVEN_K, SILU)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        w = _gemv_w(w_rows, kk, nmask, K, EVEN_K)
        acc += w.to(tl.float32) * _gemv_x(x_ptr, kk, K, EVEN_K, SILU)[None, :]
    out = tl.sum(acc, 1) * tl.load(s_ptr + rn, mask=nmask, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(o_ptr + rn, out.to(o_ptr.dtype.element_ty), mask=nmask)


# Whether the one-row gemv reads its first weight tile before the PDL wait (see
# _gemv_kernel's W_EARLY). On: the H200's one-row FP8 step under PDL 2.718 ms with it,
# 2.745 without (scripts/gpu_s7_fp8row.sh). Asking for its first 32 lines of each weight
# row in L2 instead was slower (2.870): not kept.
GEMV_EARLY_WEIGHTS = True


DEFAULT_GEMV: GemvConfig = ("gemv", 16, 1024, 8, 1)
# The gemv tiles fp8.choose_paths times at one row (weight rows x K columns a program).
# The bf16 GEMV's measured best at Llama-3.1-8B's shapes (gemv_table.py) was 8 x 512 and
# 16 x 1024 (num_stages 1); the same bytes in e4m3 are twice the columns, hence both.
GEMV_CANDIDATES: tuple[GemvConfig, ...] = (
    ("gemv", 8, 512, 4, 1),
    DEFAULT_GEMV,
    ("gemv", 8, 1024, 4, 1),
    ("gemv", 16, 2048, 8, 1),
)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x [1, K] @ (w [N, K] e4m3 * w_scale [N] or [N, 1]).T + bias`` -> ``[1, N]`` in x's
    dtype; x is not quantized. With ``silu_mul`` x is ``[gate | up]`` ``[1, 2K]`` and the
    product is taken with ``silu(gate) * up`` computed in the kernel (SwiGLU's activation
    and the down projection in one launch). ValueError for more than one row, or an x of
    the wrong width."""
    M, K = x.shape
    if M != 1:
        raise ValueError(f"the FP8 gemv takes one row, got M={M}")
    N = w.shape[0]
    if silu_mul:
        if 2 * w.shape[1] != K:
            raise ValueError(f"silu_mul: x must be [1, 2K] = [1, {2 * w.shape[1]}], got {K}")
        K = w.shape[1]
    kind, bn, bk, warps, stages = config or DEFAULT_GEMV
    if kind != "gemv":
        raise ValueError(f"gemv: config {config} is not a gemv config")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x,
        w,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        N,
        K,
        w.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=K % bk == 0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SILU=silu_mul,
        W_EARLY=GEMV_EARLY_WEIGHTS,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_options(x),
    )
    return out
