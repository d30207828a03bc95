"""FP8 weights (``pdserve/model/fp8.py``): checkpoints of the three published layouts, written
here at tiny shapes with the real tensor names and config keys, load and match a reference
that holds the dequantized weights; online quantization (``quantization="fp8"``) likewise;
tensor-parallel ranks take their rows and scale groups; excluded modules, embeddings, LM
head and norms stay high precision; KV-cache scales are read."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from test_parity import TOL, run_paged_scenario

from pdserve.model import fp8
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import embedded_tokenizer, load_model_source
from pdserve.model.tp_group import TPGroup
from pdserve.parallel import TPRank

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

# Each format: its quantization_config as the producing tool writes it, and how the test
# quantizes a weight: (kind, scale tensor name, scale shape of a per-tensor scale).
CT_GROUP = {"targets": ["Linear"]}
FORMATS = {
    # AutoFP8 / vLLM "fp8": one scale per tensor (shape []), static activation scales
    "tensor": {
        "config": {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "ignored_layers": ["lm_head", "model.layers.1.mlp.down_proj"],
        },
        "kind": "tensor",
        "scale_name": "weight_scale",
        "input_scale": True,
    },
    # compressed-tensors FP8_DYNAMIC: one scale per output channel [out, 1], per-token
    # dynamic activations (no input_scale)
    "channel": {
        "config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    **CT_GROUP,
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel",
                        "dynamic": False,
                        "symmetric": True,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                        "symmetric": True,
                    },
                }
            },
            "ignore": ["lm_head", "re:.*layers\\.0\\.mlp\\.down_proj$"],
        },
        "kind": "channel",
        "scale_name": "weight_scale",
        "input_scale": False,
    },
    # transformers' fine-grained FP8 (Qwen3-FP8, DeepSeek-V3): 2-D block scales
    # weight_scale_inv [ceil(out / bn), ceil(in / bk)]; 32 x 16 blocks so that the tiny
    # shapes span several blocks (a ragged last one of qwen3's 160 q|k|v rows... and the
    # 48 intermediate columns of a TP rank start on a block)
    "block": {
        "config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [32, 16],
            "modules_to_not_convert": ["lm_head"],
        },
        "kind": "block",
        "scale_name": "weight_scale_inv",
        "input_scale": False,
    },
    # the published 128 x 128 blocks: every tiny tensor is one (ragged) block
    "block128": {
        "config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
        "kind": "block",
        "scale_name": "weight_scale_inv",
        "input_scale": False,
    },
}


def _excluded(scheme: fp8.Fp8Scheme, module: str) -> bool:
    return not scheme.quantized(module)


def write_fp8_checkpoint(folder, hf, fmt: str, kv_scales: bool = False) -> None:
    """Save ``hf`` (fp32 transformers model) as an FP8 checkpoint of format ``fmt`` into
    ``folder`` and put the dequantized weights back into ``hf`` (the reference)."""
    spec = FORMATS[fmt]
    cfg = hf.config
    cfg.quantization_config = spec["config"]
    scheme = fp8.scheme_from_config(cfg)
    tensors: dict[str, torch.Tensor] = {}
    params = dict(hf.named_parameters())
    for name, w in hf.state_dict().items():
        module = name.rsplit(".", 1)[0]
        is_linear = name.endswith(".weight") and module.split(".", 3)[-1] in LINEARS
        if not is_linear or _excluded(scheme, module):
            tensors[name] = w.detach().clone().contiguous()
            continue
        if spec["kind"] == "tensor":
            q, s = fp8.quantize_tensor(w)
            deq = q.float() * s
        elif spec["kind"] == "channel":
            q, s = fp8.quantize_per_channel(w)
            deq = q.float() * s
        else:
            block = tuple(spec["config"]["weight_block_size"])
            q, s = fp8.quantize_block(w, block)
            rows = s.repeat_interleave(block[0], 0)[: w.shape[0]]
            deq = q.float() * rows.repeat_interleave(block[1], 1)[:, : w.shape[1]]
        tensors[name] = q
        tensors[f"{module}.{spec['scale_name']}"] = s
        if spec["input_scale"]:
            tensors[f"{module}.input_scale"] = torch.tensor(0.02)
        with torch.no_grad():
            params[name].copy_(deq)
    if kv_scales:
        for i in range(cfg.num_hidden_layers):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25 + i)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    cfg.save_pretrained(folder)
    embedded_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory, tiny_hf_builder):
    """``fp8_dir(arch, fmt)`` -> (folder of the FP8 checkpoint, reference HF model)."""
    cache = {}

    def get(arch: str, fmt: str, kv_scales: bool = False):
        key = (arch, fmt, kv_scales)
        if key not in cache:
            hf = tiny_hf_builder(arch)
            folder = str(tmp_path_factory.mktemp(f"fp8-{arch}-{fmt}"))
            write_fp8_checkpoint(folder, hf, fmt, kv_scales)
            cache[key] = (folder, hf)
        return cache[key]

    return get


def _load(folder: str, dtype=torch.float32, tp=None, quantization=None) -> LlamaForCausalLM:
    src = load_model_source(folder)
    model = LlamaForCausalLM(src.hf_config, dtype, "cpu", tp=tp, quantization=quantization)
    model.load_weights(src.weights(shard=model.weight_shard) if tp else src.weights())
    return model


STEPS = [[7, 5], [1, 3], [1, 1], [1, 1]]  # prefill, chunk + decode, decodes


@pytest.mark.parametrize(
    "arch,fmt",
    [("llama", f) for f in ("tensor", "channel", "block", "block128")]
    + [("qwen2", "tensor"), ("qwen3", "block")],  # untied head + biases; head_dim 32
)
def test_fp8_checkpoint_matches_dequantized_reference(arch, fmt, fp8_dir):
    folder, hf = fp8_dir(arch, fmt)
    model = _load(folder)
    scheme = model.fp8_scheme
    assert scheme is not None and scheme.source == "checkpoint"
    for i, layer in enumerate(model.decoder_layers()):
        for name in fp8.FUSED_MODULES:
            excluded = _excluded(scheme, f"model.layers.{i}.{fp8.FUSED_MODULES[name][0]}")
            if excluded:  # stays high precision, no FP8 entry
                assert name not in layer.fp8 and getattr(layer, name).dtype == torch.float32
            else:
                assert layer.fp8[name].weight.dtype == torch.float8_e4m3fn
        assert layer.input_layernorm.dtype == torch.float32
    assert model.embed_tokens.dtype == torch.float32
    if model.lm_head is not None:
        assert model.lm_head.dtype == torch.float32
    if fmt == "tensor":  # static input scales are read (max over the fused parts)
        layer0 = next(model.decoder_layers())
        assert float(layer0.fp8["qkv_proj"].input_scale) == pytest.approx(0.02)
    err = run_paged_scenario(model, hf, STEPS, [12, 8], page_size=4)
    assert err < TOL, f"{arch}/{fmt}: max |dlogprob| {err}"


def test_fp8_checkpoint_in_bf16_close_to_reference(fp8_dir):
    folder, hf = fp8_dir("llama", "block")
    model = _load(folder, dtype=torch.bfloat16)
    err = run_paged_scenario(model, hf, STEPS, [12, 8], page_size=4)
    assert err < 0.15, err  # bf16 activations against the fp32 dequantized reference


@pytest.mark.parametrize("fmt", ["tensor", "channel", "block", "block128"])
def test_fp8_checkpoint_sharded_per_tp_rank(fmt, fp8_dir):
    """Each of 2 ranks reads only its slice from disk; its dequantized rows/columns equal
    the same slice of the whole model's (rows of q/k/v/gate/up, columns of o/down)."""
    folder, _ = fp8_dir("llama", fmt)
    whole = _load(folder)
    for rank in range(2):
        part = _load(folder, tp=TPGroup(TPRank(rank, 2)))
        s = part.shapes
        for lw, lp in zip(whole.decoder_layers(), part.decoder_layers()):
            for name in fp8.FUSED_MODULES:
                if name not in lw.fp8:
                    continue
                full = lw.fp8[name].dequantize()
                got = lp.fp8[name].dequantize()
                D = s.head_dim
                if name == "o_proj":
                    want = full[:, s.head_range[0] * D : s.head_range[1] * D]
                elif name == "down_proj":
                    want = full[:, s.intermediate_range[0] : s.intermediate_range[1]]
                elif name == "gate_up_proj":
                    i0, i1 = s.intermediate_range
                    I = s.total_intermediate
                    want = torch.cat((full[i0:i1], full[I + i0 : I + i1]))
                else:
                    nq, nkv = s.total_heads * D, s.total_kv_heads * D
                    q0, q1 = (h * D for h in s.head_range)
                    k0, k1 = (h * D for h in s.kv_head_range)
                    want = torch.cat(
                        (full[q0:q1], full[nq + k0 : nq + k1], full[nq + nkv + k0 : nq + nkv + k1])
                    )
                assert torch.equal(got, want), (fmt, rank, name)


