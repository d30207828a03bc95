"""``linear.logits_fp32``: the lm_head's fp32 logits, from one GEMM writing fp32 on a listed
GPU, else the 16-bit GEMM and its cast (the CPU path, as before)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import linear as lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_off_listed_gpus_are_the_gemm_then_the_cast(dtype):
    """Off a listed GPU (here the CPU) the logits are ``linear`` in x's dtype cast to fp32,
    into ``out`` when given (the same tensor returned) or a new contiguous tensor."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    w = torch.randn(50, 64, generator=gen).to(dtype)
    ref = lin.linear(x, w, None, None).float()
    got = lin.logits_fp32(x, w)
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, ref)
    out = torch.full((3, 50), 7.0)
    assert lin.logits_fp32(x, w, out).data_ptr() == out.data_ptr() and torch.equal(out, ref)


@pytest.mark.gpu
def test_logits_on_a_listed_gpu_come_from_one_fp32_gemm(monkeypatch):
    """On CUDA with the device listed: bf16 x and weight give the fp32 product (the
    accumulator, not rounded to bf16), into a slice of a wider buffer as a graph passes it;
    the argmax equals the bf16 path's wherever its top two differ by well more than bf16's
    rounding."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device")
    monkeypatch.setattr(lin, "_fp32_gemm_listed", lambda index: True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(128256, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    buf = torch.empty(256, 128256, device="cuda")
    got = lin.logits_fp32(x, w, buf[:64])
    assert got.data_ptr() == buf.data_ptr()
    exact = x.double() @ w.double().t()
    rounded = (x @ w.t()).float()
    err = (got.double() - exact).abs().max().item()
    assert err < 1e-3 < (rounded.double() - exact).abs().max().item()
    top2 = rounded.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1  # well past twice bf16's half step
    assert torch.equal(got.argmax(-1)[clear], rounded.argmax(-1)[clear])
