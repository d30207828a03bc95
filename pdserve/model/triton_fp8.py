"""``x @ real(w).T`` for e4m3 weights and bf16/fp16/fp32 activations, in Triton (CUDA; the CPU
tests run it under ``TRITON_INTERPRET=1``).

At decode batch sizes a linear layer is a read of its weight: an e4m3 weight is half the
bytes of bf16, but cuBLAS's FP8 path (``torch._scaled_mm``) only pays off from a few dozen
rows (issue 26's H200 figures). This kernel reads the e4m3 weight once and converts it to
the activations' dtype in registers; scales (``scale [N, G]`` fp32, one per output row and
``GROUP`` input columns, :mod:`pdserve.model.fp8`) are applied to the fp32 partial sums:
once at the end for one group (tensor/channel scales), per K tile for block scales (a tile
never straddles a group: ``BLOCK_K`` divides ``GROUP``).

Kernels (one ``@triton.jit``, ``DOT`` constexpr):
``rows``  M = 1: each program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` tiles,
          multiplying elementwise in fp32 (no tensor cores, wide loads).
``dot``   any M: ``[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]`` ``tl.dot`` tiles (``BLOCK_M`` = M
          rounded up to a power of two >= 16, at most 64; ``BLOCK_K`` >= 16, what Triton
          builds on CUDA); fp32 activations in IEEE fp32 (Triton's CUDA default is TF32).
Both take ``SPLIT`` K slices (fp32 partials ``[SPLIT, M, N]`` summed by torch) so that a
small N still fills the GPU. Which configuration runs for which shape and row count is
:func:`config_for`: the measured table :data:`TABLE` (``scripts/gpu_fp8_check.sh`` writes
the sweep), else a default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.model import pdl
from pdserve.model.pdl import pdl_enter

# (kernel "rows" | "dot", BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages)
Config = tuple[str, int, int, int, int, int]
# (N, K) -> ((largest M, config), ...) ascending in M; measured on the GPU (empty: defaults).
TABLE: dict[tuple[int, int], tuple[tuple[int, Config], ...]] = {}


@triton.jit(do_not_specialize=("M",))  # per-step sizes: no recompile
def _fp8_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    o_ptr,
    M,
    N,
    K,
    K_SPLIT,
    s_xm,
    s_wn,
    s_sn,
    s_om,
    s_os,
    GROUP: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT)``: ``o[m, n] = sum_k x[m, k]
    w[n, k] s[n, k // GROUP] (+ b[n])``; with ``SPLIT > 1`` fp32 partials of K slice
    ``program_id(2)`` go to ``o + split * s_os`` (no bias). ``IEEE``: the dots in full fp32
    (fp32 activations; Triton's CUDA default for fp32 dots is TF32)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # M = 1: summed over K at the end
        acc1 = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        kmask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if DOT:
            x = tl.load(
                x_ptr + rm[:, None] * s_xm + kk[None, :],
                mask=mmask[:, None] & kmask[None, :],
                other=0.0,
            )
            if IEEE:
                part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            if ONE_GROUP:
                acc += part
            else:
                s = tl.load(s_ptr + rn * s_sn + k0 // GROUP, mask=nmask, other=0.0)
                acc += part * s[None, :]
        else:
            x = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            prod = w.to(tl.float32) * x[None, :]
            if ONE_GROUP:
                acc2 += prod
            else:
                s = tl.load(s_ptr + rn * s_sn + k0 // GROUP, mask=nmask, other=0.0)
                acc1 += tl.sum(prod, 1) * s
    if DOT:
        out = acc
        if ONE_GROUP:
            out = out * tl.load(s_ptr + rn * s_sn, mask=nmask, other=0.0)[None, :]
    else:
        if ONE_GROUP:
            acc1 = tl.sum(acc2, 1) * tl.load(s_ptr + rn * s_sn, mask=nmask, other=0.0)
        out = acc1[None, :]  # [1, BLOCK_N]; BLOCK_M is 1
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(
            o_ptr + rm[:, None] * s_om + rn[None, :], out.to(o_ptr.dtype.element_ty), mask=omask
        )
    else:
        tl.store(o_ptr + pid_s * s_os + rm[:, None] * s_om + rn[None, :], out, mask=omask)


# The dot kernel's smallest BLOCK_K: Triton builds a CUDA tl.dot of 16-bit inputs from
# K = 16 (fp32: 8); M and N are padded by Triton (BLOCK_M is 16 at least anyway: block_m).
# The interpreter takes any size, so a CPU run does not catch a smaller tile.
MIN_DOT_K = 16


def block_m(m: int) -> int:
    """The ``dot`` kernel's row tile: the power of two >= ``m``, at least 16, at most 64."""
    return min(64, max(16, 1 << (m - 1).bit_length()))


