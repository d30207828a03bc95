# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# (Triton kernels, as the other kernel modules in [tool.mypy.overrides] of pyproject.toml)
"""Skinny bf16 GEMM ``x @ w.T`` for decode batches of 16-256 rows, in Triton (CUDA; CPU tests
under ``TRITON_INTERPRET=1``), with early weight reads, split-K and a SwiGLU epilogue.

At 64 decode rows a Llama-3.1-8B linear layer is a weight read (qkv ``[6144, 4096]``, o
``[4096, 4096]``: 50 / 34 MB) too short to reach the bandwidth: cuBLAS has 48-96 output tiles
for 132 SMs and starts reading only once the kernel before it has ended. This kernel:

- tiles ``[BLOCK_M, BLOCK_N]`` of the output over ``SPLIT`` slices of K (grid
  ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT)``): enough programs for every SM; with
  ``SPLIT > 1`` each slice stores fp32 partials ``[SPLIT, M, N]``, summed in slice order
  by ``triton_gemv_parts._splitk_reduce_kernel`` or, where the next op is the residual
  add + RMSNorm, by that kernel (:func:`partials`, ``fused_splitk_norm.add_rms_norm``);
- under PDL (``pdl.launch_options``) asks for the first ``PREFETCH`` 128-byte lines of each
  of its weight rows in L2 before the grid-dependency wait, so the weight stream starts
  during the previous kernel's tail (weights are never written by a step);
- with ``SWIGLU`` (the gate/up projection, ``w = [gate; up]`` ``[2I, K]``) each program reads
  rows ``n`` and ``I + n`` and stores ``silu(gate) * up`` ``[M, I]`` (the gate and up
  outputs rounded to x's dtype first, then ``fused_ops.silu_mul``'s rounding): no separate
  activation kernel, no ``[M, 2I]`` round trip.

fp32 accumulation; results differ from cuBLAS only by summation order. Where which
configuration runs is not guessed: ``skinny_table`` (written from an H200 measurement,
``scripts/gpu_s8_mm64.py``), read by :func:`pick`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from pdserve.model import pdl, skinny_table
from pdserve.model.fused_splitk_norm import SplitKPartials
from pdserve.model.pdl import pdl_enter, prefetch_l2
from pdserve.model.triton_act import silu_mul_rounded
from pdserve.model.triton_gemv_parts import REDUCE_BLOCK, _splitk_reduce_kernel

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages, PREFETCH lines)
Config = tuple[int, int, int, int, int, int, int]
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=("M",))  # per-step sizes: no recompile
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, K_SPLIT, UP, s_xm, s_wn, s_om, s_os,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PARTIAL: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), splits)``: ``o[m, n] = sum_k x[m, k]
    w[n, k] (+ b[n])`` over K slice ``program_id(2)`` (``K_SPLIT`` columns, a multiple of
    BLOCK_K; BLOCK_K divides K). ``SWIGLU``: also ``u[m, n]`` from weight row ``UP + n``
    (bias ``b[UP + n]``), and ``o = silu(g) * u``. ``PARTIAL``: the fp32 sum stored at
    ``o + slice * s_os`` (no bias: the reduce adds it). ``PREFETCH`` > 0 (CUDA, PDL):
    the first lines of the program's weight rows asked for in L2 before the wait."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_s * K_SPLIT
    if PREFETCH > 0 and PDL:  # (PDL: CUDA; the interpreter has no inline PTX)
        lines = tl.minimum(k_lo + tl.arange(0, PREFETCH) * 64, K - 1)
        rows = tl.minimum(rn, N - 1).to(tl.int64) * s_wn
        prefetch_l2(w_ptr + rows[:, None] + lines[None, :])
        if SWIGLU:
            prefetch_l2(w_ptr + UP * s_wn + rows[:, None] + lines[None, :])
    pdl_enter(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn  # [BLOCK_N, 1]
    u_rows = w_rows + UP * s_wn
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_xm  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_rows + kk[None, :], mask=mmask[:, None], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=nmask[:, None], other=0.0)
        if EMULATE:  # the interpreter: fp32 tiles
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
        if SWIGLU:
            u = tl.load(u_rows + kk[None, :], mask=nmask[:, None], other=0.0)
            if EMULATE:
                u = u.to(tl.float32)
            acc_u = tl.dot(x, tl.trans(u), acc_u)
    offs = rm[:, None] * s_om + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if PARTIAL:
        tl.store(o_ptr + pid_s * s_os + offs, acc, mask=omask)
    else:
        ty = o_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            if HAS_BIAS:
                acc_u += tl.load(b_ptr + UP + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(o_ptr + offs, silu_mul_rounded(acc.to(ty), acc_u.to(ty)), mask=omask)
        else:
            tl.store(o_ptr + offs, acc.to(ty), mask=omask)


def check(config: Config, M: int, N: int, K: int, swiglu: bool = False) -> None:
    """ValueError when ``config`` cannot run ``[M, K] x [N, K]`` (N the output width: I for
    SwiGLU): BLOCK_K must divide K and every K slice be whole BLOCK_K tiles; SwiGLU takes no
    split; blocks are powers of two >= 16."""
    bm, bn, bk, split, _, _, _ = config
    for b in (bm, bn, bk):
        if b < 16 or b & (b - 1):
            raise ValueError(f"block {b} is not a power of two >= 16 ({config})")
    if K % bk or K % split or (K // split) % bk:
        raise ValueError(f"K={K} is not {split} slices of whole {bk}-column tiles")
    if swiglu and split != 1:
        raise ValueError("the SwiGLU epilogue takes no K split")


def run(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config,
    swiglu: bool = False,
    keep_partials: bool = False,
) -> torch.Tensor | SplitKPartials:
    """``x [M, K] @ weight[N, K].T + bias`` with ``config``: a new ``[M, N]`` tensor in x's
    dtype; with ``swiglu`` ``silu(g) * u`` of ``[g | u] = x @ weight.T + bias`` (``[M,
    N/2]``); with ``keep_partials`` and ``SPLIT > 1`` the unreduced
    :class:`~pdserve.model.fused_splitk_norm.SplitKPartials` (``[SPLIT, M, N]`` fp32).
    x and weight row-contiguous, one dtype. ValueError as :func:`check`."""
    bm, bn, bk, split, warps, stages, prefetch = config
    M, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    check(config, M, N, K, swiglu)
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == K and weight.dtype == x.dtype
    out = x.new_empty(M, N)
    parts = split > 1
    dst = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if parts else out
    if M:
        b: Any = bias if bias is not None else weight
        opts = pdl.launch_options(x)
        _skinny_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm), split)](
            x, weight, b, dst, M, N, K, K // split, N, x.stride(0), weight.stride(0), N, M * N,
            HAS_BIAS=bias is not None, SWIGLU=swiglu, PARTIAL=parts, EMULATE=_INTERPRET,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PREFETCH=prefetch if opts["PDL"] else 0,
            num_warps=warps, num_stages=stages, **opts,
        )  # fmt: skip
    if parts and keep_partials:
        return SplitKPartials(dst, bias, x.dtype)
    if parts and M:
        b2: Any = bias if bias is not None else weight
        _splitk_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            dst, b2, out, N, M * N, HAS_BIAS=bias is not None, SPLIT_K=split,
            BLOCK=REDUCE_BLOCK, num_warps=4, **pdl.launch_options(x),
        )  # fmt: skip
    return out


def pick(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> Config | None:
    """The measured configuration for ``x [M, K] @ weight[N, K].T`` (``swiglu``: the gate/up
    projection with its activation) from ``skinny_table`` when :data:`skinny_table.ON`:
    ``(kind, dtype name, N, K) -> ((m, config or None), ...)`` ascending in m, the entry
    of the smallest measured ``m >= M`` decides (a graph's rows are its bucket); None =
    not this kernel (past the last entry too)."""
    if not skinny_table.ON or not skinny_table.TABLE or x.dim() != 2:
        return None
    kind = "swiglu" if swiglu else "linear"
    key = (kind, str(x.dtype).removeprefix("torch."), weight.shape[0], weight.shape[1])
    rows = skinny_table.TABLE.get(key)
    if rows is None:
        return None
    M = x.shape[0]
    for m, config in rows:
        if m >= M:
            return config
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` through this kernel where ``skinny_table`` picks it, else None."""
    config = pick(x, weight)
    if config is None:
        return None
    out = run(x, weight, bias, config)
    assert isinstance(out, torch.Tensor)
    return out


def partials(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | SplitKPartials | None:
    """As :func:`linear`, but a split configuration's partials are returned unreduced (for
    the next add + RMSNorm to sum, when ``fused_splitk_norm.FUSE`` is on)."""
    config = pick(x, weight)
    if config is None:
        return None
    from pdserve.model import fused_splitk_norm

    return run(x, weight, bias, config, keep_partials=fused_splitk_norm.FUSE)


def swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``silu(g) * u`` of ``[g | u] = x @ weight.T + bias`` in one kernel where
    ``skinny_table`` picks it (kind ``swiglu``), else None."""
    config = pick(x, weight, swiglu=True)
    if config is None:
        return None
    out = run(x, weight, bias, config, swiglu=True)
    assert isinstance(out, torch.Tensor)
    return out