def test_block_not_fitting_a_tp_rank_is_refused(fp8_dir):
    """32-column blocks over 96 intermediate columns: rank 1 of 2 starts at column 48,
    inside a block (128-column blocks would be one block: that loads, see above)."""
    FORMATS["block32"] = {**FORMATS["block"], "config": dict(FORMATS["block"]["config"])}
    FORMATS["block32"]["config"]["weight_block_size"] = [32, 32]
    folder, _ = fp8_dir("llama", "block32")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _load(folder, tp=TPGroup(TPRank(1, 2)))


def test_kv_scales_read_from_checkpoint(fp8_dir):
    folder, _ = fp8_dir("llama", "channel", kv_scales=True)
    model = _load(folder)
    assert model.kv_scales == ((0.5, 0.25), (1.5, 1.25))
    plain = _load(fp8_dir("llama", "channel")[0])
    assert plain.kv_scales == ((1.0, 1.0), (1.0, 1.0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_online_quantization_matches_per_channel_reference(arch, tiny_dir, tiny_hf_builder):
    folder, _ = tiny_dir(arch)
    model = _load(folder, quantization="fp8")
    ref = tiny_hf_builder(arch)  # the same weights, each linear replaced by its e4m3 copy
    with torch.no_grad():
        for name, p in ref.named_parameters():
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module.split(".", 3)[-1] in LINEARS:
                q, s = fp8.quantize_per_channel(p)
                p.copy_(q.float() * s)
    for layer in model.decoder_layers():
        assert set(layer.fp8) == set(fp8.FUSED_MODULES)
        for name, w in layer.fp8.items():
            assert w.weight.dtype == torch.float8_e4m3fn and w.scale.shape[1] == 1
            assert getattr(layer, name).dtype == torch.float8_e4m3fn  # no high-precision copy
    assert model.embed_tokens.dtype == torch.float32
    err = run_paged_scenario(model, ref, STEPS, [12, 8], page_size=4)
    assert err < TOL, err
    # and it stays close to the unquantized model (e4m3 keeps ~2 significant digits)
    assert run_paged_scenario(model, tiny_hf_builder(arch), STEPS, [12, 8], page_size=4) < 0.5
    # loading again (the weights arrive in the model dtype) quantizes again
    model.load_weights(load_model_source(folder).weights())
    assert run_paged_scenario(model, ref, STEPS, [12, 8], page_size=4) < TOL


def test_scheme_errors_name_the_key(tiny_hf_builder):
    cfg = tiny_hf_builder("llama").config
    cfg.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match="quant_method"):
        fp8.scheme_from_config(cfg)
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128]}
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8.scheme_from_config(cfg)
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 8]}
    with pytest.raises(ValueError, match=r"weight_block_size: \[bn, bk\] = \[128, 8\]"):
        fp8.scheme_from_config(cfg)  # a K tile of 8 has no CUDA tl.dot
    w = {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 8]}
    cfg.quantization_config = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"weights": w}},
    }
    with pytest.raises(ValueError, match="block_structure"):
        fp8.scheme_from_config(cfg)
    cfg.quantization_config = {
        "quant_method": "fp8",
        "ignored_layers": ["model.layers.0.self_attn.q_proj"],
    }
    with pytest.raises(ValueError, match="fused projection"):
        LlamaForCausalLM(cfg, torch.float32, "meta")
    with pytest.raises(ValueError, match="quantization"):
        fp8.scheme_from_config(tiny_hf_builder("llama").config, "int4")


