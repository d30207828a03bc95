"""The skinny Triton GEMM (``model/triton_skinny.py``): plain, split-K (reduced here or left
as partials), the SwiGLU epilogue, its table lookup, and a model's greedy tokens with every
linear layer on it. Kernels run on CPU under Triton's interpreter (this folder's conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import fused_ops, fused_splitk_norm, skinny_table, triton_skinny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # (the interpreter: fp32)
NAME = str(DTYPE).removeprefix("torch.")
TOL = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=3e-2, rtol=3e-2)


def _data(m, n, k, with_bias, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if with_bias else None
    return x, w, b


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [5, 20])
def test_linear_matches_f_linear(split, with_bias, m):
    n, k = 40, 128  # N not a multiple of BLOCK_N (16): the last tile masked; rows past M too
    x, w, b = _data(m, n, k, with_bias)
    cfg = (16, 16, 32, split, 4, 2, 2)
    out = triton_skinny.run(x, w, b, cfg)
    assert isinstance(out, torch.Tensor) and out.shape == (m, n) and out.dtype == DTYPE
    torch.testing.assert_close(out, F.linear(x, w, b), **TOL)


@pytest.mark.parametrize("with_bias", [False, True])
def test_partials_fold_into_add_rms_norm_as_the_reduce_does(with_bias):
    m, n, k = 7, 48, 128
    x, w, b = _data(m, n, k, with_bias)
    cfg = (16, 16, 32, 2, 4, 2, 0)
    parts = triton_skinny.run(x, w, b, cfg, keep_partials=True)
    assert isinstance(parts, fused_splitk_norm.SplitKPartials) and parts.parts.shape == (2, m, n)
    res = torch.randn(m, n).to(DEVICE, DTYPE)
    nw = torch.rand(n).to(DEVICE, DTYPE)
    h, y = fused_splitk_norm.add_rms_norm(res, parts, nw, 1e-5)
    reduced = triton_skinny.run(x, w, b, cfg)
    h_ref, y_ref = fused_ops.add_rms_norm(res, reduced, nw, 1e-5)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_epilogue_matches_linear_then_silu_mul(with_bias):
    m, inter, k = 9, 48, 64
    x, w, b = _data(m, 2 * inter, k, with_bias)
    out = triton_skinny.run(x, w, b, (16, 16, 32, 1, 4, 2, 0), swiglu=True)
    ref = fused_ops.silu_mul(F.linear(x, w, b))
    assert isinstance(out, torch.Tensor) and out.shape == (m, inter)
    torch.testing.assert_close(out, ref, **TOL)


def test_configs_it_cannot_run_are_refused():
    x, w, _ = _data(4, 32, 96, False)
    with pytest.raises(ValueError, match="whole"):
        triton_skinny.run(x, w, None, (16, 16, 64, 1, 4, 2, 0))  # 96 not 64-column tiles
    with pytest.raises(ValueError, match="power of two"):
        triton_skinny.run(x, w, None, (16, 24, 32, 1, 4, 2, 0))
    with pytest.raises(ValueError, match="SwiGLU"):
        triton_skinny.run(x, w, None, (16, 16, 32, 3, 4, 2, 0), swiglu=True)


def test_pick_reads_the_table_by_kind_and_rows(monkeypatch):
    x, w, _ = _data(20, 32, 64, False)
    cfg = (32, 16, 32, 2, 4, 2, 0)
    monkeypatch.setattr(skinny_table, "TABLE", {("linear", NAME, 32, 64): ((16, None), (32, cfg))})
    assert triton_skinny.pick(x, w) == cfg
    assert triton_skinny.pick(x[:8], w) is None  # the 16-row entry: not this kernel
    assert triton_skinny.pick(torch.cat([x, x]), w) is None  # past the last entry
    assert triton_skinny.pick(x, w, swiglu=True) is None  # another kind
    monkeypatch.setattr(skinny_table, "ON", False)
    assert triton_skinny.pick(x, w) is None
    assert triton_skinny.linear(x, w, None) is None


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="forces the CUDA path on CPU (interpreter)")
def test_a_model_on_the_skinny_gemm_gives_the_same_greedy_tokens(monkeypatch, tiny_hf_builder):
    """The tiny Llama on the CUDA path (fused ops, triton attention) with qkv, o (split:
    partials folded into the norm), gate/up (SwiGLU epilogue) and down (split) on the
    skinny GEMM: the same greedy tokens as with F.linear, logits within fp32 rounding."""
    from tp_model_ranks import PROMPTS, greedy_paged

    from pdserve.model import linear as lin
    from pdserve.model import llama

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = tiny_hf_builder("llama", seed=4)
    model = llama.LlamaForCausalLM(hf.config, torch.float32, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    s = model.shapes
    qkv_out = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    base = greedy_paged(model, PROMPTS[:2], 3)
    table = {
        ("linear", "float32", qkv_out, s.hidden): ((64, (16, 16, 32, 1, 4, 2, 0)),),
        ("linear", "float32", s.hidden, s.n_heads * s.head_dim): ((64, (16, 16, 32, 2, 4, 2, 0)),),
        ("swiglu", "float32", 2 * s.intermediate, s.hidden): ((64, (16, 16, 32, 1, 4, 2, 0)),),
        ("linear", "float32", s.hidden, s.intermediate): ((64, (16, 16, 32, 1, 4, 2, 0)),),
    }
    monkeypatch.setattr(skinny_table, "TABLE", table)
    calls = []
    real_run = triton_skinny.run
    monkeypatch.setattr(triton_skinny, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    real_linear = lin.linear

    def linear_anywhere(x, w, b, packed):  # the table's kernel off CUDA too
        y = triton_skinny.linear(x, w, b)
        return real_linear(x, w, b, packed) if y is None else y

    monkeypatch.setattr(lin, "linear", linear_anywhere)
    skinny = greedy_paged(model, PROMPTS[:2], 3)
    assert len(calls) >= 4 * s.n_layers
    assert skinny[0] == base[0]
    for a, b in zip(base[1], skinny[1]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_model_through_the_skinny_gemm_agrees_with_cublas(tiny_hf_builder, monkeypatch):
    """bf16 on CUDA: the tiny Qwen2 model (biases on q/k/v) with qkv, o (split: partials
    folded into the norm), gate/up (SwiGLU epilogue) and down (split) on the skinny GEMM at
    every row count <= 64 keeps >= 0.99 top-1 agreement with the cuBLAS path (the kernels
    sum in another order than cuBLAS: not the same bits)."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    from test_gpu_backends import SCENARIOS, scenario_logits

    from pdserve.model.llama import LlamaForCausalLM

    hf = tiny_hf_builder("qwen2")
    model = LlamaForCausalLM(hf.config, torch.bfloat16, "cuda", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    s = model.shapes
    qkv_out = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    cfg1, cfg2 = (64, 16, 32, 1, 4, 3, 4), (64, 16, 16, 2, 4, 3, 4)
    table = {
        ("linear", "bfloat16", qkv_out, s.hidden): ((64, cfg1),),
        ("linear", "bfloat16", s.hidden, s.n_heads * s.head_dim): ((64, cfg2),),
        ("swiglu", "bfloat16", 2 * s.intermediate, s.hidden): ((64, cfg1),),
        ("linear", "bfloat16", s.hidden, s.intermediate): ((64, cfg2),),
    }
    agree = total = 0
    for i, (steps, ps) in enumerate(SCENARIOS):
        monkeypatch.setattr(skinny_table, "TABLE", {})
        ref = scenario_logits(model, steps, ps, seed=i)
        monkeypatch.setattr(skinny_table, "TABLE", table)
        got = scenario_logits(model, steps, ps, seed=i)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += ref.shape[0]
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"


def test_committed_table_entries_are_configurations_the_kernel_runs():
    """Every entry of ``skinny_table`` (a measured pick) passes the kernel's own check at its
    rows and shape, row bounds ascending, ``None`` (not this kernel) allowed."""
    for (kind, _dtype, n, k), rows in skinny_table.TABLE.items():
        if kind not in ("linear", "swiglu"):
            continue
        bounds = [m for m, _ in rows]
        assert bounds == sorted(set(bounds)) and bounds[0] >= 1
        for m, config in rows:
            if config is not None:
                triton_skinny.check(config, m, n, k, swiglu=kind == "swiglu")
