"""Attention-backend conformance: every registered backend against transformers (through the
paged scenarios of ``test_parity``) and against ``torch_sdpa`` (the oracle) kernel by kernel.

On a CPU machine the ``triton`` backend runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set by this folder's conftest before Triton is imported), so CI checks the same kernels the
GPU runs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_parity import TOL, run_paged_scenario

from pdserve.config import ATTENTION_BACKENDS
from pdserve.model.attention import (
    AttentionMetadata,
    available_backends,
    build_attention_metadata,
    get_attention_backend,
)
from pdserve.model.llama import LlamaForCausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = list(available_backends())


def test_registry_names_every_backend_and_rejects_unknown():
    assert {"torch_sdpa", "triton"} <= set(BACKENDS)
    assert tuple(BACKENDS) == ATTENTION_BACKENDS  # the names ModelConfig accepts
    with pytest.raises(ValueError, match="bogus"):
        get_attention_backend("bogus")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_backend_paged_parity_fp32(backend, arch, tiny_hf_builder):
    """Prefill of mixed lengths, chunked prefill over a cached prefix mixed with decodes, then
    decode-only steps; pages scattered; fp32 logprobs match transformers."""
    hf = tiny_hf_builder(arch)
    model = LlamaForCausalLM(hf.config, torch.float32, DEVICE, attn_backend=backend)
    model.load_weights(hf.state_dict().items())
    steps = [[5, 11, 1, 7], [1, 4, 1, 3], [1, 1, 1, 1], [1, 1, 1, 1]]
    err = run_paged_scenario(model, hf, steps, [5, 11, 1, 7], page_size=3, seed=1)
    assert err < TOL, f"{backend} {arch}: max log-prob diff {err:.2e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_page_sizes(backend, tiny_hf_builder):
    hf = tiny_hf_builder("llama")
    model = LlamaForCausalLM(hf.config, torch.float32, DEVICE, attn_backend=backend)
    model.load_weights(hf.state_dict().items())
    for page_size in (1, 16):
        err = run_paged_scenario(
            model, hf, [[9, 2], [1, 1], [2, 1]], [9, 2], page_size, seed=page_size, host_lens=False
        )
        assert err < TOL, f"{backend} page_size {page_size}: max log-prob diff {err:.2e}"


def _random_step(q_lens, s_lens, page_size, Hq, Hkv, D, num_pages, dtype, seed, page_major):
    """Random q/k/v of one step, a pool with the cached prefix filled, scattered pages.

    page_major: the per-layer K/V views are strided slices of a ``[P, L=2, 2, Hkv, ps, D]``
    pool (the page-major order), not contiguous ``[P, ps, Hkv, D]`` tensors."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for s in s_lens:
        need = math.ceil(s / page_size)
        tables.append(perm[used : used + need])
        used += need
    T = sum(q_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    if page_major:
        pool = rnd(num_pages, 2, 2, Hkv, page_size, D)
        k_cache = pool[:, 1, 0].permute(0, 2, 1, 3)  # layer 1's K: [P, ps, Hkv, D], strided
        v_cache = pool[:, 1, 1].permute(0, 2, 1, 3)
    else:
        k_cache, v_cache = rnd(num_pages, page_size, Hkv, D), rnd(num_pages, page_size, Hkv, D)
    qkv = rnd(T, Hq + 2 * Hkv, D)  # q/k/v are strided views of one fused tensor, as in llama
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    md = build_attention_metadata(q_lens, s_lens, tables, page_size, device=DEVICE)
    return q, k, v, k_cache, v_cache, md


def _attend(name, q, k, v, k_cache, v_cache, md, page_size):
    backend = get_attention_backend(name)
    kc, vc = k_cache.clone(), v_cache.clone()
    if name == "torch_sdpa":  # the oracle indexes a flat view: give it contiguous caches
        kc, vc = kc.contiguous(), vc.contiguous()
    out = backend.forward(q, k, v, kc, vc, md, backend.plan(md, page_size), q.shape[-1] ** -0.5)
    return out, kc, vc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page_major", [False, True])
@pytest.mark.parametrize(
    "q_lens, s_lens, page_size",
    [
        ([1, 1, 1], [1, 70, 300], 16),  # decode only, several splits and many pages
        ([5, 1, 70], [5, 40, 75], 4),  # prefill, decode and extend over a cached prefix
        # mixed: leading decode rows (the decode kernel, several splits), then a prefill
        ([1, 1, 40], [70, 300, 40], 16),
        # two leading decode rows, then an extend over a prefix and a decode row after it
        # (that one stays in the extend kernel)
        ([1, 1, 5, 1], [30, 70, 75, 9], 4),
    ],
)
def test_triton_matches_sdpa_kernelwise(q_lens, s_lens, page_size, page_major):
    """The triton kernels against torch_sdpa on the same step: outputs, and the K/V stored
    (the rest of the pool untouched), for contiguous and page-major strided caches."""
    Hq, Hkv, D = 8, 2, 32
    args = _random_step(q_lens, s_lens, page_size, Hq, Hkv, D, 48, torch.float32, 3, page_major)
    ref, kr, vr = _attend("torch_sdpa", *args, page_size)
    out, kt, vt = _attend("triton", *args, page_size)
    assert (out - ref).abs().max().item() < 1e-5
    assert torch.equal(kt, kr) and torch.equal(vt, vr)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize(
    "cfg",
    [
        (1, 16, 4, 1, 0),  # one split: the kernel writes the output, no merge kernel
        (1, 32, 2, 2, 0),  # a tile of two pages at page size 16 (gathered)
        (3, 16, 4, 1, 32),  # merge kernel; a floor of 32 tokens leaves splits empty
        (4, 16, 2, 2, 0),
        (2, 64, 4, 1, 128),  # every row but the longest in its first split
        (1, 16, 4, 1, 0, 0, True),  # the next tile loaded before this one's math
        (1, 32, 2, 2, 0, 0, True),  # prefetched tiles of two pages (gathered)
        (3, 16, 4, 1, 32, 0, True),  # prefetch with splits, some empty
    ],
)
def test_triton_decode_configs_match_sdpa(cfg, page_size, monkeypatch):
    """Every kind of decode configuration (one split without a merge, the merge kernel, a
    split floor, tiles inside a page or across pages, with and without the prefetch of the
    next tile) equals torch_sdpa on a page-major
    pool, twice with the same plan (its scratch reused)."""
    from pdserve.model import triton_backend

    config = triton_backend.DecodeConfig(*cfg)
    monkeypatch.setattr(triton_backend, "decode_config", lambda *a: config)
    monkeypatch.setattr(triton_backend, "eager_config", lambda c: c)  # odd splits too (graphs)
    args = _random_step([1, 1, 1], [1, 70, 300], page_size, 8, 2, 32, 128, torch.float32, 4, True)
    ref, _, _ = _attend("torch_sdpa", *args, page_size)
    backend = get_attention_backend("triton")
    q, k, v, k_cache, v_cache, md = args
    plan = backend.plan(md, page_size)
    for _ in range(2):
        out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), md, plan, 32**-0.5)
        assert (out - ref).abs().max().item() < 1e-5
    assert plan.config == config
    assert (plan.mid_o is None) == (config.splits == 1)


