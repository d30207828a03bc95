"""The SwiGLU activation as every kernel of ours computes it: one owner for its roundings,
which must equal torch's ``F.silu(gate) * up`` in the activation dtype bit for bit (the
exactness of a fused kernel against the unfused path rests on it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul_rounded(g, u):
    """``silu(g) * u`` for ``g``, ``u`` already in the activation dtype (bf16/fp16/fp32, any
    shape): silu in fp32 rounded to that dtype, then the product in fp32 rounded again,
    where torch rounds them."""
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
