# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# (Triton kernels, as the other kernel modules in [tool.mypy.overrides] of pyproject.toml)
"""The pieces both GEMV kernel modules use (:mod:`pdserve.model.triton_gemv` and
:mod:`pdserve.model.triton_gemv_tma`): loading x (optionally as ``silu(gate) * up``) and
the deterministic split-K reduce. A module of its own so that neither kernel module
imports the other for them (``triton_gemv.gemv`` dispatches the ``tma*`` kinds to
``triton_gemv_tma``)."""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.model.pdl import pdl_enter
from pdserve.model.triton_act import silu_mul_rounded

REDUCE_BLOCK = 1024  # elements a program of the split-K reduce sums


@triton.jit
def _load_x(x_ptr, offs, mask, K, SILU: tl.constexpr):
    """x at ``offs``; with ``SILU`` the row is ``[gate | up]`` (``2K`` wide) and x is
    ``silu(gate) * up``, rounded as ``fused_ops.silu_mul`` rounds it."""
    if SILU:
        g = tl.load(x_ptr + offs, mask=mask, other=0.0)
        u = tl.load(x_ptr + offs + K, mask=mask, other=0.0)
        x = silu_mul_rounded(g, u)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _splitk_reduce_kernel(
    p_ptr,
    b_ptr,
    o_ptr,
    N,
    MN,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(MN, BLOCK),)``: ``o = sum_s p[s] (+ b)`` over ``p [SPLIT_K, M, N]`` fp32,
    in the order s = 0, 1, ... (deterministic), rounded once to o's dtype."""
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = r < MN
    acc = tl.load(p_ptr + r, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * MN + r, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + r % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + r, acc.to(o_ptr.dtype.element_ty), mask=mask)
