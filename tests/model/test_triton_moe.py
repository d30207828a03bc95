"""The fused MoE kernels (pdserve/model/triton_moe.py) against the per-expert torch loop:
on CPU under ``TRITON_INTERPRET=1`` (tests/model/conftest.py sets it without CUDA), on CUDA
when there is one. Tiny shapes with ragged edges (hidden and expert sizes not multiples of
the tiles), every tile configuration, decode (1 token) to prefill-sized batches; the
alignment (sort by expert, pad per expert) on its own; a whole model with the fused path
against transformers."""

from __future__ import annotations

import pytest
import torch
from test_moe import MOE_CONFIGS, TOL, hf_greedy, scenario_away_from_ties
from tp_model_ranks import PROMPTS, greedy_paged

from pdserve.model import moe, pdl, triton_moe, triton_moe_gemv, triton_moe_route
from pdserve.model.llama import LlamaForCausalLM
from tiny_models import random_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [
    triton_moe.MoEConfig(16, 32, 16, 4, 2),
    triton_moe.MoEConfig(32, 16, 32, 4, 2),
    triton_moe.MoEConfig(64, 64, 64, 4, 2),
]


def _problem(T, H, inter, E, k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    # a skewed router: some experts popular, some never chosen
    logits = torch.randn(T, E, generator=g) + torch.linspace(2.0, -2.0, E)
    w, ids = moe.route(logits, k, True)
    to = dict(device=DEVICE)
    return (
        x.to(dtype=dtype, **to),
        w13.to(dtype=dtype, **to),
        w2.to(dtype=dtype, **to),
        w.to(**to),
        ids.to(**to),
    )


@pytest.mark.parametrize("T, E, k, block_m", [(1, 8, 2, 16), (7, 5, 3, 4), (40, 6, 2, 16)])
def test_align_groups_each_assignment_once_by_expert(T, E, k, block_m):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    al = triton_moe.align(ids, E, block_m)
    N = T * k
    sorted_ids = al.sorted_ids.tolist()
    used = int(al.used.item())
    assert used % block_m == 0 and len(sorted_ids) == triton_moe.max_rows(N, E, block_m)
    real = [a for a in sorted_ids[:used] if a < N]
    assert sorted(real) == list(range(N)), "every assignment exactly once"
    assert all(a == N for a in sorted_ids[used:]), "nothing past the used rows"
    flat = ids.flatten().tolist()
    for b in range(len(sorted_ids) // block_m):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        e = int(al.block_expert[b])
        if b * block_m >= used:
            assert e == -1
            continue
        assert all(flat[a] == e for a in rows if a < N), f"block {b} mixes experts"
    experts = [flat[a] for a in real]
    assert experts == sorted(experts), "groups in ascending expert order"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"bm{c.block_m}")
@pytest.mark.parametrize(
    "T, H, inter, E, k", [(1, 40, 24, 8, 2), (9, 72, 20, 6, 3), (33, 24, 40, 4, 2)]
)
def test_fused_equals_loop_fp32(T, H, inter, E, k, config):
    x, w13, w2, w, ids = _problem(T, H, inter, E, k)
    ref = moe.experts_loop(x, w13, w2, w, ids)
    got = triton_moe.fused_experts(x, w13, w2, w, ids, config)
    assert got.shape == (T, H) and got.dtype == x.dtype
    err = (got - ref).abs().max().item()
    assert err < 1e-5 * max(1.0, ref.abs().max().item()), f"max |diff| {err:.2e}"


# bf16 only on the GPU: Triton 3.9's interpreter computes bf16 dots wrongly (~1e10 off)
HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_fused_default_config_half_and_empty_batch(dtype):
    """16-bit inputs (dots in the tensor-core precision, fp32 accumulation) against the loop
    in fp32 on the same rounded weights: within a few roundings of the output."""
    x, w13, w2, w, ids = _problem(12, 64, 32, 8, 2, dtype=dtype, seed=3)
    ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w, ids)
    got = triton_moe.fused_experts(x, w13, w2, w, ids)
    assert got.dtype == dtype
    assert (got.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    empty = triton_moe.fused_experts(x[:0], w13, w2, w[:0], ids[:0])
    assert empty.shape == (0, 64)


def test_pick_config_small_blocks_for_decode():
    assert triton_moe.pick_config(8, 128).block_m == 16  # batch 1, 8 experts routed
    assert triton_moe.pick_config(64 * 8, 128).block_m == 16  # 4 tokens per expert
    assert triton_moe.pick_config(16384 * 8, 128).block_m == 64  # prefill


@pytest.mark.parametrize(
    "T, E, k, renorm, block_m",
    [(1, 8, 2, True, 16), (5, 6, 3, False, 4), (13, 128, 8, True, 16), (64, 128, 8, True, 16)],
)
def test_route_align_equals_route_then_align(T, E, k, renorm, block_m):
    """The one-launch routing + alignment of decode batches: the torch pair's ids, order,
    blocks and used rows exactly, weights to fp32 rounding."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    assert triton_moe.route_align_fits(T, E)
    w, ids, al = triton_moe.route_align(logits, k, renorm, block_m)
    w0, ids0 = moe.route(logits, k, renorm)
    al0 = triton_moe.align(ids0, E, block_m)
    assert torch.equal(ids, ids0)
    assert (w - w0).abs().max().item() < 1e-6
    assert torch.equal(al.sorted_ids, al0.sorted_ids)
    assert torch.equal(al.block_expert, al0.block_expert)
    assert int(al.used.item()) == int(al0.used.item())


@pytest.mark.parametrize(
    "config",
    [
        triton_moe.RouteAlignConfig("one", 2, True),
        triton_moe.RouteAlignConfig("split", 1, False, 1, 2),
        triton_moe.RouteAlignConfig("split", 2, True, 4, 4),
        triton_moe.RouteAlignConfig("split", 1, False, 1, 4, "experts"),
        triton_moe.RouteAlignConfig("split", 2, False, 4, 1, "experts"),
    ],
)
@pytest.mark.parametrize(
    "T, E, k, renorm, block_m",
    [(1, 8, 2, True, 16), (21, 40, 3, False, 4), (64, 128, 8, True, 16), (64, 128, 8, True, 32)],
)
def test_route_align_variants_equal_route_then_align(T, E, k, renorm, block_m, config):
    """The rank on tensor cores and the split launches (routing in programs of a few
    tokens, then the alignment) give the torch pair's ids, order, blocks and used rows."""
    g = torch.Generator().manual_seed(T)
    logits = (torch.randn(T, E, generator=g) + torch.linspace(1.0, -1.0, E)).to(DEVICE)
    w, ids, al = triton_moe.route_align(logits, k, renorm, block_m, config=config)
    w0, ids0 = moe.route(logits, k, renorm)
    al0 = triton_moe.align(ids0, E, block_m)
    assert torch.equal(ids, ids0)
    assert (w - w0).abs().max().item() < 1e-6
    assert torch.equal(al.sorted_ids, al0.sorted_ids)
    assert torch.equal(al.block_expert, al0.block_expert)
    assert int(al.used.item()) == int(al0.used.item())


def test_align_experts_kind_with_crowded_experts_and_bad_kind():
    """The alignment in one program per expert when a few experts take every token (several
    row blocks of one expert, most experts empty, padding rows past the used ones) equals
    :func:`align`; an unknown ``align_kind`` is refused."""
    T, E, k = 40, 16, 4
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(T, E, generator=g) * 0.1 + torch.arange(E).flip(0) * 2.0).to(DEVICE)
    cfg = triton_moe.RouteAlignConfig("split", 1, False, 1, 4, "experts")
    w, ids, al = triton_moe.route_align(logits, k, True, 8, config=cfg)
    al0 = triton_moe.align(ids, E, 8)
    assert sorted(ids.unique().tolist()) == [0, 1, 2, 3], "every token: the same 4 experts"
    assert torch.equal(al.sorted_ids, al0.sorted_ids)
    assert torch.equal(al.block_expert, al0.block_expert)
    assert int(al.used.item()) == int(al0.used.item()) == 4 * 40
    with pytest.raises(ValueError, match="align_kind"):
        triton_moe.route_align(logits, k, True, 8, config=cfg._replace(align_kind="bad"))


