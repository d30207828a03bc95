"""The one-row FP8 ``gemvk`` kernel that ``scripts/gpu_s8_fp8g.py`` / ``gpu_s8_fp8g2.py``
timed against the engine's gemv (``pdserve.model.triton_w8a8.gemv``): not used by the engine.
On the H200 it read 0.68-0.79 of the gemv's GB/s at Llama-3.1-8B's one-row shapes (o:
7.70 vs 5.85 us, down: 20.7 vs 16.3 us; 32-layer chain 2,883 vs 2,090 us,
docs/benchmarks.md row S8-FP8G); kept here, beside its sweep, to run that again.

Design: the weight tile is read as ``[BLOCK_N, BLOCK_K / 16, 16]`` (one 16-byte load a
thread per 16 columns) and each 16-column product summed in the thread at once, so the fp32
accumulator is 16 times smaller than the gemv's ``[BLOCK_N, BLOCK_K]`` and registers go to
weight bytes in flight (``AHEAD``: the next tile loaded before the current one is
multiplied); K may be split into slices whose partials the engine's split-K reduce kernel
sums. Runs on CPU under ``TRITON_INTERPRET=1`` (``scripts/gpu_s8_fp8g2.py --cpu`` compares it
with the current path there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.model import pdl, triton_w8a8
from pdserve.model.pdl import pdl_enter
from pdserve.model.triton_gemv_parts import REDUCE_BLOCK, _splitk_reduce_kernel

# (kind "gemvk", BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages, AHEAD)
GemvkConfig = tuple[str, int, int, int, int, int, bool]
# e4m3 bytes a thread reads in one vector load (the ``V`` side of gemvk's tiles)
GEMVK_VEC = 16


@triton.jit
def _gemvk_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    o_ptr,
    N,
    K,
    K_SPLIT,
    s_wn,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    V: tl.constexpr,
    AHEAD: tl.constexpr,
    W_EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), splits)``, one row, ``BLOCK_K`` divides K and ``K_SPLIT``:
    ``o[n] = (sum_k w[n, k] x[k]) * s[n] (+ b[n])`` over K slice ``program_id(1)``, w e4m3.
    The weight tile is read as ``[BLOCK_N, BLOCK_K / V, V]`` (V contiguous e4m3 bytes: one
    16-byte load a thread) and its products summed over V at once, so the fp32 accumulator
    is ``[BLOCK_N, BLOCK_K / V]`` (V times smaller than the plain gemv's): registers go to
    loads in flight instead. ``AHEAD``: the next K tile is loaded before the current one is
    multiplied (two tiles in flight a program). ``PARTIAL``: the scaled fp32 sum goes to
    ``o + slice * N`` (no bias; the split-K reduce kernel adds it). ``W_EARLY``: the first
    tile is read before the PDL wait (weights are never written by a step)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    nmask = rn < N
    offs = tl.arange(0, BLOCK_K // V)[:, None] * V + tl.arange(0, V)[None, :]  # [C, V]
    w_rows = w_ptr + rn[:, None, None].to(tl.int64) * s_wn + offs[None, :, :]
    wmask = nmask[:, None, None]
    if W_EARLY:
        w = tl.load(w_rows + k_lo, mask=wmask, other=0.0)
        pdl_enter(PDL)
    else:
        pdl_enter(PDL)
        w = tl.load(w_rows + k_lo, mask=wmask, other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_K // V], tl.float32)
    if AHEAD:
        for k0 in range(k_lo, k_hi - BLOCK_K, BLOCK_K):
            w_next = tl.load(w_rows + (k0 + BLOCK_K), mask=wmask, other=0.0)
            x = tl.load(x_ptr + k0 + offs).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :, :], 2)
            w = w_next
        x = tl.load(x_ptr + (k_hi - BLOCK_K) + offs).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :, :], 2)
    else:
        x = tl.load(x_ptr + k_lo + offs).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :, :], 2)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            w = tl.load(w_rows + k0, mask=wmask, other=0.0)
            x = tl.load(x_ptr + k0 + offs).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :, :], 2)
    out = tl.sum(acc, 1) * tl.load(s_ptr + rn, mask=nmask, other=0.0)
    if PARTIAL:
        tl.store(o_ptr + tl.program_id(1) * N + rn, out, mask=nmask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(o_ptr + rn, out.to(o_ptr.dtype.element_ty), mask=nmask)


def gemvk(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvkConfig,
) -> torch.Tensor:
    """``x [1, K] @ (w [N, K] e4m3 * w_scale [N] or [N, 1]).T + bias`` -> ``[1, N]`` in x's
    dtype (x bf16/fp16/fp32, not quantized) by :func:`_gemvk_kernel`, K cut into ``SPLIT``
    slices of whole ``BLOCK_K`` tiles whose fp32 partials the split-K reduce kernel sums in
    slice order. ValueError for more than one row, a config of another kind, or a
    ``BLOCK_K`` that is not a multiple of 16 dividing K (the kernel reads whole tiles)."""
    M, K = x.shape
    if M != 1:
        raise ValueError(f"the FP8 gemvk takes one row, got M={M}")
    kind, bn, bk, split, warps, stages, ahead = config
    if kind != "gemvk" or bk % GEMVK_VEC or K % bk:
        raise ValueError(f"gemvk: config {config} does not fit K={K} (BLOCK_K | K, 16 | BLOCK_K)")
    N = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_split)
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    dst = out if split == 1 else torch.empty(split, 1, N, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else w_scale
    opts = pdl.launch_options(x)
    _gemvk_kernel[(triton.cdiv(N, bn), split)](
        x,
        w,
        w_scale,
        b,
        dst,
        N,
        K,
        k_split,
        w.stride(0),
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        BLOCK_N=bn,
        BLOCK_K=bk,
        V=GEMVK_VEC,
        AHEAD=ahead,
        W_EARLY=triton_w8a8.GEMV_EARLY_WEIGHTS,
        num_warps=warps,
        num_stages=stages,
        **opts,
    )
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(N, REDUCE_BLOCK),)](
            dst,
            b,
            out,
            N,
            N,
            HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=REDUCE_BLOCK,
            num_warps=4,
            **opts,
        )
    return out
