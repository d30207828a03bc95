"""RoPE (+ Qwen3's q/k norm) and the KV store inside the split-KV decode kernel
(``triton_backend.DECODE_ROPE``, the kernel's ``ROPE``) against the RoPE + KV store kernel
then the decode kernel (``fused_ops.rope_store_kv`` + ``forward(kv_stored=True)``): the same
output bits and the same cache bytes, bf16 and e4m3 caches, every decode variant; a tiny
Llama's and Qwen3-MoE's greedy decode the same tokens and logits with the flag on and off
(CPU: TRITON_INTERPRET=1, conftest). Eager launches stay within the warm-up's variants:
tests/model/test_triton_warmup.py."""

from __future__ import annotations

import math

import pytest
import torch
from test_moe import MOE_CONFIGS

from tiny_models import random_tiny_model

pytest.importorskip("triton")

from pdserve.model import fused_ops, llama, triton_backend
from pdserve.model.attention import AttentionMetadata, DecodeRope
from pdserve.model.triton_backend import DecodeConfig, TritonBackend, TritonPlan

E4M3 = torch.float8_e4m3fn


def _step(seq_lens: list[int], page_size: int, Hq: int, Hkv: int, D: int, dtype, kv_dtype, seed):
    """One decode step's tensors: rows of ``seq_lens`` (0: a padded row of a graph: slot -1,
    position 0) over scattered pages whose old contents are random (the newest slot too:
    a read of it before the store would show)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    width = max(1, max(-(-s // page_size) for s in seq_lens))
    pages = torch.randperm(B * width + 3, generator=gen)[: B * width].view(B, width)
    P = B * width + 3
    kc = torch.randn(P, page_size, Hkv, D, generator=gen).to(kv_dtype)
    vc = torch.randn(P, page_size, Hkv, D, generator=gen).to(kv_dtype)
    qkv = (2 * torch.randn(B, Hq + 2 * Hkv, D, generator=gen)).to(dtype)
    table = torch.randn(64, D, generator=gen).to(dtype)  # any cos | sin rows: same math
    pos = torch.tensor([max(s - 1, 0) for s in seq_lens], dtype=torch.int64)
    slots = torch.tensor(
        [int(pages[b, (s - 1) // page_size]) * page_size + (s - 1) % page_size if s else -1
         for b, s in enumerate(seq_lens)],
        dtype=torch.int64,
    )  # fmt: skip
    md = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        page_table=pages.to(torch.int32),
        slot_mapping=slots,
        query_lens_host=(1,) * B,
        seq_lens_host=tuple(seq_lens),
    )
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype)
    wk = (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype)
    return qkv, table, pos, md, kc, vc, (w, wk, 1e-6, Hq)


def _both(cfg, seq_lens, page_size=16, Hq=4, Hkv=2, D=32, dtype=torch.bfloat16, kv=None,
          qk_norm=True, kv_scale=(1.0, 1.0), seed=0):  # fmt: skip
    """(unfused, fused) ``(out, k_cache, v_cache)`` of one decode step in ``cfg``."""
    qkv, table, pos, md, kc, vc, norm = _step(
        seq_lens, page_size, Hq, Hkv, D, dtype, kv or dtype, seed
    )
    norm = norm if qk_norm else None
    backend = TritonBackend()
    res = []
    for fused in (False, True):
        x, k_cache, v_cache = qkv.clone(), kc.clone(), vc.clone()
        plan = TritonPlan(True, max(seq_lens), 1, sum(seq_lens), config=cfg)
        q, k, v = x[:, :Hq], x[:, Hq : Hq + Hkv], x[:, Hq + Hkv :]
        if fused:
            rope = DecodeRope(table, pos, norm)
            out = backend.forward(
                q, k, v, k_cache, v_cache, md, plan, D**-0.5, kv_scale=kv_scale, rope=rope
            )
            assert torch.equal(x, qkv)  # nothing rotated in place
        else:
            fused_ops.rope_store_kv(
                x[:, : Hq + Hkv], v, table, pos, k_cache, v_cache, md.slot_mapping, norm, kv_scale
            )
            out = backend.forward(
                q, k, v, k_cache, v_cache, md, plan, D**-0.5, kv_stored=True, kv_scale=kv_scale
            )
        res.append((out, k_cache, v_cache))
    return res


def _assert_same(res) -> None:
    (o0, k0, v0), (o1, k1, v1) = res
    assert torch.equal(o0, o1), (o0.float() - o1.float()).abs().max()
    assert torch.equal(k0.view(torch.uint8), k1.view(torch.uint8))
    assert torch.equal(v0.view(torch.uint8), v1.view(torch.uint8))


# Rows: 17 tokens (4 splits of 16: the newest in split 1 of 4), 1 token, 40 (split 2), 64
# (the last split), a padded row (context 0). One split, several, the balanced rule, and
# every loop variant.
ROWS = [17, 1, 40, 0, 64]
CONFIGS = {
    "one": DecodeConfig(1, 16, 4, 2),
    "split": DecodeConfig(4, 16, 4, 2),
    "balanced": DecodeConfig(8, 16, 4, 2, 0, 64),
    "prefetch": DecodeConfig(4, 16, 4, 2, prefetch=True),
    "unroll_evict": DecodeConfig(4, 16, 4, 2, unroll=2, evict=True),
    "fma": DecodeConfig(4, 16, 4, 2, fma=True),
    "even": DecodeConfig(4, 16, 4, 2, even=True),
    "vmul_widen": DecodeConfig(2, 32, 4, 2, widen=2, vmul=True),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "plain"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_decode_gives_the_bits_of_rope_store_then_decode(name, qk_norm, kv):
    """Each decode variant, bf16 queries: the output and both caches' bytes are those of
    the unfused step (an e4m3 cache with scales != 1, its bf16 queries with fp16 dots
    where the rule takes them: "split" and "balanced")."""
    kv_dtype = E4M3 if kv == "e4m3" else torch.bfloat16
    scale = (0.5, 0.25) if kv == "e4m3" else (1.0, 1.0)
    res = _both(CONFIGS[name], ROWS, kv=kv_dtype, qk_norm=qk_norm, kv_scale=scale)
    _assert_same(res)
    out = res[1][0].view(len(ROWS), 4, 32)
    assert torch.isfinite(out.float()).all() and not out[3].any()  # the padded row: 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page_size, rows, cfg",
    [
        (4, [5, 1, 23], DecodeConfig(4, 16, 4, 2)),  # tiles across pages
        (16, [1, 1, 2], DecodeConfig(8, 16, 4, 2)),  # contexts of 1-2 tokens, empty splits
        (16, [33, 200], DecodeConfig(32, 16, 4, 2, 0, 32)),  # many splits, balanced
    ],
)
def test_fused_decode_pages_contexts_and_splits(page_size, rows, cfg):
    """Page sizes below a tile, one-token contexts, 32 splits, fp32 and GQA 8/1 too."""
    _assert_same(_both(cfg, rows, page_size=page_size))
    _assert_same(_both(cfg, rows, page_size=page_size, Hq=8, Hkv=1, dtype=torch.float32))


def test_decode_rope_needs_a_decode_plan_of_a_power_of_two_head_dim(monkeypatch):
    """Mixed / extend plans and head dims of no power of two keep the RoPE kernel."""
    backend = TritonBackend()
    plan = TritonPlan(True, 10, 1, 10)
    mixed = TritonPlan(False, 10, 7, 10, num_decode_rows=1)
    monkeypatch.setattr(triton_backend, "DECODE_ROPE", False)
    assert not backend.fuses_decode_rope(plan, 128)
    monkeypatch.setattr(triton_backend, "DECODE_ROPE", True)
    assert backend.fuses_decode_rope(plan, 128) and backend.fuses_decode_rope(plan, 64)
    assert not backend.fuses_decode_rope(mixed, 128)
    assert not backend.fuses_decode_rope(plan, 96) and not backend.fuses_decode_rope(plan, 8)
    k = torch.zeros(1, 1, 96)
    with pytest.raises(ValueError, match="power-of-two"):
        backend.forward(k, k, k, torch.zeros(1, 4, 1, 96), torch.zeros(1, 4, 1, 96),
                        None, mixed, 1.0, rope=DecodeRope(k[0], torch.zeros(1)))  # fmt: skip


def _greedy(model, prompts, steps, kv_dtype, page_size=4):
    """Prefill ``prompts`` in one step, then ``steps`` batched greedy decode steps over a
    pool of ``kv_dtype`` (tests/model/tp_model_ranks.greedy_paged's loop, any cache dtype).
    Returns (tokens per prompt, each step's logits)."""
    from pdserve.engine.kv.layout import KVCacheLayout
    from pdserve.model.attention import build_attention_metadata

    s = model.shapes
    totals = [len(p) + steps for p in prompts]
    num_pages = sum(math.ceil(n / page_size) for n in totals) + 2
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3)).tolist()
    tables, used = [], 0
    for n in totals:
        need = math.ceil(n / page_size)
        tables.append(perm[used : used + need])
        used += need
    lay = KVCacheLayout(
        "page_major", s.n_layers, s.n_kv_heads, s.head_dim, page_size, num_pages, kv_dtype
    )
    caches = lay.layer_views(lay.allocate("cpu"))
    B = len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits_all = []
    done, qlens = [0] * B, [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    for _ in range(1 + steps):
        seq_lens = [d + q for d, q in zip(done, qlens)]
        md = build_attention_metadata(qlens, seq_lens, tables, page_size)
        pos = torch.cat([torch.arange(done[b], seq_lens[b]) for b in range(B)])
        hidden = model(ids, pos, md, caches)
        last = torch.tensor([sum(qlens[: b + 1]) - 1 for b in range(B)])
        logits = model.compute_logits(hidden.index_select(0, last))
        logits_all.append(logits)
        nxt = logits.argmax(-1).tolist()
        for b in range(B):
            tokens[b].append(nxt[b])
        done, qlens, ids = seq_lens, [1] * B, torch.tensor(nxt)
    return tokens, logits_all


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "arch, dtype, kv",
    [
        ("llama", torch.float32, "e4m3"),
        ("qwen3", torch.float32, "model"),
        ("qwen3_moe", torch.float32, "e4m3"),
    ],
)
def test_greedy_decode_with_the_flag_on_equals_off(monkeypatch, tiny_hf_builder, arch, dtype, kv):
    """A tiny model on the CUDA path (fused ops, the triton backend), here interpreted (fp32:
    the CPU's bf16 weights are packed for its own matmuls; bf16 queries: the kernel tests
    above), an e4m3 cache with per-layer scales or the model's dtype: greedy decode (a prefill, then 3 decode steps of 3 rows) with the flag on gives the
    tokens and logits of the flag off, bit for bit; on, the decode steps run no RoPE
    kernel (the prefill does) and every layer's decode launches the kernel's ROPE."""
    from pdserve.model.llama import LlamaForCausalLM

    monkeypatch.setattr(llama, "use_fused_ops", lambda ids: True)
    if arch == "qwen3_moe":
        hf = random_tiny_model(MOE_CONFIGS[arch](), seed=4)
    else:
        hf = tiny_hf_builder(arch, seed=3)
    model = LlamaForCausalLM(hf.config, dtype, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    kv_dtype = E4M3 if kv == "e4m3" else dtype
    if kv == "e4m3":
        for i, layer in enumerate(model.decoder_layers()):
            layer.kv_scale = (0.5 + 0.25 * i, 0.125 * (i + 1))
    prompts = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 77], [11]]
    ropes, fused = [], []
    real_rope, real_decode = fused_ops.rope_store_kv, TritonBackend._decode
    monkeypatch.setattr(
        fused_ops, "rope_store_kv", lambda *a, **kw: ropes.append(1) or real_rope(*a, **kw)
    )

    def decode(self, *args):
        fused.append(args[-1] is not None)
        return real_decode(self, *args)

    monkeypatch.setattr(TritonBackend, "_decode", decode)
    monkeypatch.setattr(triton_backend, "DECODE_ROPE", False)
    off = _greedy(model, prompts, 3, kv_dtype)
    n_layers = model.shapes.n_layers
    assert len(ropes) == 4 * n_layers and not any(fused)
    ropes.clear()
    fused.clear()
    monkeypatch.setattr(triton_backend, "DECODE_ROPE", True)
    on = _greedy(model, prompts, 3, kv_dtype)
    assert len(ropes) == n_layers  # the prefill's only
    assert fused == [True] * (3 * n_layers)
    assert on[0] == off[0]
    for a, b in zip(on[1], off[1]):
        assert torch.equal(a, b)
