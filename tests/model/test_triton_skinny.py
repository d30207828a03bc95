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


# ---------------------------------------------------------------- e4m3 weights (FP8 skinny)
def _fp8_data(m, n, k, with_bias, seed=7):
    """x in the tests' dtype, an e4m3 weight with per-row scales (fp8.quantize_per_channel)
    and its dequantized fp32 value, a bias."""
    from pdserve.model import fp8

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
    wq, ws = fp8.quantize_per_channel(torch.randn(n, k, generator=gen) / k**0.5)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if with_bias else None
    real = (wq.float() * ws).to(DEVICE)
    return x, wq.to(DEVICE), ws.to(DEVICE), real, b


def _ref(x, real, b):
    """The dequantized product in fp32, rounded to x's dtype as the kernel rounds once."""
    out = x.float() @ real.T
    return (out if b is None else out + b.float()).to(x.dtype)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [5, 20])
def test_e4m3_weights_match_the_dequantized_product(split, with_bias, m):
    n, k = 40, 128  # the last N tile masked, rows past M too
    x, wq, ws, real, b = _fp8_data(m, n, k, with_bias)
    out = triton_skinny.run(x, wq, b, (16, 16, 32, split, 4, 2, 2), scale=ws)
    assert isinstance(out, torch.Tensor) and out.shape == (m, n) and out.dtype == DTYPE
    torch.testing.assert_close(out, _ref(x, real, b), **TOL)


@pytest.mark.parametrize("with_bias", [False, True])
def test_e4m3_partials_are_scaled_and_fold_into_add_rms_norm(with_bias):
    m, n, k = 7, 48, 128
    x, wq, ws, real, b = _fp8_data(m, n, k, with_bias)
    cfg = (16, 16, 32, 2, 4, 2, 0)
    parts = triton_skinny.run(x, wq, b, cfg, keep_partials=True, scale=ws.reshape(-1))
    assert isinstance(parts, fused_splitk_norm.SplitKPartials) and parts.parts.shape == (2, m, n)
    torch.testing.assert_close(parts.parts.sum(0), x.float() @ real.T, atol=1e-3, rtol=1e-3)
    res = torch.randn(m, n).to(DEVICE, DTYPE)
    nw = torch.rand(n).to(DEVICE, DTYPE)
    h, y = fused_splitk_norm.add_rms_norm(res, parts, nw, 1e-5)
    reduced = triton_skinny.run(x, wq, b, cfg, scale=ws)
    h_ref, y_ref = fused_ops.add_rms_norm(res, reduced, nw, 1e-5)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("with_bias", [False, True])
def test_e4m3_swiglu_scales_gate_and_up_rows_by_their_own_scales(with_bias):
    m, inter, k = 9, 48, 64
    x, wq, ws, real, b = _fp8_data(m, 2 * inter, k, with_bias)
    ws[inter:] *= 3.0  # the up rows' scales differ from the gate rows'
    real[inter:] *= 3.0
    out = triton_skinny.run(x, wq, b, (16, 16, 32, 1, 4, 2, 0), swiglu=True, scale=ws)
    ref = fused_ops.silu_mul(_ref(x, real, b))
    assert isinstance(out, torch.Tensor) and out.shape == (m, inter)
    torch.testing.assert_close(out, ref, **TOL)


