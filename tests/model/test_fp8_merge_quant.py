"""The split-KV merge and o_proj's per-row e4m3 quantization in one kernel
(``triton_kernels.decode_merge_quant_kernel``, ``TritonBackend.forward_quantized``,
``fp8.FUSE_MERGE_QUANT``): the codes and scales are the bits of the merge kernel followed by
``triton_w8a8.quantize_rows``, in the kernel pair, through the backend (e4m3 and 16-bit
caches, a V scale) and through a model; one launch a layer fewer. Kernels run on CPU under
Triton's interpreter (this folder's conftest)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.model import triton_backend
from pdserve.model.attention import build_attention_metadata, get_attention_backend, quantize_kv
from pdserve.model.triton_backend import DecodeConfig, TritonPlan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _partials(B: int, Hq: int, S: int, D: int, seed: int):
    """Split partials as the split kernel leaves them: ``mid_o [B, Hq, S, D]`` fp32 (garbage,
    NaN, where a split is empty), ``mid_lse [B, Hq, S]`` (-inf for an empty split); row 1's
    last splits empty, row B-1 all empty (a padded row), one large value in row 0."""
    gen = torch.Generator().manual_seed(seed)
    mid_o = 3 * torch.randn(B, Hq, S, D, generator=gen)
    mid_lse = 4 * torch.randn(B, Hq, S, generator=gen)
    mid_o[0, 1, 0, 3] = 90.0
    if B > 2:
        mid_lse[1, :, S // 2 :] = float("-inf")
        mid_o[1, :, S // 2 :] = float("nan")
    mid_lse[B - 1] = float("-inf")
    mid_o[B - 1] = float("nan")
    return mid_o.to(DEVICE), mid_lse.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B, Hq, S, D, v_scale",
    [(4, 4, 2, 32, 1.0), (3, 6, 8, 16, 0.5), (2, 8, 5, 24, 1.0), (5, 2, 32, 64, 2.0)],
)
def test_merge_quant_kernel_gives_the_bits_of_merge_then_quantize_rows(B, Hq, S, D, v_scale, dtype):
    """Several split counts (5: the split block padded; 32: the most), head counts (6: the
    head block padded) and head dims (24: the dim block padded), bf16 and fp32 outputs, an
    e4m3 cache's V scale (a power of two: exact in bf16 whatever the rounding), empty splits
    and an all-empty row (scale 1e-12 / 448, zero codes)."""
    from pdserve.model.triton_kernels import decode_merge_kernel, decode_merge_quant_kernel
    from pdserve.model.triton_w8a8 import quantize_rows

    mid_o, mid_lse = _partials(B, Hq, S, D, seed=S)
    block_d = triton_backend._pow2(D)
    out = torch.empty(B, Hq, D, dtype=dtype, device=DEVICE)
    decode_merge_kernel[(B, Hq)](
        mid_o, mid_lse, out, *mid_o.stride()[:3], *mid_lse.stride()[:2], out.stride(0),
        out.stride(1), D=D, NUM_SPLITS=S, BLOCK_D=block_d, PDL=False,
    )  # fmt: skip
    if v_scale != 1.0:
        out.mul_(v_scale)
    q0, s0 = quantize_rows(out.view(B, Hq * D))
    counts = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    # one program a row (all heads), or the heads in groups of 1 / 2 / 4 (the last one of a
    # row quantizes it; 6 heads in 4s: a padded group)
    for heads in sorted({triton_backend._pow2(Hq, 1), 1, 2, 4} - {8}):
        groups = -(-Hq // heads)
        q = torch.empty(B, Hq * D, dtype=torch.float8_e4m3fn, device=DEVICE)
        s = torch.empty(B, 1, dtype=torch.float32, device=DEVICE)
        amax = torch.empty(B, groups, device=DEVICE)
        scratch = torch.full_like(out, float("nan"))
        decode_merge_quant_kernel[(B, groups)](
            mid_o, mid_lse, scratch, q, s, amax, counts, v_scale, *mid_o.stride()[:3],
            *mid_lse.stride()[:2], scratch.stride(0), scratch.stride(1), q.stride(0), HQ=Hq,
            D=D, NUM_SPLITS=S, BLOCK_H=heads, BLOCK_D=block_d, GROUPS=groups,
            BLOCK_G=triton_backend._pow2(groups, 1), PDL=False,
        )  # fmt: skip
        assert torch.equal(s, s0) and torch.equal(_u8(q), _u8(q0)), heads
        assert s[B - 1].item() == pytest.approx(1e-12 / 448) and not q[B - 1].float().any()
        assert q[0].float().abs().max().item() == 448.0  # the row's largest value: its scale
        assert not counts.any()  # each row's last program set its counter back
        if groups > 1:  # the 16-bit output kept on the way: the merge kernel's
            assert torch.equal(scratch, out)


def _decode_step(B: int, ctx: list[int], Hq: int, Hkv: int, D: int, ps: int, kv_dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    pages = sum(math.ceil(c / ps) for c in ctx) + 2
    perm = torch.randperm(pages, generator=gen).tolist()
    tables, used = [], 0
    for c in ctx:
        n = math.ceil(c / ps)
        tables.append(perm[used : used + n])
        used += n
    k_cache = 2 * torch.randn(pages, ps, Hkv, D, generator=gen)
    v_cache = 2 * torch.randn(pages, ps, Hkv, D, generator=gen)
    if kv_dtype == torch.float8_e4m3fn:
        k_cache, v_cache = quantize_kv(k_cache, 1.0), quantize_kv(v_cache, 1.0)
    md = build_attention_metadata([1] * B, ctx, tables, ps, device=DEVICE)
    q = torch.randn(B, Hq, D, generator=gen).to(DEVICE)
    return q, k_cache.to(DEVICE), v_cache.to(DEVICE), md


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("splits, heads", [(1, 0), (2, 0), (4, 0), (4, 2)])
def test_forward_quantized_gives_the_bits_of_forward_then_quantize_rows(
    kv_dtype, splits, heads, monkeypatch
):
    """A decode step of several splits: forward_quantized's (codes, scales) are
    quantize_rows of forward's output (an e4m3 cache with a V scale: the output's multiply
    inside the kernel), one program a row or (``heads``) two heads a program; one split (no
    merge) returns forward's output itself; a prefill step too."""
    from pdserve.model.triton_w8a8 import quantize_rows

    monkeypatch.setattr(triton_backend, "MERGE_QUANT_HEADS", heads)
    B, Hq, Hkv, D, ps = 3, 4, 2, 32, 8
    backend = get_attention_backend("triton")
    q, k_cache, v_cache, md = _decode_step(B, [70, 5, 130], Hq, Hkv, D, ps, kv_dtype, splits)
    kv_scale = (0.5, 0.75) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    cfg = DecodeConfig(splits, 16, 4, 2)
    kv = q[:, :Hkv]
    args = (q, kv, kv, k_cache, v_cache, md)
    ref = backend.forward(*args, TritonPlan(True, 130, 1, 205, cfg), D**-0.5, True, kv_scale)
    got = backend.forward_quantized(
        *args, TritonPlan(True, 130, 1, 205, cfg), D**-0.5, True, kv_scale
    )
    if splits == 1:
        assert isinstance(got, torch.Tensor) and torch.equal(got, ref)
    else:
        assert isinstance(got, tuple)
        q0, s0 = quantize_rows(ref)
        assert torch.equal(got[1], s0) and torch.equal(_u8(got[0]), _u8(q0))
    prefill = build_attention_metadata([5], [5], [[0]], ps, device=DEVICE)
    qp = torch.randn(5, Hq, D).to(DEVICE)
    kp = qp[:, :Hkv]
    p_args = (qp, kp, kp, k_cache.clone(), v_cache.clone(), prefill)
    plan = backend.plan(prefill, ps)
    out = backend.forward_quantized(*p_args, plan, D**-0.5)
    assert isinstance(out, torch.Tensor) and out.shape == (5, Hq * D)