def test_eager_decode_configs_are_a_fixed_set():
    """An eager step's decode configuration (rows x longest context x total) is one of the
    few ``eager_decode_configs`` that start-up compiles: the split count is a compile-time
    constant, and 1 row of 512..640 tokens used to give 8, 9 or 10 splits."""
    from pdserve.model.triton_backend import decode_config, eager_config, eager_decode_configs

    allowed = set(eager_decode_configs())
    assert len(allowed) == 19
    seen = set()
    for rows in (1, 2, 3, 5, 8, 13, 24, 32, 50, 64, 100, 256):
        for longest in (1, 17, 64, 65, 300, 513, 600, 640, 1024, 1025, 3000, 4096, 40000):
            for total in (longest, longest * rows):
                cfg = eager_config(decode_config(rows, 8, 128, longest, total))
                assert cfg in allowed, (rows, longest, total, cfg)
                seen.add(cfg)
    assert len(seen) >= 12  # the set is what the rule gives, not a superset far from it
    assert eager_config(decode_config(1, 8, 128, 600, 600)).splits == 16  # 10, rounded up


def test_measured_decode_picks_take_over_and_stay_in_the_fixed_set():
    """With measured picks (``decode_attn_table``'s form), short contexts from the least
    measured ``B * Hkv`` take the entry whose bound holds ``B * Hkv`` (the last past it),
    smaller batches and long contexts keep the rule (prefetching with ``long_prefetch``),
    and every eager step's configuration is still one of the start-up set, which adds the
    picks' own configurations."""
    from pdserve.model.triton_backend import (
        DecodeConfig,
        DecodePicks,
        decode_config,
        eager_config,
        eager_decode_configs,
    )

    a, b = DecodeConfig(1, 32, 4, 1, 0, 0, True), DecodeConfig(2, 64, 8, 1, 0, 0, True)
    picks = DecodePicks(((512, a), (1024, b)), long_prefetch=True, short_min=384)
    assert decode_config(48, 8, 128, 200, None, picks) == a  # 384 rows x KV heads
    assert decode_config(47, 8, 128, 200, None, picks) == decode_config(47, 8, 128, 200)
    assert decode_config(64, 8, 128, 1024, None, picks) == a  # 512
    assert decode_config(65, 8, 128, 1024, None, picks) == b
    assert decode_config(256, 8, 128, 300, 256 * 300, picks) == b  # past the last bound
    assert decode_config(16, 8, 128, 200, None, picks) == decode_config(16, 8, 128, 200)
    long = decode_config(64, 8, 128, None, None, picks)
    assert long.prefetch and replace(long, prefetch=False) == decode_config(64, 8, 128, None)
    allowed = set(eager_decode_configs(picks))
    assert {a, b} <= allowed and len(allowed) == 21
    for rows in (1, 3, 8, 24, 32, 50, 64, 100, 256):
        for longest in (1, 65, 300, 1024, 1025, 4096, 40000):
            for total in (longest, longest * rows):
                cfg = eager_config(decode_config(rows, 8, 128, longest, total, picks))
                assert cfg in allowed, (rows, longest, total, cfg)