def test_fp8_skinny_path_runs_where_the_paths_pick_it(monkeypatch):
    """fp8's ``skinny`` path kind: run_path, linear_partials (split: partials) and swiglu
    (whole K only) follow ``fp8.PATHS``; another path kind gives None."""
    from pdserve.model import fp8

    m, n, k = 6, 32, 64
    x, wq, ws, real, _ = _fp8_data(m, n, k, False)
    w = fp8.Fp8Weight(wq, ws, k)
    split2, whole = (16, 16, 32, 2, 4, 2, 0), (16, 16, 32, 1, 4, 2, 0)
    out = fp8.run_path(("skinny", split2), x, w, None)
    torch.testing.assert_close(out, _ref(x, real, None), **TOL)
    monkeypatch.setattr(fp8, "PATHS", {(n, k): ((4, ("w8a8", None)), (64, ("skinny", split2)))})
    parts = fp8.linear_partials(x, w, None)
    assert isinstance(parts, fused_splitk_norm.SplitKPartials)
    assert fp8.linear_partials(x[:3], w, None) is None  # 3 rows: the w8a8 entry
    assert fp8.swiglu(x, w, None) is None  # a split tile has no SwiGLU epilogue
    monkeypatch.setattr(fp8, "PATHS", {(n, k): ((64, ("skinny", whole)),)})
    act = fp8.swiglu(x, w, None)
    assert act is not None and act.shape == (m, n // 2)
    torch.testing.assert_close(act, fused_ops.silu_mul(_ref(x, real, None)), **TOL)


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="forces the CUDA path on CPU (interpreter)")
@pytest.mark.parametrize("kind", ["skinny", "skinny8"])
def test_an_fp8_model_on_the_skinny_path_gives_the_dequantized_greedy_tokens(
    kind, monkeypatch, tiny_hf_builder
):
    """The tiny Llama quantized to e4m3 at load, on the CUDA layer path (fused ops), with
    fp8.PATHS giving every linear the ``skinny`` path: qkv whole, o and down split (their
    partials summed by the next add + RMSNorm), gate/up with its SwiGLU epilogue. The same
    greedy tokens as the dequantized weights (``fp8.linear`` on CPU), logits within fp32
    rounding, and each layer's four linears ran the kernel; ``skinny8`` (activations
    quantized in the kernel) the same calls, the prompts' logits within e4m3's error."""
    from tp_model_ranks import PROMPTS, greedy_paged

    from pdserve.model import fp8, llama

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = tiny_hf_builder("llama", seed=4)
    model = llama.LlamaForCausalLM(
        hf.config, torch.float32, "cpu", attn_backend="triton", quantization="fp8"
    )
    model.load_weights(hf.state_dict().items())
    s = model.shapes
    base = greedy_paged(model, PROMPTS[:2], 3)
    whole, split = (16, 16, 32, 1, 4, 2, 0), (16, 16, 32, 2, 4, 2, 0)
    qkv_out = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    paths = {
        (qkv_out, s.hidden): ((64, (kind, whole)),),
        (s.hidden, s.n_heads * s.head_dim): ((64, (kind, split)),),
        (2 * s.intermediate, s.hidden): ((64, (kind, whole)),),
        (s.hidden, s.intermediate): ((64, (kind, (16, 16, 16, 2, 4, 2, 0))),),  # K 2 x 48
    }
    monkeypatch.setattr(fp8, "PATHS", paths)
    calls = []
    real_run = triton_skinny.run
    monkeypatch.setattr(triton_skinny, "run", lambda *a, **k: calls.append(k) or real_run(*a, **k))
    real_linear = fp8.linear

    def linear_anywhere(x, w, b):  # the skinny path off CUDA too (qkv: fp8.linear)
        found = fp8._skinny_config(x, w)
        if found is None:
            return real_linear(x, w, b)
        return fp8.run_path(("skinny8" if found[1] else "skinny", found[0]), x, w, b)

    monkeypatch.setattr(fp8, "linear", linear_anywhere)
    got = greedy_paged(model, PROMPTS[:2], 3)
    steps = 4  # prefill + 3 decode steps
    assert len(calls) == 4 * s.n_layers * steps
    assert sum(bool(k.get("swiglu")) for k in calls) == s.n_layers * steps
    assert sum(bool(k.get("keep_partials")) for k in calls) == 2 * s.n_layers * steps
    assert sum(bool(k.get("quant_x")) for k in calls) == (len(calls) if kind == "skinny8" else 0)
    if kind == "skinny8":  # e4m3 activations (per row and tile) through 2 layers x 4 linears:
        # the prompts' logits (the same inputs) within 10 % of the largest; the random tiny
        # model's near-tied logits then pick other tokens, so the later steps differ
        a, b = base[1][0], got[1][0]
        assert (a - b).abs().max() <= 0.1 * a.abs().max()
        return
    assert got[0] == base[0]
    for a, b in zip(base[1], got[1]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def _group_quant_ref(x, bk):
    """x [M, K] quantized to e4m3 per row and ``bk`` columns as the ``quant_x`` kernel does:
    ``scale = max(amax, 1e-12) * fp32(1 / 448)``, ``q = clamp(x * (1 / scale))`` rounded to
    e4m3; returns the dequantized fp32 values."""
    from pdserve.model import fp8

    m, k = x.shape
    g = x.float().reshape(m, k // bk, bk)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) * torch.tensor(1 / 448.0)
    q = (g * (1.0 / scale)).clamp(-448, 448).to(fp8.FP8).float()
    return (q * scale).reshape(m, k)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quant_x_matches_the_group_quantized_product(split, with_bias):
    """``quant_x``: the activations quantized per row and BLOCK_K columns inside the kernel,
    FP8 dots: the product of the group-quantized x and the dequantized weight (fp32 sums),
    and within e4m3's error of the unquantized product."""
    m, n, k, bk = 20, 40, 128, 32
    x, wq, ws, real, b = _fp8_data(m, n, k, with_bias)
    x[3] = 0.0  # an all-zero row: scale floor, zeros out
    x[5, :32] *= 100.0  # one group far larger than the others: its own scale
    out = triton_skinny.run(x, wq, b, (16, 16, bk, split, 4, 2, 0), scale=ws, quant_x=True)
    assert isinstance(out, torch.Tensor) and out.shape == (m, n)
    ref = _group_quant_ref(x, bk) @ real.T
    ref = (ref if b is None else ref + b.float()).to(DTYPE)
    torch.testing.assert_close(out, ref, **TOL)
    exact = _ref(x, real, b).float()
    assert (out.float() - exact).abs().max() <= 0.06 * exact.abs().max()
    if b is None:
        assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_quant_x_swiglu_and_partials():
    from pdserve.model import fp8

    m, inter, k, bk = 9, 48, 64, 32
    x, wq, ws, real, _ = _fp8_data(m, 2 * inter, k, False)
    out = triton_skinny.run(
        x, wq, None, (16, 16, bk, 1, 4, 2, 0), swiglu=True, scale=ws, quant_x=True
    )
    xg = _group_quant_ref(x, bk)
    torch.testing.assert_close(out, fused_ops.silu_mul((xg @ real.T).to(DTYPE)), **TOL)
    w = fp8.Fp8Weight(wq[:inter].contiguous(), ws[:inter].contiguous(), k)
    parts = fp8.run_path(("skinny8", (16, 16, bk, 2, 4, 2, 0)), x, w, None)
    torch.testing.assert_close(parts, (xg @ real[:inter].T).to(DTYPE), **TOL)
