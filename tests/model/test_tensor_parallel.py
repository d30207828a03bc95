"""Tensor-parallel LlamaForCausalLM: TP=2 / TP=4 gloo ranks (spawned processes, CPU) against
TP=1 over a paged KV cache, and the per-rank weight slices.

Tiny random-weight models (every parameter random, biases included) so a wrong split, a
bias added twice or a misplaced head shows in the logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tp_model_ranks import PROMPTS, greedy_paged, rank_many, rank_raise, run_ranks

from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import embedded_tokenizer, load_model_source
from pdserve.model.tp_group import TPGroup
from pdserve.parallel import TPRank
from tiny_models import random_tiny_model

DECODE_STEPS = 4
LOGIT_TOL = 1e-4  # fp32: only the order of the row-parallel sums differs

# Row biases (o_proj, down_proj) must be added once; an odd vocabulary pads the last shard.
BIAS_ODD_VOCAB = dict(
    vocab_size=509,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attention_bias=True,
    mlp_bias=True,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def folders(tiny_dir, tmp_path_factory):
    """arch -> folder: conftest's llama (GQA 4/2, tied), qwen2 (q/k/v bias, 1 KV head),
    qwen3 (q/k norm), plus a Llama with o_proj/MLP biases and a 509-token vocabulary."""
    out = {arch: tiny_dir(arch)[0] for arch in ("llama", "qwen2", "qwen3")}
    folder = tmp_path_factory.mktemp("tiny-bias-odd-vocab")
    random_tiny_model(transformers.LlamaConfig(**BIAS_ODD_VOCAB), seed=3).save_pretrained(folder)
    embedded_tokenizer().save_pretrained(folder)
    out["llama_bias_odd_vocab"] = str(folder)
    return out


def _reference(folder: str, packed: str | None = None):
    src = load_model_source(folder)
    model = LlamaForCausalLM(src.hf_config, torch.float32, "cpu")
    with pytest.MonkeyPatch.context() as mp:
        if packed is not None:
            mp.setenv("PDSERVE_CPU_PACKED_LINEAR", packed)
        model.load_weights(src.weights())
    return greedy_paged(model, PROMPTS, DECODE_STEPS)


def _check_parity(name, ref, per_rank):
    ref_tokens, ref_logits = ref
    for rank, (tokens, logits, _) in enumerate(per_rank):
        assert tokens == ref_tokens, f"{name} rank {rank}: greedy tokens differ"
        for step, (got, want) in enumerate(zip(logits, ref_logits)):
            assert got.shape == want.shape, f"{name} step {step}: logits {tuple(got.shape)}"
            err = (got - want).abs().max().item()
            assert err < LOGIT_TOL, f"{name} rank {rank} step {step}: max |logit diff| {err:.2e}"
            assert torch.equal(got, per_rank[0][1][step]), f"{name}: ranks' logits differ"


TP2_ARCHS = ["llama", "qwen2", "qwen3", "llama_bias_odd_vocab"]
PACKED = "llama_bias_odd_vocab"  # also run with fp32 oneDNN-packed linears


@pytest.fixture(scope="module")
def tp2_runs(folders):
    """One 2-rank group runs every model (qwen2 from full tensors, the rest sliced), then
    the packed-linear case; ``(runs by name, collectives per rank)``."""
    names = TP2_ARCHS + ["packed"]
    jobs = [(folders[a], a != "qwen2", None) for a in TP2_ARCHS]
    per_rank = run_ranks(2, rank_many, jobs + [(folders[PACKED], True, "all")])
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}, [r[-1] for r in per_rank]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", TP2_ARCHS)
def test_tp2_greedy_equals_tp1(arch, folders, tp2_runs):
    runs, _ = tp2_runs
    _check_parity(arch, _reference(folders[arch]), runs[arch])
    facts = [f for _, _, f in runs[arch]]
    total_kv = facts[0]["total_kv_heads"]
    if total_kv >= 2:  # split: each rank its half of the KV heads
        assert [f["kv_head_range"] for f in facts] == [
            (0, total_kv // 2),
            (total_kv // 2, total_kv),
        ]
    else:  # qwen2 has 1 KV head: replicated on both ranks
        assert [f["kv_head_range"] for f in facts] == [(0, 1), (0, 1)]
    assert all(f["n_heads"] == 2 for f in facts)  # 4 query heads over 2 ranks
    vocab = len(runs[arch][0][1][0][0])
    assert all(f["empty_logits"] == (0, vocab) for f in facts)  # no rows: no gather, no hang


@pytest.mark.timeout(300)
def test_tp2_packed_cpu_linear(folders, tp2_runs):
    """PDSERVE_CPU_PACKED_LINEAR=all: each rank packs its shard (the padded LM head too)."""
    runs, _ = tp2_runs
    assert all(f["packed"] for _, _, f in runs["packed"]), "the ranks packed no linear"
    _check_parity("packed", _reference(folders[PACKED], packed="all"), runs["packed"])


@pytest.mark.timeout(300)
def test_tp2_collectives(tp2_runs):
    _, coll = tp2_runs
    for summed, cols, rows in coll:
        assert summed == [3.0, 3.0, 3.0]
        assert cols == [[0.0, 1.0], [0.0, 1.0]]
        assert rows == [[0.0, 0.0], [1.0, 1.0]]


@pytest.mark.timeout(300)
def test_tp4_replicates_kv_heads(folders):
    """TP=4 over 2 KV heads: each KV head on two ranks; the 509-token vocabulary splits
    128/128/128/125 (the last shard padded)."""
    archs = ["llama", "llama_bias_odd_vocab"]
    per_rank = run_ranks(4, rank_many, [(folders[a], True, None) for a in archs])
    for i, arch in enumerate(archs):
        runs = [r[i] for r in per_rank]
        _check_parity(f"{arch} tp4", _reference(folders[arch]), runs)
        facts = [f for _, _, f in runs]
        assert [f["kv_head_range"] for f in facts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
        assert all(f["n_kv_heads"] == 1 and f["n_heads"] == 1 for f in facts)
    assert [r[1][2]["embed_rows"] for r in per_rank] == [128] * 4


@pytest.mark.timeout(600)
def test_embedded_model_tp3_equals_tp1(embedded_source):
    """The real SmolLM2-135M (9 query heads, 3 KV heads: TP 3, not 2) at TP 3, each rank
    reading its slices of the converted safetensors, greedy-equal to TP 1."""
    model_id = embedded_source.model_id
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible by"):
        LlamaForCausalLM(embedded_source.hf_config, torch.float32, "meta", tp=TPGroup(TPRank(0, 2)))
    per_rank = run_ranks(3, rank_many, [(model_id, True, None)])
    runs = [r[0] for r in per_rank]
    _check_parity("smollm2 tp3", _reference(model_id), runs)
    assert [f["kv_head_range"] for _, _, f in runs] == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.timeout(120)
def test_rank_exception_fails_the_test():
    with pytest.raises(AssertionError, match=r"rank 1 raised:[\s\S]*ValueError: boom from rank 1"):
        run_ranks(2, rank_raise)


# ------------------------------------------------------------------ in-process (no collectives)
def _rank_model(folder, rank, size, sliced=True):
    src = load_model_source(folder)
    model = LlamaForCausalLM(src.hf_config, torch.float32, "cpu", tp=TPGroup(TPRank(rank, size)))
    model.load_weights(src.weights(shard=model.weight_shard if sliced else None))
    return model


@pytest.mark.parametrize("arch", ["qwen2", "llama_bias_odd_vocab"])
def test_rank_weights_are_the_slices_of_the_checkpoint(arch, folders):
    """Each rank's fused parameters hold exactly its rows/columns of the HF tensors, read
    sliced from safetensors or narrowed from full tensors alike."""
    folder = folders[arch]
    hf = dict(load_model_source(folder).weights())
    size = 2
    for rank in range(size):
        model = _rank_model(folder, rank, size)
        full_read = _rank_model(folder, rank, size, sliced=False)
        for (name, a), b in zip(model.state_dict().items(), full_read.state_dict().values()):
            assert torch.equal(a, b), f"rank {rank} {name}: sliced read differs from full read"
        s, D = model.shapes, model.shapes.head_dim
        layer = next(model.decoder_layers())
        pre = "model.layers.0."
        q0, q1 = s.head_range
        k0, k1 = s.kv_head_range
        i0, i1 = s.intermediate_range
        v0, v1 = s.vocab_range
        nq, nkv = s.n_heads * D, s.n_kv_heads * D
        assert torch.equal(
            layer.qkv_proj[:nq], hf[pre + "self_attn.q_proj.weight"][q0 * D : q1 * D]
        )
        assert torch.equal(
            layer.qkv_proj[nq + nkv :], hf[pre + "self_attn.v_proj.weight"][k0 * D : k1 * D]
        )
        assert torch.equal(layer.o_proj, hf[pre + "self_attn.o_proj.weight"][:, q0 * D : q1 * D])
        assert torch.equal(layer.down_proj, hf[pre + "mlp.down_proj.weight"][:, i0:i1])
        assert torch.equal(
            layer.gate_up_proj[s.intermediate :], hf[pre + "mlp.up_proj.weight"][i0:i1]
        )
        assert torch.equal(model.embed_tokens[: v1 - v0], hf["model.embed_tokens.weight"][v0:v1])
        assert not model.embed_tokens[v1 - v0 :].any(), "padded vocab rows must be zero"
        if layer.qkv_bias is not None:
            assert torch.equal(
                layer.qkv_bias[nq : nq + nkv], hf[pre + "self_attn.k_proj.bias"][k0 * D : k1 * D]
            )
        if layer.o_bias is not None:  # row-parallel bias: whole on every rank
            assert torch.equal(layer.o_bias, hf[pre + "self_attn.o_proj.bias"])


def test_sliced_source_yields_only_the_rank_share(folders):
    src = load_model_source(folders["llama"])
    model = LlamaForCausalLM(src.hf_config, torch.float32, "meta", tp=TPGroup(TPRank(1, 2)))
    shapes = {n: tuple(t.shape) for n, t in src.weights(shard=model.weight_shard)}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads x 16
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (48, 64)
    assert shapes["model.embed_tokens.weight"] == (256, 64)
    assert shapes["model.norm.weight"] == (64,)


def test_random_source_shards(tmp_path):
    """``random:`` weights draw the full tensor (same values on every rank), then narrow."""
    src = load_model_source("random:tiny")
    full = dict(src.weights())
    model = LlamaForCausalLM(src.hf_config, torch.float32, "cpu", tp=TPGroup(TPRank(1, 2)))
    model.load_weights(src.weights(shard=model.weight_shard))
    layer = next(model.decoder_layers())
    i0, i1 = model.shapes.intermediate_range
    assert torch.equal(layer.down_proj, full["model.layers.0.mlp.down_proj.weight"][:, i0:i1])


@pytest.mark.parametrize(
    "overrides, size, message",
    [
        (
            dict(num_attention_heads=4, num_key_value_heads=2),
            3,
            "num_attention_heads=4 is not divisible by tensor_parallel_size=3",
        ),
        (
            dict(num_attention_heads=6, num_key_value_heads=3),
            2,
            "num_key_value_heads=3 is not divisible by tensor_parallel_size=2",
        ),
        (
            dict(num_attention_heads=12, num_key_value_heads=3),
            4,
            "tensor_parallel_size=4 is neither a divisor nor a multiple of num_key_value_heads=3",
        ),
        (
            dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=90),
            4,
            "intermediate_size=90 is not divisible by tensor_parallel_size=4",
        ),
    ],
)
def test_indivisible_sizes_name_the_field(overrides, size, message):
    cfg = transformers.LlamaConfig(
        **{**BIAS_ODD_VOCAB, "hidden_size": 48, "head_dim": 8, **overrides}
    )
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(cfg, torch.float32, "meta", tp=TPGroup(TPRank(0, size)))


def test_single_group_is_a_no_op():
    g = TPGroup.single()
    t = torch.arange(4.0)
    assert g.all_reduce_(t) is t and g.all_gather(t) is t and (g.rank, g.size) == (0, 1)
    with pytest.raises(RuntimeError, match="not initialised"):
        TPGroup.from_torch_distributed()
