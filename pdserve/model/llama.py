"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, SmolLM2; Qwen3-MoE and Mixtral, whose
sparse MLP layers are :class:`pdserve.model.moe.SparseMoeBlock`) over a paged KV cache.

Q/K/V and gate/up projections are fused at load time (one matmul each). Norms, RoPE and the
order of operations follow ``transformers``' Llama/Qwen2/Qwen3 so fp32 logits match it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import fp8, weight_map
from pdserve.model import linear as lin
from pdserve.model import moe as moe_mlp
from pdserve.model.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from pdserve.model.rope import apply_rope, cos_sin_table
from pdserve.model.shapes import ModelShapes
from pdserve.model.tp_group import TPGroup

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pdserve.model.fused_splitk_norm import SplitKPartials


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


def add_rms_norm(
    h: torch.Tensor,
    delta: torch.Tensor | SplitKPartials | None,
    weight: torch.Tensor,
    eps: float,
    fused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta))`` (``delta`` None: ``(h, rms_norm(h))``); h, delta
    ``[T, H]``. fused: ``pdserve.model.fused_ops`` on CUDA (one kernel for both), else None
    (torch's add, then :func:`rms_norm`: the CPU path's ops unchanged). A ``delta`` of
    split-K partials (the previous layer's down projection, ``fused_splitk_norm``, CUDA
    path only) is reduced inside the same kernel."""
    if delta is not None and not isinstance(delta, torch.Tensor):
        from pdserve.model import fused_splitk_norm

        return fused_splitk_norm.add_rms_norm(h, delta, weight, eps)
    if fused is not None:
        out: tuple[torch.Tensor, torch.Tensor] = fused.add_rms_norm(h, delta, weight, eps)
        return out
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def use_fused_ops(input_ids: torch.Tensor) -> bool:
    """Whether a forward on ``input_ids`` runs the Triton kernels of
    ``pdserve.model.fused_ops`` (CUDA tensors; tests set it for CPU under
    ``TRITON_INTERPRET=1``)."""
    return input_ids.is_cuda


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: fused QKV (+bias), optional per-head q/k RMSNorm, RoPE,
    paged attention, o_proj, fused gate/up SwiGLU MLP.

    Under tensor parallelism (``tp`` of size > 1; Megatron-LM's split, Shoeybi et al. 2019)
    the layer holds this rank's share: QKV and gate/up column-parallel (its query heads, its
    KV heads, its intermediate rows), o_proj and down_proj row-parallel, their partial
    outputs summed over the ranks (``tp.all_reduce_``) before the row bias is added once.
    ``tp=None`` is the TP=1 path: no collective, the bias fused into the matmul.
    ``sparse``: the MLP is a mixture of experts (``self.moe``; the dense MLP parameters are
    then None), its partial outputs all-reduced like down_proj's. ``layer``: the layer's
    index (seeds a benchmark's uniform routing, ``PDSERVE_MOE_ROUTING``)."""

    def __init__(
        self,
        s: ModelShapes,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup | None = None,
        sparse: bool = False,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.s = s
        self.tp = tp if tp is not None and tp.size > 1 else None
        qkv_out = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
        self.input_layernorm = _empty((s.hidden,), dtype, device)
        self.qkv_proj = _empty((qkv_out, s.hidden), dtype, device)
        self.qkv_bias = _empty((qkv_out,), dtype, device) if s.qkv_bias else None
        self.q_norm = _empty((s.head_dim,), dtype, device) if s.qk_norm else None
        self.k_norm = _empty((s.head_dim,), dtype, device) if s.qk_norm else None
        self.o_proj = _empty((s.hidden, s.n_heads * s.head_dim), dtype, device)
        self.o_bias = _empty((s.hidden,), dtype, device) if s.o_bias else None
        self.post_attention_layernorm = _empty((s.hidden,), dtype, device)
        dense = not sparse
        self.moe = moe_mlp.SparseMoeBlock(s, dtype, device, layer) if sparse else None
        self.gate_up_proj = _empty((2 * s.intermediate, s.hidden), dtype, device) if dense else None
        self.gate_up_bias = (
            _empty((2 * s.intermediate,), dtype, device) if dense and s.mlp_bias else None
        )
        self.down_proj = _empty((s.hidden, s.intermediate), dtype, device) if dense else None
        self.down_bias = _empty((s.hidden,), dtype, device) if dense and s.mlp_bias else None
        self.packed: dict[str, torch.Tensor] = {}  # CPU pre-packed weights (see linear.py)
        # FP8 linears (model/fp8.py): fused name -> weight, filled after loading
        self.fp8: dict[str, fp8.Fp8Weight] = {}
        self.fp8_names: tuple[str, ...] = ()
        self.fp8_groups: dict[str, int] = {}
        self.fp8_input_scales: dict[str, torch.Tensor] = {}
        # per-tensor (K, V) scales of an FP8 KV cache: 1.0 or the checkpoint's k/v_scale
        self.kv_scale: tuple[float, float] = (1.0, 1.0)

    def forward(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | SplitKPartials | None,
        rope: Callable[..., torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        plan: Any,
        backend: AttentionBackend,
        fused: Any = None,
        rope_store: Callable[..., None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | SplitKPartials]:
        """h ``[T, H]``: the residual stream, to which ``delta`` (the previous layer's MLP
        output, None for the first layer) is still to be added; rope: rotates
        ``[T, heads, D]`` (returns the rotated tensor, may be in place; on CUDA it takes a
        second argument, a ``fused_ops.QKNorm``, to RMS-normalise the q/k heads first);
        fused: ``pdserve.model.fused_ops`` on CUDA (SiLU-and-mul, add + RMSNorm in one
        kernel, Qwen3's q/k norms inside RoPE's); rope_store: ``(qk, v, k_cache, v_cache,
        qk_norm, kv_scale)`` -> (q/k normalised first when ``qk_norm``, as ``rope``) rotates
        ``qk`` in place and writes K/V into the cache, an FP8 one quantized with this
        layer's ``kv_scale`` (one kernel, CUDA with a backend that
        ``accepts_stored_kv``), used instead of ``rope`` and the backend's own store when
        given. Before a sparse MLP on CUDA, for up to ``fused_ops.ROUTER_FUSE_MAX_TOKENS``
        rows, the router's logits come out of the add + RMSNorm kernel.
        Returns ``(h, mlp_out)``: the stream after attention and this layer's MLP output,
        added by the next norm (so each add and its norm are one kernel on CUDA); with
        ``fused_splitk_norm.FUSE`` on, a split-K down projection's output is its unreduced
        partials (a ``SplitKPartials``), reduced by that norm's kernel."""
        s = self.s
        T = h.shape[0]
        normed = None
        if fused is not None and not isinstance(delta, tuple):
            # the FP8 activation quantization inside the norm's kernel (a split-K GEMV's
            # partials, from a bf16 down projection, go to add_rms_norm below)
            normed = fp8.add_rms_norm_linear(
                h, delta, self.input_layernorm, s.eps, self.fp8.get("qkv_proj"), self.qkv_bias
            )
        if normed is not None:
            h, qkv = normed
        else:
            h, x = add_rms_norm(h, delta, self.input_layernorm, s.eps, fused)
            qkv = self._linear("qkv_proj", x, self.qkv_bias)
        qkv = qkv.view(T, s.n_heads + 2 * s.n_kv_heads, s.head_dim)
        nq, nqk = s.n_heads, s.n_heads + s.n_kv_heads
        qk_norm = None  # (q_w, k_w, eps, nq): normalised by the RoPE kernel (CUDA)
        if self.q_norm is not None and self.k_norm is not None and fused is not None:
            qk = qkv[:, :nqk]  # both norms in the RoPE kernel: no copies, no cat
            qk_norm = (self.q_norm, self.k_norm, s.eps, nq)
        elif self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            qk = torch.cat(
                (
                    rms_norm(qkv[:, :nq], self.q_norm, s.eps),
                    rms_norm(qkv[:, nq:nqk], self.k_norm, s.eps),
                ),
                1,
            )
        else:
            qk = qkv[:, :nqk]
        v = qkv[:, nqk:]
        if rope_store is not None:  # rotated in place, K/V already in the cache
            rope_store(qk, v, k_cache, v_cache, qk_norm, self.kv_scale)
        elif qk_norm is not None:
            qk = rope(qk, qk_norm)
        else:
            qk = rope(qk)  # q and k heads rotated together: [T, Hq + Hkv, D]
        q, k = qk[:, :nq], qk[:, nq:]
        stored = rope_store is not None
        o = backend.forward(
            q, k, v, k_cache, v_cache, attn, plan, s.scale, kv_stored=stored, kv_scale=self.kv_scale
        )
        o_out: torch.Tensor | SplitKPartials | None = None
        if fused is not None and self.tp is None and self.moe is None and "o_proj" not in self.fp8:
            # the skinny GEMM where measured faster; a split one's reduce left to the norm
            from pdserve.model import triton_skinny

            o_out = triton_skinny.partials(o, self.o_proj, self.o_bias)
        if o_out is None:
            o_out = self._row_parallel("o_proj", o, self.o_bias)
        if self.moe is not None:
            assert isinstance(o_out, torch.Tensor)
            o = o_out
            logits = None
            if fused is not None and 0 < T <= fused.ROUTER_FUSE_MAX_TOKENS:
                # the router's GEMM inside the add + RMSNorm kernel (decode batches)
                h, x, logits = fused.add_rms_norm_router(
                    h, o, self.post_attention_layernorm, s.eps, self.moe.gate
                )
            else:
                h, x = add_rms_norm(h, o, self.post_attention_layernorm, s.eps, fused)
            if self.tp is None:  # the top-k sum may be left to the next add + RMSNorm
                return h, self.moe(x, logits, rows_out=fused is not None)
            out = self.moe(x, logits)
            assert isinstance(out, torch.Tensor)
            return h, self.tp.all_reduce_(out)
        assert self.gate_up_proj is not None and self.down_proj is not None
        normed = None
        if fused is not None and isinstance(o_out, torch.Tensor):
            # the FP8 activation quantization inside the norm's kernel
            normed = fp8.add_rms_norm_linear(
                h,
                o_out,
                self.post_attention_layernorm,
                s.eps,
                self.fp8.get("gate_up_proj"),
                self.gate_up_bias,
            )
        if normed is not None:
            h, gate_up = normed
        else:
            h, x = add_rms_norm(h, o_out, self.post_attention_layernorm, s.eps, fused)
            act_fused = None
            if fused is not None and self.tp is None and "gate_up_proj" not in self.fp8:
                # gate/up and SwiGLU in one skinny GEMM, where measured faster
                from pdserve.model import triton_skinny

                act_fused = triton_skinny.swiglu(x, self.gate_up_proj, self.gate_up_bias)
            if act_fused is not None:
                return h, self._down(act_fused)
            gate_up = self._linear("gate_up_proj", x, self.gate_up_bias)
        if fused is not None:
            # SwiGLU inside the down projection's GEMV, where it runs
            if self.tp is None and "down_proj" not in self.fp8:
                down = lin.silu_mul_linear(gate_up, self.down_proj, self.down_bias)
                if down is not None:
                    return h, down
            elif self.tp is None:  # an FP8 down projection: its one-row gemv, when fused
                down = fp8.linear_silu_mul(gate_up, self.fp8["down_proj"], self.down_bias)
                if down is None:  # its e4m3 rows from the SwiGLU kernel, where it quantizes
                    down = fp8.silu_mul_linear(gate_up, self.fp8["down_proj"], self.down_bias)
                if down is not None:
                    return h, down
            act = fused.silu_mul(gate_up)
            return h, self._down(act)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
        return h, self._row_parallel("down_proj", act, self.down_bias)

    def _down(self, act: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """The down projection of SwiGLU's output ``act [T, I]`` on the CUDA (fused-ops) path:
        a split-K kernel's partials (the skinny GEMM's, else the split-K GEMV's) left to the
        next add + RMSNorm where a table picks one and ``fused_splitk_norm.FUSE`` is on."""
        if self.tp is None and "down_proj" not in self.fp8 and self.down_proj is not None:
            from pdserve.model import fused_splitk_norm, triton_skinny

            out = triton_skinny.partials(act, self.down_proj, self.down_bias)
            if out is not None:
                return out
            # a split-K GEMV's reduce left to the next add + RMSNorm (when FUSE is on)
            parts = fused_splitk_norm.down_partials(act, self.down_proj, self.down_bias)
            if parts is not None:
                return parts
        return self._row_parallel("down_proj", act, self.down_bias)

    def _linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in] @ W.T + bias`` for fused parameter ``name``: its FP8 weight
        (``fp8.linear``) when it has one, else the plain/packed one (``linear.linear``)."""
        q = self.fp8.get(name)
        if q is not None:
            return fp8.linear(x, q, bias)
        return lin.linear(x, getattr(self, name), bias, self.packed.get(name))

    def _row_parallel(self, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in/tp] @ W.T`` of parameter ``name`` summed over the ranks, plus ``bias``
        once -> ``[T, out]``."""
        if self.tp is None:
            return self._linear(name, x, bias)
        out = self.tp.all_reduce_(self._linear(name, x, None))
        return out if bias is None else out.add_(bias)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    hf_config: ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (``MistralConfig`` without
    sliding window). dtype: parameter and activation dtype. device: where parameters live
    (``"meta"`` builds shapes only). Parameters are uninitialised until :meth:`load_weights`.
    tp: this rank's tensor-parallel group (``None`` or size 1: the whole model, no
    collective). With ``tp.size > 1`` the rank holds its share (see
    :class:`LlamaDecoderLayer`; ``shapes`` gives the rank-local counts and ranges), the
    embedding and LM head hold its vocabulary rows (padded to ``shapes.vocab_shard``), and
    :meth:`forward` / :meth:`compute_logits` are collectives every rank calls with the same
    inputs. quantization: ``"fp8"`` quantizes the four linears of every layer to e4m3 at
    load (one scale per output channel); a checkpoint whose config has an FP8
    ``quantization_config`` loads as published whatever this says (``model/fp8.py``).
    Embeddings, LM head and norms stay in ``dtype``.
    Raises ``ValueError`` for unsupported model types / rope types, and naming the field
    when a count does not split over ``tensor_parallel_size``.
    """

    rope_cos_sin: torch.Tensor  # [max_positions, D] buffer: cos | sin (see rope.cos_sin_table)

    def __init__(
        self,
        hf_config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attn_backend: str = "torch_sdpa",
        tp: TPGroup | None = None,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp if tp is not None else TPGroup.single()
        self._tp = self.tp if self.tp.size > 1 else None  # None: no collective anywhere
        s = self.shapes = ModelShapes(hf_config, self.tp.tp)
        self.config = hf_config
        self.dtype = dtype
        self.embed_tokens = _empty((s.vocab_shard, s.hidden), dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(s, dtype, device, self._tp, sparse=i in s.moe_layers, layer=i)
            for i in range(s.n_layers)
        )
        self.norm = _empty((s.hidden,), dtype, device)
        self.lm_head = None if s.tied else _empty((s.vocab_shard, s.hidden), dtype, device)
        # FP8 linears: the checkpoint's format, or online quantization (quantization="fp8")
        self.fp8_scheme = fp8.scheme_from_config(hf_config, quantization)
        if self.fp8_scheme is not None and self.fp8_scheme.source == "checkpoint":
            fp8.prepare_checkpoint_layers(list(self.decoder_layers()), self.fp8_scheme)
        self.register_buffer(
            "rope_cos_sin",
            cos_sin_table(hf_config, s.head_dim, s.max_positions, dtype, device),
            persistent=False,
        )
        self.backend = get_attention_backend(attn_backend)
        self._lm_head_packed: torch.Tensor | None = None
        self._shard_specs: dict[str, tuple[Any, tuple[int, ...]]] | None = None
        self._freed: dict[
            nn.Parameter, torch.Size
        ] = {}  # packed params whose plain copy was dropped

    # ----------------------------------------------------------------- weights
    def decoder_layers(self) -> Iterator[LlamaDecoderLayer]:
        """The decoder layers in order, typed (``nn.ModuleList`` yields plain modules)."""
        for layer in self.layers:
            yield cast(LlamaDecoderLayer, layer)

    def _targets(self) -> dict[str, weight_map.Target]:
        """HF name -> where it goes (rows of a fused parameter, this rank's slice)."""
        t = weight_map.weight_targets(
            self.shapes, self.embed_tokens, self.norm, self.lm_head, self.decoder_layers()
        )
        sparse = {i: ly.moe for i, ly in enumerate(self.decoder_layers()) if ly.moe is not None}
        if sparse:
            t.update(moe_mlp.moe_weight_targets(self.shapes, self.config.model_type, sparse))
        return t

    def weight_shard(self, name: str, shape: Sequence[int]) -> weight_map.ShardSpec | None:
        """``(dim, start, end)`` of the HF tensor ``name`` (full shape ``shape``) this rank
        reads, or ``None`` for the whole tensor (TP=1, norms, row biases, unknown names or
        an unexpected shape, which :meth:`load_weights` then reports). Pass it to
        ``ModelSource.weights(shard=...)`` so a rank reads only its slice."""
        if self._tp is None:
            return None
        if self._shard_specs is None:
            self._shard_specs = {n: (t.spec(), t.full_shape()) for n, t in self._targets().items()}
        spec, full = self._shard_specs.get(name, (None, None))
        return spec if full == tuple(shape) else None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (any float dtype, CPU or device) into the fused parameters.

        Each tensor is the full HF tensor (sliced here to this rank's share) or already the
        rank's slice (``ModelSource.weights(shard=model.weight_shard)``); each is copied and
        released as it comes, so peak memory stays the rank's shard + one full tensor.
        Raises ``ValueError`` naming the weight on an unknown name or a shape mismatch, and
        listing the missing names when some expected weight never arrived.
        """
        self._unpack()
        targets = self._targets()
        s = self.shapes
        pad = s.vocab_range[0] + s.vocab_shard - s.vocab_range[1]  # vocab rows past the end
        for head in (self.embed_tokens, self.lm_head):
            if pad and head is not None and head.device.type != "meta":
                head[s.vocab_shard - pad :].zero_()
        loaded: set[str] = set()
        layers = list(self.decoder_layers())
        scheme = self.fp8_scheme
        scales = None
        if scheme is not None and scheme.source == "checkpoint":
            scales = fp8.CheckpointScales(scheme, targets, layers)
        kv_scales: dict[tuple[int, str], float] = {}
        if self.shapes.moe_layers:  # transformers-5 fused expert tensors -> hub names
            weights = moe_mlp.hub_names(weights, self.config.model_type)
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            if name not in targets:
                if scales is not None and scales.accept(name, tensor):
                    continue
                kv = fp8.kv_scale_of(name)
                if kv is not None and kv[0] < len(layers):
                    kv_scales[kv] = float(tensor.float().max())
                    continue
                raise ValueError(
                    f"weight {name!r} is not a parameter of this {self.shapes.__class__.__name__} model"
                )
            weight_map.copy_weight(name, targets[name], tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            )
            raise ValueError(f"weights missing from the checkpoint: {shown}")
        if scales is not None:
            if scales.missing():
                raise ValueError(f"FP8 scales missing from the checkpoint: {scales.missing()[:5]}")
            fp8.finish_layers(layers)
        elif scheme is not None:
            fp8.quantize_layers_online(layers, scheme)
        if self.fp8_scheme is not None and self.embed_tokens.is_cuda:  # the switch, per shape
            fp8.choose_paths(w for layer in layers for w in layer.fp8.values())
        for i, layer in enumerate(layers):
            both = kv_scales.get((i, "kv"), 1.0)
            layer.kv_scale = (kv_scales.get((i, "k"), both), kv_scales.get((i, "v"), both))
        self._pack()

    @property
    def kv_scales(self) -> tuple[tuple[float, float], ...]:
        """Per layer the ``(k_scale, v_scale)`` of an FP8 KV cache (1.0 unless the
        checkpoint gives them): stored K/V are ``k / k_scale`` in e4m3."""
        return tuple(layer.kv_scale for layer in self.decoder_layers())

    _PACKED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def _pack(self) -> None:
        """Pre-pack linear weights for CPU (no-op elsewhere); drop the plain copies."""
        mode = lin.packing_mode()  # once per load
        for layer in self.decoder_layers():
            for name in self._PACKED:
                if name in layer.fp8:
                    continue
                param = getattr(layer, name)
                if param is None:  # a sparse layer: no dense MLP
                    continue
                packed = lin.pack(param, mode)
                if packed is not None:
                    layer.packed[name] = packed
                    self._freed[param] = param.shape
                    param.data = param.data.new_empty(0)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        # the plain copy stays: embedding lookups need it
        self._lm_head_packed = lin.pack(head, mode)

    def _unpack(self) -> None:
        """Undo :meth:`_pack` so weights can be loaded again."""
        for param, shape in self._freed.items():
            param.data = param.data.new_empty(shape)
        self._freed.clear()
        for layer in self.decoder_layers():
            layer.packed.clear()
            if self.fp8_scheme is not None and self.fp8_scheme.source == "online":
                for name in layer.fp8:  # back to the dtype the checkpoint is loaded in
                    p = getattr(layer, name)
                    p.data = torch.empty(p.shape, dtype=self.dtype, device=p.device)
                layer.fp8 = {}
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
        rope: Callable[..., torch.Tensor]
        rope_store: Callable[..., None] | None = None
        # one kernel each: RoPE (+ q/k norm, KV store), SiLU-and-mul, add + RMSNorm (+ router)
        if use_fused_ops(input_ids):
            from pdserve.model import fused_ops

            fused = fused_ops
            table = self.rope_cos_sin

            def rope(x: torch.Tensor, qk_norm: Any = None) -> torch.Tensor:
                fused_ops.rope_inplace(x, table, positions, qk_norm)
                return x

            # an FP8 cache too: the kernel quantizes with the layer's K/V scales
            if self.backend.accepts_stored_kv:
                slots = attn.slot_mapping

                def rope_store(
                    qk: torch.Tensor,
                    v: torch.Tensor,
                    kc: torch.Tensor,
                    vc: torch.Tensor,
                    qk_norm: Any = None,
                    kv_scale: tuple[float, float] = (1.0, 1.0),
                ) -> None:
                    fused_ops.rope_store_kv(
                        qk, v, table, positions, kc, vc, slots, qk_norm, kv_scale
                    )
        else:
            cs = self.rope_cos_sin.index_select(0, positions)[:, None, :]  # [T, 1, D]
            cos, sin = cs.chunk(2, dim=-1)

            def rope(x: torch.Tensor) -> torch.Tensor:
                return apply_rope(x, cos, sin)

        h = self._embed(input_ids)
        delta: torch.Tensor | SplitKPartials | None = None
        for i, layer in enumerate(self.decoder_layers()):
            h, delta = layer(
                h,
                delta,
                rope,
                kv_cache[i][0],
                kv_cache[i][1],
                attn,
                plan,
                self.backend,
                fused,
                rope_store,
            )
        return add_rms_norm(h, delta, self.norm, self.shapes.eps, fused)[1]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, H]``. Vocab-parallel under TP: each rank looks up the ids of
        its rows (others masked to 0), then the ranks' rows are summed."""
        if self._tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        lo, hi = self.shapes.vocab_range
        local = input_ids - lo
        outside = (local < 0) | (local >= hi - lo)
        h = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self._tp.all_reduce_(h.masked_fill_(outside[:, None], 0.0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[N, V]`` float32 (full vocabulary) of hidden states ``[N, H]`` (tied
        embeddings when configured). Under TP a collective: each rank computes its vocab
        rows ``[N, vocab_shard]``, gathered in rank order, the padding dropped.
        out: an ``[N, V]`` float32 tensor to write them into (the cast to fp32 is that
        copy: no extra pass; CUDA graphs share one such buffer), returned; ``None``: a new
        tensor. Without TP or a packed head, on a GPU ``decode_attn_table.FP32_LOGITS``
        lists, the GEMM writes fp32 itself (``linear.logits_fp32``): no 16-bit rounding of
        the logits, no cast pass; every step of that process computes them so."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        if self._tp is None and self._lm_head_packed is None:  # fp32 from the GEMM where listed
            return lin.logits_fp32(hidden, w, out)
        logits = lin.linear(hidden, w, None, self._lm_head_packed)
        if self._tp is not None:
            if hidden.shape[0] == 0:  # every rank has the same rows: all skip the gather
                logits = logits.new_empty((0, self.shapes.vocab))
            else:
                logits = self._tp.all_gather(logits, dim=-1)  # [N, size * vocab_shard]
                V = self.shapes.vocab
                if logits.shape[-1] != V:
                    logits = logits[:, :V]
        if out is None:
            return logits.float().contiguous()
        return out.copy_(logits)
