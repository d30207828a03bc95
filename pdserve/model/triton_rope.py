"""The arithmetic of RoPE (after Qwen3's per-head q/k RMSNorm) and of the paged cache's
K/V cast, as ``@triton.jit`` helpers that every kernel applying them calls: the RoPE + KV
store kernel (``fused_ops._rope_kernel``) and the split-KV decode kernel when it applies
RoPE and stores the new token itself (``triton_kernels.decode_split_kernel``'s ``ROPE``).
One copy of the math, so both give the same values from the same inputs: each product,
sum and rounding to the input dtype is the same operation in the same order (an
elementwise function of the inputs; only the norm's fp32 sum of squares is a reduction, of
one head's ``2 * HALF`` values, whose order on a GPU follows the calling kernel's layout).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def inv_rms(sum_first, sum_second, HALF: tl.constexpr, eps):
    """``1 / sqrt(mean(x^2) + eps)`` of heads of ``2 * HALF`` values from the fp32 sums of
    squares of their two halves (added first half first, as every caller adds them)."""
    return tl.rsqrt((sum_first + sum_second) / (2 * HALF) + eps)


@triton.jit
def rope_rotate(x, partner, cos, sin, sign, r, w, w_partner, QK_NORM: tl.constexpr):
    """One half of rotated heads, elementwise: ``x * cos + sign * partner * sin`` (x's
    dtype, rounded where torch rounds in ``pdserve.model.rope.apply_rope``: each product,
    then the sum), where ``partner`` is the value ``rotate_half`` pairs with ``x`` (its
    other half) and ``sign`` -1 for the first half, +1 for the second: the first half's
    ``x1 * cos - x2 * sin`` and the second's ``x2 * cos + x1 * sin`` (``-1 * v`` is exact,
    so ``a + -1 * b`` is ``a - b``). With ``QK_NORM`` both values are first
    RMS-normalised by ``r`` (:func:`inv_rms` of their head, broadcast), rounded to x's
    dtype and scaled by their weights ``w`` / ``w_partner`` (fp32), rounded again
    (``llama.rms_norm``, transformers' order). ``cos``, ``sin``, ``sign`` broadcast to x.
    Returns fp32 values of x's dtype (the caller casts)."""
    ty = x.dtype
    a = x.to(tl.float32)
    b = partner.to(tl.float32)
    if QK_NORM:
        a = (w * (a * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        b = (w_partner * (b * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    return (a * cos).to(ty).to(tl.float32) + sign * (b * sin).to(ty).to(tl.float32)


@triton.jit
def kv_cache_value(x, inv, cache_ptr, FP8: tl.constexpr):
    """What the paged cache ``cache_ptr`` (its element type) holds for K or V ``x`` (x's dtype, the
    model's): ``x`` cast, or with ``FP8`` (an e4m3 cache) ``attention.quantize_kv``:
    ``x.float() * inv`` (``inv`` = 1 / the per-tensor scale), saturated to +-448, cast."""
    if FP8:
        return tl.clamp(x.to(tl.float32) * inv, -448.0, 448.0).to(cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)
