"""Rotary position embedding (RoPE): inverse frequencies from an HF config, cos/sin table, apply.

Formulas follow ``transformers`` (``LlamaRotaryEmbedding``, ``rotate_half`` layout: the two
halves of the head dim rotate together), so logits match it bit for bit in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Scaling types whose frequencies do not depend on the current sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """Return the RoPE parameter dict (``rope_theta``, ``rope_type``, scaling keys) of a config.

    Reads ``config.rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
    (transformers 4). Raises ``ValueError`` for an unsupported ``rope_type``.
    """
    given = getattr(hf_config, "rope_parameters", None)
    params: dict[str, Any]
    if given and "rope_theta" in given:
        params = dict(given)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {params['rope_type']!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return params


def inv_freq_and_scaling(hf_config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` fp32 and the cos/sin multiplier of ``hf_config``.

    ``default``: ``1 / theta ** (2i / head_dim)`` (Su et al., RoFormer); scaled types use
    transformers' ``ROPE_INIT_FUNCTIONS`` (e.g. ``llama3``: Llama 3.1's frequency smoothing).
    """
    params = rope_parameters(hf_config)
    if params["rope_type"] == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, torch.device("cpu"))
    return inv.float(), float(scaling)


def cos_sin_table(
    hf_config: PretrainedConfig,
    head_dim: int,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """``[max_positions, head_dim]`` table: cos in the first half, sin in the second, in ``dtype``.

    Computed in fp32 as ``positions * inv_freq`` (the same products transformers forms).
    """
    inv, scaling = inv_freq_and_scaling(hf_config, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
    table = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
    return table.to(dtype).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by ``cos, sin`` ``[T, 1, D/2]`` (``x*cos + rotate_half(x)*sin``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