def test_route_align_config_reads_the_table(monkeypatch):
    from pdserve.model import moe_table

    # the committed picks: 17-64 tokens align in one program per expert
    assert triton_moe.route_align_config(64, 128).align_kind == "experts"
    assert triton_moe.route_align_config(16, 128).align_kind == "one"

    monkeypatch.setattr(moe_table, "ROUTE_ALIGN", ((16, ("one", 1, True, 4, 4)),))
    assert triton_moe.route_align_config(16, 128) == triton_moe.RouteAlignConfig("one", 1, True)
    assert triton_moe.route_align_config(17, 128) == triton_moe.RouteAlignConfig()
    with pytest.raises(ValueError, match="kind"):
        triton_moe.route_align(
            torch.zeros(2, 8), 2, True, 16, config=triton_moe.RouteAlignConfig("bad")
        )


def test_route_align_takes_decode_batches_only():
    assert triton_moe.route_align_fits(64, 128) and not triton_moe.route_align_fits(65, 128)
    assert not triton_moe.route_align_fits(0, 8)


# (T, H, inter, E, k, renorm) of the few-token tests: one token; ragged H and I (not multiples
# of the 16 / 8 wide tiles) with k not a power of two; 4 tokens x top 4 of 16 experts with H
# and I multiples of every tile (32: still 2+ column blocks and 2+ K chunks of each 16-wide
# tile, one of the "wide" tiles below; it was 64 x 48: ~3x the interpreted tile loops)
GEMV_SHAPES = [(1, 40, 24, 8, 2, True), (3, 33, 20, 6, 3, False), (4, 32, 32, 16, 4, True)]

