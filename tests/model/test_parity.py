"""Logit parity of LlamaForCausalLM with transformers (fp32) through the paged KV cache."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pdserve.engine.kv.layout import KV_ORDERS, KVCacheLayout
from pdserve.model import linear as lin
from pdserve.model.attention import AttentionMetadata, build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import load_model_source

TOL = 1e-4  # max |log_softmax(ours) - log_softmax(transformers)|


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run_paged_scenario(
    model,
    hf,
    steps,
    prompt_lens,
    page_size,
    seed=0,
    host_lens=True,
    kv_order="page_major",
    skip=None,
):
    """Feed token streams through ``model`` step by step (``steps``: query length of each
    sequence per step) over a shuffled, scattered page pool laid out in ``kv_order``;
    compare every new token's log-probs with ``hf`` (fp32, CPU) run on the whole prefix.
    ``skip(seq) -> set of positions`` (optional, called once per sequence with its whole
    token tensor): positions left out of the comparison. Returns the max abs difference."""
    s = model.shapes
    device, dtype = model.embed_tokens.device, model.dtype
    gen = torch.Generator().manual_seed(seed)
    totals = [sum(step[b] for step in steps) for b in range(len(prompt_lens))]
    seqs = [torch.randint(0, s.vocab, (n,), generator=gen) for n in totals]
    skipped = [skip(seq) if skip else set() for seq in seqs]
    num_pages = 64
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for n in totals:  # each sequence gets exactly the pages it needs, scattered over the pool
        need = math.ceil(n / page_size)
        tables.append(perm[used : used + need])
        used += need
    lay = KVCacheLayout(kv_order, s.n_layers, s.n_kv_heads, s.head_dim, page_size, num_pages, dtype)
    kv = lay.allocate(device)
    caches = lay.layer_views(kv)
    done = [0] * len(prompt_lens)
    err = 0.0
    for i, qlens in enumerate(steps):
        seq_lens = [d + q for d, q in zip(done, qlens)]
        md = build_attention_metadata(qlens, seq_lens, tables, page_size, device=device)
        if not host_lens or i % 2:  # the plan must also work from the device tensors alone
            md = dataclasses.replace(md, query_lens_host=None, seq_lens_host=None)
        ids = torch.cat([seqs[b][done[b] : seq_lens[b]] for b in range(len(qlens))])
        pos = torch.cat([torch.arange(done[b], seq_lens[b]) for b in range(len(qlens))])
        lp = torch.log_softmax(
            model.compute_logits(model(ids.to(device), pos.to(device), md, caches)), dim=-1
        ).cpu()
        row = 0
        for b, q in enumerate(qlens):
            with torch.no_grad():
                ref = torch.log_softmax(
                    hf(seqs[b][None, : seq_lens[b]]).logits[0, done[b] :].float(), dim=-1
                )
            keep = [p - done[b] for p in range(done[b], seq_lens[b]) if p not in skipped[b]]
            if keep:
                err = max(err, (lp[row : row + q][keep] - ref[keep]).abs().max().item())
            row += q
        done = seq_lens
    unused = sorted(set(range(num_pages)) - {p for t in tables for p in t})
    if unused:
        written = lay.pages(kv, unused).abs().max().item()
        assert written == 0.0, "K/V written outside the sequences' pages"
    return err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kv_order", KV_ORDERS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_parity_prefill_mixed_decode(arch, kv_order, tiny_dir):
    folder, hf = tiny_dir(arch)
    src = load_model_source(folder)
    model = LlamaForCausalLM(src.hf_config, torch.float32, "cpu")
    model.load_weights(src.weights())
    prompt_lens = [5, 11, 1, 7]
    steps = [
        prompt_lens,  # prefill of mixed lengths; the 1-token prompt takes the batched decode path
        [1, 4, 1, 3],  # mixed: decodes + chunked prefill over a cached prefix
        [1, 1, 1, 1],
        [1, 1, 1, 1],
        [1, 1, 1, 1],  # decode-only
    ]
    err = run_paged_scenario(model, hf, steps, prompt_lens, page_size=3, kv_order=kv_order)
    assert err < TOL, f"{arch} {kv_order}: max log-prob diff {err:.2e}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kv_order", KV_ORDERS)
def test_parity_page_size_one_and_large(kv_order, tiny_dir):
    folder, hf = tiny_dir("llama")
    model = LlamaForCausalLM(load_model_source(folder).hf_config, torch.float32, "cpu")
    model.load_weights(hf.state_dict().items())
    for page_size in (1, 16):
        steps = [[9, 2], [1, 1], [2, 1]]
        err = run_paged_scenario(
            model,
            hf,
            steps,
            [9, 2],
            page_size=page_size,
            seed=page_size,
            host_lens=False,
            kv_order=kv_order,
        )
        assert err < TOL, f"page_size {page_size} {kv_order}: max log-prob diff {err:.2e}"


def test_attention_metadata_builder():
    md = build_attention_metadata([3, 1], [3, 6], [[7], [2, 5]], page_size=4)
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert md.seq_lens.tolist() == [3, 6]
    assert md.page_table.dtype == torch.int32 and md.page_table.tolist() == [[7, 0], [2, 5]]
    assert md.slot_mapping.dtype == torch.int64
    assert md.slot_mapping.tolist() == [28, 29, 30, 5 * 4 + 1]  # seq 1's token at position 5
    assert md.max_seq_len == 6 and not md.is_decode_only
    bare = AttentionMetadata(md.query_start_loc, md.seq_lens, md.page_table, md.slot_mapping)
    assert bare.host_lens() == ((3, 1), (3, 6))
    with pytest.raises(ValueError, match="page_tables"):
        build_attention_metadata([1], [9], [[0, 1]], page_size=4)
    with pytest.raises(ValueError, match="query_len"):
        build_attention_metadata([0], [0], [[0]], page_size=4)
    with pytest.raises(ValueError, match="one entry per sequence"):
        build_attention_metadata([1, 1], [1], [[0]], page_size=4)


def test_load_weights_rejects_bad_names_and_shapes(tiny_dir):
    folder, hf = tiny_dir("qwen2")
    model = LlamaForCausalLM(hf.config, torch.float32, "cpu")
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.bias"):
        model.load_weights(
            (k, v) for k, v in state.items() if k != "model.layers.0.self_attn.q_proj.bias"
        )
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(bad.items())
    with pytest.raises(ValueError, match="model.bogus"):
        model.load_weights([("model.bogus", torch.ones(1))])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "packed, dtype, tol",
    [
        ("all", torch.float32, TOL),
        ("none", torch.float32, TOL),
        ("auto", torch.bfloat16, 0.15),
        ("none", torch.bfloat16, 0.15),
    ],
)
def test_parity_packed_and_plain_linear_and_reload(
    packed, dtype, tol, tiny_dir, tiny_hf_builder, monkeypatch
):
    """Both the CPU pre-packed linear path and plain F.linear match; weights can be reloaded."""
    monkeypatch.setenv("PDSERVE_CPU_PACKED_LINEAR", packed)
    folder, hf = tiny_dir("qwen3")
    model = LlamaForCausalLM(hf.config, dtype, "cpu")
    model.load_weights(
        tiny_hf_builder("qwen3", seed=5).state_dict().items()
    )  # other weights first ...
    model.load_weights(hf.state_dict().items())  # ... then the real ones (after packing)
    assert bool(model.layers[0].packed) == (
        packed != "none" and lin.packing_supported(torch.ones(1, 1, dtype=dtype), packed)
    )
    err = run_paged_scenario(model, hf, [[6, 3], [1, 1]], [6, 3], page_size=4, seed=3)
    assert err < tol, f"packed={packed} {dtype}: max log-prob diff {err:.2e}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, 0.15)])
def test_parity_on_device(device, dtype, tol, tiny_hf_builder):
    """Each architecture on each available device; bf16 against the fp32 reference (a loose
    bound that still catches a wrong bias, norm or rotation, which cost O(1))."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    for arch in ("llama", "qwen2", "qwen3"):
        hf = tiny_hf_builder(arch)
        model = LlamaForCausalLM(hf.config, dtype, device)
        model.load_weights(hf.state_dict().items())
        steps = [[5, 11, 1], [1, 4, 1], [1, 1, 1], [1, 1, 1]]
        for kv_order in KV_ORDERS:
            err = run_paged_scenario(
                model, hf, steps, [5, 11, 1], page_size=3, seed=7, kv_order=kv_order
            )
            assert err < tol, f"{arch} {device} {dtype} {kv_order}: max log-prob diff {err:.2e}"
