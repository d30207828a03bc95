"""``bench offline`` on a mixture-of-experts model (CPU, ``random:tiny-qwen3-moe``): same
greedy outputs as transformers, a roofline that counts only the experts the batch routed
to (``PDSERVE_MOE_ROUTING_STATS``)."""

from __future__ import annotations

import json

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