GEMV_CONFIGS = [
    triton_moe.GemvConfig(8, 16, 4, 8, 16, 4),  # several K chunks, ragged column blocks
    triton_moe.GemvConfig(32, 64, 4, 16, 64, 2),  # one chunk, one column block
]


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=["small", "wide"])
@pytest.mark.parametrize(
    "T, H, inter, E, k, renorm",
    GEMV_SHAPES,
)
def test_route_experts_gemv_equals_route_and_loop_fp32(T, H, inter, E, k, renorm, config):
    """The few-token path (routing inside the gate/up GEMV, weights and top-k sum inside the
    down GEMV): route's ids exactly, its weights to fp32 rounding, the loop's output."""
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, seed=T)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(7 + T)).to(DEVICE)
    out, w, ids = triton_moe.route_experts_gemv(logits, x, w13, w2, k, renorm, config)
    w0, ids0 = moe.route(logits, k, renorm)
    assert torch.equal(ids, ids0)
    assert (w - w0).abs().max().item() < 1e-6
    ref = moe.experts_loop(x, w13, w2, w0, ids0)
    assert out.shape == (T, H) and out.dtype == x.dtype
    err = (out - ref).abs().max().item()
    assert err < 1e-5 * max(1.0, ref.abs().max().item()), f"max |diff| {err:.2e}"


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_route_experts_gemv_half_and_router_logits_in_bf16(dtype):
    """16-bit activations and weights (fp32 accumulation, the loop's roundings) against the
    loop in fp32 on the same rounded weights; the router logits in the model's dtype."""
    x, w13, w2, _, _ = _problem(2, 64, 32, 8, 2, dtype=dtype, seed=5)
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    out, w, ids = triton_moe.route_experts_gemv(logits, x, w13, w2, 2, True)
    w0, ids0 = moe.route(logits, 2, True)
    assert torch.equal(ids, ids0) and (w - w0).abs().max().item() < 1e-6
    ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w0, ids0)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_gemv_fits_few_tokens_only(monkeypatch):
    from pdserve.model import moe_table

    monkeypatch.delenv("PDSERVE_MOE_GEMV_MAX_TOKENS", raising=False)
    bound = moe_table.GEMV_MAX_TOKENS  # the measured default: 1 token on the H200
    assert triton_moe.gemv_fits(bound) == (bound > 0) and not triton_moe.gemv_fits(bound + 1)
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", "4")
    assert triton_moe.gemv_fits(1) and triton_moe.gemv_fits(4)
    assert not triton_moe.gemv_fits(5) and not triton_moe.gemv_fits(0)
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", "0")
    assert not triton_moe.gemv_fits(1)


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter path (greedy_paged is CPU)")
@pytest.mark.parametrize(
    "cells, gemv",
    [(triton_moe.ROUTE_ALIGN_MAX_CELLS, 0), (8, 0), (triton_moe.ROUTE_ALIGN_MAX_CELLS, 4)],
    ids=["one-launch", "torch", "gemv"],
)
def test_model_with_fused_experts_equals_transformers(monkeypatch, cells, gemv):
    """PDSERVE_MOE_EXPERTS=fused: the whole tiny Qwen3-MoE through the Triton kernels, its
    routing in the one-launch kernel (every step fits) or in torch (none but 1 row fits);
    ``gemv``: the two decode steps (2 rows) through the few-token kernels, the prefill
    through the grouped ones."""
    monkeypatch.setenv("PDSERVE_MOE_EXPERTS", "fused")
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", str(gemv))
    monkeypatch.setattr(
        triton_moe_route, "ROUTE_ALIGN_MAX_CELLS", cells
    )  # route_align_fits reads it
    hf = random_tiny_model(MOE_CONFIGS["qwen3_moe"](), seed=4)
    model = LlamaForCausalLM(hf.config, torch.float32, "cpu")
    model.load_weights(hf.state_dict().items())
    called: dict[str, int] = {
        "grouped_experts": 0,
        "route_align": 0,
        "align": 0,
        "route_experts_gemv": 0,
    }
    for name in called:
        real = getattr(triton_moe, name)

        def spy(*a, _real=real, _name=name, **kw):
            called[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, name, spy)
    prompts = PROMPTS[:2]
    tokens, logits = greedy_paged(model, prompts, 2)
    if gemv:
        assert called["route_experts_gemv"] == 2 * 2, "2 decode steps x 2 sparse layers"
        assert called["grouped_experts"] == called["route_align"] == 2, "the prefill"
        assert called["align"] == 0
    else:
        assert called["route_experts_gemv"] == 0
        assert called["grouped_experts"] == 3 * 2, "the fused kernels: 3 steps x 2 sparse layers"
        if cells == 8:
            assert called["align"] == 6 and called["route_align"] == 0
        else:
            assert called["route_align"] == 6 and called["align"] == 0
    ref_tokens, ref_logits = hf_greedy(hf, prompts, 2)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert (got - want).abs().max().item() < TOL


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter path (the model is on CPU)")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp16_model_through_fused_kernels_away_from_routing_ties(monkeypatch, arch):
    """The kernels' 16-bit path in a whole model (fp16: the interpreter's bf16 dots are
    wrong): the scenario of the CUDA parity test within 0.02 of transformers in fp32 where
    the routing is not a near-tie (fp16 keeps 3 more mantissa bits than bf16)."""
    monkeypatch.setenv("PDSERVE_MOE_EXPERTS", "fused")
    calls = []
    real = triton_moe.grouped_experts
    monkeypatch.setattr(
        triton_moe, "grouped_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    hf = random_tiny_model(MOE_CONFIGS[arch](), seed=1)
    model = LlamaForCausalLM(hf.config, torch.float16, "cpu")
    model.load_weights(hf.state_dict().items())
    err, _ = scenario_away_from_ties(model, hf)
    assert calls, "the fused kernels never ran"
    assert err < 0.02, f"{arch} fp16 fused: max log-prob diff {err:.2e}"


REAL_SHAPES = [
    (1, 2048, 768, 128, 8),  # a Qwen3-30B-A3B layer
    (64, 2048, 768, 128, 8),
    (1000, 2048, 768, 128, 8),
    (64, 4096, 14336, 8, 2),  # a Mixtral-8x7B layer, 16 tokens per expert
]


@pytest.mark.gpu
@pytest.mark.parametrize("T, H, inter, E, k", REAL_SHAPES)
def test_fused_equals_loop_at_real_shapes_bf16(T, H, inter, E, k):
    """One layer's experts at the real presets' shapes in bf16 against the loop in fp32 on
    the same rounded weights."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    x, w13, w2, w, ids = _problem(T, H, inter, E, k, dtype=torch.bfloat16, seed=T)
    ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w, ids)
    got = triton_moe.fused_experts(x, w13, w2, w, ids)
    assert (got.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


@pytest.mark.gpu
def test_fused_experts_capture_in_a_cuda_graph_and_replay_new_routing():
    """Captured once, replayed with other tokens and other experts: the graph follows the
    routing held in its input buffers (no host sync, no shape that depends on it)."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    T, H, inter, E, k = 16, 256, 128, 32, 4
    x, w13, w2, w, ids = _problem(T, H, inter, E, k, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        triton_moe.fused_experts(x, w13, w2, w, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_experts(x, w13, w2, w, ids)
    for seed in (1, 2, 3):
        x2, _, _, w_new, ids_new = _problem(T, H, inter, E, k, dtype=torch.bfloat16, seed=seed)
        x.copy_(x2)
        w.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w, ids)
        assert (out.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


@pytest.mark.gpu
def test_route_align_and_experts_capture_in_a_cuda_graph():
    """The decode path of SparseMoeBlock on CUDA (router logits -> route_align ->
    grouped_experts) captured once and replayed on new hidden states and router logits."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    T, H, inter, E, k = 8, 256, 128, 64, 8
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE)
    cfg = triton_moe.pick_config(T * k, E)

    def step():
        w, ids, al = triton_moe.route_align(logits, k, True, cfg.block_m)
        return triton_moe.grouped_experts(x, w13, w2, w, al, cfg)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        logits.copy_(torch.randn(T, E, device=DEVICE, generator=g))
        x.copy_(torch.randn(T, H, device=DEVICE, generator=g).bfloat16())
        graph.replay()
        w, ids = moe.route(logits, k, True)
        ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w, ids)
        assert (out.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


@pytest.mark.gpu
def test_route_experts_gemv_captures_in_a_cuda_graph():
    """The few-token path (router logits -> 2 launches) captured once and replayed on new
    hidden states and router logits (other experts each time)."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    T, H, inter, E, k = 4, 2048, 768, 128, 8
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE)

    def step():
        return triton_moe.route_experts_gemv(logits, x, w13, w2, k, True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, w, ids = step()
    for seed in (1, 2):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        logits.copy_(torch.randn(T, E, device=DEVICE, generator=g))
        x.copy_(torch.randn(T, H, device=DEVICE, generator=g).bfloat16())
        graph.replay()
        w0, ids0 = moe.route(logits, k, True)
        assert torch.equal(ids, ids0)
        ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w0, ids0)
        assert (out.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter path (greedy_paged is CPU)")
@pytest.mark.parametrize(
    "arch, backend",
    [("qwen3_moe", "torch_sdpa"), ("qwen3_moe", "triton"), ("mixtral", "triton")],
    ids=["qwen3-rope", "qwen3-rope_store", "mixtral"],
)
def test_model_through_the_cuda_decode_kernels_equals_transformers(monkeypatch, arch, backend):
    """The decoder as it runs on CUDA, here under the interpreter: every fused op of
    ``fused_ops`` (add + RMSNorm, with the router GEMM inside it before a sparse MLP; Qwen3's
    q/k norms inside the RoPE kernel, with the KV store too for the triton backend), the
    decode steps' experts through the few-token kernels, the prefill's through the grouped
    ones. Tiny Qwen3-MoE (and Mixtral: no q/k norms, top-2 of 8 experts) in fp32 against
    transformers: the same greedy tokens, logits within 1e-4."""
    from pdserve.model import fused_ops, llama

    monkeypatch.setenv("PDSERVE_MOE_EXPERTS", "fused")
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", "4")
    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    calls = []
    real = triton_moe.route_experts_gemv
    monkeypatch.setattr(
        triton_moe, "route_experts_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    router_calls = []
    real_router = fused_ops.add_rms_norm_router
    monkeypatch.setattr(
        fused_ops,
        "add_rms_norm_router",
        lambda *a, **kw: router_calls.append(1) or real_router(*a, **kw),
    )
    hf = random_tiny_model(MOE_CONFIGS[arch](), seed=4)
    assert hf.config.model_type == arch
    model = LlamaForCausalLM(hf.config, torch.float32, "cpu", attn_backend=backend)
    model.load_weights(hf.state_dict().items())
    layer = next(model.decoder_layers())
    assert (layer.q_norm is not None) == (arch == "qwen3_moe"), "Qwen3's q/k norms in RoPE"
    prompts = PROMPTS[:2]
    tokens, logits = greedy_paged(model, prompts, 2)
    assert len(calls) == 2 * 2, "2 decode steps x 2 sparse layers"
    assert len(router_calls) == 3 * 2, "the router inside add + RMSNorm: 3 steps x 2 layers"
    ref_tokens, ref_logits = hf_greedy(hf, prompts, 2)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize(
    "T, H, inter, E, k, renorm",
    GEMV_SHAPES,
)
def test_route_experts_gemv_dot_kind_equals_route_and_loop_fp32(T, H, inter, E, k, renorm):
    """The few-token path with the gate/up products on tensor cores (``up_kind="dot"``,
    16-row tiles of which one is the token): route's ids, the loop's output (IEEE fp32
    dots), ragged column blocks and several K chunks."""
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, seed=T)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(7 + T)).to(DEVICE)
    w0, ids0 = moe.route(logits, k, renorm)
    ref = moe.experts_loop(x, w13, w2, w0, ids0)
    cfg = triton_moe.GemvConfig(16, 16, 4, 8, 16, 4, "dot", 2)
    for c in (cfg, cfg._replace(down_n=16, down_kind="dot", down_stages=2)):
        out, w, ids = triton_moe.route_experts_gemv(logits, x, w13, w2, k, renorm, c)
        assert torch.equal(ids, ids0) and (w - w0).abs().max().item() < 1e-6
        err = (out - ref).abs().max().item()
        assert err < 1e-5 * max(1.0, ref.abs().max().item()), f"max |diff| {err:.2e}"
    with pytest.raises(ValueError, match="up_kind"):
        triton_moe.route_experts_gemv(logits, x, w13, w2, k, renorm, cfg._replace(up_kind="x"))
    with pytest.raises(ValueError, match="kind"):
        triton_moe.route_experts_gemv(logits, x, w13, w2, k, renorm, cfg._replace(down_kind="x"))


@pytest.mark.parametrize(
    "T, H, inter, E, k, renorm",
    GEMV_SHAPES,
)
def test_route_experts_gemv_assign_down_equals_loop_and_grouped(T, H, inter, E, k, renorm):
    """The few-token path with the down projection per assignment (``down_kind="assign"``:
    per (assignment, column block) a tensor-core product, then the top-k sum kernel): route's
    ids, the loop's output (IEEE fp32), ragged column blocks and several K chunks; and the
    grouped path's output on the same routing (its roundings and summation order)."""
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, seed=T)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(7 + T)).to(DEVICE)
    w0, ids0 = moe.route(logits, k, renorm)
    ref = moe.experts_loop(x, w13, w2, w0, ids0)
    cfg = triton_moe.GemvConfig(16, 16, 4, 16, 8, 4, "dot", 2, "assign", 2)
    out, w, ids = triton_moe.route_experts_gemv(logits, x, w13, w2, k, renorm, cfg)
    assert torch.equal(ids, ids0) and (w - w0).abs().max().item() < 1e-6
    err = (out - ref).abs().max().item()
    assert err < 1e-5 * max(1.0, ref.abs().max().item()), f"max |diff| {err:.2e}"
    plan = triton_moe.MoEPlan(CONFIGS[0], CONFIGS[0], None, True)
    grouped = triton_moe.fused_experts(x, w13, w2, w, ids, plan)
    assert (out - grouped).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
    # the top-k sum inside the down kernel: the same bits, twice (its counters left zero)
    for _ in range(2):
        fused = triton_moe.route_experts_gemv(
            logits, x, w13, w2, k, renorm, cfg._replace(down_kind="assign_sum")
        )[0]
        assert torch.equal(fused, out)
    assert all(int(c.count_nonzero()) == 0 for c in triton_moe_gemv._COUNTERS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_assign_sum_equals_assign_then_topk_sum(dtype):
    """``down_kind="assign_sum"`` (the last of a token's k programs of a column block sums
    the k rows) gives the bits of the per-assignment down kernel + ``_topk_sum_kernel``
    with several tokens, ragged column blocks and k not a power of two."""
    T, H, inter, E, k = 3, 50, 24, 8, 3
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=dtype, seed=5)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    cfg = triton_moe.GemvConfig(16, 16, 4, 16, 8, 4, "dot", 2, "assign", 2)
    want = triton_moe.route_experts_gemv(logits, x, w13, w2, k, True, cfg)[0]
    got = triton_moe.route_experts_gemv(
        logits, x, w13, w2, k, True, cfg._replace(down_kind="assign_sum")
    )[0]
    assert torch.equal(got, want)


