"""Skinny matmul ``x @ w.T`` for a few rows (decode at small batch), in Triton, CUDA only.

At decode a step is mostly weight reads: every linear layer multiplies ``M`` rows (the batch,
a captured graph's bucket: 1, 2, 4, 8, 16, 32, 48, 64) by a bf16 matrix ``w [N, K]``
(row-major, K contiguous) read once from HBM, with fp32 accumulation. Kernels:

``rows``  M = 1 only: each program owns ``BLOCK_N`` output features and walks K in
          ``BLOCK_K`` chunks, accumulating ``w * x`` elementwise in fp32 and summing once at
          the end (no tensor cores; wide loads, many programs). One launch.
``dot``   M <= ``MAX_ROWS`` (64): the same walk with ``tl.dot`` on ``[BLOCK_M, BLOCK_K] x
          [BLOCK_K, BLOCK_N]`` tiles, ``BLOCK_M`` = M rounded up to 16, 32 or 64
          (:func:`block_m`), the loads software-pipelined (``num_stages``), rows past M
          masked to zero. One launch.
``splitkS`` (S = 2, 4, 8) the ``dot`` walk with K cut into S slices, one program per
          (``BLOCK_N`` features, slice), each storing fp32 partials ``[S, M, N]``; a second
          kernel sums them in slice order (deterministic) and rounds once. Two launches;
          enough programs for wide tiles when N is small.
``tma*``  M <= 64: the weight streamed through Hopper's bulk tensor copies (TMA) by a
          persistent grid, one tile a unit, K slices or stream-K, optionally
          warp-specialized: :mod:`pdserve.model.triton_gemv_tma`.

Which shape and row count use which kernel and tile, or cuBLAS, is not guessed: it is the
table ``pdserve.model.gemv_table.TABLE`` (read by :func:`pick`), written by
``scripts/gpu_gemv_sweep.py`` from a GPU measurement (a configuration is used only where
it beat ``F.linear`` by >= 3 %; figures: docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pdserve.model import pdl
from pdserve.model.pdl import pdl_enter
from pdserve.model.triton_gemv_parts import REDUCE_BLOCK, _load_x, _splitk_reduce_kernel

# A configuration: (kernel, BLOCK_N, BLOCK_K, num_warps, num_stages); kernel "rows", "dot",
# "splitk2" / "splitk4" / "splitk8" or one of the "tma*" kinds (KNOWN below).
Config = tuple[str, int, int, int, int]
MAX_ROWS = 64  # the most rows the dot kernels take (the largest BLOCK_M)
SPLITS = {"dot": 1, "splitk2": 2, "splitk4": 4, "splitk8": 8}  # kernel name -> K slices
# The TMA-fed kernels (model/triton_gemv_tma.py), M <= 64: "tma" (a BLOCK_N tile a unit),
# "tma_skS" (S = 2..32 K slices, the split-K reduce of triton_gemv_parts), "tma_stream" (stream-K), each also
# warp-specialized as "tma_ws", "tma_ws_skS", "tma_ws_stream".
KNOWN = "rows, dot, splitk2, splitk4, splitk8, tma, tma_skS, tma_stream, tma_ws*"


def block_m(m: int) -> int:
    """The dot kernels' row tile for ``m`` rows: 16, 32 or 64 (``tl.dot`` takes powers of two
    >= 16). ValueError past ``MAX_ROWS``."""
    if m > MAX_ROWS:
        raise ValueError(f"the dot kernel takes at most {MAX_ROWS} rows, got M={m}")
    return max(16, 1 << (m - 1).bit_length())  # the power of two >= m


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
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N),)``, one row: ``o[n] = sum_k w[n, k] x[k] (+ b[n])``."""
    pdl_enter(PDL)
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


@triton.jit(do_not_specialize=("M",))  # per-step sizes: no recompile
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
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
    SILU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``, ``M <= BLOCK_M`` rows: ``o = x @ w.T (+ b)``.

    With ``SPLIT_K == 1`` the program stores the output; otherwise program ``(n, s)`` sums K
    in ``[s * K_SPLIT, (s + 1) * K_SPLIT)`` and stores fp32 partials at ``o + s * s_os``
    (the bias is then the reduce kernel's)."""
    pdl_enter(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:  # the whole of K (a loop from 0: what the measured M <= 16 entries ran)
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(1) * K_SPLIT
        k_hi = k_lo + K_SPLIT
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
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
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        o = o_ptr + rm[:, None] * s_om + rn[None, :]
        tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        o = o_ptr + tl.program_id(1) * s_os + rm[:, None] * s_om + rn[None, :]
        tl.store(o, acc, mask=omask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with the kernel and tile of ``config``.

    x ``[M, K]`` (dim stride 1; M <= ``MAX_ROWS`` (64), and M == 1 for the ``rows`` kernel),
    weight ``[N, K]`` (dim stride 1), bias ``[N]`` or None; same dtype. With ``silu_mul`` x
    is ``[gate | up]`` ``[M, 2K]`` and the product is taken with ``silu(gate) * up`` computed
    on the fly (``fused_ops.silu_mul``'s rounding; SwiGLU's activation and the down
    projection in one kernel). Returns a new ``[M, N]`` tensor in x's dtype (fp32
    accumulation, one rounding at the end; split-K sums its fp32 slices in a fixed order, so
    results are deterministic). ValueError for a row count the kernel cannot take, an
    unknown kernel name, or (``tma*`` kinds) a weight whose base or row stride is not
    16-byte aligned.
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
    if kind == "rows":
        if M != 1:
            raise ValueError(f"the rows kernel takes one row, got M={M}")
        _gemv_rows_kernel[(triton.cdiv(N, block_n),)](
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
            **pdl.launch_options(x),
        )
        return out
    if kind.startswith("tma"):
        from pdserve.model import triton_gemv_tma

        if triton_gemv_tma.parse_kind(kind) is None:
            raise ValueError(f"unknown GEMV kernel {kind!r}; known: {KNOWN}")
        triton_gemv_tma.gemv_tma(x, weight, bias, out, config, block_m(M), silu_mul)
        return out
    split = SPLITS.get(kind)
    if split is None:
        raise ValueError(f"unknown GEMV kernel {kind!r}; known: {KNOWN}")
    bm = block_m(M)
    # K per slice, a multiple of BLOCK_K (the last slice's tail is masked).
    k_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    dst = out if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    _gemv_dot_kernel[(triton.cdiv(N, block_n), split)](
        x,
        weight,
        b,
        dst,
        M,
        N,
        K,
        k_split,
        x.stride(0),
        weight.stride(0),
        N,
        M * N,
        HAS_BIAS=bias is not None,
        SILU=silu_mul,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_options(x),
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
            **pdl.launch_options(x),
        )
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
