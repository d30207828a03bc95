"""FP8 KV cache in the attention backends: the store quantizes (``k / k_scale`` in e4m3), the
kernels dequantize on load; both backends (triton under Triton's interpreter on CPU) equal
plain attention over the dequantized K/V, for decode, prefill and extend over a cached
prefix, on a page-major strided pool."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pdserve.model.attention import build_attention_metadata, get_attention_backend, quantize_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALES = (0.5, 2.0)


def _step(q_lens, s_lens, page_size, Hq, Hkv, D, num_pages, seed):
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for s in s_lens:
        need = math.ceil(s / page_size)
        tables.append(perm[used : used + need])
        used += need
    T = sum(q_lens)
    pool = torch.randn(num_pages, 2, 2, Hkv, page_size, D, generator=gen) * 3
    k8 = quantize_kv(pool[:, :, 0], SCALES[0])
    v8 = quantize_kv(pool[:, :, 1], SCALES[1])
    pool8 = torch.stack((k8, v8), dim=2).to(DEVICE)  # [P, L=2, 2, Hkv, ps, D] e4m3
    qkv = (torch.randn(T, Hq + 2 * Hkv, D, generator=gen) * 3).to(DEVICE)
    md = build_attention_metadata(q_lens, s_lens, tables, page_size, device=DEVICE)
    return pool8, qkv, md


def _views(pool):
    return pool[:, 1, 0].permute(0, 2, 1, 3), pool[:, 1, 1].permute(0, 2, 1, 3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torch_sdpa", "triton"])
@pytest.mark.parametrize(
    "q_lens, s_lens, page_size",
    [
        ([1, 1, 1], [1, 70, 300], 16),  # decode only (splits and a merge on triton)
        ([5, 1, 70], [5, 40, 75], 4),  # prefill, decode and extend over a cached prefix
    ],
)
def test_fp8_cache_equals_attention_over_dequantized_kv(backend, q_lens, s_lens, page_size):
    Hq, Hkv, D = 8, 2, 32
    pool8, qkv, md = _step(q_lens, s_lens, page_size, Hq, Hkv, D, 48, seed=7)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    b = get_attention_backend(backend)
    k_cache, v_cache = _views(pool8)
    scale = D**-0.5
    out = b.forward(q, k, v, k_cache, v_cache, md, b.plan(md, page_size), scale, kv_scale=SCALES)

    # the store: this step's K/V as e4m3 of k / k_scale at their slots, nothing else touched
    slots = md.slot_mapping.to(pool8.device)
    pages, offs = slots // page_size, slots % page_size
    want_pool = pool8.clone()
    wk, wv = _views(want_pool)
    wk[pages, offs] = quantize_kv(k, SCALES[0])
    wv[pages, offs] = quantize_kv(v, SCALES[1])
    assert torch.equal(pool8.view(torch.uint8), want_pool.view(torch.uint8))

    # the reference: fp32 attention over the dequantized pool (this step's tokens included)
    ref_pool = pool8.float()
    ref_pool[:, :, 0] *= SCALES[0]
    ref_pool[:, :, 1] *= SCALES[1]
    rk, rv = _views(ref_pool)
    sdpa = get_attention_backend("torch_sdpa")
    kd = (quantize_kv(k, SCALES[0]).float() * SCALES[0]).contiguous()
    vd = (quantize_kv(v, SCALES[1]).float() * SCALES[1]).contiguous()
    ref = sdpa.forward(q, kd, vd, rk, rv, md, sdpa.plan(md, page_size), scale, kv_stored=True)
    assert (out.float() - ref).abs().max().item() < 1e-4


def test_quantize_kv_leaves_its_input_alone():
    """fp32 K/V at scale 1: the saturation is of a copy (``x.float()`` is x itself in
    fp32, and an in-place clamp of it saturated the caller's values too)."""
    x = torch.tensor([[300.0, -700.0, 1000.0, 0.5]])
    before = x.clone()
    q = quantize_kv(x, 1.0)
    assert torch.equal(x, before)
    assert q.float().tolist() == [[288.0, -448.0, 448.0, 0.5]]


def test_fp8_decode_tiles_replace_the_bf16_ones_by_rule(monkeypatch):
    """FP8_DECODE_TILES gives an e4m3 cache its own tile / warps / stages for the rules it
    lists (min_split rounded up to the tile, splits kept); other rules, and an empty table,
    leave the configuration as the bf16 cache's."""
    from pdserve.model import triton_backend as tb

    short = tb.DecodeConfig(16, 64, 4, 2)
    one = tb.DecodeConfig(1, 64, 4, 3)
    long = tb.DecodeConfig(8, 64, 4, 2, 64, 1024)
    assert [tb.decode_rule(c) for c in (short, one, long)] == ["split", "one", "long"]
    monkeypatch.setattr(tb, "FP8_DECODE_TILES", {"long": (128, 8, 3)})
    monkeypatch.setattr(tb, "FP8_KV_EVEN", frozenset())
    tb.fp8_decode_config.cache_clear()
    try:
        assert tb.fp8_decode_config(long) == tb.DecodeConfig(8, 128, 8, 3, 128, 1024)
        assert tb.fp8_decode_config(short) is short and tb.fp8_decode_config(one) is one
    finally:
        tb.fp8_decode_config.cache_clear()


@pytest.mark.timeout(300)
def test_fp8_decode_with_its_own_tiles_equals_the_default_tiles(monkeypatch):
    """An e4m3 decode step under FP8_DECODE_TILES' 128-token tiles (and the 3-stage,
    8-warp variant) gives the output of the default tiles (fp32 queries: the same sums up to
    their order)."""
    from pdserve.model import triton_backend as tb

    Hq, Hkv, D, ps = 8, 2, 32, 128
    pool8, qkv, md = _step([1, 1, 1], [1, 300, 700], ps, Hq, Hkv, D, 12, seed=3)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    b = tb.TritonBackend()
    real = tb.fp8_decode_config
    launched = []  # the configurations the kernel ran with
    monkeypatch.setattr(
        tb, "fp8_decode_config", lambda c, t=None: launched.append(real(c, t)) or real(c, t)
    )

    def run(tiles):
        monkeypatch.setattr(tb, "FP8_DECODE_TILES", tiles)
        real.cache_clear()
        pool = pool8.clone()
        kc, vc = _views(pool)
        out = b.forward(q, k, v, kc, vc, md, b.plan(md, ps), D**-0.5, kv_scale=SCALES)
        return out.float()

    try:
        base = run({})
        assert launched[-1] == tb.DecodeConfig(16, 64, 4, 2)  # the short rule's, 16 splits
        for tiles in ({"split": (128, 4, 2)}, {"split": (128, 8, 3)}):
            assert (run(tiles) - base).abs().max().item() < 1e-4
            assert launched[-1] == tb.DecodeConfig(16, *tiles["split"])
    finally:
        real.cache_clear()


def test_fp8_one_tiles_by_rows_replace_the_one_rule_only(monkeypatch):
    """DecodePicks.fp8_one: the entry with the largest least not above B * Hkv, none below
    the first; fp8_decode_config takes it for a one-split short step only (a split or long
    step keeps FP8_DECODE_TILES' rule); the table's entries are ascending valid tiles."""
    from pdserve.model import decode_attn_table
    from pdserve.model import triton_backend as tb

    picks = tb.DecodePicks(fp8_one=((4096, (16, 1, 3)), (16384, (32, 1, 3))))
    assert picks.fp8_one_tile(2048) is None and tb.NO_PICKS.fp8_one_tile(1 << 20) is None
    assert picks.fp8_one_tile(4096) == picks.fp8_one_tile(8192) == (16, 1, 3)
    assert picks.fp8_one_tile(16384) == (32, 1, 3)
    monkeypatch.setattr(tb, "FP8_DECODE_TILES", {"long": (64, 2, 2)})
    monkeypatch.setattr(tb, "FP8_KV_EVEN", frozenset())
    tb.fp8_decode_config.cache_clear()
    try:
        one, short = tb.DecodeConfig(1, 32, 2, 3), tb.DecodeConfig(4, 64, 4, 2)
        long = tb.DecodeConfig(8, 64, 4, 2, 256, 1024)
        assert tb.fp8_decode_config(one, (16, 1, 3)) == tb.DecodeConfig(1, 16, 1, 3)
        assert tb.fp8_decode_config(one, None) is one
        assert tb.fp8_decode_config(short, (16, 1, 3)) is short
        assert tb.fp8_decode_config(long, (16, 1, 3)) == tb.DecodeConfig(8, 64, 2, 2, 256, 1024)
    finally:
        tb.fp8_decode_config.cache_clear()
    for entries in decode_attn_table.FP8_ONE.values():
        leasts = [n for n, _ in entries]
        assert leasts == sorted(set(leasts))
        for _, t in entries:
            assert tb.decode_rule(tb.DecodeConfig(1, *t)) == "one"


@pytest.mark.timeout(300)
def test_fp8_one_tiles_of_large_steps_equal_the_default_tiles(monkeypatch):
    """An e4m3 one-split decode step under the rows' FP8_ONE tiles (16 tokens, 1 warp)
    gives the output of the one rule's default tiles (fp32 queries: the same sums up to
    their order), and the launch takes the tiles only from their least rows x KV heads."""
    from pdserve.model import triton_backend as tb

    Hq, Hkv, D, ps = 8, 2, 32, 16
    pool8, qkv, md = _step([1, 1, 1], [1, 70, 300], ps, Hq, Hkv, D, 48, seed=5)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    b = tb.TritonBackend()
    real = tb.fp8_decode_config
    launched = []
    monkeypatch.setattr(
        tb, "fp8_decode_config", lambda c, t=None: launched.append(real(c, t)) or real(c, t)
    )
    one = tb.DecodeConfig(1, 32, 2, 3)  # the short rule's pick from 0 rows: one split

    def run(least):
        picks = tb.DecodePicks(((1 << 20, one),), False, 0, ((least, (16, 1, 3)),))
        monkeypatch.setattr(tb, "device_picks", lambda *a: picks)
        real.cache_clear()
        kc, vc = _views(pool8.clone())
        out = b.forward(q, k, v, kc, vc, md, b.plan(md, ps), D**-0.5, kv_scale=SCALES)
        return out.float()

    try:
        base = run(7)  # 3 rows x 2 KV heads = 6 < 7: the rule's tiles
        assert launched[-1] == one
        got = run(6)
        assert launched[-1] == tb.DecodeConfig(1, 16, 1, 3)
        assert (got - base).abs().max().item() < 1e-4
    finally:
        real.cache_clear()


@pytest.mark.timeout(300)
def test_bf16_queries_over_an_fp8_cache_take_fp16_dots_and_match_the_reference(monkeypatch):
    """bf16 queries over an e4m3 cache (the CUDA case): the decode kernel converts the
    tiles (and q) to fp16 for its dots (``F16_DOT``); the output equals fp32 attention over
    the dequantized K/V up to bf16's rounding of it, splits and merge included."""
    from pdserve.model import triton_backend as tb

    monkeypatch.setattr(tb, "FP8_KV_F16_DOTS", frozenset({"split"}))  # the rule run here
    Hq, Hkv, D, ps = 8, 2, 32, 16
    pool8, qkv, md = _step([1, 1, 1], [1, 70, 300], ps, Hq, Hkv, D, 48, seed=9)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    b = tb.TritonBackend()
    kc, vc = _views(pool8)
    out = b.forward(q, k, v, kc, vc, md, b.plan(md, ps), D**-0.5, kv_scale=SCALES)
    assert out.dtype == torch.bfloat16
    ref_pool = pool8.float()
    ref_pool[:, :, 0] *= SCALES[0]
    ref_pool[:, :, 1] *= SCALES[1]
    rk, rv = _views(ref_pool)
    sdpa = get_attention_backend("torch_sdpa")
    kd = (quantize_kv(k, SCALES[0]).float() * SCALES[0]).contiguous()
    vd = (quantize_kv(v, SCALES[1]).float() * SCALES[1]).contiguous()
    qf = q.float()
    ref = sdpa.forward(qf, kd, vd, rk, rv, md, sdpa.plan(md, ps), D**-0.5, kv_stored=True)
    err = (out.float() - ref).abs().max().item()
    assert err <= 2**-7 * ref.abs().max().item(), err


@pytest.mark.timeout(300)
def test_fp16_dots_build_for_hopper_without_the_per_value_bf16_conversions(sm90_build):
    """Compiled for sm_90 without a GPU (``scripts/sm90_build_check.py --decode --kv fp8``:
    Triton's own ptxas, the interpreter off): an e4m3 tile converted for bf16 dots costs a
    packed e4m3 -> fp16 conversion (F2FP) a pair plus an fp16 -> bf16 one (F2F) a value;
    with ``F16_DOT`` the F2F are gone."""
    rows = []
    for extra in ([], ["--f16-dot"]):
        rows += sm90_build(
            *["--decode", "--kv", "fp8", "--json", *extra],
            *["--configs", "(8, 64, 4, 2, 256, 1024)"],
            timeout=240,
        )[0]
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    bf16_dots, f16_dots = rows
    assert bf16_dots["sass"]["F2F"] >= 64 and bf16_dots["sass"]["F2FP"] > 0
    assert f16_dots["sass"]["F2F"] == 0 and f16_dots["sass"]["F2FP"] > 0


@pytest.mark.timeout(300)
def test_fp8_decode_aligned_loads_change_no_number(monkeypatch):
    """The decode kernel's ``ALIGNED`` (16-byte K/V loads, a compiler hint) over an e4m3
    cache, bf16 queries (the CUDA case), splits and merge: the same output as without it,
    under bf16 dots and under fp16 dots; ``kv_rows_aligned`` says when it may be set."""
    from pdserve.model import triton_backend as tb

    Hq, Hkv, D, ps = 8, 2, 32, 16
    pool8, qkv, md = _step([1, 1, 1], [1, 70, 300], ps, Hq, Hkv, D, 48, seed=5)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    b = tb.TritonBackend()
    kc, vc = _views(pool8)
    assert tb.kv_rows_aligned(kc, vc)  # 32 one-byte dims a row
    assert not tb.kv_rows_aligned(kc[:, :, :, 1:], vc)  # a row starting one byte in

    def run(aligned: bool, f16_dots: bool):
        monkeypatch.setattr(tb, "FP8_KV_ALIGNED_LOADS", aligned)
        monkeypatch.setattr(tb, "FP8_KV_F16_DOTS", frozenset({"split"} if f16_dots else ()))
        plan = b.plan(md, ps)
        out = b.forward(q, k, v, kc, vc, md, plan, D**-0.5, kv_scale=SCALES, kv_stored=True)
        assert plan.config is not None and plan.config.splits > 1  # the merge ran too
        return out

    f16 = run(False, True)
    assert torch.equal(run(True, False), run(False, False))
    assert torch.equal(run(True, True), f16)
    ref_pool = pool8.float()
    ref_pool[:, :, 0] *= SCALES[0]
    ref_pool[:, :, 1] *= SCALES[1]
    rk, rv = _views(ref_pool)
    sdpa = get_attention_backend("torch_sdpa")
    ref = sdpa.forward(q.float(), k, v, rk, rv, md, sdpa.plan(md, ps), D**-0.5, kv_stored=True)
    assert (f16.float() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item()


@pytest.mark.timeout(300)
def test_aligned_decode_builds_for_hopper_with_16_byte_loads(sm90_build):
    """Compiled for sm_90 without a GPU (``scripts/sm90_build_check.py --decode``, the
    long-context rule's configuration): without ``ALIGNED`` an e4m3 tile is loaded one
    element an instruction (Triton cannot see that a row read through the page table starts
    on 16 bytes), with it 16 bytes a thread (``LDG.E.128``: a 64 x 128 tile of K and one
    of V over 128 threads, 4 each), for the e4m3 cache as for bf16 (8 each)."""
    rows = []
    for extra in (["--kv", "fp8"], ["--kv", "fp8", "--aligned"], ["--kv", "bf16", "--aligned"]):
        rows += sm90_build(
            *["--decode", "--json", *extra, "--configs", "(8, 64, 4, 2, 256, 1024)"],
            timeout=240,
        )[0]
    assert len(rows) == 3 and all("error" not in r for r in rows), rows
    fp8, fp8_aligned, bf16_aligned = (r["sass"] for r in rows)
    assert fp8["LDG"] >= 128 and fp8["LDG.E.128"] <= 1  # the q row only
    assert fp8_aligned["LDG.E.128"] >= 8 and fp8_aligned["LDG"] < 32
    assert bf16_aligned["LDG.E.128"] >= 16 and bf16_aligned["LDG"] < 32


def test_fp8_decode_tiles_may_set_widen_and_fma(monkeypatch):
    """An FP8_DECODE_TILES value of five fields also sets DecodeConfig's ``widen`` and
    ``fma``; of three, both stay off; a rule in FP8_KV_EVEN gets ``even``."""
    from pdserve.model import triton_backend as tb

    long = tb.DecodeConfig(8, 64, 4, 2, 256, 1024)
    monkeypatch.setattr(tb, "FP8_KV_EVEN", frozenset())
    monkeypatch.setattr(tb, "FP8_DECODE_TILES", {"long": (32, 2, 2, 1, False)})
    tb.fp8_decode_config.cache_clear()
    try:
        assert tb.fp8_decode_config(long) == tb.DecodeConfig(8, 32, 2, 2, 256, 1024, widen=1)
        monkeypatch.setattr(tb, "FP8_DECODE_TILES", {"long": (16, 4, 2, 0, True)})
        tb.fp8_decode_config.cache_clear()
        assert tb.fp8_decode_config(long) == tb.DecodeConfig(8, 16, 4, 2, 256, 1024, fma=True)
        monkeypatch.setattr(tb, "FP8_DECODE_TILES", {"long": (64, 2, 2)})
        tb.fp8_decode_config.cache_clear()
        assert tb.fp8_decode_config(long) == tb.DecodeConfig(8, 64, 2, 2, 256, 1024)
        monkeypatch.setattr(tb, "FP8_KV_EVEN", frozenset({"long"}))  # a rule's even tiles
        tb.fp8_decode_config.cache_clear()
        assert tb.fp8_decode_config(long) == tb.DecodeConfig(8, 64, 2, 2, 256, 1024, even=True)
        monkeypatch.setattr(tb, "FP8_KV_VMUL", frozenset({"long"}))  # and its V widened
        tb.fp8_decode_config.cache_clear()
        assert tb.fp8_decode_config(long) == tb.DecodeConfig(
            8, 64, 2, 2, 256, 1024, even=True, vmul=True
        )
        short = tb.DecodeConfig(1, 64, 4, 3)  # "one": not a listed rule, kept as it is
        assert tb.fp8_decode_config(short) == short
    finally:
        tb.fp8_decode_config.cache_clear()
    with pytest.raises(ValueError, match="widen"):
        tb.DecodeConfig(1, 64, 4, 2, widen=4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_decode_widen_and_fma_match_the_reference(kv):
    """The decode kernel's ``WIDEN`` (an e4m3 tile converted before its layout change; a
    select on the mask that loads already zeroed) gives the same numbers as without it;
    ``FMA`` (fp32 products and sums, BLOCK_H = G) equals fp32 attention over the
    dequantized K/V up to the output's rounding; bf16 queries, splits and merge, the
    balanced long-context rule too, over a page-major pool with pages out of order."""
    from pdserve.model import triton_backend as tb

    Hq, Hkv, D, ps = 8, 2, 32, 16
    pool8, qkv, md = _step([1, 1, 1], [1, 70, 300], ps, Hq, Hkv, D, 48, seed=13)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    scales = SCALES if kv == "fp8" else (1.0, 1.0)
    pool = pool8 if kv == "fp8" else pool8.float().to(torch.bfloat16)
    kc, vc = _views(pool)
    b = tb.TritonBackend()

    def run(cfg):
        plan = b.plan(md, ps)
        plan.config = cfg
        out = b.forward(q, k, v, kc, vc, md, plan, D**-0.5, kv_scale=scales, kv_stored=True)
        return out.float()

    ref_pool = pool.float()
    ref_pool[:, :, 0] *= scales[0]
    ref_pool[:, :, 1] *= scales[1]
    rk, rv = _views(ref_pool)
    sdpa = get_attention_backend("torch_sdpa")
    ref = sdpa.forward(q.float(), k, v, rk, rv, md, sdpa.plan(md, ps), D**-0.5, kv_stored=True)
    top = ref.abs().max().item()
    for base in (tb.DecodeConfig(4, 32, 4, 2), tb.DecodeConfig(8, 32, 2, 2, 0, 16)):
        plain = run(base)
        for widen in (1, 3):
            assert torch.equal(run(replace(base, widen=widen)), plain)
        fma = run(replace(base, block_n=16, fma=True))
        assert (fma - ref).abs().max().item() <= 2**-8 * top  # bf16 rounding of the output
        if kv == "fp8" or DEVICE == "cuda":  # Triton 3.9's interpreter: bf16 x bf16 dots are
            assert (plain - ref).abs().max().item() <= 2**-7 * top  # wrong (values ~1e8)


@pytest.mark.timeout(600)
def test_decode_unroll_evict_and_even_give_the_same_numbers():
    """The decode kernel's ``UNROLL`` (the tile loop unrolled 2 or 4 times: tiles folded in
    the same order), ``EVICT`` (an evict-first load hint) and ``EVEN`` (whole tiles without
    masks, the partial last one with them) leave every output bit as it is (``EVEN`` under
    the interpreter; compiled for the H200 it rounds within one bf16 step): an e4m3 cache, bf16 queries, fp16 dots, splits and merge and the balanced rule, over
    a page-major pool with pages out of order, contexts of 1 / 70 / 300 tokens (a split's
    tile count not a multiple of the unroll)."""
    from pdserve.model import triton_backend as tb

    Hq, Hkv, D, ps = 8, 2, 32, 16
    pool8, qkv, md = _step([1, 1, 1], [1, 70, 300], ps, Hq, Hkv, D, 48, seed=17)
    qkv = qkv.to(torch.bfloat16)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    kc, vc = _views(pool8)
    b = tb.TritonBackend()

    def run(cfg):
        plan = b.plan(md, ps)
        plan.config = cfg
        out = b.forward(q, k, v, kc, vc, md, plan, D**-0.5, kv_scale=SCALES, kv_stored=True)
        return out.float()

    for base in (
        tb.DecodeConfig(4, 32, 4, 2),
        tb.DecodeConfig(8, 16, 2, 2, 0, 16),
        tb.DecodeConfig(2, 32, 2, 2),  # tiles of 32 across 16-token pages: a page per token
    ):
        plain = run(base)
        for fields in (
            {"unroll": 2},
            {"unroll": 4},
            {"evict": True},
            {"unroll": 2, "evict": True},
            {"even": True},
            {"even": True, "evict": True},
        ):
            out = run(replace(base, **fields))
            if fields.get("even") and DEVICE == "cuda":  # the H200's maskless loop rounds
                top = plain.abs().max().item()  # otherwise: within one bf16 step (FP8_KV_EVEN)
                assert (out - plain).abs().max().item() <= 2**-8 * top, fields
            else:
                assert torch.equal(out, plain), fields
    with pytest.raises(ValueError, match="unroll"):
        tb.DecodeConfig(1, 64, 4, 2, unroll=3)


def test_fp8_kv_vmul_is_off_by_default():
    """``DecodeConfig.vmul`` is a pick to be measured on the H200 first
    (``scripts/gpu_s11_fp8v.sh``): no rule takes it yet, and the engine's long-context e4m3
    configuration at 32 x 4,096 (a graph's: no context bound) runs without it."""
    from pdserve.model import triton_backend as tb

    assert not tb.FP8_KV_VMUL
    tb.fp8_decode_config.cache_clear()
    long = tb.fp8_decode_config(tb.decode_config(32, 8, 128, None))
    assert tb.decode_rule(long) == "long" and not long.vmul
    assert not tb.DecodeConfig(1, 64, 4, 2).vmul


@pytest.mark.timeout(900)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_decode_vmul_gives_the_same_numbers(q_dtype):
    """The decode kernel's ``VMUL`` (each e4m3 V tile converted to q's dtype and multiplied by
    a runtime 1.0 in registers before its layout change for the dot) leaves every output bit
    as it is, and the output stays within the rounding of attention over the dequantized K/V
    (per-tensor scales 0.5 / 2.0: the V scale still applied to the output once): bf16
    queries with fp16 dots ("long", "split") and with bf16 dots ("one": on a GPU only, Triton
    3.9's interpreter gets bf16 x bf16 dots wrong), fp32 queries ("one" included);
    contexts of 1 / 70 / 300 / 129 tokens (partial last tiles, a context of one token, a
    context one past a page), several splits and the merge, the balanced rule, a split's
    whole tiles without masks (``even``), tiles of 32 across 16-token pages (a page-table
    read a token), tiles unrolled or prefetched, over a page-major pool with pages out of
    order. A bf16 cache ignores it (no conversion there)."""
    from pdserve.model import triton_backend as tb

    Hq, Hkv, D, ps = 8, 2, 32, 16
    pool8, qkv, md = _step([1, 1, 1, 1], [1, 70, 300, 129], ps, Hq, Hkv, D, 64, seed=19)
    qkv = qkv.to(q_dtype)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    b = tb.TritonBackend()

    def run(cfg, pool=pool8, scales=SCALES):
        kc, vc = _views(pool)
        plan = b.plan(md, ps)
        plan.config = cfg
        out = b.forward(q, k, v, kc, vc, md, plan, D**-0.5, kv_scale=scales, kv_stored=True)
        return out.float()

    ref_pool = pool8.float()
    ref_pool[:, :, 0] *= SCALES[0]
    ref_pool[:, :, 1] *= SCALES[1]
    rk, rv = _views(ref_pool)
    sdpa = get_attention_backend("torch_sdpa")
    ref = sdpa.forward(q.float(), k, v, rk, rv, md, sdpa.plan(md, ps), D**-0.5, kv_stored=True)
    top = ref.abs().max().item()
    for base in (
        tb.DecodeConfig(8, 16, 2, 2, 0, 16),  # balanced ("long": fp16 dots under bf16 q)
        tb.DecodeConfig(4, 32, 4, 2),  # "split"
        tb.DecodeConfig(1, 16, 2, 3),  # "one": one split, no merge, bf16 dots
        tb.DecodeConfig(2, 32, 2, 2),  # tiles of 32 across 16-token pages
    ):
        bf16_dots = q_dtype == torch.bfloat16 and tb.decode_rule(base) not in tb.FP8_KV_F16_DOTS
        if bf16_dots and DEVICE != "cuda":  # the interpreter's bf16 x bf16 dots: garbage
            continue
        plain = run(base)
        assert (plain - ref).abs().max().item() <= 2**-7 * top, base
        for fields in (
            {"vmul": True},
            {"vmul": True, "even": True},
            {"vmul": True, "unroll": 2},
            {"vmul": True, "prefetch": True},
        ):
            assert torch.equal(run(replace(base, **fields)), plain), (base, fields)
    if q_dtype == torch.bfloat16 and DEVICE == "cuda":  # the interpreter's bf16 x bf16 dots
        pool16 = pool8.float().to(torch.bfloat16)  # are wrong (see the widen test)
        cfg = tb.DecodeConfig(8, 16, 2, 2, 0, 16)
        plain = run(cfg, pool16, (1.0, 1.0))
        assert torch.equal(run(replace(cfg, vmul=True), pool16, (1.0, 1.0)), plain)


@pytest.mark.timeout(300)
def test_widened_v_builds_for_hopper_without_byte_loads_from_shared_memory(sm90_build):
    """Compiled for sm_90 without a GPU (``scripts/sm90_build_check.py --decode``, the
    long-context rule's e4m3 configuration, fp16 dots, 16-byte loads): without ``WIDEN``
    the V tile goes through shared memory in bytes and is read back one byte an
    instruction (LDS: ~20 a 64 x 128 tile's thread); widened (V converted first) it is
    read back by ``ldmatrix`` (LDSM) in 16-bit lanes, and the kernel holds fewer
    registers."""
    rows = []
    for widen in (0, 1):
        rows += sm90_build(
            *["--decode", "--kv", "fp8", "--f16-dot", "--aligned"],
            *["--json", "--configs", f"(8, 64, 2, 2, 256, 1024, False, {widen})"],
            timeout=240,
        )[0]
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    plain, widened = rows
    assert plain["sass"]["LDS"] >= 3 * widened["sass"]["LDS"]
    assert widened["sass"]["LDSM"] > plain["sass"]["LDSM"]
    assert widened["registers"] < plain["registers"]


@pytest.mark.timeout(400)
def test_vmul_builds_for_hopper_without_byte_loads_from_shared_memory(sm90_build):
    """Compiled for sm_90 without a GPU (``scripts/sm90_build_check.py --decode``, the
    long-context rule's e4m3 tiles with whole tiles unmasked, fp16 dots, 16-byte loads):
    without ``VMUL`` the V tile is read back from shared memory one byte an instruction
    (``LDS.U8``); with it none is (V reaches the dot in 16 bits, by ``ldmatrix``), and the
    whole tiles' loop issues fewer instructions and the kernel holds fewer registers."""
    base = "8, 64, 2, 2, 256, 1024, False, 0, False, 1, False, True"
    rows, log = sm90_build(
        *["--decode", "--kv", "fp8", "--f16-dot", "--aligned"],
        *["--json", "--configs", f"({base})", f"({base}, True)"],
        timeout=380,
    )
    assert len(rows) == 2 and all("error" not in r for r in rows), (rows, log[-2000:])
    plain, vmul = rows
    assert plain["lds_u8"] >= 64 and vmul["lds_u8"] == 0
    assert vmul["sass"]["LDSM"] > plain["sass"]["LDSM"]
    assert vmul["loops"][0]["instructions"] < 0.95 * plain["loops"][0]["instructions"]
    assert vmul["registers"] < plain["registers"]