def test_gemv_defaults_from_the_table(monkeypatch):
    """Without ``PDSERVE_MOE_GEMV_MAX_TOKENS`` the few-token bound and tiles are
    ``moe_table``'s picks; the variable, when set, wins."""
    from pdserve.model import moe_table

    monkeypatch.delenv("PDSERVE_MOE_GEMV_MAX_TOKENS", raising=False)
    monkeypatch.setattr(moe_table, "GEMV_MAX_TOKENS", 2)
    monkeypatch.setattr(moe_table, "GEMV", (32, 64, 4, 32, 64, 4, "dot", 3, "assign", 3))
    assert triton_moe.gemv_fits(2) and not triton_moe.gemv_fits(3)
    assert triton_moe.gemv_config().down_kind == "assign"
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", "0")
    assert not triton_moe.gemv_fits(1)
    monkeypatch.setattr(moe_table, "GEMV", None)
    assert triton_moe.gemv_config() == triton_moe.GemvConfig()


def test_moe_pdl_pick_same_results(monkeypatch):
    """``moe_table.PDL`` only changes how the grouped path's kernels launch (PDL on sm_90+;
    off on CPU and under the interpreter): route_align + grouped experts give the same bits
    with it on and off."""
    from pdserve.model import moe_table

    T, H, inter, E, k = 5, 40, 24, 8, 2
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, seed=3)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    plan = triton_moe.MoEPlan(CONFIGS[0], CONFIGS[0], None, True)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(moe_table, "PDL", on)
        w, ids, al = triton_moe.route_align(logits, k, True, plan.up.block_m)
        outs.append(triton_moe.grouped_experts(x, w13, w2, w, al, plan, ids=ids))
        assert triton_moe.moe_pdl(x).get("PDL", False) == (on and pdl.launch_options(x)["PDL"])
    assert torch.equal(outs[0], outs[1])


