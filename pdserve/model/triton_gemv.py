"""Skinny matmul ``x @ w.T`` for a few rows (decode at small batch), in Triton, CUDA only.

At batch 1 a decode step is weight reads: every linear layer is a GEMV over a bf16 matrix
``w [N, K]`` (row-major, K contiguous) with fp32 accumulation. Two kernels, one launch each
(no split-K reduce):

``rows``  M = 1 only: each program owns ``BLOCK_N`` output features and walks K in
          ``BLOCK_K`` chunks, accumulating ``w * x`` elementwise in fp32 and summing once at
          the end (no tensor cores; wide loads, many programs).
``dot``   M <= ``BLOCK_M`` (16): the same walk with ``tl.dot`` on ``[BLOCK_M, BLOCK_K] x
          [BLOCK_K, BLOCK_N]`` tiles, the loads software-pipelined (``num_stages``), rows past
          M masked to zero.

Which shape and row count use which kernel and tile, or cuBLAS, is not guessed: it is the
table ``pdserve.model.gemv_table.TABLE``, written by ``scripts/gpu_gemv_sweep.py`` from a
measurement on the GPU (each configuration timed in a CUDA graph over weight copies that
do not fit in L2, against ``F.linear`` timed the same way; every timing in
``docs/figures/h200_gemv_sweep.json``). :func:`pick` reads it. On the H200 (2026-12-01) the
``rows`` kernel won at M = 1 for qkv (14.2 vs 15.3 µs), o_proj (10.5 vs 12.4: cuBLAS runs
split-K plus a reduce there) and down_proj (28.8 vs 30.7); gate_up and the LM head were
within 3 % (cuBLAS kept), and at M = 2..16 cuBLAS was as fast except o_proj at 16.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

# A configuration: (kernel, BLOCK_N, BLOCK_K, num_warps, num_stages); kernel "rows" or "dot".
Config = tuple[str, int, int, int, int]
BLOCK_M = 16  # rows of the dot kernel's tile (tl.dot's smallest)


@triton.jit
def _load_x(x_ptr, offs, mask, K, SILU: tl.constexpr):
    """x at ``offs``; with ``SILU`` the row is ``[gate | up]`` (``2K`` wide) and x is
    ``silu(gate) * up``, rounded as ``fused_ops.silu_mul`` rounds it."""
    if SILU:
        g = tl.load(x_ptr + offs, mask=mask, other=0.0)
        u = tl.load(x_ptr + offs + K, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        sg = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        x = (sg.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _gemv_rows_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    N,
    K,
    s_wn,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N),)``, one row: ``o[n] = sum_k w[n, k] x[k] (+ b[n])``."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        x = _load_x(x_ptr, kk, kmask, K, SILU)
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * s_wn + kk[None, :],
            mask=nmask[:, None] & kmask[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(o_ptr + rn, out.to(o_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    M,
    N,
    K,
    s_xm,
    s_wn,
    s_om,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N),)``, ``M <= BLOCK_M`` rows: ``o = x @ w.T (+ b)``."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        x = _load_x(
            x_ptr, rm[:, None] * s_xm + kk[None, :], mmask[:, None] & kmask[None, :], K, SILU
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + rn[None, :].to(tl.int64) * s_wn + kk[:, None],
            mask=nmask[None, :] & kmask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        o_ptr + rm[:, None] * s_om + rn[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with the kernel and tile of ``config``.

    x ``[M, K]`` (dim stride 1; M <= 16, and M == 1 for the ``rows`` kernel), weight
    ``[N, K]`` (dim stride 1), bias ``[N]`` or None; same dtype. With ``silu_mul`` x is
    ``[gate | up]`` ``[M, 2K]`` and the product is taken with ``silu(gate) * up`` computed
    on the fly (``fused_ops.silu_mul``'s rounding; SwiGLU's activation and the down
    projection in one kernel). Returns a new ``[M, N]`` tensor in x's dtype (fp32
    accumulation, one rounding at the end). ValueError for a row count the kernel cannot
    take or an unknown kernel name.
    """
    kind, block_n, block_k, warps, stages = config
    M, K = x.shape
    if silu_mul:
        K //= 2
    N = weight.shape[0]
    out = x.new_empty(M, N)
    if M == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == K
    b: Any = bias if bias is not None else weight
    grid = (triton.cdiv(N, block_n),)
    if kind == "rows":
        if M != 1:
            raise ValueError(f"the rows kernel takes one row, got M={M}")
        _gemv_rows_kernel[grid](
            x,
            weight,
            b,
            out,
            N,
            K,
            weight.stride(0),
            HAS_BIAS=bias is not None,
            SILU=silu_mul,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
            num_stages=stages,
        )
    elif kind == "dot":
        if M > BLOCK_M:
            raise ValueError(f"the dot kernel takes at most {BLOCK_M} rows, got M={M}")
        _gemv_dot_kernel[grid](
            x,
            weight,
            b,
            out,
            M,
            N,
            K,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            SILU=silu_mul,
            BLOCK_M=BLOCK_M,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            IEEE=x.dtype == torch.float32,
            num_warps=warps,
            num_stages=stages,
        )
    else:
        raise ValueError(f"unknown GEMV kernel {kind!r}; known: rows, dot")
    return out


def pick(
    table: dict[tuple[str, int, int], tuple[tuple[int, Config | None], ...]],
    x: torch.Tensor,
    weight: torch.Tensor,
) -> Config | None:
    """The measured configuration for ``x [M, K] @ weight[N, K].T``, or None (cuBLAS).

    table: ``(dtype name, N, K) -> ((m, config or None), ...)`` ascending in m, as
    ``gemv_table.TABLE``; the entry of the smallest measured ``m >= M`` decides (a captured
    graph's rows are its bucket size, one of the measured ones); None past the last one.
    """
    rows = table.get((str(x.dtype).removeprefix("torch."), weight.shape[0], weight.shape[1]))
    if rows is None:
        return None
    M = x.shape[0]
    for m, config in rows:
        if m >= M:
            return config
    return None
