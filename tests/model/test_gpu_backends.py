"""On the GPU: bf16 top-1 agreement of ``triton`` with ``torch_sdpa`` over the paged
scenarios of the parity tests (issue 10's bar: >= 0.99). Run by ``make test-gpu``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM

# The parity tests' scenarios: (steps of per-sequence query lengths, page size).
SCENARIOS = [
    ([[5, 11, 1, 7], [1, 4, 1, 3], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], 3),
    ([[9, 2], [1, 1], [2, 1]], 1),
    ([[9, 2], [1, 1], [2, 1]], 16),
    ([[6, 3], [1, 1]], 4),
    ([[5, 11, 1], [1, 4, 1], [1, 1, 1], [1, 1, 1]], 3),
    ([[200, 37], [1, 1]] + [[1, 1]] * 30, 16),  # longer contexts: several decode splits
]


def scenario_logits(model, steps, page_size, seed):
    """fp32 logits of every new token of every step (rows in step order) over a scattered
    page pool; the same token streams and pages for a given seed."""
    s = model.shapes
    device = model.embed_tokens.device
    gen = torch.Generator().manual_seed(seed)
    n_seqs = len(steps[0])
    totals = [sum(step[b] for step in steps) for b in range(n_seqs)]
    seqs = [torch.randint(0, s.vocab, (n,), generator=gen) for n in totals]
    need = [math.ceil(n / page_size) for n in totals]
    perm = torch.randperm(sum(need) + 8, generator=gen).tolist()
    tables, used = [], 0
    for k in need:
        tables.append(perm[used : used + k])
        used += k
    lay = KVCacheLayout(
        "page_major", s.n_layers, s.n_kv_heads, s.head_dim, page_size, len(perm), model.dtype
    )
    kv = lay.layer_views(lay.allocate(device))
    done = [0] * n_seqs
    out = []
    for qlens in steps:
        seq_lens = [d + q for d, q in zip(done, qlens)]
        md = build_attention_metadata(qlens, seq_lens, tables, page_size, device=device)
        ids = torch.cat([seqs[b][done[b] : seq_lens[b]] for b in range(n_seqs)]).to(device)
        pos = torch.cat([torch.arange(done[b], seq_lens[b]) for b in range(n_seqs)]).to(device)
        plan = model.backend.plan(md, page_size)
        out.append(model.compute_logits(model(ids, pos, md, kv, plan)))
        done = seq_lens
    return torch.cat(out)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_triton_bf16_top1_agrees_with_sdpa(tiny_hf_builder):
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    same = total = 0
    for arch in ("llama", "qwen2", "qwen3"):
        hf = tiny_hf_builder(arch)
        models = {}
        for name in ("torch_sdpa", "triton"):
            models[name] = LlamaForCausalLM(hf.config, torch.bfloat16, "cuda", attn_backend=name)
            models[name].load_weights(hf.state_dict().items())
        for i, (steps, page_size) in enumerate(SCENARIOS):
            if max(sum(st[b] for st in steps) for b in range(len(steps[0]))) > 256:
                continue  # beyond the tiny models' context
            ref = scenario_logits(models["torch_sdpa"], steps, page_size, seed=i)
            got = scenario_logits(models["triton"], steps, page_size, seed=i)
            same += (ref.argmax(-1) == got.argmax(-1)).sum().item()
            total += ref.shape[0]
            assert (ref - got).abs().max().item() < 0.5, f"{arch} scenario {i}"
    assert total > 100
    assert same / total >= 0.99, f"top-1 agreement {same}/{total}"


DECODE_CONFIGS = [
    (1, 64, 4, 2, 0),  # one split: the kernel writes the output, no merge
    (1, 128, 8, 3, 0),
    (1, 32, 2, 1, 0),
    (2, 32, 2, 2, 0),  # merge kernel
    (2, 64, 4, 2, 256),  # a floor of 256 tokens a split: short rows use one (batch 64)
    (4, 64, 4, 2, 256),
    (32, 64, 4, 2, 0),  # batch 1
    (2, 16, 4, 2, 0, 0, False, 0, True),  # fp32 products and sums (fma), no dots
]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cfg", DECODE_CONFIGS)
def test_triton_decode_configs_match_fp32_attention_at_llama_shapes(cfg, monkeypatch):
    """Every decode configuration the backend may pick, on a page-major bf16 pool of
    128-token pages at Llama-8B head shapes (32 q / 8 KV heads, head_dim 128), rows of
    1-700 tokens and a padded row (context 0), captured in a CUDA graph and replayed twice:
    equal to fp32 attention within bf16 rounding."""
    from pdserve.model import triton_backend
    from pdserve.model.attention import AttentionMetadata, get_attention_backend

    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    config = triton_backend.DecodeConfig(*cfg)
    monkeypatch.setattr(triton_backend, "decode_config", lambda *a: config)
    Hq, Hkv, D, ps, L = 32, 8, 128, 128, 2
    gen = torch.Generator(device="cuda").manual_seed(sum(cfg[:4]))
    lens = [1, 127, 128, 129, 700, 300, 0, 255]
    pool = torch.randn(48, L, 2, Hkv, ps, D, device="cuda", generator=gen).bfloat16()
    kc, vc = pool[:, 1, 0].permute(0, 2, 1, 3), pool[:, 1, 1].permute(0, 2, 1, 3)
    perm = torch.randperm(48, device="cuda", generator=gen).to(torch.int32)
    table = perm[: len(lens) * 6].view(len(lens), 6).contiguous()
    q = torch.randn(len(lens), Hq, D, device="cuda", generator=gen).bfloat16()
    md = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device="cuda"),
        page_table=table,
        slot_mapping=torch.full((len(lens),), -1, dtype=torch.int64, device="cuda"),
    )
    tri = get_attention_backend("triton")
    plan = tri.plan_for_capture(md, ps)
    static = torch.empty(len(lens), Hq * D, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(len(lens), Hkv, D, device="cuda", dtype=torch.bfloat16)
    static.copy_(tri.forward(q, k, k, kc, vc, md, plan, D**-0.5, kv_stored=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(tri.forward(q, k, k, kc, vc, md, plan, D**-0.5, kv_stored=True))
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.zeros(len(lens), Hq, D, device="cuda")
    for b, s in enumerate(lens):
        if s == 0:
            continue
        pages = table[b, : math.ceil(s / ps)].long()
        kk = kc[pages].reshape(-1, Hkv, D)[:s].float().repeat_interleave(Hq // Hkv, 1)
        vv = vc[pages].reshape(-1, Hkv, D)[:s].float().repeat_interleave(Hq // Hkv, 1)
        w = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), kk) * D**-0.5, -1)
        ref[b] = torch.einsum("ht,thd->hd", w, vv)
    err = (static.view(len(lens), Hq, D).float() - ref).abs().max().item()
    assert err < 2e-2, f"{config}: max abs diff {err:.3e}"