def test_decode_attn_table_entries_are_valid():
    """Every committed pick is a valid configuration the warm-up compiles as is: bounds
    ascending, split counts powers of two (``eager_config`` keeps them), 128-token pages
    tiled whole; greedy picks of positive sizes."""
    from pdserve.model import decode_attn_table as t
    from pdserve.model.triton_backend import DecodeConfig, eager_config

    for (name, group, head_dim), (least, entries) in t.SHORT.items():
        assert name and group >= 1 and head_dim >= 16 and entries
        bounds = [n for n, _ in entries]
        assert bounds == sorted(set(bounds)) and 1 <= least <= bounds[0]
        for _, c in entries:
            cfg = DecodeConfig(*c)
            assert eager_config(cfg) == cfg and 128 % cfg.block_n == 0
    for target, block_v, warps in t.GREEDY.values():
        assert target >= 1 and block_v >= 16 and block_v & (block_v - 1) == 0 and warps >= 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hkv", [8, 2, 1])  # GQA ratios 1, 4, 8 (8 query heads)
@pytest.mark.parametrize(
    "cfg, s_lens",
    [
        ((2, 16, 4, 1, 0, 0), [300, 300]),  # uniform, two splits
        ((5, 16, 4, 1, 0, 1024), [1, 37, 700]),  # balanced, pieces of one tile
        ((16, 16, 2, 1, 0, 6), [1, 37, 700]),  # balanced: 6 pieces, most splits empty
        ((8, 32, 4, 1, 64, 3), [700, 5, 129]),  # balanced over a 64-token floor
    ],
)
def test_triton_decode_splits_gqa_and_lengths_match_sdpa(cfg, s_lens, hkv, monkeypatch):
    """The split-KV decode kernel equals torch_sdpa for several split counts (with and
    without the balanced split length computed from the batch's total context), GQA
    ratios and context lengths, on a page-major pool; the merge ignores empty splits."""
    from pdserve.model import triton_backend

    config = triton_backend.DecodeConfig(*cfg)
    monkeypatch.setattr(triton_backend, "decode_config", lambda *a: config)
    monkeypatch.setattr(triton_backend, "eager_config", lambda c: c)  # odd splits too (graphs)
    monkeypatch.setattr(triton_backend, "_BALANCE_BLOCK_B", 2)  # the total: a loop of 2
    args = _random_step([1] * len(s_lens), s_lens, 16, 8, hkv, 32, 128, torch.float32, 5, True)
    ref, _, _ = _attend("torch_sdpa", *args, 16)
    backend = get_attention_backend("triton")
    q, k, v, k_cache, v_cache, md = args
    plan = backend.plan(md, 16)
    out = backend.forward(q, k, v, k_cache, v_cache, md, plan, 32**-0.5)
    assert (out - ref).abs().max().item() < 1e-5
    if config.splits == 1:
        return
    # Which splits hold context (lse > -inf): the length the kernel derived on the device.
    splits, bn, _, _, floor, balance = cfg
    per_split = [math.ceil(math.ceil(s / splits) / bn) * bn for s in s_lens]
    if balance:
        piece = math.ceil(math.ceil(sum(s_lens) * hkv / balance) / bn) * bn
        per_split = [max(p, piece) for p in per_split]
    per_split = [max(p, floor) for p in per_split]
    used = (plan.mid_lse[:, 0, :] > float("-inf")).sum(1).tolist()
    assert used == [min(splits, -(-s // p)) for s, p in zip(s_lens, per_split)]


def test_kv16_even_rules_take_whole_tiles_with_the_same_numbers(monkeypatch):
    """A rule in ``KV16_EVEN`` (the long-context rule on the H200's measurement) runs a
    16-bit (here fp32) cache's decode with ``even`` (whole tiles without masks), other rules
    as they are; under the interpreter the output is the masked loop's, bit for bit, and
    torch_sdpa's."""
    from pdserve.model import triton_backend as tb

    long, short = tb.DecodeConfig(5, 16, 4, 1, 0, 1024), tb.DecodeConfig(2, 16, 4, 1)
    assert frozenset({"long"}) == tb.KV16_EVEN  # the H200's pick (see its comment)

    def rules(r: frozenset) -> None:
        monkeypatch.setattr(tb, "KV16_EVEN", r)
        tb.kv16_decode_config.cache_clear()

    rules(frozenset())
    assert tb.kv16_decode_config(long) is long
    rules(frozenset({"long"}))
    assert tb.kv16_decode_config(long) == tb.DecodeConfig(5, 16, 4, 1, 0, 1024, even=True)
    assert tb.kv16_decode_config(short) is short
    monkeypatch.setattr(tb, "decode_config", lambda *a: long)
    monkeypatch.setattr(tb, "eager_config", lambda c: c)
    args = _random_step([1, 1, 1], [1, 37, 700], 16, 8, 2, 32, 128, torch.float32, 5, True)
    ref, _, _ = _attend("torch_sdpa", *args, 16)
    backend = get_attention_backend("triton")
    q, k, v, k_cache, v_cache, md = args
    outs = []
    try:
        for r in (frozenset({"long"}), frozenset()):
            rules(r)
            plan = backend.plan(md, 16)
            outs.append(backend.forward(q, k, v, k_cache, v_cache, md, plan, 32**-0.5))
    finally:
        tb.kv16_decode_config.cache_clear()  # no entry of these rules outlives the test
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] - ref).abs().max().item() < 1e-5


def test_decode_config_choice_and_validation():
    """Short contexts: rows x KV heads x splits near 1024 programs, one split (no merge)
    from 256 rows x KV heads, fewer splits for an eager step's short contexts. Long or
    unknown contexts: the balanced rule (the kernel cuts the batch's KV into 1024 pieces):
    a graph launches up to 2048 programs, an eager step as many splits as its longest row
    needs. Bad values name the field."""
    from pdserve.model.triton_backend import DecodeConfig, decode_config

    assert decode_config(64, 8, 128, None) == DecodeConfig(4, 64, 4, 2, 256, 1024)
    assert decode_config(128, 8, 128, None) == DecodeConfig(2, 64, 4, 2, 256, 1024)
    assert decode_config(1, 8, 128, None) == DecodeConfig(32, 64, 4, 2, 0, 1024)
    assert decode_config(16, 8, 128, None) == DecodeConfig(16, 64, 4, 2, 0, 1024)
    assert decode_config(1, 8, 128, 100).splits == 2
    # Known short contexts at a large batch (an eager step, or a graph captured for the
    # bound): one split of 3 stages, no merge; past the bound the balanced rule.
    assert decode_config(64, 8, 128, 1024) == DecodeConfig(1, 64, 4, 3)
    assert decode_config(32, 8, 128, 200) == DecodeConfig(1, 64, 4, 3)
    assert decode_config(16, 8, 128, 500) == DecodeConfig(8, 64, 4, 2, 0)  # 128 programs
    assert decode_config(64, 8, 128, 1025) == DecodeConfig(4, 64, 4, 2, 256, 1024)  # graph
    # eager, uniform: 64 x 1025 x 8 / 1024 -> pieces of 576 tokens, 2 splits a row
    assert decode_config(64, 8, 128, 1025, 64 * 1025) == DecodeConfig(2, 64, 4, 2, 256, 1024)
    # eager, 32 rows x 4,096 (the long-context row): pieces of 1,024, 4 splits
    assert decode_config(32, 8, 128, 4096, 32 * 4096).splits == 4
    # eager, one 32k row among 31 of 100 tokens: the long row takes every split
    assert decode_config(32, 8, 128, 32768, 32768 + 31 * 100).splits == 32
    # eager, batch 1 x 4,096: pieces of the 64-token floor, 32 splits
    assert decode_config(1, 8, 128, 4096, 4096).splits == 32
    for bad, field in (
        (dict(splits=0), "splits"),
        (dict(splits=33), "splits"),
        (dict(block_n=48), "block_n"),
        (dict(min_split=100), "min_split"),
    ):
        kw = dict(splits=2, block_n=64, num_warps=4, num_stages=2) | bad
        with pytest.raises(ValueError, match=field):
            DecodeConfig(**kw)


def test_graphs_get_a_short_context_bound():
    """The triton backend asks every batch size for a graph bounded at
    ONE_SPLIT_MAX_CONTEXT (the measured short-context rule; one split from 256 rows x KV
    heads) besides its unbounded one (the balanced rule); the CPU backend never; the
    runner replays the smallest bound that holds the longest context."""
    from pdserve.engine.worker.cuda_graph import pick_graph
    from pdserve.model.triton_backend import ONE_SPLIT_MAX_CONTEXT, TritonBackend, decode_config

    tri, sdpa = TritonBackend(), get_attention_backend("torch_sdpa")
    for bs in (1, 8, 16, 31, 32, 48, 64, 128, 256):
        one_split = decode_config(bs, 8, 128, ONE_SPLIT_MAX_CONTEXT).splits == 1
        unbounded = decode_config(bs, 8, 128, None)
        assert unbounded.balance and bs * 8 * unbounded.splits <= max(2048, bs * 8)
        assert tri.capture_context_bounds(bs, 8) == (ONE_SPLIT_MAX_CONTEXT,)
        assert one_split == (bs >= 32)
        assert sdpa.capture_context_bounds(bs, 8) == ()
    assert pick_graph(64, (1024,), 1) == (64, 1024)
    assert pick_graph(64, (1024,), 1024) == (64, 1024)
    assert pick_graph(64, (1024,), 1025) == (64, None)
    assert pick_graph(64, (256, 1024), 300) == (64, 1024)
    assert pick_graph(8, (), 5) == (8, None)


def test_mixed_step_plans_its_leading_decode_rows_for_the_decode_kernel():
    """A mixed step's leading one-token rows are planned for the decode kernel with their
    own context bounds; the extend part gets the longest query among the rest."""
    backend = get_attention_backend("triton")
    md = build_attention_metadata([1, 1, 7, 1], [50, 9, 20, 4], [[0] * 13] * 4, 4, device=DEVICE)
    plan = backend.plan(md, 4)
    assert not plan.decode and plan.num_decode_rows == 2
    assert (plan.max_seq_len, plan.total_context, plan.max_q_len) == (50, 59, 7)
    md = build_attention_metadata([3, 1], [3, 9], [[0] * 3] * 2, 4, device=DEVICE)
    assert backend.plan(md, 4).num_decode_rows == 0  # the first row is a prefill
    md = build_attention_metadata([1, 1], [3, 9], [[0] * 3] * 2, 4, device=DEVICE)
    plan = backend.plan(md, 4)
    assert plan.decode and plan.num_decode_rows == 0


def test_triton_padded_rows_write_nothing_and_output_zero():
    """A captured batch's padded rows (slot -1, context 0) leave the pool as it was."""
    backend = get_attention_backend("triton")
    Hq, Hkv, D, ps = 4, 2, 16, 4
    k_cache = torch.zeros(3, ps, Hkv, D, device=DEVICE)
    v_cache = torch.zeros(3, ps, Hkv, D, device=DEVICE)
    q, k, v = (torch.randn(2, h, D, device=DEVICE) for h in (Hq, Hkv, Hkv))
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([1, 0], dtype=torch.int64, device=DEVICE),
        page_table=torch.tensor([[2], [0]], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor([2 * ps + 0, -1], dtype=torch.int64, device=DEVICE),
    )
    out = backend.forward(q, k, v, k_cache, v_cache, md, backend.plan_for_capture(md, ps), 0.25)
    assert torch.equal(k_cache[2, 0], k[0]) and torch.equal(v_cache[2, 0], v[0])
    k_cache[2, 0] = 0
    v_cache[2, 0] = 0
    assert k_cache.abs().max().item() == 0 and v_cache.abs().max().item() == 0
    assert torch.allclose(out[0].view(Hq, D), v[0].repeat_interleave(Hq // Hkv, 0), atol=1e-6)
    assert out[1].abs().max().item() == 0


def test_paged_kernels_compile_one_variant_for_every_page_table_width():
    """The page table's row stride (its width in pages) changes from step to step: Triton must
    not specialise on it (a width of 1, of 16, of neither would each compile a kernel again,
    ~0.8 s on the H200, during a request's step)."""
    from pdserve.model import triton_kernels

    for kernel in (triton_kernels.extend_kernel, triton_kernels.decode_split_kernel):
        if hasattr(kernel, "params"):  # compiled
            unspecialised = {p.name for p in kernel.params if p.do_not_specialize}
        else:  # under TRITON_INTERPRET=1: the decorator's arguments as given
            unspecialised = set(kernel.kwargs["do_not_specialize"])
        expected = (
            {"s_tb", "num_rows"}
            if kernel is triton_kernels.decode_split_kernel
            else {"s_tb", "row0"}  # a mixed step's leading decode rows: an offset
        )
        assert unspecialised == expected, kernel


@pytest.mark.timeout(300)
def test_decode_kernel_builds_for_hopper_with_and_without_prefetch(sm90_build):
    """Compiled for sm_90 without a GPU (``scripts/sm90_build_check.py --decode``: Triton's
    own ptxas, the interpreter off): the default short-context configuration stages its
    tiles through shared memory (cp.async, LDGSTS); the prefetching one loads them into
    registers (LDG, no LDGSTS) and spills nothing, so a 64-row step's 512 programs fit one
    wave of the H200's 132 SMs (4 programs an SM by registers)."""
    cfgs = ["(1, 64, 4, 3)", "(1, 32, 4, 1, 0, 0, True)"]
    rows, log = sm90_build("--decode", "--configs", *cfgs, "--json", timeout=240)
    assert len(rows) == 2, log[-3000:]
    staged, prefetch = rows
    assert "error" not in staged and "error" not in prefetch, rows
    assert staged["sass"]["LDGSTS"] > 0
    assert prefetch["sass"]["LDGSTS"] == 0 and prefetch["sass"]["LDG"] > 0
    assert prefetch["sass"]["LDL"] == 0 and prefetch["sass"]["STL"] == 0
    assert prefetch["programs_per_sm_by_registers"] * 132 >= 64 * 8
