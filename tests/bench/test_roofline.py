"""The roofline of ``bench offline``: FLOP and byte counts of a decode step, and the two
rates measured on the device."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.roofline import (
    copy_bandwidth,
    forward_flops,
    matmul_rate,
    matmul_weights_per_token,
    roofline_seconds,
)
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.presets import preset_config


def _meta_model(preset: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(preset_config(preset), torch.bfloat16, "meta")


def test_llama_8b_matmul_weights_add_up_to_its_published_size():
    """Meta's model card: Llama-3.1-8B has 8,030,261,248 parameters. The matmul weights a
    token meets, plus the input embedding (untied) and the norms, must be exactly that."""
    model = _meta_model("llama-3.1-8b")
    s = model.shapes
    norms = (2 * s.n_layers + 1) * s.hidden
    embed = s.vocab * s.hidden
    assert matmul_weights_per_token(s) + embed + norms == 8_030_261_248
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


@pytest.mark.parametrize(
    "preset", ["tiny", "smollm2-135m", "llama-3.1-8b", "tiny-qwen3-moe", "tiny-mixtral"]
)
def test_matmul_weights_are_the_models_2d_weights(preset):
    """Every 2-D weight of the decoder layers, plus the LM head (the embedding when tied);
    of a mixture-of-experts layer the router and top_k of its experts (3-D ``[E, ...]``)."""
    model = _meta_model(preset)
    layer_mats = sum(
        p.numel() for layer in model.layers for p in layer.parameters() if p.dim() == 2
    )
    experts = sum(
        model.shapes.top_k * (layer.moe.w13[0].numel() + layer.moe.w2[0].numel())
        for layer in model.layers
        if layer.moe is not None
    )
    assert experts > 0 or "moe" not in preset and "mixtral" not in preset
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    assert matmul_weights_per_token(model.shapes) == layer_mats + experts + head.numel()


def test_forward_flops_is_two_per_weight_plus_attention():
    s = _meta_model("llama-3.1-8b").shapes
    w = matmul_weights_per_token(s)
    assert forward_flops(s, 1, 0) == 2 * w
    # PaLM appendix B: 4 * L * H * Q * T for attention; 32 layers, 32 heads of 128, T = 1000
    assert forward_flops(s, 3, 1000) == 3 * (2 * w + 4 * 32 * 32 * 128 * 1000)
    # GPU.md: a 256-row step of Llama-3.1-8B is about 4 TFLOP
    assert 3.8e12 < forward_flops(s, 256, 230) < 4.2e12


def test_roofline_takes_the_slower_of_bytes_and_flops():
    assert roofline_seconds(4e9, 0.4e12, 4e12, 800e12) == (pytest.approx(1e-3), "memory")
    assert roofline_seconds(4e9, 4e12, 4e12, 800e12) == (pytest.approx(5e-3), "compute")
    with pytest.raises(ValueError, match="rates"):
        roofline_seconds(1, 1, 0, 1)


def test_rates_are_measured_on_the_device():
    bw = copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=2)
    rate = matmul_rate("cpu", torch.float32, n=64, repeats=2)
    assert 1e6 < bw < 1e13  # 1 MB/s .. 10 TB/s: a real timing, not a constant
    assert 1e5 < rate < 1e14
    held = matmul_rate("cpu", torch.float32, n=64, repeats=3, sustain_s=0.05)
    assert 1e5 < held < 1e14  # after 50 ms of load: the median of three, a real timing too
    fp8 = matmul_rate("cpu", torch.float8_e4m3fn, n=64, repeats=2)  # FP8 weights' scaled mm
    assert 1e5 < fp8 < 1e14