def test_merge_quant_path_only_where_o_proj_takes_e4m3_rows(monkeypatch):
    """o_proj's path at the step's rows: w8a8 and _scaled_mm take the merge's e4m3 rows, the
    one-row gemv (and w8a16) its 16-bit output; off with the flag, on CPU, for fp32
    activations, for a block-scaled weight."""
    from pdserve.model import fp8

    K = N = 64
    q, sc = fp8.quantize_per_channel(torch.randn(N, K))
    w = fp8.Fp8Weight(q, sc, K)
    cfg = ("w8a8", 16, 32, 32, 1, True, 4, 2)
    paths = (
        (1, ("gemv", None)),
        (2, ("w8a16", None)),
        (32, ("w8a8", cfg)),
        (64, ("scaled_mm", None)),
    )
    monkeypatch.setitem(fp8.PATHS, (N, K), paths)
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    assert fp8.merge_quant_path(32, w, x) is None  # CPU
    monkeypatch.setattr(fp8, "kernels_on", lambda t: True)
    monkeypatch.setattr(fp8, "FUSE_MERGE_QUANT", True)
    got = {m: fp8.merge_quant_path(m, w, x) for m in (1, 2, 16, 32, 64, 300)}
    assert got == {1: None, 2: None, 16: ("w8a8", cfg), 32: ("w8a8", cfg)} | {
        64: ("scaled_mm", None),
        300: ("scaled_mm", None),
    }
    assert fp8.merge_quant_path(32, None, x) is None
    bq, bs = fp8.quantize_block(torch.randn(N, K), (1, 32))
    assert fp8.merge_quant_path(32, fp8.Fp8Weight(bq, bs, 32), x) is None
    monkeypatch.setattr(fp8, "FUSE_MERGE_QUANT", False)
    assert fp8.merge_quant_path(32, w, x) is None


