"""On the GPU: bf16 top-1 agreement of ``triton`` with ``torch_sdpa`` over the paged
scenarios of the parity tests (issue 10's bar: >= 0.99). Run by ``make test-gpu``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.kv_layout import KVCacheLayout
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