PLANS = [
    # other tiles for the down kernel than for gate/up (same block_m)
    triton_moe.MoEPlan(
        triton_moe.MoEConfig(16, 16, 32, 4, 2), triton_moe.MoEConfig(16, 32, 16, 4, 2)
    ),
    # the down projection, routing weights and top-k sum in one GEMV launch
    triton_moe.MoEPlan(
        triton_moe.MoEConfig(16, 32, 16, 4, 2),
        triton_moe.MoEConfig(16, 32, 16, 4, 2),
        ("rows", 8, 16, 4, 1),
    ),
    # the same on tensor cores (one pipelined loop over the k experts' K chunks)
    triton_moe.MoEPlan(
        triton_moe.MoEConfig(16, 32, 16, 4, 2),
        triton_moe.MoEConfig(16, 32, 16, 4, 2),
        ("dot", 16, 16, 4, 2),
    ),
    # the grouped down kernel, the top-k sum in Triton
    triton_moe.MoEPlan(
        triton_moe.MoEConfig(16, 32, 16, 4, 2), triton_moe.MoEConfig(16, 32, 16, 4, 2), None, True
    ),
]


@pytest.mark.parametrize(
    "plan", PLANS, ids=["down-tiles", "down-sum", "down-sum-dot", "triton-sum"]
)
@pytest.mark.parametrize("T, H, inter, E, k", [(1, 40, 24, 8, 2), (5, 33, 20, 6, 3)])
def test_grouped_plans_equal_loop_fp32(T, H, inter, E, k, plan):
    """A :class:`MoEPlan` through route_align + grouped_experts equals the loop: separate
    down tiles, or the fused down + weights + top-k sum (which needs the ids)."""
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, seed=3 + T)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    w, ids, al = triton_moe.route_align(logits, k, True, plan.up.block_m, num_warps=1)
    out = triton_moe.grouped_experts(x, w13, w2, w, al, plan, ids=ids)
    ref = moe.experts_loop(x, w13, w2, w, ids)
    assert out.shape == (T, H) and out.dtype == x.dtype
    err = (out - ref).abs().max().item()
    assert err < 1e-5 * max(1.0, ref.abs().max().item()), f"max |diff| {err:.2e}"
    assert torch.equal(triton_moe.fused_experts(x, w13, w2, w, ids, plan), out)
    if plan.down_sum is not None:
        with pytest.raises(ValueError, match="ids"):
            triton_moe.grouped_experts(x, w13, w2, w, al, plan)


def test_pick_plan_reads_the_decode_table(monkeypatch):
    """Decode sizes take moe_table.DECODE's row of the smallest bound >= the assignments
    (the last row past them); prefill sizes the large blocks."""
    from pdserve.model import moe_table

    rows = ((8, (16, 32, 256, 4, 4), (16, 64, 128, 4, 3), ("rows", 4, 256, 8, 1), False),
            (512, (16, 64, 128, 4, 3), (16, 32, 128, 4, 3), None, True))  # fmt: skip
    monkeypatch.setattr(moe_table, "DECODE", rows)
    p = triton_moe.pick_plan(8, 128)
    assert p.up == (16, 32, 256, 4, 4) and p.down_sum == ("rows", 4, 256, 8, 1)
    assert triton_moe.pick_plan(16, 128).down == (16, 32, 128, 4, 3)
    assert triton_moe.pick_plan(16, 128).triton_sum and not p.triton_sum
    assert triton_moe.pick_plan(1024, 128).down == (16, 32, 128, 4, 3)
    assert triton_moe.pick_plan(16384 * 8, 128).up.block_m == 64


RA_REAL = [
    triton_moe.RouteAlignConfig("one", 4, True),
    triton_moe.RouteAlignConfig("split", 1, False, 1, 4),
    triton_moe.RouteAlignConfig("split", 4, True, 16, 8),
    triton_moe.RouteAlignConfig("split", 1, True, 1, 4, "experts"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_plans_and_dot_path_at_real_shapes_bf16(T):
    """Qwen3-30B-A3B's layer in bf16: the decode table's plan, a down_sum plan and the
    tensor-core few-token path against the loop in fp32 on the same rounded weights."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    H, inter, E, k = 2048, 768, 128, 8
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=torch.bfloat16, seed=T)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    w, ids = moe.route(logits, k, True)
    ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w, ids)
    tol = 0.02 * ref.abs().max().item()
    c = triton_moe.MoEConfig(16, 32, 256, 4, 3)
    plans = [triton_moe.pick_plan(T * k, E)]
    plans += [
        triton_moe.MoEPlan(c, c, ("rows", 4, 256, 8, 1)),
        triton_moe.MoEPlan(c, c, ("dot", 16, 256, 4, 4)),
    ]
    for ra in RA_REAL:  # route_align's variants, compiled for the GPU
        w1, ids1, al = triton_moe.route_align(logits, k, True, 16, config=ra)
        al0 = triton_moe.align(ids, E, 16)
        assert torch.equal(ids1, ids) and torch.equal(al.sorted_ids, al0.sorted_ids), ra
        assert torch.equal(al.block_expert, al0.block_expert), ra
    for plan in plans:
        w1, ids1, al = triton_moe.route_align(logits, k, True, plan.up.block_m)
        got = triton_moe.grouped_experts(x, w13, w2, w1, al, plan, ids=ids1)
        assert (got.float() - ref).abs().max().item() < tol, plan
    cfg = triton_moe.GemvConfig(16, 256, 4, 16, 256, 4, "dot", 4, "dot", 4)
    got = triton_moe.route_experts_gemv(logits, x, w13, w2, k, True, cfg)[0]
    assert (got.float() - ref).abs().max().item() < tol


@pytest.mark.gpu
def test_assign_path_and_pdl_grouped_path_in_a_cuda_graph_bf16(monkeypatch):
    """On CUDA (PDL on sm_90+): the few-token path with the per-assignment down kernel and
    the grouped path with ``moe_table.PDL`` on, each captured in a CUDA graph and replayed,
    give the bits of the grouped path without PDL at Qwen3-30B-A3B-like shapes."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    from pdserve.model import moe_table

    T, H, inter, E, k = 1, 512, 256, 32, 8
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE)
    plan = triton_moe.pick_plan(T * k, E)
    gcfg = triton_moe.GemvConfig(32, 256, 4, 64, 128, 4, "dot", 3, "assign", 3)

    def grouped(p=plan):
        w, ids, al = triton_moe.route_align(logits, k, True, p.up.block_m)
        return triton_moe.grouped_experts(x, w13, w2, w, al, p, ids=ids)

    monkeypatch.setattr(moe_table, "PDL", False)
    want = grouped()
    monkeypatch.setattr(moe_table, "PDL", True)
    for fn in (
        grouped,
        lambda: triton_moe.route_experts_gemv(logits, x, w13, w2, k, True, gcfg)[0],
        lambda: triton_moe.route_experts_gemv(
            logits, x, w13, w2, k, True, gcfg._replace(down_kind="assign_sum")
        )[0],
        lambda: grouped(plan._replace(triton_sum=True, fused_sum=True)),
    ):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        assert (
            out.float() - want.float()
        ).abs().max().item() <= 1e-2 * want.float().abs().max().item()


@pytest.mark.parametrize(
    "config",
    [
        None,
        triton_moe.RouteAlignConfig("one", 2, True),
        triton_moe.RouteAlignConfig("split", 1, False, 1, 2),
        triton_moe.RouteAlignConfig("split", 1, True, 1, 4, "experts"),
    ],
)
def test_route_align_counts_routed_experts_in_its_kernel(config):
    """``route_align(stats=row)``: the alignment adds the forward's distinct experts and one
    forward to the two float64 counters (what ``SparseMoeBlock`` counted with torch ops)."""
    T, E, k = 9, 16, 3
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(T, E, generator=g) + torch.linspace(2.0, -2.0, E)).to(DEVICE)
    row = torch.tensor([5.0, 2.0], dtype=torch.float64, device=DEVICE)
    _, ids, _ = triton_moe.route_align(logits, k, True, 4, config=config, stats=row)
    distinct = ids.unique().numel()
    assert row.tolist() == [5.0 + distinct, 3.0]


