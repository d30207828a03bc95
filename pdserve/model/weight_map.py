"""Where each HF checkpoint tensor goes in a (possibly sharded) Llama-family model.

One :class:`Target` per HF name: the destination rows of a fused parameter, and the slice
of the full HF tensor this rank owns (Megatron-LM's split, Shoeybi et al. 2019):
- column-parallel (q/k/v, gate/up, their biases; embedding and LM head rows): dim 0;
- row-parallel (o_proj, down_proj): dim 1; their biases whole (added once, after the sum);
- norms (q/k norms are per head_dim, shared by every head): whole.
The ranges come from :class:`pdserve.model.shapes.ModelShapes` (i.e. ``pdserve.parallel``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from pdserve.model.shapes import ModelShapes

# (dim, start, end) of the full tensor that a rank reads; None: the whole tensor.
ShardSpec = tuple[int, int, int]


class LayerWeights(Protocol):
    """The parameters of one decoder layer that checkpoint tensors land in (what
    ``llama.LlamaDecoderLayer`` holds; ``None``: the model has no such tensor; a sparse
    layer's experts are mapped by ``pdserve.model.moe.moe_weight_targets``)."""

    input_layernorm: nn.Parameter
    post_attention_layernorm: nn.Parameter
    qkv_proj: nn.Parameter
    qkv_bias: nn.Parameter | None
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None
    o_proj: nn.Parameter
    o_bias: nn.Parameter | None
    gate_up_proj: nn.Parameter | None  # None: a mixture-of-experts layer
    gate_up_bias: nn.Parameter | None
    down_proj: nn.Parameter | None
    down_bias: nn.Parameter | None


class Target(NamedTuple):
    """``param[lo:hi]`` (rows) receives ``full_tensor.narrow(dim, start, end - start)``;
    ``full`` is the full tensor's size along ``dim``."""

    param: torch.Tensor
    lo: int
    hi: int
    dim: int
    start: int
    end: int
    full: int

    def view(self) -> torch.Tensor:
        """The destination rows."""
        return self.param[self.lo : self.hi]

    def shard_shape(self) -> tuple[int, ...]:
        """Shape of this rank's slice (= the destination's)."""
        return tuple(self.view().shape)

    def full_shape(self) -> tuple[int, ...]:
        """Shape of the HF tensor."""
        shape = list(self.shard_shape())
        shape[self.dim] = self.full
        return tuple(shape)

    def spec(self) -> ShardSpec | None:
        """``(dim, start, end)`` to read, ``None`` when the rank reads the whole tensor."""
        if self.start == 0 and self.end == self.full:
            return None
        return self.dim, self.start, self.end


def _whole(p: torch.Tensor) -> Target:
    return Target(p, 0, p.shape[0], 0, 0, p.shape[0], p.shape[0])


def weight_targets(
    s: ModelShapes,
    embed_tokens: torch.Tensor,
    norm: torch.Tensor,
    lm_head: torch.Tensor | None,
    layers: Iterable[LayerWeights],
) -> dict[str, Target]:
    """HF name -> :class:`Target` for every weight the model expects."""
    D = s.head_dim
    nq, nkv, inter = s.n_heads * D, s.n_kv_heads * D, s.intermediate
    q0, q1 = (h * D for h in s.head_range)
    kv0, kv1 = (h * D for h in s.kv_head_range)
    i0, i1 = s.intermediate_range
    v0, v1 = s.vocab_range
    tq, tkv, ti = s.total_heads * D, s.total_kv_heads * D, s.total_intermediate
    t: dict[str, Target] = {
        "model.embed_tokens.weight": Target(embed_tokens, 0, v1 - v0, 0, v0, v1, s.vocab),
        "model.norm.weight": _whole(norm),
    }
    if lm_head is not None:
        t["lm_head.weight"] = Target(lm_head, 0, v1 - v0, 0, v0, v1, s.vocab)
    for i, layer in enumerate(layers):
        pre = f"model.layers.{i}."
        t[pre + "input_layernorm.weight"] = _whole(layer.input_layernorm)
        t[pre + "post_attention_layernorm.weight"] = _whole(layer.post_attention_layernorm)
        t[pre + "self_attn.o_proj.weight"] = Target(layer.o_proj, 0, s.hidden, 1, q0, q1, tq)
        if layer.down_proj is not None:
            t[pre + "mlp.down_proj.weight"] = Target(layer.down_proj, 0, s.hidden, 1, i0, i1, ti)
        for suffix, fused in (("weight", layer.qkv_proj), ("bias", layer.qkv_bias)):
            if fused is not None:
                t[f"{pre}self_attn.q_proj.{suffix}"] = Target(fused, 0, nq, 0, q0, q1, tq)
                t[f"{pre}self_attn.k_proj.{suffix}"] = Target(fused, nq, nq + nkv, 0, kv0, kv1, tkv)
                t[f"{pre}self_attn.v_proj.{suffix}"] = Target(
                    fused, nq + nkv, nq + 2 * nkv, 0, kv0, kv1, tkv
                )
        for suffix, fused in (("weight", layer.gate_up_proj), ("bias", layer.gate_up_bias)):
            if fused is not None:
                t[f"{pre}mlp.gate_proj.{suffix}"] = Target(fused, 0, inter, 0, i0, i1, ti)
                t[f"{pre}mlp.up_proj.{suffix}"] = Target(fused, inter, 2 * inter, 0, i0, i1, ti)
        if layer.o_bias is not None:
            t[pre + "self_attn.o_proj.bias"] = _whole(layer.o_bias)
        if layer.down_bias is not None:
            t[pre + "mlp.down_proj.bias"] = _whole(layer.down_bias)
        if layer.q_norm is not None and layer.k_norm is not None:
            t[pre + "self_attn.q_norm.weight"] = _whole(layer.q_norm)
            t[pre + "self_attn.k_norm.weight"] = _whole(layer.k_norm)
    return t


def copy_weight(name: str, target: Target, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` (the full HF tensor, or already this rank's slice) into ``target``.

    Raises ``ValueError`` naming ``name`` when the shape is neither.
    """
    view = target.view()
    shard, full = target.shard_shape(), target.full_shape()
    got = tuple(tensor.shape)
    if got != shard:
        if got != full:
            also = f" (or this rank's slice {shard})" if shard != full else ""
            raise ValueError(f"weight {name!r} has shape {got}, expected {full}{also}")
        tensor = tensor.narrow(target.dim, target.start, target.end - target.start)
    if view.device.type != "meta":
        view.copy_(tensor)


def narrow_to(tensor: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """``tensor`` narrowed to ``spec`` (a view; the whole tensor when ``spec`` is None)."""
    if spec is None:
        return tensor
    dim, start, end = spec
    return tensor.narrow(dim, start, end - start)
