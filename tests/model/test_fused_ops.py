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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_add_then_rms_norm(dtype, with_residual):
    from pdserve.model.fused_ops import add_rms_norm
    from pdserve.model.llama import rms_norm

    gen = torch.Generator().manual_seed(2)
    T, N, eps = 3, 1000, 1e-5  # N not a power of two: the masked tail counts nothing
    x = torch.randn(T, 2 * N, generator=gen).to(dtype).to(DEVICE)[:, :N]  # a strided view
    r = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    w = (1 + 0.1 * torch.randn(N, generator=gen)).to(dtype).to(DEVICE)
    ref_h = x + r if r is not None else x
    xf = ref_h.float()
    ref_y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    h, y = add_rms_norm(x, r, w, eps)
    assert h.dtype == y.dtype == dtype and y.shape == (T, N)
    assert torch.equal(h, ref_h)  # the add rounds as torch's does
    # fp32: summation order only; bf16: one rounding of the output.
    tol = 1e-5 if dtype == torch.float32 else 2**-7 * ref_y.abs().max().item()
    assert (y.float() - ref_y.float()).abs().max().item() <= tol
    if dtype == torch.float32:  # and as the model's torch path (F.rms_norm) computes it
        assert (y - rms_norm(ref_h, w, eps)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "kv_dtype,kv_scale",
    [(None, (1.0, 1.0)), ("fp8", (1.0, 1.0)), ("fp8", (0.5, 0.25))],
    ids=["model-dtype", "fp8", "fp8-scaled"],
)
@pytest.mark.parametrize("order", ["page_major", "layer_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_equals_rope_then_the_backends_store(order, dtype, kv_dtype, kv_scale):
    """The fused RoPE + KV store leaves q/k and the pool byte for byte as RoPE followed by
    the triton backend's store kernel (the unfused path); a padded row (slot -1) writes
    nothing. bf16 too on CPU: both paths convert the same way under the interpreter. An
    e4m3 pool gets ``quantize_kv`` of K and V with the layer's scales in both paths (the
    scales here powers of two: ``x / s`` and the kernel's ``x * (1 / s)`` are equal)."""
    from pdserve.engine.kv.layout import KVCacheLayout
    from pdserve.model.attention import build_attention_metadata
    from pdserve.model.fused_ops import rope_inplace, rope_store_kv
    from pdserve.model.triton_backend import TritonBackend

    gen = torch.Generator().manual_seed(3)
    Hq, Hkv, D, ps, L = 4, 2, 16, 3, 2
    from pdserve.model.attention import quantize_kv

    pool_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else dtype
    layout = KVCacheLayout(order, L, Hkv, D, ps, 8, pool_dtype)
    # Three sequences: a 2-token prefill over a cached prefix, two decodes, one padded row.
    md = build_attention_metadata([2, 1, 1], [5, 1, 7], [[6, 2], [0], [3, 5, 1]], ps, DEVICE)
    slots = torch.cat((md.slot_mapping, torch.tensor([-1], device=DEVICE)))
    positions = torch.tensor([3, 4, 0, 6, 9], device=DEVICE)
    T = slots.shape[0]
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=gen).to(dtype).to(DEVICE)
    table = torch.randn(64, D, generator=gen).to(dtype).to(DEVICE)
    if kv_dtype == "fp8" and DEVICE == "cpu":
        # Triton 3.9's interpreter casts fp32 -> e4m3 wrongly when the rounding carries
        # into the exponent (0.4846 -> 0.25, not 0.5); the GPU's cast rounds as torch's.
        # So here K and V are values of e4m3's grid and RoPE the identity (cos 1, sin 0):
        # nothing is rounded, the kernel's scaling, saturation and slots are what is tested.
        qkv = qkv.to(torch.float8_e4m3fn).to(dtype)
        table[:, : D // 2], table[:, D // 2 :] = 1.0, 0.0
    if kv_dtype == "fp8":  # some values past e4m3's 448 once divided by the scale
        qkv[0, Hq + Hkv, :2] = torch.tensor([320.0, -704.0], dtype=dtype)
    pool = torch.randn(layout.shape, generator=gen).to(pool_dtype).to(DEVICE)
    layer, before = 1, pool.clone()

    ref_qkv, ref_pool = qkv.clone(), pool.clone()
    rope_inplace(ref_qkv[:, : Hq + Hkv], table, positions)
    kc, vc = layout.layer_views(ref_pool)[layer]
    md.slot_mapping = slots
    plan = TritonBackend().plan(md, ps)
    k, v = ref_qkv[:, Hq : Hq + Hkv], ref_qkv[:, Hq + Hkv :]
    TritonBackend().forward(ref_qkv[:, :Hq], k, v, kc, vc, md, plan, D**-0.5, kv_scale=kv_scale)

    kc, vc = layout.layer_views(pool)[layer]
    rope_store_kv(
        qkv[:, : Hq + Hkv], qkv[:, Hq + Hkv :], table, positions, kc, vc, slots, None, kv_scale
    )
    assert torch.equal(qkv, ref_qkv)  # q and k rotated as RoPE alone does, V untouched
    # the same bytes in the pool, nothing else written
    assert torch.equal(pool.view(torch.uint8), ref_pool.view(torch.uint8))
    kc, vc = layout.layer_views(pool)[layer]
    for t in range(T - 1):  # each real token's rotated K and its V sit at its slot
        page, off = divmod(int(slots[t]), ps)
        k_t, v_t = qkv[t, Hq : Hq + Hkv], qkv[t, Hq + Hkv :]
        if kv_dtype == "fp8":
            k_t, v_t = quantize_kv(k_t, kv_scale[0]), quantize_kv(v_t, kv_scale[1])
        assert torch.equal(kc[page, off].view(torch.uint8), k_t.view(torch.uint8))
        assert torch.equal(vc[page, off].view(torch.uint8), v_t.view(torch.uint8))
    if kv_dtype == "fp8":  # saturated, as quantize_kv saturates
        page, off = divmod(int(slots[0]), ps)
        want = [max(-448.0, min(448.0, x / kv_scale[1])) for x in (320.0, -704.0)]
        assert vc[page, off, 0, :2].float().tolist() == want  # [320, -448] or [448, -448]
    changed = pool.view(torch.uint8) != before.view(torch.uint8)
    changed = changed.movedim(layout.page_dim, 0).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [0, 1, 2]  # the pages of the 4 slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("store", [False, True], ids=["rope", "rope_store_kv"])
def test_qk_norm_inside_rope_equals_rms_norm_then_rope(dtype, store):
    """Qwen3's per-head q/k RMSNorm folded into the RoPE kernel (``qk_norm``), in place on
    the strided q/k view of a fused QKV output: the model's unfused path (``rms_norm`` of the
    q heads and of the k heads, cat, RoPE; then the KV store) within one rounding (bf16) or
    to fp32's last bits; V untouched (and stored as is)."""
    from pdserve.model.fused_ops import rope_inplace, rope_store_kv
    from pdserve.model.llama import rms_norm

    gen = torch.Generator().manual_seed(11)
    T, Hq, Hkv, D, eps, ps = 4, 4, 2, 16, 1e-6, 2
    qkv = (3 * torch.randn(T, Hq + 2 * Hkv, D, generator=gen)).to(dtype).to(DEVICE)
    qw = (1 + torch.randn(D, generator=gen)).to(dtype).to(DEVICE)
    kw = (1 + torch.randn(D, generator=gen)).to(dtype).to(DEVICE)
    table = torch.randn(64, D, generator=gen).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 9, 9, 40], device=DEVICE)
    cs = table.index_select(0, positions)[:, None, :]
    cos, sin = cs.chunk(2, dim=-1)
    normed = torch.cat(
        (rms_norm(qkv[:, :Hq], qw, eps), rms_norm(qkv[:, Hq : Hq + Hkv], kw, eps)), 1
    )
    ref = apply_rope(normed, cos, sin)
    v_before = qkv[:, Hq + Hkv :].clone()
    qk = qkv[:, : Hq + Hkv]
    if store:
        kc = torch.zeros(T, ps, Hkv, D, dtype=dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        slots = torch.tensor([0, 3, -1, 6], device=DEVICE)
        rope_store_kv(qk, qkv[:, Hq + Hkv :], table, positions, kc, vc, slots, (qw, kw, eps, Hq))
    else:
        rope_inplace(qk, table, positions, (qw, kw, eps, Hq))
    tol = 1e-5 if dtype == torch.float32 else 2**-6 * ref.abs().max().item()
    assert (qkv[:, : Hq + Hkv].float() - ref.float()).abs().max().item() <= tol
    assert torch.equal(qkv[:, Hq + Hkv :], v_before)
    if store:
        for t, slot in enumerate(slots.tolist()):
            page, off = divmod(slot, ps)
            if slot < 0:
                continue
            assert torch.equal(kc[page, off], qkv[t, Hq : Hq + Hkv])
            assert torch.equal(vc[page, off], v_before[t])
        assert kc.flatten(0, 1).abs().sum(-1).sum(-1).nonzero().flatten().tolist() == [0, 3, 6]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, N, E, block_e, chunk", [(1, 64, 8, 16, 512), (5, 40, 20, 8, 16), (2, 64, 10, 4, 2048)]
)
def test_add_rms_norm_router_equals_add_rms_norm_then_linear(dtype, T, N, E, block_e, chunk):
    """The router GEMM inside the add + RMSNorm kernel (several expert blocks and column
    chunks, ragged edges): h and y exactly as add_rms_norm's, the logits as F.linear of y
    within fp32 summation order (bf16: one rounding)."""
    from pdserve.model.fused_ops import add_rms_norm, add_rms_norm_router

    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    w = (1 + torch.randn(N, generator=gen)).to(dtype).to(DEVICE)
    gate = torch.randn(E, N, generator=gen).to(dtype).to(DEVICE)
    h0, y0 = add_rms_norm(x, res, w, 1e-6)
    h, y, logits = add_rms_norm_router(x, res, w, 1e-6, gate, block_e, chunk)
    assert torch.equal(h, h0) and torch.equal(y, y0)
    ref = F.linear(y0.float(), gate.float())
    tol = (
        1e-5 * ref.abs().max().item() if dtype == torch.float32 else 2**-7 * ref.abs().max().item()
    )
    assert logits.dtype == dtype and logits.shape == (T, E)
    assert (logits.float() - ref).abs().max().item() <= tol


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter path (greedy_paged is CPU)")
def test_dense_qwen3_through_the_cuda_kernels_equals_transformers(monkeypatch, tiny_hf_builder):
    """Dense Qwen3 as it decodes on CUDA (every ``fused_ops`` kernel, its q/k norms inside
    the RoPE + KV store kernel of the triton backend), here under the interpreter, in fp32:
    transformers' greedy tokens, logits within 1e-4."""
    from test_moe import hf_greedy
    from tp_model_ranks import PROMPTS, greedy_paged

    from pdserve.model import llama

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = tiny_hf_builder("qwen3", seed=3)
    model = llama.LlamaForCausalLM(hf.config, torch.float32, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    tokens, logits = greedy_paged(model, PROMPTS[:2], 2)
    ref_tokens, ref_logits = hf_greedy(hf, PROMPTS[:2], 2)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert (got - want).abs().max().item() < 1e-4


@pytest.mark.skipif(DEVICE == "cuda", reason="forces the CUDA path on CPU (interpreter)")
def test_an_fp8_cache_is_stored_by_the_rope_kernel_with_each_layers_scales(
    monkeypatch, tiny_hf_builder
):
    """On the CUDA path (fused ops) an e4m3 pool is written by the RoPE kernel, quantized
    with each layer's own K/V scales; the backend's store kernel (and the torch
    quantization before it: four elementwise kernels for K and V) does not run."""
    from pdserve.engine.kv.layout import KVCacheLayout
    from pdserve.model import fused_ops, llama, triton_backend
    from pdserve.model.attention import build_attention_metadata

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = tiny_hf_builder("llama", seed=5)
    model = llama.LlamaForCausalLM(hf.config, torch.float32, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    layers = list(model.decoder_layers())
    for i, layer in enumerate(layers):
        layer.kv_scale = (0.5 * (i + 1), 0.25 * (i + 1))
    s = model.shapes
    lay = KVCacheLayout(
        "page_major", s.n_layers, s.n_kv_heads, s.head_dim, 4, 8, torch.float8_e4m3fn
    )
    pool = lay.allocate("cpu")
    caches = lay.layer_views(pool)
    stored = []
    real_store = fused_ops.rope_store_kv

    def recording(qk, v, table, positions, kc, vc, slots, qk_norm=None, kv_scale=(1.0, 1.0)):
        stored.append((kc.dtype, kv_scale))
        real_store(qk, v, table, positions, kc, vc, slots, qk_norm, kv_scale)

    monkeypatch.setattr(fused_ops, "rope_store_kv", recording)

    class NoStore:
        def __getitem__(self, grid):
            raise AssertionError("the backend's store kernel ran")

    monkeypatch.setattr(triton_backend, "store_kv_kernel", NoStore())
    md = build_attention_metadata([5], [5], [[3, 6]], 4)
    model(torch.tensor([1, 7, 9, 4, 2]), torch.arange(5), md, caches)
    assert stored == [(torch.float8_e4m3fn, layer.kv_scale) for layer in layers]
    assert pool.view(torch.uint8).any()  # the prompt's K/V are in the pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_quant_gives_the_bits_of_add_rms_norm_then_quantize_rows(dtype, with_residual):
    """The e4m3 rows and scales of the fused kernel are those of the two kernels it replaces
    (bf16 too on CPU: both round through the same conversion), h the same, and an all-zero
    row keeps scale 1e-12 / 448 with zero codes."""
    from pdserve.model.fused_ops import add_rms_norm, add_rms_norm_quant
    from pdserve.model.triton_w8a8 import quantize_rows

    gen = torch.Generator().manual_seed(3)
    T, N, eps = 3, 1000, 1e-5  # N not a power of two: the masked tail counts nothing
    x = (4 * torch.randn(T, 2 * N, generator=gen)).to(dtype).to(DEVICE)[:, :N]  # strided
    r = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    x[2] = 0.0
    if r is not None:
        r[2] = 0.0
    w = (1 + 0.1 * torch.randn(N, generator=gen)).to(dtype).to(DEVICE)
    h0, y0 = add_rms_norm(x, r, w, eps)
    q0, s0 = quantize_rows(y0)
    h, q, s = add_rms_norm_quant(x, r, w, eps)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, N) and s.shape == (T, 1)
    assert torch.equal(h, h0)
    assert torch.equal(s, s0) and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    assert s[2].item() == pytest.approx(1e-12 / 448) and not q[2].float().any()


@pytest.mark.gpu
def test_add_rms_norm_linear_equals_norm_then_fp8_linear(monkeypatch):
    """fp8.add_rms_norm_linear (the quantization in the norm's kernel, then w8a8) gives the
    bits of add_rms_norm then fp8.linear wherever the path is w8a8, and None elsewhere."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    from pdserve.model import fp8
    from pdserve.model.fused_ops import add_rms_norm

    gen = torch.Generator().manual_seed(4)
    K, N = 512, 384
    q, sc = fp8.quantize_per_channel(torch.randn(N, K, generator=gen) * 0.1)
    wt = fp8.Fp8Weight(q.cuda(), sc.cuda(), K)
    cfg = ("w8a8", 16, 64, 128, 1, True, 4, 4)
    monkeypatch.setitem(fp8.PATHS, (N, K), ((4, ("w8a8", cfg)), (8, ("gemv", None))))
    monkeypatch.setattr(fp8, "FUSE_NORM_QUANT", True)
    norm = (1 + 0.1 * torch.randn(K, generator=gen)).bfloat16().cuda()
    for T in (1, 3):
        x = torch.randn(T, K, generator=gen).bfloat16().cuda()
        d = torch.randn(T, K, generator=gen).bfloat16().cuda()
        got = fp8.add_rms_norm_linear(x, d, norm, 1e-5, wt, None)
        assert got is not None
        h0, y0 = add_rms_norm(x, d, norm, 1e-5)
        assert torch.equal(got[0], h0) and torch.equal(got[1], fp8.linear(y0, wt, None))
    x = torch.randn(6, K, generator=gen).bfloat16().cuda()
    assert fp8.add_rms_norm_linear(x, x, norm, 1e-5, wt, None) is None  # 6 rows: gemv path
    monkeypatch.setattr(fp8, "FUSE_NORM_QUANT", False)
    assert fp8.add_rms_norm_linear(x[:1], x[:1], norm, 1e-5, wt, None) is None


@pytest.mark.gpu
def test_add_rms_norm_linear_scaled_mm_equals_norm_then_fp8_linear(monkeypatch):
    """With FUSE_NORM_QUANT_SCALED_MM, rows whose path is _scaled_mm take their e4m3 rows
    from the norm's kernel: the bits of add_rms_norm then fp8.linear (quantize_rows then
    _scaled_mm); without it, None (the caller's two launches)."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    from pdserve.model import fp8
    from pdserve.model.fused_ops import add_rms_norm

    gen = torch.Generator().manual_seed(5)
    K, N = 512, 384
    q, sc = fp8.quantize_per_channel(torch.randn(N, K, generator=gen) * 0.1)
    wt = fp8.Fp8Weight(q.cuda(), sc.cuda(), K)
    monkeypatch.setitem(fp8.PATHS, (N, K), ((1024, ("scaled_mm", None)),))
    monkeypatch.setattr(fp8, "FUSE_NORM_QUANT", True)
    norm = (1 + 0.1 * torch.randn(K, generator=gen)).bfloat16().cuda()
    bias = torch.randn(N, generator=gen).bfloat16().cuda()
    x = torch.randn(300, K, generator=gen).bfloat16().cuda()
    d = torch.randn(300, K, generator=gen).bfloat16().cuda()
    monkeypatch.setattr(fp8, "FUSE_NORM_QUANT_SCALED_MM", False)
    assert fp8.add_rms_norm_linear(x, d, norm, 1e-5, wt, bias) is None
    monkeypatch.setattr(fp8, "FUSE_NORM_QUANT_SCALED_MM", True)
    got = fp8.add_rms_norm_linear(x, d, norm, 1e-5, wt, bias)
    assert got is not None
    h0, y0 = add_rms_norm(x, d, norm, 1e-5)
    assert torch.equal(got[0], h0) and torch.equal(got[1], fp8.linear(y0, wt, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_tile_max", [None, 256])
def test_silu_mul_quant_gives_the_bits_of_silu_mul_then_quantize_rows(
    dtype, one_tile_max, monkeypatch
):
    """The e4m3 rows and scales of SwiGLU + quantization in one kernel are those of the two
    kernels it replaces (silu_mul, then quantize_rows), with the row in registers and read
    twice (a narrow one-tile bound: the masked tail of the last tile too); an all-zero row
    keeps scale 1e-12 / 448 with zero codes."""
    from pdserve.model import fused_ops
    from pdserve.model.triton_w8a8 import quantize_rows

    if one_tile_max is not None:
        monkeypatch.setattr(fused_ops, "SILU_QUANT_ONE_TILE_MAX", one_tile_max)
    gen = torch.Generator().manual_seed(5)
    T, N = 4, 700  # N not a power of two; 700 > 256: three tiles when read twice
    x = (3 * torch.randn(T, 2 * N + 40, generator=gen)).to(dtype).to(DEVICE)[:, : 2 * N]
    x[1, 5] = 80.0  # one large value sets its row's scale
    x[3] = 0.0
    q0, s0 = quantize_rows(fused_ops.silu_mul(x))
    q, s = fused_ops.silu_mul_quant(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, N) and s.shape == (T, 1)
    assert torch.equal(s, s0) and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    assert s[3].item() == pytest.approx(1e-12 / 448) and not q[3].float().any()
    assert fused_ops.silu_mul_quant(x[:0])[0].shape == (0, N)


@pytest.mark.gpu
def test_silu_mul_linear_equals_silu_mul_then_fp8_linear(monkeypatch):
    """fp8.silu_mul_linear (the quantization in the SwiGLU kernel, then w8a8 or _scaled_mm)
    gives the bits of silu_mul then fp8.linear wherever the path quantizes its rows, and
    None elsewhere or with FUSE_SILU_QUANT off."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    from pdserve.model import fp8
    from pdserve.model.fused_ops import silu_mul

    gen = torch.Generator().manual_seed(6)
    K, N = 1024, 384
    q, sc = fp8.quantize_per_channel(torch.randn(N, K, generator=gen) * 0.1)
    wt = fp8.Fp8Weight(q.cuda(), sc.cuda(), K)
    cfg = ("w8a8", 16, 64, 128, 1, True, 4, 4)
    paths = ((1, ("gemv", None)), (4, ("w8a8", cfg)), (64, ("scaled_mm", None)))
    monkeypatch.setitem(fp8.PATHS, (N, K), paths)
    monkeypatch.setattr(fp8, "FUSE_SILU_QUANT", True)
    for T in (3, 40):
        gate_up = torch.randn(T, 2 * K, generator=gen).bfloat16().cuda()
        got = fp8.silu_mul_linear(gate_up, wt, None)
        assert got is not None
        assert torch.equal(got, fp8.linear(silu_mul(gate_up), wt, None))
    assert fp8.silu_mul_linear(torch.randn(1, 2 * K).bfloat16().cuda(), wt, None) is None
    monkeypatch.setattr(fp8, "FUSE_SILU_QUANT", False)
    assert fp8.silu_mul_linear(torch.randn(3, 2 * K).bfloat16().cuda(), wt, None) is None