def test_routing_counters_inside_the_fused_kernels_equal_torch_counting(monkeypatch):
    """With ``PDSERVE_MOE_ROUTING_STATS=1`` the tiny Qwen3-MoE through the Triton kernels
    (one-token forwards: the few-token gate/up kernel counts; 3 tokens: route_align's
    alignment; a prefill of 5 past route_align's cells: torch) leaves every layer's counters
    equal to the torch loop's (torch's counting)."""
    from pdserve.engine.kv.layout import KVCacheLayout
    from pdserve.model.attention import build_attention_metadata

    monkeypatch.setenv("PDSERVE_MOE_ROUTING_STATS", "1")
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", "1")
    hf = random_tiny_model(MOE_CONFIGS["qwen3_moe"](), seed=4)
    spied: list[tuple[int, bool]] = []  # (tokens, stats given) of the fused decode calls
    for name in ("route_align", "route_experts_gemv"):
        real = getattr(triton_moe, name)

        def spy(logits, *a, _real=real, **kw):
            spied.append((logits.shape[0], kw.get("stats") is not None))
            return _real(logits, *a, **kw)

        monkeypatch.setattr(triton_moe, name, spy)
    stats = {}
    for impl in ("loop", "fused"):
        monkeypatch.setenv("PDSERVE_MOE_EXPERTS", impl)
        cells = 4 * 8 if impl == "fused" else triton_moe_route.ROUTE_ALIGN_MAX_CELLS
        monkeypatch.setattr(triton_moe_route, "ROUTE_ALIGN_MAX_CELLS", cells)  # 8 experts
        model = LlamaForCausalLM(hf.config, torch.float32, "cpu")
        model.load_weights(hf.state_dict().items())
        s = model.shapes
        lay = KVCacheLayout("page_major", s.n_layers, s.n_kv_heads, s.head_dim, 4, 4, torch.float32)
        caches = lay.layer_views(lay.allocate("cpu"))
        model(torch.tensor([7, 30, 9, 40, 12]), torch.arange(5),
              build_attention_metadata([5], [5], [[0, 1, 2]], 4), caches)  # fmt: skip
        for pos in (5, 6):
            meta = build_attention_metadata([1], [pos + 1], [[0, 1, 2]], 4)
            model(torch.tensor([7 + pos]), torch.tensor([pos]), meta, caches)
        meta = build_attention_metadata([3], [10], [[0, 1, 2]], 4)
        model(torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]), meta, caches)
        stats[impl] = [ly.moe.routing_stats.clone() for ly in model.decoder_layers()]
    assert [c[0] for c in spied] == [1] * 4 + [3] * 2, "2 layers: 1-token kernels, route_align"
    assert all(c[1] for c in spied), "each counted in its kernel"
    for a, b in zip(stats["loop"], stats["fused"]):
        assert torch.equal(a, b)
        assert a[1, 1] == 2 and a[3, 1] == 1 and a[5, 1] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "T, H, inter, E, k, block_m", [(1, 40, 24, 8, 2, 16), (9, 50, 24, 8, 3, 4)]
)
def test_grouped_fused_sum_equals_triton_sum(dtype, T, H, inter, E, k, block_m):
    """A plan's ``fused_sum`` (the top-k sum inside the grouped down kernel: the program
    writing a token's last assignment of a column block sums its k rows) gives the bits of
    the down kernel + ``_topk_sum_kernel``, with row blocks of several tokens, ragged column
    blocks, k not a power of two; twice (its counters left zero). 9 tokens x top 3 over 8
    experts (seed 9): 7, 7, 7, 3 and 3 assignments, 3 experts empty: experts of a full and a
    padded 4-row block, each block's rows from 4 tokens (it was 20 tokens: more blocks of
    these same kinds, twice the interpreted programs)."""
    x, w13, w2, w, ids = _problem(T, H, inter, E, k, dtype=dtype, seed=T)
    c = triton_moe.MoEConfig(block_m, 16, 16, 4, 2)
    want = triton_moe.fused_experts(x, w13, w2, w, ids, triton_moe.MoEPlan(c, c, None, True))
    for _ in range(2):
        got = triton_moe.fused_experts(
            x, w13, w2, w, ids, triton_moe.MoEPlan(c, c, None, True, True)
        )
        assert torch.equal(got, want)
    assert all(int(c.count_nonzero()) == 0 for c in triton_moe_gemv._COUNTERS)


