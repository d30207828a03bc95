"""A Qwen3-MoE GGUF file written here (``gguf``'s writer, llama.cpp's tensor names:
``blk.N.ffn_gate_inp`` / ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, the
SmolLM2 byte-level BPE vocabulary) loads through pdserve's cached conversion, gets the
expert size from ``qwen3moe.expert_feed_forward_length`` (transformers' config mapping
drops that key; its default, 768, would not fit), and matches the transformers model it
was written from: the same weights, greedy tokens equal and logits within 1e-4.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from test_moe import TOL, hf_greedy
from tp_model_ranks import PROMPTS, greedy_paged

from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import embedded_tokenizer, load_model_source, model_config
from pdserve.model.shapes import ModelShapes
from tiny_models import random_tiny_model

CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,  # not transformers' default (768): the GGUF key must be read
    num_experts=6,
    num_experts_per_tok=2,
    norm_topk_prob=True,  # what llama.cpp's qwen3moe graph does (and transformers assumes)
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# llama.cpp's per-layer names for Qwen3-MoE (gguf.MODEL_ARCH.QWEN3MOE)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate.weight": "ffn_gate_inp",
}


def write_qwen3_moe_gguf(path, hf, tokenizer) -> None:
    """``hf`` (a ``Qwen3MoeForCausalLM``) as an F32 GGUF of architecture ``qwen3moe``."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("tiny-qwen3-moe-test")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    # the byte-level BPE vocabulary, in id order, and its merges
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert len(tokens) == c.vocab_size
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    inter = c.moe_intermediate_size
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf_name, gg in LAYER_NAMES.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[pre + hf_name])
        gate_up = sd[pre + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[pre + "mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.timeout(300)
def test_gguf_moe_file_loads_and_matches_transformers(tmp_path, monkeypatch):
    tokenizer = embedded_tokenizer()  # before the cache moves: it is saved under the cache
    hf = random_tiny_model(transformers.Qwen3MoeConfig(**CONFIG), seed=2)
    path = tmp_path / "tiny-qwen3-moe.gguf"
    write_qwen3_moe_gguf(path, hf, tokenizer)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))

    cfg = model_config(str(path))  # read from the GGUF's metadata, before any conversion
    assert cfg.model_type == "qwen3_moe" and cfg.moe_intermediate_size == 24
    src = load_model_source(str(path))
    s = ModelShapes(src.hf_config)
    assert (s.n_experts, s.top_k, s.total_moe_intermediate, s.norm_topk_prob) == (6, 2, 24, True)
    weights = dict(src.weights())
    assert "model.layers.1.mlp.experts.gate_up_proj" in weights  # transformers' fused names
    model = LlamaForCausalLM(src.hf_config, torch.float32, "cpu")
    model.load_weights(weights.items())
    block = model.layers[1].moe
    ref = hf.state_dict()
    assert torch.equal(block.w13, ref["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(block.w2, ref["model.layers.1.mlp.experts.down_proj"])
    assert torch.equal(block.gate, ref["model.layers.1.mlp.gate.weight"])

    tokens, logits = greedy_paged(model, PROMPTS, 4)
    ref_tokens, ref_logits = hf_greedy(hf, PROMPTS, 4)
    assert tokens == ref_tokens
    for step, (got, want) in enumerate(zip(logits, ref_logits)):
        err = (got - want).abs().max().item()
        assert err < TOL, f"step {step}: max |logit diff| {err:.2e}"
    # the GGUF's tokenizer came through the conversion
    assert src.tokenizer.encode("Hello world") == tokenizer.encode("Hello world")
