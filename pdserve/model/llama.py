"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, SmolLM2) over a paged KV cache.

Q/K/V and gate/up projections are fused at load time (one matmul each). Norms, RoPE and the
order of operations follow ``transformers``' Llama/Qwen2/Qwen3 so fp32 logits match it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import linear as lin
from pdserve.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from pdserve.model.rope import apply_rope, cos_sin_table

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as transformers computes it: fp32 statistics, then
    ``weight * x.to(input dtype)``. x ``[..., H]``, weight ``[H]``."""
    if (
        x.dtype == torch.float32 or x.is_cuda
    ):  # fused kernel: same bits in fp32, fewer launches on CUDA
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: fused QKV (+bias), optional per-head q/k RMSNorm, RoPE,
    paged attention, o_proj, fused gate/up SwiGLU MLP."""

    def __init__(self, s: _Shapes, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.s = s
        qkv_out = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
        self.input_layernorm = _empty((s.hidden,), dtype, device)
        self.qkv_proj = _empty((qkv_out, s.hidden), dtype, device)
        self.qkv_bias = _empty((qkv_out,), dtype, device) if s.qkv_bias else None
        self.q_norm = _empty((s.head_dim,), dtype, device) if s.qk_norm else None
        self.k_norm = _empty((s.head_dim,), dtype, device) if s.qk_norm else None
        self.o_proj = _empty((s.hidden, s.n_heads * s.head_dim), dtype, device)
        self.o_bias = _empty((s.hidden,), dtype, device) if s.o_bias else None
        self.post_attention_layernorm = _empty((s.hidden,), dtype, device)
        self.gate_up_proj = _empty((2 * s.intermediate, s.hidden), dtype, device)
        self.gate_up_bias = _empty((2 * s.intermediate,), dtype, device) if s.mlp_bias else None
        self.down_proj = _empty((s.hidden, s.intermediate), dtype, device)
        self.down_bias = _empty((s.hidden,), dtype, device) if s.mlp_bias else None
        self.packed: dict[str, torch.Tensor] = {}  # CPU pre-packed weights (see linear.py)

    def forward(
        self,
        h: torch.Tensor,
        rope: Callable[[torch.Tensor], torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        plan: Any,
        backend: AttentionBackend,
        fused: Any = None,
    ) -> torch.Tensor:
        """h ``[T, H]``; rope: rotates ``[T, heads, D]`` (returns the rotated tensor, may be
        in place); fused: ``pdserve.model.fused_ops`` on CUDA (SiLU-and-mul in one kernel)."""
        s = self.s
        T = h.shape[0]
        x = rms_norm(h, self.input_layernorm, s.eps)
        pk = self.packed
        qkv = lin.linear(x, self.qkv_proj, self.qkv_bias, pk.get("qkv_proj"))
        qkv = qkv.view(T, s.n_heads + 2 * s.n_kv_heads, s.head_dim)
        nq, nqk = s.n_heads, s.n_heads + s.n_kv_heads
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            qk = torch.cat(
                (
                    rms_norm(qkv[:, :nq], self.q_norm, s.eps),
                    rms_norm(qkv[:, nq:nqk], self.k_norm, s.eps),
                ),
                1,
            )
        else:
            qk = qkv[:, :nqk]
        qk = rope(qk)  # q and k heads rotated together: [T, Hq + Hkv, D]
        q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nqk:]
        o = backend.forward(q, k, v, k_cache, v_cache, attn, plan, s.scale)  # [T, Hq * D]
        h = h + lin.linear(o, self.o_proj, self.o_bias, pk.get("o_proj"))
        x = rms_norm(h, self.post_attention_layernorm, s.eps)
        gate_up = lin.linear(x, self.gate_up_proj, self.gate_up_bias, pk.get("gate_up_proj"))
        if fused is not None:
            act = fused.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return h + lin.linear(act, self.down_proj, self.down_bias, pk.get("down_proj"))


class _Shapes:
    """Dimensions and flags read once from an HF config."""

    def __init__(self, c: PretrainedConfig) -> None:
        mt = getattr(c, "model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(c, "use_sliding_window", False) or (
            mt == "mistral" and getattr(c, "sliding_window", None)
        ):
            raise ValueError(
                "sliding-window attention (use_sliding_window / sliding_window) is not supported"
            )
        self.hidden = c.hidden_size
        self.n_layers = c.num_hidden_layers
        self.n_heads = c.num_attention_heads
        self.n_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.intermediate = c.intermediate_size
        self.vocab = c.vocab_size
        self.eps = float(c.rms_norm_eps)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        attn_bias = bool(getattr(c, "attention_bias", False))
        self.qkv_bias = mt == "qwen2" or attn_bias  # Qwen2 always has q/k/v bias
        self.o_bias = attn_bias and mt in ("llama", "mistral")  # Qwen2/3 never bias o_proj
        self.mlp_bias = bool(getattr(c, "mlp_bias", False))
        self.qk_norm = mt == "qwen3"
        self.scale = self.head_dim**-0.5
        self.max_positions = c.max_position_embeddings
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.n_heads} is not a multiple of num_key_value_heads"
            )


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    hf_config: ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (``MistralConfig`` without
    sliding window). dtype: parameter and activation dtype. device: where parameters live
    (``"meta"`` builds shapes only). Parameters are uninitialised until :meth:`load_weights`.
    Raises ``ValueError`` for unsupported model types / rope types.
    """

    rope_cos_sin: torch.Tensor  # [max_positions, D] buffer: cos | sin (see rope.cos_sin_table)

    def __init__(
        self,
        hf_config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attn_backend: str = "torch_sdpa",
    ) -> None:
        super().__init__()
        s = self.shapes = _Shapes(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.embed_tokens = _empty((s.vocab, s.hidden), dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(s, dtype, device) for _ in range(s.n_layers))
        self.norm = _empty((s.hidden,), dtype, device)
        self.lm_head = None if s.tied else _empty((s.vocab, s.hidden), dtype, device)
        self.register_buffer(
            "rope_cos_sin",
            cos_sin_table(hf_config, s.head_dim, s.max_positions, dtype, device),
            persistent=False,
        )
        self.backend = get_attention_backend(attn_backend)
        self._lm_head_packed: torch.Tensor | None = None
        self._freed: dict[
            nn.Parameter, torch.Size
        ] = {}  # packed params whose plain copy was dropped

    # ----------------------------------------------------------------- weights
    def decoder_layers(self) -> Iterator[LlamaDecoderLayer]:
        """The decoder layers in order, typed (``nn.ModuleList`` yields plain modules)."""
        for layer in self.layers:
            yield cast(LlamaDecoderLayer, layer)

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF name -> (destination parameter, row start, row end) for every expected weight."""
        s = self.shapes
        nq, nkv, inter = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.intermediate
        t: dict[str, tuple[torch.Tensor, int, int]] = {}

        def whole(name: str, p: torch.Tensor) -> None:
            t[name] = (p, 0, p.shape[0])

        whole("model.embed_tokens.weight", self.embed_tokens)
        whole("model.norm.weight", self.norm)
        if self.lm_head is not None:
            whole("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.decoder_layers()):
            pre = f"model.layers.{i}."
            whole(pre + "input_layernorm.weight", layer.input_layernorm)
            whole(pre + "post_attention_layernorm.weight", layer.post_attention_layernorm)
            whole(pre + "self_attn.o_proj.weight", layer.o_proj)
            whole(pre + "mlp.down_proj.weight", layer.down_proj)
            for suffix, fused in (("weight", layer.qkv_proj), ("bias", layer.qkv_bias)):
                if fused is not None:
                    t[f"{pre}self_attn.q_proj.{suffix}"] = (fused, 0, nq)
                    t[f"{pre}self_attn.k_proj.{suffix}"] = (fused, nq, nq + nkv)
                    t[f"{pre}self_attn.v_proj.{suffix}"] = (fused, nq + nkv, nq + 2 * nkv)
            for suffix, fused in (("weight", layer.gate_up_proj), ("bias", layer.gate_up_bias)):
                if fused is not None:
                    t[f"{pre}mlp.gate_proj.{suffix}"] = (fused, 0, inter)
                    t[f"{pre}mlp.up_proj.{suffix}"] = (fused, inter, 2 * inter)
            if layer.o_bias is not None:
                whole(pre + "self_attn.o_proj.bias", layer.o_bias)
            if layer.down_bias is not None:
                whole(pre + "mlp.down_proj.bias", layer.down_bias)
            if layer.q_norm is not None and layer.k_norm is not None:
                whole(pre + "self_attn.q_norm.weight", layer.q_norm)
                whole(pre + "self_attn.k_norm.weight", layer.k_norm)
        return t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (any float dtype, CPU or device) into the fused parameters.

        Each tensor is copied and released as it comes, so peak memory stays ~1x the model.
        Raises ``ValueError`` naming the weight on an unknown name or a shape mismatch, and
        listing the missing names when some expected weight never arrived.
        """
        self._unpack()
        targets = self._targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            if name not in targets:
                raise ValueError(
                    f"weight {name!r} is not a parameter of this {self.shapes.__class__.__name__} model"
                )
            dst, lo, hi = targets[name]
            view = dst[lo:hi]
            if tuple(tensor.shape) != tuple(view.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}"
                )
            if view.device.type != "meta":
                view.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            )
            raise ValueError(f"weights missing from the checkpoint: {shown}")
        self._pack()

    _PACKED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def _pack(self) -> None:
        """Pre-pack linear weights for CPU (no-op elsewhere); drop the plain copies."""
        for layer in self.decoder_layers():
            for name in self._PACKED:
                param = getattr(layer, name)
                packed = lin.pack(param)
                if packed is not None:
                    layer.packed[name] = packed
                    self._freed[param] = param.shape
                    param.data = param.data.new_empty(0)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        self._lm_head_packed = lin.pack(head)  # the plain copy stays: embedding lookups need it

    def _unpack(self) -> None:
        """Undo :meth:`_pack` so weights can be loaded again."""
        for param, shape in self._freed.items():
            param.data = param.data.new_empty(shape)
        self._freed.clear()
        for layer in self.decoder_layers():
            layer.packed.clear()
        self._lm_head_packed = None

    # ----------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        plan: Any = None,
    ) -> torch.Tensor:
        """Run the decoder on this step's tokens.

        input_ids, positions: ``[T]`` int64 (token ids, absolute positions). attn: metadata of
        the step. kv_cache: per layer the ``(k_cache, v_cache)`` views ``[P, page_size, Hkv, D]``
        of the pool (strided; ``KVCacheLayout.layer_views``) in the model dtype, written in
        place at ``attn.slot_mapping``. plan: ``self.backend.plan(attn, page_size)``, built
        by the caller outside the forward (the model runner does, so a CUDA graph of the
        forward captures no planning); built here when omitted (tests, one-off calls).
        Returns the final-norm hidden states ``[T, H]``.
        """
        if plan is None:
            plan = self.backend.plan(attn, kv_cache[0][0].shape[1])
        fused: Any = None
        rope: Callable[[torch.Tensor], torch.Tensor]
        if input_ids.is_cuda:  # one RoPE kernel and one SiLU-and-mul kernel a layer
            from pdserve.model import fused_ops

            fused = fused_ops
            table = self.rope_cos_sin

            def rope(x: torch.Tensor) -> torch.Tensor:
                fused_ops.rope_inplace(x, table, positions)
                return x
        else:
            cs = self.rope_cos_sin.index_select(0, positions)[:, None, :]  # [T, 1, D]
            cos, sin = cs.chunk(2, dim=-1)

            def rope(x: torch.Tensor) -> torch.Tensor:
                return apply_rope(x, cos, sin)

        h = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.decoder_layers()):
            h = layer(h, rope, kv_cache[i][0], kv_cache[i][1], attn, plan, self.backend, fused)
        return rms_norm(h, self.norm, self.shapes.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V]`` float32 of hidden states ``[N, H]`` (tied embeddings when configured)."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return lin.linear(hidden, w, None, self._lm_head_packed).float()
