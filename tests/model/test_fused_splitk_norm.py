"""The split-K reduce folded into the next add + RMSNorm (``model/fused_splitk_norm.py``) gives
the same bits as the split-K GEMV's own reduce followed by ``fused_ops.add_rms_norm``, in
the kernel pair and through a model. Kernels run on CPU under Triton's interpreter (this
folder's conftest)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import fused_ops, fused_splitk_norm, gemv_table, triton_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # (the interpreter: fp32)


@pytest.mark.parametrize("kind", ["splitk2", "splitk4"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_reduce_add_norm_equals_reduce_then_add_norm(monkeypatch, kind, with_bias):
    gen = torch.Generator().manual_seed(3)
    m, n, k = 20, 48, 104  # K = 104 in slices of 64 (splitk2) / 32 (splitk4): tails masked
    act = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
    w = torch.randn(n, k, generator=gen).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if with_bias else None
    x = torch.randn(m, n, generator=gen).to(DEVICE, DTYPE)
    norm_w = torch.rand(n, generator=gen).to(DEVICE, DTYPE)
    cfg = (kind, 16, 32, 4, 2)
    name = str(DTYPE).removeprefix("torch.")
    monkeypatch.setattr(gemv_table, "TABLE", {(name, n, k): ((32, cfg),)})
    monkeypatch.setattr(fused_splitk_norm, "FUSE", False)
    assert fused_splitk_norm.down_partials(act, w, b) is None  # FUSE off
    monkeypatch.setattr(fused_splitk_norm, "FUSE", True)
    parts = fused_splitk_norm.down_partials(act, w, b)
    assert parts is not None and parts.parts.shape == (triton_gemv.SPLITS[kind], m, n)
    h, y = fused_splitk_norm.add_rms_norm(x, parts, norm_w, 1e-5)
    h_ref, y_ref = fused_ops.add_rms_norm(x, triton_gemv.gemv(act, w, b, cfg), norm_w, 1e-5)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)
    # rows past the table's last entry, or a kernel that is not split-K: no partials
    assert fused_splitk_norm.down_partials(act.repeat(2, 1), w, b) is None
    monkeypatch.setattr(gemv_table, "TABLE", {(name, n, k): ((32, ("dot", 16, 32, 4, 2)),)})
    assert fused_splitk_norm.down_partials(act, w, b) is None
    with pytest.raises(ValueError, match="do not match"):
        fused_splitk_norm.add_rms_norm(x[:5], parts, norm_w, 1e-5)


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="forces the CUDA path on CPU (interpreter)")
def test_a_model_with_the_reduce_folded_computes_the_same_bits(monkeypatch, tiny_hf_builder):
    """The tiny Llama on the CUDA path (fused ops, triton attention, the GEMV table's kernels)
    with its down projection on a split-K GEMV: greedy tokens and logits with the reduce folded into the next layer's
    add + RMSNorm (and the final norm) equal those with the reduce kernel, bit for bit."""
    from tp_model_ranks import PROMPTS, greedy_paged

    from pdserve.model import linear as lin
    from pdserve.model import llama

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = tiny_hf_builder("llama", seed=4)
    model = llama.LlamaForCausalLM(hf.config, torch.float32, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    s = model.shapes
    key = ("float32", s.hidden, s.intermediate)
    monkeypatch.setattr(gemv_table, "TABLE", {key: ((16, ("splitk2", 16, 32, 4, 2)),)})
    real_linear = lin.linear

    def linear_anywhere(x, w, b, packed):  # the table's GEMV off CUDA too (the reference)
        cfg = triton_gemv.pick(gemv_table.TABLE, x, w)
        return real_linear(x, w, b, packed) if cfg is None else triton_gemv.gemv(x, w, b, cfg)

    monkeypatch.setattr(lin, "linear", linear_anywhere)
    calls = []
    real = fused_splitk_norm.add_rms_norm
    monkeypatch.setattr(fused_splitk_norm, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    runs = []
    for fuse in (False, True):
        monkeypatch.setattr(fused_splitk_norm, "FUSE", fuse)
        runs.append(greedy_paged(model, PROMPTS[:2], 1))
    assert len(calls) == 2 * s.n_layers  # every layer's output, two forwards
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T, k", [(1, 8), (3, 2)])
def test_topk_rows_add_norm_equals_topk_sum_then_add_norm(T, k):
    """The few-token MoE path's weighted expert rows ``[T * k, H]`` (in the model's dtype)
    handed to the norm as a ``SplitKPartials`` of ``[k, T, H]`` (a strided view): the same
    bits as ``_topk_sum_kernel`` (fp32 sum, one rounding) then ``fused_ops.add_rms_norm``."""
    from pdserve.model import pdl, triton_moe_gemv

    gen = torch.Generator().manual_seed(T)
    n = 40  # not a power of two: the norm's block masked
    rows = torch.randn(T * k, n, generator=gen).to(DEVICE, DTYPE)
    x = torch.randn(T, n, generator=gen).to(DEVICE, DTYPE)
    norm_w = torch.rand(n, generator=gen).to(DEVICE, DTYPE)
    parts = fused_splitk_norm.SplitKPartials(rows.view(T, k, n).permute(1, 0, 2), None, DTYPE)
    h, y = fused_splitk_norm.add_rms_norm(x, parts, norm_w, 1e-5)
    total = triton_moe_gemv.topk_sum(rows, T, k, pdl.launch_options(x))
    h_ref, y_ref = fused_ops.add_rms_norm(x, total, norm_w, 1e-5)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)
