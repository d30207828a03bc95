"""The fused CUDA elementwise kernels (``model/fused_ops.py``) equal torch's ops: run on the
GPU in the model, here on CPU under Triton's interpreter (set by this folder's conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.rope import apply_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 only on the GPU: the interpreter converts fp32 -> bf16 by truncation, not rounding.
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_inplace_matches_apply_rope_on_a_strided_view(dtype):
    from pdserve.model.fused_ops import rope_inplace

    gen = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 5, 4, 2, 16
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=gen).to(dtype).to(DEVICE)
    table = torch.randn(64, D, generator=gen).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 7, 7, 33, 63], device=DEVICE)
    cs = table.index_select(0, positions)[:, None, :]
    cos, sin = cs.chunk(2, dim=-1)
    ref = apply_rope(qkv[:, : Hq + Hkv], cos, sin)
    v_before = qkv[:, Hq + Hkv :].clone()
    rope_inplace(qkv[:, : Hq + Hkv], table, positions)  # the fused path rotates in place
    # bf16: within one rounding of the products (the H200 run of 2026-12-01 differed from
    # torch's at tolerance 0); fp32: to the last bits (fused multiply-add).
    tol = (
        2**-7 * qkv.abs().max().item() * table.abs().max().item()
        if dtype != torch.float32
        else 1e-6
    )
    assert (qkv[:, : Hq + Hkv].float() - ref.float()).abs().max().item() <= tol
    assert torch.equal(qkv[:, Hq + Hkv :], v_before)  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    from pdserve.model.fused_ops import silu_mul

    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = silu_mul(x)
    assert got.shape == (3, 1500) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - ref.float()).abs().max().item() <= tol