def test_decode_table_rows_take_fused_sum(monkeypatch):
    """A ``moe_table.DECODE`` row's optional sixth field is the plan's ``fused_sum``."""
    from pdserve.model import moe_table

    t = (16, 64, 128, 4, 3)
    monkeypatch.setattr(moe_table, "DECODE", ((8, t, t, None, True), (512, t, t, None, True, True)))
    assert not triton_moe.pick_plan(8, 128).fused_sum
    assert triton_moe.pick_plan(512, 128).fused_sum


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter path (greedy_paged is CPU)")
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_top_k_sum_left_to_the_next_norm_computes_the_same_bits(monkeypatch, path):
    """``fused_splitk_norm.FUSE_TOPK`` (one decoding row, the few-token path) and
    ``FUSE_TOPK_GROUPED`` (two rows, the grouped path after ``route_align``): the MoE output
    handed to the next add + RMSNorm (and the final norm) as its k weighted expert rows,
    summed there: the greedy tokens and logits of the tiny Qwen3-MoE on the CUDA path
    (interpreter) equal those with the top-k sum kernel, bit for bit, and every sparse
    layer of each decode step takes the partials."""
    from pdserve.model import fused_splitk_norm, llama

    gemv = path == "gemv"
    monkeypatch.setenv("PDSERVE_MOE_EXPERTS", "fused")
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", "1" if gemv else "0")
    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = random_tiny_model(MOE_CONFIGS["qwen3_moe"](), seed=4)
    model = LlamaForCausalLM(hf.config, torch.float32, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    calls = []
    real = fused_splitk_norm.add_rms_norm
    monkeypatch.setattr(fused_splitk_norm, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    flag, other = ("FUSE_TOPK", "FUSE_TOPK_GROUPED")[:: 1 if gemv else -1]
    monkeypatch.setattr(fused_splitk_norm, other, False)  # the other path's switch off
    runs = []
    for fuse in (False, True):
        monkeypatch.setattr(fused_splitk_norm, flag, fuse)
        runs.append(greedy_paged(model, PROMPTS[: 1 if gemv else 2], 2))
    n_sparse = sum(layer.moe is not None for layer in model.decoder_layers())
    # 2 decode steps (and the prefill where route_align takes it: the grouped path), each
    # one's next step fed by the tokens of logits that came through the partials' norm
    assert len(calls) == (2 if gemv else 3) * n_sparse
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("T", [1, 64])
def test_top_k_rows_into_the_norm_same_bits_on_cuda_bf16(T):
    """On CUDA in bf16 at Qwen3-30B-A3B's shapes: the experts' weighted rows handed to the
    add + RMSNorm kernel unsummed (``rows_out``: the few-token path at 1 token, the grouped
    path after ``route_align`` at 64) give the bits of the top-k sum kernel followed by
    ``fused_ops.add_rms_norm``."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    from pdserve.model import fused_ops, fused_splitk_norm

    H, inter, E, k = 2048, 768, 128, 8
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE)
    h = torch.randn(T, H, device=DEVICE).bfloat16()
    norm_w = torch.rand(H, device=DEVICE).bfloat16()
    plan = triton_moe.pick_plan(T * k, E)._replace(triton_sum=True, fused_sum=False)

    def run(rows_out):
        if T == 1:
            return triton_moe.route_experts_gemv(logits, x, w13, w2, k, True, rows_out=rows_out)[0]
        w, ids, al = triton_moe.route_align(logits, k, True, plan.up.block_m)
        return triton_moe.grouped_experts(x, w13, w2, w, al, plan, ids=ids, rows_out=rows_out)

    summed, parts = run(False), run(True)
    assert isinstance(parts, fused_splitk_norm.SplitKPartials) and parts.parts.shape == (k, T, H)
    got = fused_splitk_norm.add_rms_norm(h, parts, norm_w, 1e-6)
    want = fused_ops.add_rms_norm(h, summed, norm_w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _crowded_ids(device=DEVICE):
    """40 tokens x top 2 over 7 experts with the counts that stress the persistent kernels'
    row blocks: expert 4 33 assignments (a second 32-row block of 1 row: its half tile),
    expert 1 17 (one block, past its half), expert 0 16 (exactly half a 32-row block),
    expert 2 1, expert 5 13, experts 3 and 6 none (empty); each token's two distinct."""
    seq = [4] * 33 + [1] * 17 + [0] * 16 + [2] * 1 + [5] * 13
    ids = torch.tensor([[seq[t], seq[t + 40]] for t in range(40)], dtype=torch.int64)
    assert all(a != b for a, b in ids.tolist())
    g = torch.Generator().manual_seed(11)
    w = torch.softmax(torch.randn(40, 2, generator=g), dim=1)
    return w.to(device), ids.to(device)


PERSIST_PLANS = {
    # 32-row blocks, the half tile on (a block whose second half is padding as 16 rows)
    "32-half": triton_moe.MoEPlan(
        triton_moe.MoEConfig(32, 16, 16, 4, 2),
        triton_moe.MoEConfig(32, 32, 16, 4, 2),
        None,
        True,
        persist=(1, 3),
    ),
    "32-full": triton_moe.MoEPlan(
        triton_moe.MoEConfig(32, 16, 16, 4, 2),
        triton_moe.MoEConfig(32, 32, 16, 4, 2),
        None,
        True,
        persist=(2, 1),
        half=False,
    ),
    # tiles handed out by the device counter
    "32-dyn": triton_moe.MoEPlan(
        triton_moe.MoEConfig(32, 16, 16, 4, 2),
        triton_moe.MoEConfig(32, 32, 16, 4, 2),
        None,
        True,
        persist=(2, 3),
        dynamic=True,
    ),
    # the committed row block (16): persistent grid only; the top-k sum in torch
    "16-torch-sum": triton_moe.MoEPlan(
        triton_moe.MoEConfig(16, 16, 16, 4, 2),
        triton_moe.MoEConfig(16, 16, 16, 4, 2),
        persist=(2, 2),
    ),
    # 64-row blocks with the half tile of 32 rows
    "64-half": triton_moe.MoEPlan(
        triton_moe.MoEConfig(64, 16, 16, 4, 2),
        triton_moe.MoEConfig(64, 16, 16, 4, 2),
        None,
        True,
        persist=(1, 1),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("plan", list(PERSIST_PLANS.values()), ids=list(PERSIST_PLANS))
@pytest.mark.parametrize("case", ["crowded", "skewed", "one-token"])
def test_persistent_grouped_kernels_equal_loop_and_the_grid_kernels(dtype, plan, case):
    """The persistent grouped GEMMs (``MoEPlan.persist``: a few programs walking only the
    used row blocks' tiles, the half tile for blocks whose second half is padding) equal the
    per-expert loop, and give the bits of the grid kernels with the same tiles and of the
    committed 16-row blocks with the same K chunk (each element the same sum in the same
    order): uneven experts, empty experts, padded blocks, ragged H and I, one token; twice
    through the same buffers (nothing left from the first call; the dynamic plan's tile
    counters zero again after each launch)."""
    H, inter, E = 40, 24, 7
    if case == "crowded":
        T, k = 40, 2
        x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=dtype, seed=5)
        w, ids = _crowded_ids()
    else:
        T, k = (1, 3) if case == "one-token" else (20, 3)
        x, w13, w2, w, ids = _problem(T, H, inter, E, k, dtype=dtype, seed=T)
    ref = moe.experts_loop(x.float(), w13.float(), w2.float(), w, ids)
    grid = plan._replace(persist=None)
    c16 = triton_moe.MoEPlan(
        plan.up._replace(block_m=16), plan.down._replace(block_m=16), None, plan.triton_sum
    )
    want = triton_moe.fused_experts(x, w13, w2, w, ids, grid)
    # a 16-row plan's grid plan is the committed one: the same launches, not run twice
    committed = want if c16 == grid else triton_moe.fused_experts(x, w13, w2, w, ids, c16)
    for _ in range(2):
        got = triton_moe.fused_experts(x, w13, w2, w, ids, plan)
        assert got.shape == (T, H) and got.dtype == dtype
        err = (got.float() - ref).abs().max().item()
        tol = (1e-5 if dtype == torch.float32 else 2e-3) * max(1.0, ref.abs().max().item())
        assert err < tol, f"max |diff| {err:.2e}"
        assert torch.equal(got, want)
        assert torch.equal(got, committed)
    for c in triton_moe._TILE_COUNTERS.values():  # the dynamic plan's left zero
        assert int(c.count_nonzero()) == 0


def test_persistent_plan_after_route_align_with_rows_out_and_bad_plans():
    """``route_align`` with the persistent plan's row block (32), then the kernels: the rows
    handed unsummed (``rows_out``, a ``SplitKPartials`` ``[k, T, H]``) sum to the summed
    output; a persistent plan with ``down_sum`` or ``fused_sum`` is refused (ValueError)."""
    from pdserve.model import fused_splitk_norm

    T, H, inter, E, k = 9, 33, 20, 6, 3
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, seed=2)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    plan = PERSIST_PLANS["32-half"]
    w, ids, al = triton_moe.route_align(logits, k, True, plan.up.block_m)
    out = triton_moe.grouped_experts(x, w13, w2, w, al, plan, ids=ids)
    parts = triton_moe.grouped_experts(x, w13, w2, w, al, plan, ids=ids, rows_out=True)
    assert isinstance(parts, fused_splitk_norm.SplitKPartials) and parts.parts.shape == (k, T, H)
    assert torch.equal(triton_moe.topk_sum(parts.parts.permute(1, 0, 2).reshape(T * k, H),
                                           T, k, {"PDL": False}), out)  # fmt: skip
    ref = moe.experts_loop(x, w13, w2, w, ids)
    assert (out - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())
    for bad in (
        plan._replace(fused_sum=True),
        plan._replace(down_sum=("rows", 8, 16, 4, 1)),
    ):
        with pytest.raises(ValueError, match="persistent"):
            triton_moe.grouped_experts(x, w13, w2, w, al, bad, ids=ids)


def test_persistent_programs_per_sm_bounded_by_tiles():
    """The persistent grid: ``per_sm`` programs per SM (``CPU_SMS`` under the interpreter),
    never more than the tiles of every possible row block, at least one."""
    cpu = torch.device("cpu")
    assert triton_moe.persistent_programs(cpu, 3, 100) == 3 * triton_moe.CPU_SMS
    assert triton_moe.persistent_programs(cpu, 3, 4) == 4
    assert triton_moe.persistent_programs(cpu, 1, 0) == 1


def test_persistent_table_off_by_default_and_read_per_decode_row(monkeypatch):
    """``moe_table.PERSISTENT`` is empty (the persistent kernels off) until an H200 picks
    them; a row replaces the tiles of the DECODE row of its bound (not the other rows), its
    top-k sum as that row says, never fused in the down kernel."""
    from pdserve.model import moe_table

    assert moe_table.PERSISTENT == ()
    assert all(triton_moe.pick_plan(n, 128).persist is None for n in (8, 64, 512, 4096))
    t = (16, 64, 128, 4, 3)
    monkeypatch.setattr(moe_table, "DECODE", ((8, t, t, None, True), (512, t, t, None, True, True)))
    up, down = (32, 32, 128, 4, 4), (32, 64, 128, 4, 3)
    monkeypatch.setattr(moe_table, "PERSISTENT", ((512, up, down, 3, 4, True),))
    p = triton_moe.pick_plan(512, 128)
    assert p.up == up and p.down == down and p.persist == (3, 4) and p.half
    assert p.triton_sum and not p.fused_sum and not p.dynamic
    monkeypatch.setattr(moe_table, "PERSISTENT", ((512, up, down, 3, 4, False, True),))
    p = triton_moe.pick_plan(512, 128)
    assert p.dynamic and not p.half
    assert triton_moe.pick_plan(8, 128).persist is None


@pytest.mark.timeout(300)
@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter path (greedy_paged is CPU)")
def test_model_with_persistent_grouped_kernels_same_greedy_and_logits(monkeypatch):
    """The tiny Qwen3-MoE on the CUDA path (interpreter), the grouped path at two rows
    (``route_align``, the top-k rows into the next norm): with a ``moe_table.PERSISTENT``
    row (32-row blocks, the half tile) the greedy tokens and logits equal the committed
    plan's bit for bit, and every sparse layer's forward took the persistent kernels."""
    from pdserve.model import llama, moe_table

    monkeypatch.setenv("PDSERVE_MOE_EXPERTS", "fused")
    monkeypatch.setenv("PDSERVE_MOE_GEMV_MAX_TOKENS", "0")
    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    hf = random_tiny_model(MOE_CONFIGS["qwen3_moe"](), seed=4)
    model = LlamaForCausalLM(hf.config, torch.float32, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    # the committed tiles' K chunks, so the sums are the same
    t16 = (16, 32, 32, 4, 2)
    monkeypatch.setattr(moe_table, "DECODE", ((512, t16, t16, None, True),))
    calls = []
    real = triton_moe._grouped_persistent
    monkeypatch.setattr(triton_moe, "_grouped_persistent", lambda *a: calls.append(1) or real(*a))
    runs = []
    t32 = (32, 32, 32, 4, 2)
    for rows in ((), ((512, t32, t32, 2, 3, True),)):
        monkeypatch.setattr(moe_table, "PERSISTENT", rows)
        runs.append(greedy_paged(model, PROMPTS[:2], 2))
    n_sparse = sum(layer.moe is not None for layer in model.decoder_layers())
    assert len(calls) >= 2 * n_sparse  # (the 2 decode steps; the prefill where it fits)
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("regime", ["uniform", "pool"])
def test_persistent_grouped_same_bits_on_cuda_bf16_in_a_graph(monkeypatch, regime):
    """On CUDA at Qwen3-30B-A3B's layer, 64 tokens (uniform routing, or each token's 8
    experts from 24 as the random preset routes), bf16, PDL as the table says: the
    persistent kernels after ``route_align`` (32-row blocks with the half tile, 16-row
    blocks, tiles handed out by the device counter), captured in a CUDA graph and replayed
    twice, give the committed plan's bits (the same sums in the same order: MMAs of 16-row
    tiles add K in 16-wide steps whatever the tile's K chunk)."""
    if DEVICE != "cuda":
        pytest.fail("needs CUDA")
    T, H, inter, E, k = 64, 2048, 768, 128, 8
    x, w13, w2, _, _ = _problem(T, H, inter, E, k, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(T, E, generator=g)
    if regime == "pool":
        pool = torch.randperm(E, generator=g)[:24]
        logits = logits * 0.1 - 8.0
        for t in range(T):
            logits[t, pool[torch.randperm(24, generator=g)[:k]]] = 2.0 + torch.rand(k, generator=g)
    logits = logits.to(DEVICE)
    base = triton_moe.pick_plan(T * k, E)

    def run(p):
        w, ids, al = triton_moe.route_align(logits, k, True, p.up.block_m)
        return triton_moe.grouped_experts(x, w13, w2, w, al, p, ids=ids)

    want = run(base)
    mc = triton_moe.MoEConfig
    for plan in (
        triton_moe.MoEPlan(mc(32, 32, 128, 4, 4), mc(32, 64, 128, 4, 3), None, True, False,
                           (2, 4)),
        triton_moe.MoEPlan(mc(16, 64, 128, 4, 3), mc(16, 64, 128, 4, 3), None, True, False,
                           (2, 4)),
        triton_moe.MoEPlan(mc(32, 16, 256, 4, 4), mc(32, 32, 128, 4, 4), None, True, False,
                           (2, 4), True, True),
    ):  # fmt: skip
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(plan)
        for _ in range(2):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), plan