def default_config(m: int, n: int, k: int, group: int) -> Config:
    """The configuration used where :data:`TABLE` lists none: ``rows`` with 16 x 512 tiles at
    one row, else ``dot`` with 64 x 128 tiles; K split in 2 to 4 when the row tiles alone
    make fewer than 264 programs (two per SM of an H200)."""
    kind, bn, bk, warps, stages = ("rows", 16, 512, 4, 2) if m == 1 else ("dot", 64, 128, 4, 3)
    programs = -(-n // bn) * -(-m // (1 if m == 1 else block_m(m)))
    split = 1 if programs >= 264 or k < 4 * bk else min(4, -(-264 // programs))
    return (kind, bn, bk, split, warps, stages)


def config_for(m: int, n: int, k: int, group: int) -> Config:
    """The configuration for ``m`` rows of an ``[n, k]`` weight: the first entry of
    :data:`TABLE` for ``(n, k)`` whose largest M is >= ``m``, else :func:`default_config`."""
    for m_max, cfg in TABLE.get((n, k), ()):
        if m <= m_max and (cfg[0] == "dot" or m == 1):
            return cfg
    return default_config(m, n, k, group)


def fp8_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """``x [M, K] @ (w [N, K] e4m3 * scale).T + bias`` -> ``[M, N]`` in x's dtype.

    scale: ``[N, ceil(K / group)]`` fp32 (one column: ``group = K``); bias ``[N]`` or None;
    config: a :data:`Config` (default :func:`config_for`). x's last dim must be contiguous.
    fp32 activations are multiplied in IEEE fp32 (no TF32), 16-bit ones on the tensor cores
    with fp32 accumulation. ValueError when a block-scaled weight's group is not a multiple
    of the tile's BLOCK_K (the tile is narrowed to the group when it can be), or when the
    ``dot`` kernel would get a BLOCK_K under :data:`MIN_DOT_K` (Triton cannot build that
    ``tl.dot`` on CUDA)."""
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    kind, bn, bk, split, warps, stages = config or config_for(M, N, K, group)
    one_group = scale.shape[1] == 1
    if not one_group:
        bk = min(bk, group)
        if group % bk:
            raise ValueError(
                f"group: {group} input columns per scale is not a multiple of BLOCK_K {bk}"
            )
    dot = kind == "dot" or M > 1
    bm = block_m(M) if dot else 1
    if dot and bk < MIN_DOT_K:
        raise ValueError(
            f"fp8_matmul: BLOCK_K {bk} (group {group}, config {(kind, bn, bk, split, warps, stages)})"
            f" is under {MIN_DOT_K}: Triton cannot build the dot kernel's tl.dot on CUDA"
        )
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk  # whole BLOCK_K tiles (so whole groups)
    split = -(-K // k_split)
    if split == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        s_os = 0
    else:
        out = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        s_os = out.stride(0)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    _fp8_matmul_kernel[grid](
        x,
        w,
        scale,
        bias if bias is not None else scale,
        out,
        M,
        N,
        K,
        k_split,
        x.stride(0),
        w.stride(0),
        scale.stride(0),
        out.stride(-2),
        s_os,
        GROUP=0 if one_group else group,  # unused with one group: one compiled kernel for every K
        ONE_GROUP=one_group,
        HAS_BIAS=bias is not None,
        DOT=dot,
        SPLIT=split,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_options(x),
    )
    if split == 1:
        return out
    res = out.sum(0)
    if bias is not None:
        res += bias.float()
    return res.to(x.dtype)
