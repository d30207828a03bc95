"""``bench offline`` on a mixture-of-experts model (CPU, ``random:tiny-qwen3-moe``): same
greedy outputs as transformers, a roofline that counts only the experts the batch routed
to (``PDSERVE_MOE_ROUTING_STATS``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdserve.bench.roofline import unrouted_expert_bytes
from pdserve.cli import main
from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model import moe
from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import load_model_source

MODEL = "random:tiny-qwen3-moe"


def _offline(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    argv = ["bench", "offline", "--model", MODEL, "--device", "cpu", "--num-prompts", "1,3"]
    argv += ["--max-tokens", "4", "--repeats", "1", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_bench_offline_moe_roofline_counts_routed_experts(tmp_path, monkeypatch):
    every = _offline(tmp_path, "every")  # routing not counted: every expert's bytes
    monkeypatch.setenv("PDSERVE_MOE_ROUTING_STATS", "1")
    routed = _offline(tmp_path, "routed")
    for a, b in zip(every["results"], routed["results"]):
        assert b["identical_outputs"] == 1.0, "greedy MoE outputs differ from transformers"
        assert b["step_bytes"] < a["step_bytes"], "the routed experts are fewer than all"
    # 8 experts, 2 per token, 2 layers: at most 6 experts' bytes per layer left out
    s = load_model_source(MODEL).hf_config
    expert = 3 * s.moe_intermediate_size * s.hidden_size * 4  # fp32 on CPU
    for a, b in zip(every["results"], routed["results"]):
        assert a["step_bytes"] - b["step_bytes"] <= 2 * 6 * expert


def test_routing_stats_count_distinct_experts_per_forward_size(monkeypatch):
    """A one-token forward routes to exactly top_k experts per layer; the decode size of 1
    sequence reads that row, not a 5-token forward's (a prefill); the counters reset on read."""
    monkeypatch.setenv("PDSERVE_MOE_ROUTING_STATS", "1")
    src = load_model_source(MODEL)
    model = LlamaForCausalLM(src.hf_config, torch.float32, "cpu")
    model.load_weights(src.weights())
    s = model.shapes
    lay = KVCacheLayout("page_major", s.n_layers, s.n_kv_heads, s.head_dim, 4, 4, torch.float32)
    caches = lay.layer_views(lay.allocate("cpu"))
    prefill = build_attention_metadata([5], [5], [[0, 1]], 4)
    model(torch.tensor([7, 300, 9, 4000, 12]), torch.arange(5), prefill, caches)
    for pos in (5, 6):
        decode = build_attention_metadata([1], [pos + 1], [[0, 1]], 4)
        model(torch.tensor([7 + pos]), torch.tensor([pos]), decode, caches)
    blocks = [layer.moe for layer in model.decoder_layers()]
    assert moe.routed_experts(blocks, 1, reset=False) == s.top_k
    assert s.top_k < moe.routed_experts(blocks, 5, reset=False) <= s.n_experts
    per_expert = 3 * s.moe_intermediate * s.hidden * 4
    assert unrouted_expert_bytes(model, 1) == s.n_layers * (s.n_experts - s.top_k) * per_expert
    assert moe.routed_experts(blocks, 1) is None  # reset by the read above: nothing counted


def test_uniform_routing_replaces_the_router_with_a_fixed_table(monkeypatch):
    """``PDSERVE_MOE_ROUTING=uniform`` (benchmarks): every MoE layer routes by its own table
    (seeded by the layer's index: the same in every build), whatever the router says; the
    output is the experts' sum under that routing; a forward past the table cycles it."""
    monkeypatch.setenv("PDSERVE_MOE_ROUTING", "uniform")
    src = load_model_source(MODEL)
    models = []
    for _ in range(2):
        m = LlamaForCausalLM(src.hf_config, torch.float32, "cpu")
        m.load_weights(src.weights())
        models.append(m)
    blocks = [[layer.moe for layer in m.decoder_layers()] for m in models]
    s = models[0].shapes
    tables = [b.uniform_table for b in blocks[0]]
    assert all(t is not None and t.shape == (moe.UNIFORM_ROWS, s.n_experts) for t in tables)
    assert not torch.equal(tables[0], tables[1])  # each layer its own
    assert all(torch.equal(a.uniform_table, b.uniform_table) for a, b in zip(*blocks))
    block = blocks[0][1]
    x = torch.randn(6, s.hidden, generator=torch.Generator().manual_seed(0))
    weights, ids = moe.route(block.uniform_table[:6], s.top_k, s.norm_topk_prob)
    ref = moe.experts_loop(x, block.w13, block.w2, weights, ids)
    assert torch.equal(block(x), ref)
    assert torch.equal(block(x, logits=torch.full((6, s.n_experts), 9.0)), ref)  # ignored
    long = moe.uniform_logits(block.uniform_table, moe.UNIFORM_ROWS + 3)
    assert torch.equal(long[-3:], block.uniform_table[:3])
    monkeypatch.setenv("PDSERVE_MOE_ROUTING", "model")
    plain = LlamaForCausalLM(src.hf_config, torch.float32, "cpu")
    assert all(layer.moe.uniform_table is None for layer in plain.decoder_layers())
    monkeypatch.setenv("PDSERVE_MOE_ROUTING", "even")
    with pytest.raises(ValueError, match="PDSERVE_MOE_ROUTING"):
        LlamaForCausalLM(src.hf_config, torch.float32, "cpu")


@pytest.mark.timeout(300)
def test_bench_offline_moe_routing_flag(tmp_path, monkeypatch, capsys):
    """``bench offline --moe-routing uniform`` needs ``--ours-only`` (it changes the outputs:
    exit 2 naming the flag), labels the JSON, and leaves the process's environment as it
    was (the layers read it while the engine is built)."""
    monkeypatch.delenv("PDSERVE_MOE_ROUTING", raising=False)
    argv = ["bench", "offline", "--model", MODEL, "--device", "cpu", "--num-prompts", "2"]
    assert main([*argv, "--moe-routing", "uniform"]) == 2
    assert "--moe-routing uniform" in capsys.readouterr().err
    out = _offline(tmp_path, "uniform", "--ours-only", "--moe-routing", "uniform")
    assert out["moe_routing"] == "uniform"
    assert "PDSERVE_MOE_ROUTING" not in os.environ
    assert _offline(tmp_path, "model", "--ours-only")["moe_routing"] == "model"