class _Count:
    """Stands in for a Triton kernel in a module's namespace: counts its launches."""

    def __init__(self, kernel, counts: dict, name: str) -> None:
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts[self.name] = self.counts.get(self.name, 0) + 1
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.timeout(600)
@pytest.mark.skipif(DEVICE == "cuda", reason="forces the CUDA path on CPU (interpreter)")
def test_a_model_with_the_merge_quantizing_computes_the_same_bits(monkeypatch, tiny_hf_builder):
    """The tiny FP8 Llama on the CUDA path (fused ops, triton attention with 4 decode splits,
    o_proj on the w8a8 kernel): greedy tokens and logits with fp8.FUSE_MERGE_QUANT on equal
    those with it off bit for bit, and each decode step of each layer launches the merge +
    quantization kernel instead of the merge and quantize_rows (one kernel fewer)."""
    from tp_model_ranks import greedy_paged

    from pdserve.model import fp8, llama, triton_w8a8

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = tiny_hf_builder("llama", seed=6)
    model = llama.LlamaForCausalLM(
        hf.config, torch.float32, "cpu", attn_backend="triton", quantization="fp8"
    )
    model.load_weights(hf.state_dict().items())
    assert model.backend.quantized_output  # the warm-up would compile the fused variants
    s = model.shapes
    o_shape = (s.hidden, s.n_heads * s.head_dim)
    assert o_shape not in {(s.hidden, s.intermediate), (2 * s.intermediate, s.hidden)}
    cfg = ("w8a8", 16, 32, 32, 1, True, 4, 2)
    monkeypatch.setitem(fp8.PATHS, o_shape, ((64, ("w8a8", cfg)),))
    real_linear = fp8.linear

    def linear_anywhere(x, w, b):  # o_proj on its path off CUDA too (the reference)
        if tuple(w.weight.shape) != o_shape:
            return real_linear(x, w, b)
        return fp8.run_path(fp8.path_for(x.shape[0], *o_shape), x, w, b)

    monkeypatch.setattr(fp8, "linear", linear_anywhere)
    monkeypatch.setattr(fp8, "kernels_on", lambda x: True)  # fp32 on CPU here
    fixed = DecodeConfig(4, 16, 4, 2)
    monkeypatch.setattr(triton_backend, "decode_config", lambda *a, **k: fixed)
    counts: dict = {}
    for mod, name in (
        (triton_backend, "decode_merge_kernel"),
        (triton_backend, "decode_merge_quant_kernel"),
        (triton_w8a8, "_quant_rows_kernel"),
    ):
        monkeypatch.setattr(mod, name, _Count(getattr(mod, name), counts, name))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (50, 37, 61)]
    steps = 3
    runs, launches = [], []
    for fuse in (False, True):
        monkeypatch.setattr(fp8, "FUSE_MERGE_QUANT", fuse)
        counts.clear()
        runs.append(greedy_paged(model, prompts, steps, page_size=8))
        launches.append(dict(counts))
    per_run, prefill = steps * s.n_layers, s.n_layers  # the prefill's o_proj quantizes its rows
    assert launches[0] == {"decode_merge_kernel": per_run, "_quant_rows_kernel": per_run + prefill}
    assert launches[1] == {"decode_merge_quant_kernel": per_run, "_quant_rows_kernel": prefill}
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split, with_bias", [(2, False), (4, True)])
def test_splitk_add_norm_quant_gives_the_bits_of_reduce_then_add_norm_quant(
    split, with_bias, dtype
):
    """fused_splitk_norm.add_rms_norm_quant (a split-K w8a8 linear's fp32 partials reduced in
    the add + RMSNorm + quantization kernel) gives the bits of the reduce kernel then
    fused_ops.add_rms_norm_quant: h, the e4m3 rows and their scales; an all-zero row keeps
    scale 1e-12 / 448."""
    from pdserve.model import fused_ops, fused_splitk_norm, pdl
    from pdserve.model.triton_gemv_parts import REDUCE_BLOCK, _splitk_reduce_kernel

    gen = torch.Generator().manual_seed(split)
    T, N, eps = 5, 200, 1e-5  # N not a power of two: the masked tail counts nothing
    parts = (2 * torch.randn(split, T, N, generator=gen)).to(DEVICE)
    x = (3 * torch.randn(T, N, generator=gen)).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(N, generator=gen)).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    parts[:, 3] = 0.0
    x[3] = 0.0
    if b is not None:
        b.zero_()
    reduced = torch.empty(T, N, dtype=dtype, device=DEVICE)
    _splitk_reduce_kernel[(-(-T * N // REDUCE_BLOCK),)](
        parts, b if b is not None else w, reduced, N, T * N, HAS_BIAS=b is not None,
        SPLIT_K=split, BLOCK=REDUCE_BLOCK, num_warps=4, **pdl.launch_options(x),
    )  # fmt: skip
    h0, q0, s0 = fused_ops.add_rms_norm_quant(x, reduced, w, eps)
    p = fused_splitk_norm.SplitKPartials(parts, b, dtype)
    h, q, s = fused_splitk_norm.add_rms_norm_quant(x, p, w, eps)
    assert torch.equal(h, h0) and torch.equal(s, s0) and torch.equal(_u8(q), _u8(q0))
    assert s[3].item() == pytest.approx(1e-12 / 448) and not q[3].float().any()
    with pytest.raises(ValueError, match="do not match"):
        fused_splitk_norm.add_rms_norm_quant(x[:2], p, w, eps)


@pytest.mark.timeout(600)
@pytest.mark.skipif(DEVICE == "cuda", reason="forces the CUDA path on CPU (interpreter)")
def test_a_model_with_the_fp8_splitk_reduce_folded_computes_the_same_bits(
    monkeypatch, tiny_hf_builder
):
    """The tiny FP8 Llama on the CUDA path with all four linears on w8a8 tiles, o_proj and
    down_proj splitting K in two: greedy tokens and logits with fp8.FUSE_SPLITK_NORM on (their
    reduce in the next add + RMSNorm + quantization kernel, the last layer's in the final
    norm's) equal those with it off bit for bit, and no reduce kernel runs (two a layer
    before), with and without the merge + quantization kernel (4 decode splits)."""
    from tp_model_ranks import greedy_paged

    from pdserve.model import fp8, fused_splitk_norm, llama, triton_w8a8

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = tiny_hf_builder("llama", seed=7)
    model = llama.LlamaForCausalLM(
        hf.config, torch.float32, "cpu", attn_backend="triton", quantization="fp8"
    )
    model.load_weights(hf.state_dict().items())
    s = model.shapes
    one, two = ("w8a8", 16, 32, 32, 1, True, 4, 2), ("w8a8", 16, 32, 32, 2, True, 4, 2)
    shapes = {
        ((s.n_heads + 2 * s.n_kv_heads) * s.head_dim, s.hidden): one,  # qkv
        (s.hidden, s.n_heads * s.head_dim): two,  # o_proj
        (2 * s.intermediate, s.hidden): one,  # gate_up
        (s.hidden, s.intermediate): two,  # down (96 = 64 + 32: an uneven last slice)
    }
    assert len(shapes) == 4
    for shape, cfg in shapes.items():
        monkeypatch.setitem(fp8.PATHS, shape, ((256, ("w8a8", cfg)),))
    real_linear = fp8.linear

    def linear_anywhere(x, w, b):  # the listed shapes on their paths off CUDA too
        shape = tuple(w.weight.shape)
        if shape not in shapes:
            return real_linear(x, w, b)
        return fp8.run_path(fp8.path_for(x.shape[0], *shape), x, w, b)

    monkeypatch.setattr(fp8, "linear", linear_anywhere)
    monkeypatch.setattr(fp8, "kernels_on", lambda x: True)  # fp32 on CPU here
    fixed = DecodeConfig(4, 16, 4, 2)
    monkeypatch.setattr(triton_backend, "decode_config", lambda *a, **k: fixed)
    counts: dict = {}
    for mod, name in (
        (triton_w8a8, "_splitk_reduce_kernel"),
        (fused_splitk_norm, "_splitk_add_rms_norm_quant_kernel"),
        (fused_splitk_norm, "_splitk_add_rms_norm_kernel"),
    ):
        monkeypatch.setattr(mod, name, _Count(getattr(mod, name), counts, name))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (45, 30)]
    steps = 2
    forwards = 1 + steps
    for merge in (False, True):
        monkeypatch.setattr(fp8, "FUSE_MERGE_QUANT", merge)
        runs, launches = [], []
        for fold in (False, True):
            monkeypatch.setattr(fp8, "FUSE_SPLITK_NORM", fold)
            counts.clear()
            runs.append(greedy_paged(model, prompts, steps, page_size=8))
            launches.append(dict(counts))
        assert launches[0] == {"_splitk_reduce_kernel": 2 * s.n_layers * forwards}
        assert launches[1] == {  # o_proj's and down's (the last one's: the final norm's)
            "_splitk_add_rms_norm_quant_kernel": (2 * s.n_layers - 1) * forwards,
            "_splitk_add_rms_norm_kernel": forwards,
        }
        assert runs[0][0] == runs[1][0]
        for a, b in zip(runs[0][1], runs[1][1]):
            assert torch.equal(a, b)


@pytest.mark.timeout(600)
@pytest.mark.skipif(DEVICE == "cuda", reason="forces the CUDA path on CPU (interpreter)")
def test_the_engine_decodes_the_same_tokens_with_the_merge_quantizing(monkeypatch):
    """Through the engine (``LLM``, random:tiny, FP8 weights, the triton backend and the
    CUDA path forced on CPU, 4 decode splits, o_proj on a w8a8 tile): the greedy tokens and
    their logprobs with fp8.FUSE_MERGE_QUANT on equal those with it off, and the decode steps
    ran the merge + quantization kernel instead of the merge."""
    from pdserve import LLM, SamplingParams
    from pdserve.model import fp8, llama

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    llm = LLM(
        "random:tiny",
        device="cpu",
        attention_backend="triton",
        quantization="fp8",
        num_pages=64,
        page_size=8,
        enable_prefix_caching=False,  # both runs prefill the whole prompts alike
    )
    try:
        s = llm.engine.executor.rank0.model.shapes
        o_shape = (s.hidden, s.n_heads * s.head_dim)
        cfg = ("w8a8", 16, 32, 32, 1, True, 4, 2)
        monkeypatch.setitem(fp8.PATHS, o_shape, ((256, ("w8a8", cfg)),))
        real_linear = fp8.linear

        def linear_anywhere(x, w, b):  # o_proj on its path off CUDA too (the reference)
            if tuple(w.weight.shape) != o_shape:
                return real_linear(x, w, b)
            return fp8.run_path(fp8.path_for(x.shape[0], *o_shape), x, w, b)

        monkeypatch.setattr(fp8, "linear", linear_anywhere)
        monkeypatch.setattr(fp8, "kernels_on", lambda x: True)
        fixed = DecodeConfig(4, 16, 4, 2)
        monkeypatch.setattr(triton_backend, "decode_config", lambda *a, **k: fixed)
        counts: dict = {}
        for name in ("decode_merge_kernel", "decode_merge_quant_kernel"):
            kernel = getattr(triton_backend, name)
            monkeypatch.setattr(triton_backend, name, _Count(kernel, counts, name))
        gen = torch.Generator().manual_seed(4)
        prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (40, 57)]
        params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
        runs, launches = [], []
        for fuse in (False, True):
            monkeypatch.setattr(fp8, "FUSE_MERGE_QUANT", fuse)
            counts.clear()
            outs = llm.generate(prompts, params)
            runs.append(
                [(o.outputs[0].token_ids, [x.logprob for x in o.outputs[0].logprobs]) for o in outs]
            )
            launches.append(dict(counts))
        assert runs[0] == runs[1]
        assert launches[0].get("decode_merge_kernel", 0) > 0 and not launches[1].get(
            "decode_merge_kernel"
        )
        assert launches[1].get("decode_merge_quant_kernel", 0) == launches[0]["decode_merge_kernel"]
    finally:
        llm.shutdown()
