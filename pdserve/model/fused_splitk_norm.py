# mypy: disallow-untyped-defs=False, disallow-incomplete-defs=False, disallow-untyped-decorators=False
# (Triton kernels, as the other kernel modules in [tool.mypy.overrides] of pyproject.toml)
"""The split-K GEMV's reduce folded into the next add + RMSNorm: one kernel less per layer.

Where ``gemv_table`` runs a down projection as a ``splitkS`` GEMV (Llama-3.1-8B at 64 decode
rows: ``splitk2``), its first kernel writes fp32 partials ``[S, M, N]`` and a second one
(``_splitk_reduce_kernel``) sums them in slice order and rounds once; the sum is the layer's
MLP output, which the next layer's first kernel (``fused_ops.add_rms_norm``) adds to the
residual stream and normalizes. With :data:`FUSE` the down projection stops after the
partials (:func:`down_partials`: a :class:`SplitKPartials` instead of a tensor) and
:func:`add_rms_norm` does the reduce's sum, bias and rounding, then the add and the norm,
in one kernel: the same operations in the same order, so the same bits as the two kernels.

On by default, kept on its H200 measurement (docs/benchmarks.md, row S7-BF16:
``scripts/gpu_s7_bf16rows.py`` runs the decode step with and without it in one process).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.model import gemv_table, pdl, triton_gemv
from pdserve.model.pdl import pdl_enter

# Whether a split-K down projection leaves its reduce to the next add + RMSNorm.
FUSE = True
# Whether the few-token MoE path (one token, no TP) leaves its top-k sum to the next add +
# RMSNorm (``SparseMoeBlock.forward``'s ``rows_out``): one launch fewer per sparse layer.
# Kept on its H200 measurement (random:qwen3-30b-a3b, bf16, one engine, the 1-row graphs
# with and without it interleaved: step 2.794 -> 2.769 ms, paired median -0.036 ms, the
# same greedy tokens; docs/benchmarks.md row S10-MOE10, docs/figures/h200_s10/moe10.json).
FUSE_TOPK = True
# The same for a decode batch on the grouped MoE path (``route_align``'s sizes; a plan
# whose top-k sum is the Triton kernel). Kept on the same run's 64-row step: 5.888 ->
# 5.805 ms, paired median -0.087 ms, 64 of 64 greedy outputs the same.
FUSE_TOPK_GROUPED = True


class SplitKPartials(NamedTuple):
    """A split-K GEMV's unreduced output: ``parts [S, M, N]`` fp32 (slice s's sum over its
    K range), ``bias [N]`` or None (added once, after the sum), ``dtype`` the output's.
    Also the few-token MoE path's top-k rows (``triton_moe_gemv.route_experts_gemv`` with
    ``rows_out``): ``parts [k, T, H]`` in the output's dtype (a strided view of the down
    kernel's ``[T * k, H]`` rows, last dim contiguous), summed in fp32 by the norm's kernel
    as the top-k sum kernel would (:data:`FUSE_TOPK`)."""

    parts: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype


def down_partials(
    act: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> SplitKPartials | None:
    """``act [M, K] @ weight[N, K].T`` as split-K partials when :data:`FUSE` is on and
    ``gemv_table`` runs this shape and row count with a ``splitkS`` GEMV (the same kernel
    and tile, its reduce left out); None otherwise (the caller runs ``linear``)."""
    if not FUSE or not gemv_table.TABLE or act.dim() != 2:
        return None
    config = triton_gemv.pick(gemv_table.TABLE, act, weight)
    if config is None or config[0] not in ("splitk2", "splitk4", "splitk8"):
        return None
    kind, block_n, block_k, warps, stages = config
    split = triton_gemv.SPLITS[kind]
    M, K = act.shape
    N = weight.shape[0]
    if act.stride(-1) != 1:
        act = act.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == K
    parts = torch.empty(split, M, N, device=act.device, dtype=torch.float32)
    if M:
        k_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
        b: Any = bias if bias is not None else weight
        triton_gemv._gemv_dot_kernel[(triton.cdiv(N, block_n), split)](
            act, weight, b, parts, M, N, K, k_split, act.stride(0), weight.stride(0), N, M * N,
            HAS_BIAS=bias is not None, SILU=False, BLOCK_M=triton_gemv.block_m(M),
            BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, IEEE=act.dtype == torch.float32,
            num_warps=warps, num_stages=stages, **pdl.launch_options(act),
        )  # fmt: skip
    return SplitKPartials(parts, bias, act.dtype)


@triton.jit
def _splitk_add_rms_norm_kernel(
    x_ptr, p_ptr, b_ptr, w_ptr, h_ptr, y_ptr, s_x, s_h, s_y, N, s_ps, s_pt, eps,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per row t: ``r = sum_s p[s, t] (+ b)`` in fp32 in slice order, rounded
    to x's dtype (``_splitk_reduce_kernel``'s sum; 16-bit partials, the top-k rows of
    :class:`SplitKPartials`, as ``triton_moe_gemv._topk_sum_kernel`` sums them); ``h = x + r``
    rounded, stored; ``y = rms_norm(h) * w`` as ``fused_ops._add_rms_norm_kernel`` computes
    it. ``p[s, t, n]`` at ``s * s_ps + t * s_pt + n``."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0)
    ty = x.dtype
    acc = tl.load(p_ptr + t * s_pt + cols, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * s_ps + t * s_pt + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = acc.to(ty)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
    tl.store(h_ptr + t * s_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (hf * rstd).to(ty).to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + t * s_y + cols, y.to(ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, partials: SplitKPartials, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h))`` with ``h = x + reduce(partials)``, in one kernel: the same bits
    as ``_splitk_reduce_kernel`` then ``fused_ops.add_rms_norm``. x ``[T, N]`` (dim stride
    1), ``partials.parts [S, T, N]`` (fp32, or the top-k rows in x's dtype; last dim
    contiguous), weight ``[N]``; both outputs new ``[T, N]``
    tensors in x's dtype. ValueError when the shapes or the dtype disagree."""
    T, N = x.shape
    p = partials.parts
    if p.dim() != 3 or p.shape[1:] != (T, N) or partials.dtype != x.dtype:
        raise ValueError(
            f"partials {tuple(p.shape)} ({partials.dtype}) do not match x {tuple(x.shape)} ({x.dtype})"
        )
    h = x.new_empty(T, N)
    y = x.new_empty(T, N)
    if T == 0:
        return h, y
    assert x.stride(-1) == 1 and p.stride(-1) == 1
    block = triton.next_power_of_2(N)
    b: Any = partials.bias if partials.bias is not None else weight
    _splitk_add_rms_norm_kernel[(T,)](
        x, p, b, weight, h, y, x.stride(0), h.stride(0), y.stride(0), N, p.stride(0),
        p.stride(1), eps,
        HAS_BIAS=partials.bias is not None, SPLIT_K=p.shape[0], BLOCK=block,
        num_warps=min(16, max(1, block // 512)), **pdl.launch_options(x),
    )  # fmt: skip
    return h, y
