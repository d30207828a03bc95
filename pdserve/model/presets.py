"""Shapes of real models for ``random:<preset>`` weights (performance work without checkpoints).

Every preset keeps its real model's shapes, vocabulary size included, so speed and memory
match the real model. All presets share the embedded SmolLM2 tokenizer (49152 ids): token
ids at or above 49152, which larger-vocabulary presets can produce, decode to ``""``.
``tiny`` is a 2-layer Llama with the tokenizer's own vocabulary, for tests; ``tiny-qwen3-moe``
and ``tiny-mixtral`` are 2-layer mixtures of experts likewise. ``qwen3-30b-a3b`` and
``mixtral-8x7b`` are the real MoE shapes (all experts in memory: ~61 GB / ~93 GB in bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import transformers

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# name -> (config class, config kwargs). rope parameters are split out in :func:`preset_config`.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        ),
    ),
    "smollm2-135m": (
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=100000.0,
        ),
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        ),
    ),
    "llama-3.1-8b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE,
        ),
    ),
    "qwen2.5-0.5b": (
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
        ),
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
        ),
    ),
    "qwen3-8b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        ),
    ),
}


def _experts(dense: str, cls_name: str, **changes: Any) -> tuple[str, dict[str, Any]]:
    """A mixture-of-experts preset as ``cls_name``: the attention and embedding shape of the
    dense preset ``dense`` with ``changes`` (the experts, and each field that differs)."""
    return cls_name, {**PRESETS[dense][1], **changes}


# The MoE presets, each from the dense preset whose attention shape it shares.
PRESETS["tiny-qwen3-moe"] = _experts(
    "tiny",
    "Qwen3MoeConfig",
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)
PRESETS["tiny-mixtral"] = _experts(
    "tiny",
    "MixtralConfig",
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    sliding_window=None,
    rope_theta=1000000.0,
)
PRESETS["qwen3-30b-a3b"] = _experts(
    "qwen3-8b",
    "Qwen3MoeConfig",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=48,
    num_key_value_heads=4,
)
PRESETS["mixtral-8x7b"] = _experts(
    "llama-3.1-8b",
    "MixtralConfig",
    vocab_size=32000,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=32768,
    sliding_window=None,
    rope_theta=1000000.0,
    rope_scaling=None,
)


def preset_names() -> tuple[str, ...]:
    """Names accepted after ``random:``."""
    return tuple(PRESETS)


def preset_config(name: str) -> transformers.PretrainedConfig:
    """The HF config of preset ``name`` (``bos=1``, ``eos=2`` as in the SmolLM2 tokenizer).

    Raises ``ValueError`` naming the preset and listing the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"random preset {name!r} is unknown; presets: {', '.join(PRESETS)}")
    cls_name, kwargs = PRESETS[name]
    kwargs = dict(kwargs)
    rope = {
        "rope_theta": kwargs.pop("rope_theta"),
        "rope_type": "default",
        **(kwargs.pop("rope_scaling", None) or {}),
    }
    cls: Callable[..., transformers.PretrainedConfig] = getattr(transformers, cls_name)
    cfg = cls(**kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=2, rope_parameters=rope)
    if getattr(cfg, "rope_parameters", None) != rope:  # transformers 4: rope_theta + rope_scaling
        cfg.rope_theta = rope["rope_theta"]
        cfg.rope_scaling = None if rope["rope_type"] == "default" else rope
    return cfg