def test_missing_scale_is_named(tmp_path, fp8_dir):
    folder, _ = fp8_dir("llama", "channel")
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    for name in os.listdir(folder):
        if name != "model.safetensors":
            with open(os.path.join(folder, name), "rb") as src, open(tmp_path / name, "wb") as dst:
                dst.write(src.read())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight_scale"):
        _load(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["quantization_config"]


def test_config_names_the_same_quantizations():
    from pdserve.config import QUANTIZATIONS

    assert QUANTIZATIONS == fp8.QUANTIZATIONS  # config checks names without importing the model


def test_online_block_quantization_matches_its_reference(tiny_dir, tiny_hf_builder):
    """``quantization="fp8_block"``: one scale per output row and 128 input columns (the
    tiny model's 96 intermediate columns: one ragged group), against the same rounding."""
    folder, _ = tiny_dir("llama")
    model = _load(folder, quantization="fp8_block")
    ref = tiny_hf_builder("llama")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module.split(".", 3)[-1] in LINEARS:
                q, s = fp8.quantize_block(p, (1, 128))
                p.copy_(q.float() * s.repeat_interleave(128, 1)[:, : p.shape[1]])
    layer = next(model.decoder_layers())
    assert layer.fp8["qkv_proj"].group == 64 and layer.fp8["down_proj"].group == 96
    assert run_paged_scenario(model, ref, STEPS, [12, 8], page_size=4) < TOL


def test_online_block_groups_span_wide_rows():
    w = torch.randn(8, 300) * torch.linspace(0.01, 3, 300)  # column ranges of other sizes
    q, s = fp8.quantize_block(w, (1, 128))
    assert s.shape == (8, 3)
    fw = fp8.Fp8Weight(q, s, 128)
    assert (fw.dequantize() - w).abs().max() <= 3 * 2**-4 * w.abs().max()
    assert (fw.dequantize() - w).abs().max() < (
        fp8.Fp8Weight(*fp8.quantize_per_channel(w), 300).dequantize() - w
    ).abs().max()
