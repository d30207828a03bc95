"""FP8 (e4m3) weights of the decoder's four linear layers: the checkpoint formats, online
quantization at load, and the matmul.

Formats read (``config.json``'s ``quantization_config``; scales are *multipliers*: the real
weight is ``fp8_weight.float() * scale``, including DeepSeek's ``weight_scale_inv``):

- ``quant_method: "fp8"`` with ``weight_block_size: [bn, bk]`` (Qwen3-FP8, DeepSeek-V3,
  transformers' fine-grained FP8): ``<module>.weight`` e4m3 and ``<module>.weight_scale_inv``
  fp32 ``[ceil(out / bn), ceil(in / bk)]``; ``modules_to_not_convert`` /
  ``ignored_layers`` stay high precision.
- ``quant_method: "fp8"`` without a block size (AutoFP8-style, ``activation_scheme``
  ``static`` or ``dynamic``): ``<module>.weight_scale`` one fp32 per tensor (shape ``[]`` or
  ``[1]``), ``<module>.input_scale`` likewise when static; ``ignored_layers``.
- ``quant_method: "compressed-tensors"`` (``format: float-quantized``; llm-compressor's
  ``FP8``, ``FP8_DYNAMIC``, ``FP8_BLOCK``): ``config_groups.*.weights.strategy`` ``tensor``
  (``weight_scale`` ``[1]``), ``channel`` (``weight_scale`` ``[out, 1]``) or ``block``
  (``weight_scale`` ``[ceil(out / bn), ceil(in / bk)]``, ``block_structure``);
  ``input_scale`` when ``input_activations.dynamic`` is false; ``ignore`` (names or
  ``re:`` patterns).

KV-cache scales of such checkpoints (``model.layers.N.self_attn.k_scale`` / ``v_scale``, or
one ``kv_scale``) are read by :func:`kv_scale_of`.

Whatever the format, a layer holds its weight ``[out, in]`` as ``torch.float8_e4m3fn`` and
one fp32 scale per output row and input group, ``scale [out, ceil(in / group)]`` (a tensor or
channel scale: one group, ``group = in``; a block scale: ``group = bk``, each block row
repeated over its ``bn`` output rows), so fused projections (q|k|v, gate|up) keep each
part's own scales and a tensor-parallel rank takes its rows and groups like the weight's.

``--quantization fp8`` on a bf16/fp16/fp32 checkpoint quantizes at load: e4m3, one scale per
output channel (``amax(row) / 448``); ``--quantization fp8_block`` one per output row and
128 input columns (finer: closer to bf16, see docs/benchmarks.md, but never through
``_scaled_mm``). Under tensor parallelism each rank quantizes its own
share, so a row-parallel weight's (o_proj, down_proj) channel scale is the amax over the
rank's columns: finer than TP 1's, and not the same numbers.

Matmul (:func:`linear`): on CPU the weight is dequantized to the activations' dtype and
multiplied (correct, not fast). On CUDA a few rows run the Triton kernel of
:mod:`pdserve.model.triton_fp8` (e4m3 weights converted in registers, bf16 activations), and
from :func:`scaled_mm_min_rows` rows on, a one-group weight under bf16 activations goes
through ``torch._scaled_mm`` with dynamic per-token activation scales (block-scaled weights stay on
the Triton kernel); the row count of that switch is chosen per shape when the model loads
(:func:`choose_paths`). Static ``input_scale`` values are read and kept (``Fp8Weight``) but the
activations are quantized per token whatever the checkpoint says.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The decoder layer's fused linear parameters and the HF modules each is made of.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
QUANTIZATIONS = ("fp8", "fp8_block")  # values of --quantization besides none
# fp8_block's online scales: one per output row and this many input columns
ONLINE_BLOCK = (1, 128)
# From this many rows on, a one-group FP8 weight of shape (N, K) goes through
# ``torch._scaled_mm`` instead of the Triton kernel. Filled at start on CUDA for the model's
# shapes by :func:`choose_paths` (timed there), unless listed here; scripts/gpu_fp8_check.sh
# measures the same crossover with a configuration sweep (``fp8_kernels.json``). A shape
# neither lists uses DEFAULT_SCALED_MM_MIN_ROWS, read off the H200 figures of issue 26
# (cuBLAS's FP8 path beats bf16 from about 16-64 rows).
SCALED_MM_MIN_ROWS: dict[tuple[int, int], int] = {}
DEFAULT_SCALED_MM_MIN_ROWS = 32
# Row counts :func:`choose_paths` times at start for a shape the table does not list.
PROBE_ROWS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear layers are stored in FP8.

    source: ``checkpoint`` (the safetensors hold e4m3 weights and scales) or ``online``
    (quantized at load from a high-precision checkpoint). scale_kind: ``tensor``,
    ``channel`` or ``block``. block: ``(bn, bk)`` of a block scale, else None.
    scale_name: the checkpoint's scale tensor suffix (``weight_scale`` or
    ``weight_scale_inv``). static_input: the checkpoint carries ``input_scale`` tensors.
    ignored: module names (``model.layers.0.mlp.down_proj``, ``lm_head``) or ``re:``
    patterns that stay high precision.
    """

    source: str
    scale_kind: str
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    static_input: bool = False
    ignored: tuple[str, ...] = ()

    def quantized(self, module: str) -> bool:
        """Whether HF module ``module`` (e.g. ``model.layers.3.self_attn.q_proj``) is FP8."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif module == entry or module.endswith("." + entry) or module.startswith(entry + "."):
                return False
        return True


def _as_dict(qc: Any) -> dict[str, Any] | None:
    if qc is None:
        return None
    if isinstance(qc, Mapping):
        return dict(qc)
    to_dict = getattr(qc, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else None


# The narrowest input block (bk) a block-scaled checkpoint may have: the CUDA kernel's K
# tile holds whole blocks, and Triton's tl.dot needs a K tile of 16 or more
# (pdserve.model.triton_fp8.MIN_DOT_K; published checkpoints use 128).
MIN_BLOCK_K = 16


def _checked_block(bs: Sequence[Any], key: str) -> tuple[int, int]:
    bn, bk = int(bs[0]), int(bs[1])
    if bn < 1 or bk < MIN_BLOCK_K:
        raise ValueError(
            f"{key}: [bn, bk] = {[bn, bk]}: bn must be >= 1 and bk >= {MIN_BLOCK_K} "
            "(the FP8 matmul's K tile holds whole blocks)"
        )
    return bn, bk


def _compressed_tensors_scheme(qc: dict[str, Any]) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"quantization_config.config_groups: one FP8 group is supported, got {len(groups)}"
        )
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
        raise ValueError(
            "quantization_config.config_groups: only 8-bit float weights (FP8) are supported, "
            f"got type {w.get('type')!r} num_bits {w.get('num_bits')!r}"
        )
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(
            f"quantization_config weights.strategy must be tensor, channel or block, got {strategy!r}"
        )
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
            raise ValueError(
                f"quantization_config weights.block_structure: expected [bn, bk], got {bs!r}"
            )
        block = _checked_block(bs, "quantization_config weights.block_structure")
    act = group.get("input_activations") or {}
    static = bool(act) and not act.get("dynamic", False)
    return Fp8Scheme(
        "checkpoint", strategy, block, "weight_scale", static, tuple(qc.get("ignore") or ())
    )


def scheme_from_config(hf_config: Any, quantization: str | None = None) -> Fp8Scheme | None:
    """The :class:`Fp8Scheme` of a model: its checkpoint's ``quantization_config`` when it
    has one (FP8 only), else online per-channel quantization when ``quantization`` is
    ``fp8``, else None (high precision). ValueError naming the key for a quantization
    method or layout that is not supported, or for ``quantization`` not in
    :data:`QUANTIZATIONS`."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    qc = _as_dict(getattr(hf_config, "quantization_config", None))
    if qc is None:
        if quantization == "fp8_block":
            return Fp8Scheme("online", "block", ONLINE_BLOCK)
        return Fp8Scheme("online", "channel") if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt not in ("float-quantized", "naive-quantized", None):
            raise ValueError(
                f"quantization_config.format: {fmt!r} is not supported (float-quantized FP8 is)"
            )
        return _compressed_tensors_scheme(qc)
    if method in ("fp8", "fbgemm_fp8"):
        ignored = tuple(qc.get("ignored_layers") or ()) + tuple(
            qc.get("modules_to_not_convert") or ()
        )
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt: only e4m3 is supported, got {fmt!r}")
        bs = qc.get("weight_block_size")
        if bs is not None:
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2):
                raise ValueError(
                    f"quantization_config.weight_block_size: expected [bn, bk], got {bs!r}"
                )
            block = _checked_block(bs, "quantization_config.weight_block_size")
            return Fp8Scheme("checkpoint", "block", block, "weight_scale_inv", False, ignored)
        static = qc.get("activation_scheme", "dynamic") == "static"
        kind = "channel" if method == "fbgemm_fp8" else "tensor"
        return Fp8Scheme("checkpoint", kind, None, "weight_scale", static, ignored)
    raise ValueError(
        f"quantization_config.quant_method: {method!r} is not supported "
        "(FP8 checkpoints are: fp8, fbgemm_fp8, compressed-tensors)"
    )


@dataclass
class Fp8Weight:
    """One FP8 linear weight (see the module doc).

    weight: ``[out, in]`` ``float8_e4m3fn``; scale: ``[out, ceil(in / group)]`` fp32, the
    multiplier of row ``n`` over input columns ``[g * group, (g + 1) * group)``; group:
    input columns per scale (``in`` for one group); input_scale: the checkpoint's static
    activation scale (fp32 scalar) or None (kept, not used by the kernels).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    group: int
    input_scale: torch.Tensor | None = None
    _scale_row: torch.Tensor | None = field(default=None, repr=False)

    @property
    def one_group(self) -> bool:
        """One scale per output row (tensor or channel scales)."""
        return self.scale.shape[1] == 1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weight ``[out, in]`` in ``dtype`` (computed in fp32, then cast)."""
        w = self.weight.float()
        s = self.scale
        if s.shape[1] > 1:
            s = s.repeat_interleave(self.group, dim=1)[:, : w.shape[1]]
        return (w * s).to(dtype)

    def __post_init__(self) -> None:
        # made here, not on first use: a first use inside a CUDA-graph capture would
        # allocate it from the graph's pool
        if self.one_group:
            self._scale_row = self.scale[:, 0].reshape(1, -1).contiguous()

    def scale_row(self) -> torch.Tensor:
        """``[1, out]`` fp32 contiguous (``_scaled_mm``'s ``scale_b``); one-group weights
        (ValueError otherwise)."""
        if self._scale_row is None:
            raise ValueError("scale_row: a block-scaled weight has no per-row scale")
        return self._scale_row


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization of ``w [out, in]`` with one scale per output row: returns
    ``(q [out, in] float8_e4m3fn, scale [out, 1] fp32)`` with ``w ≈ q.float() * scale``
    (``scale = amax(|row|) / 448``; an all-zero row gets scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization of ``w [out, in]`` with one scale per ``block`` ``(bn, bk)`` tile,
    as block-scaled checkpoints store it: ``(q [out, in] float8_e4m3fn, scale
    [ceil(out / bn), ceil(in / bk)] fp32)``. For tests and tools writing such checkpoints."""
    bn, bk = block
    out, inp = w.shape
    wf = w.float()
    pad = torch.zeros(-(-out // bn) * bn, -(-inp // bk) * bk, device=w.device)
    pad[:out, :inp] = wf
    tiles = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view_as(pad)[:out, :inp]
    return q.to(FP8).contiguous(), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization with one scale for the whole tensor: ``(q, scale [] fp32)``."""
    wf = w.float()
    amax = wf.abs().max()
    scale = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
    return (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(())


# ------------------------------------------------------------------ layer parameters
class Fp8Layer(Protocol):
    """What a decoder layer (``llama.LlamaDecoderLayer``) keeps of its FP8 linears:
    fp8_names: its fused parameters stored in e4m3; fp8_groups: input columns per scale of
    each; fp8_input_scales: a checkpoint's static activation scale of each; fp8: the
    weights the forward uses (:func:`finish_layers`). The parameters themselves
    (``qkv_proj``, ``qkv_proj_scale``, ...) are read and set by name."""

    fp8: dict[str, Fp8Weight]
    fp8_names: tuple[str, ...]
    fp8_groups: dict[str, int]
    fp8_input_scales: dict[str, torch.Tensor]


def _group_of(scheme: Fp8Scheme, in_features: int) -> int:
    return scheme.block[1] if scheme.scale_kind == "block" and scheme.block else in_features


def _layer_modules(i: int, name: str) -> list[str]:
    return [f"model.layers.{i}.{m}" for m in FUSED_MODULES[name]]


def quantized_names(scheme: Fp8Scheme, layer_index: int, layer: Any = None) -> tuple[str, ...]:
    """The fused parameters of layer ``layer_index`` stored in FP8 under ``scheme`` (of
    those ``layer`` has: a mixture-of-experts layer has no dense MLP, and its experts stay
    high precision). ValueError naming the module when a fused projection is only partly
    excluded."""
    names = []
    for name in FUSED_MODULES:
        if layer is not None and getattr(layer, name, None) is None:
            continue
        flags = {scheme.quantized(m) for m in _layer_modules(layer_index, name)}
        if len(flags) > 1:
            raise ValueError(
                f"quantization_config: {', '.join(_layer_modules(layer_index, name))} are one "
                "fused projection here; exclude all of them or none"
            )
        if flags.pop():
            names.append(name)
    return tuple(names)


def prepare_checkpoint_layers(layers: Iterable[Fp8Layer], scheme: Fp8Scheme) -> None:
    """Before loading an FP8 checkpoint: make each quantized fused parameter of each layer
    an e4m3 parameter of the same shape and add its ``<name>_scale`` parameter
    ``[out, ceil(in / group)]`` fp32 (1.0 until loaded), on the same device."""
    for i, layer in enumerate(layers):
        names = quantized_names(scheme, i, layer)
        layer.fp8_names = names
        for name in names:
            p = getattr(layer, name)
            out, inp = p.shape
            group = _group_of(scheme, inp)
            setattr(
                layer,
                name,
                nn.Parameter(
                    torch.empty((out, inp), dtype=FP8, device=p.device), requires_grad=False
                ),
            )
            scale = torch.ones((out, -(-inp // group)), dtype=torch.float32, device=p.device)
            setattr(layer, name + "_scale", nn.Parameter(scale, requires_grad=False))
            layer.fp8_groups[name] = group


class CheckpointScales:
    """Takes the scale tensors of an FP8 checkpoint as :meth:`LlamaForCausalLM.load_weights`
    meets them and writes them into the layers' ``<name>_scale`` parameters (this rank's
    rows and groups).

    targets: the model's weight targets (``weight_map.weight_targets``: where each
    ``<module>.weight`` lands); layers: the decoder layers prepared by
    :func:`prepare_checkpoint_layers`.
    """

    def __init__(
        self, scheme: Fp8Scheme, targets: Mapping[str, Any], layers: Sequence[Fp8Layer]
    ) -> None:
        self.scheme = scheme
        self.layers = layers
        self.expected: dict[str, tuple[Any, Fp8Layer, str]] = {}
        self.inputs: dict[str, tuple[Fp8Layer, str]] = {}
        self.seen: set[str] = set()
        for i, layer in enumerate(layers):
            for name in layer.fp8_names:
                for module in _layer_modules(i, name):
                    t = targets[module + ".weight"]
                    self.expected[f"{module}.{scheme.scale_name}"] = (t, layer, name)
                    self.inputs[f"{module}.input_scale"] = (layer, name)

    def accept(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """Take ``hf_name`` if it is a scale of this checkpoint (True), else False.
        ValueError naming it on a shape that fits no scale layout."""
        if hf_name in self.inputs:
            layer, name = self.inputs[hf_name]
            if tensor.numel() == 0:
                raise ValueError(f"weight {hf_name!r} is empty")
            value = tensor.float().max().reshape(())
            old = layer.fp8_input_scales.get(name)
            layer.fp8_input_scales[name] = value if old is None else torch.maximum(old, value)
            return True
        if hf_name not in self.expected:
            return False
        t, layer, name = self.expected[hf_name]
        full_out, full_in = t.full_shape()
        rows = self._expand(hf_name, tensor.float(), full_out, full_in)  # [full_out, groups]
        group = layer.fp8_groups[name]
        if t.dim == 0:  # column-parallel: this rank's output rows
            rows = rows[t.start : t.end]
        elif rows.shape[1] > 1:  # row-parallel, block scales: this rank's input groups
            if t.start % group:
                raise ValueError(
                    f"weight {hf_name!r}: this rank's input columns start at {t.start}, not "
                    f"on a {group}-column scale block (tensor_parallel_size does not fit "
                    "the block size)"
                )
            rows = rows[:, t.start // group : -(-t.end // group)]
        dest = getattr(layer, name + "_scale")[t.lo : t.hi]
        if tuple(rows.shape) != tuple(dest.shape):
            raise ValueError(
                f"weight {hf_name!r}: scales of shape {tuple(rows.shape)} after expansion, "
                f"expected {tuple(dest.shape)}"
            )
        if dest.device.type != "meta":
            dest.copy_(rows)
        self.seen.add(hf_name)
        return True

    def _expand(self, hf_name: str, s: torch.Tensor, out: int, inp: int) -> torch.Tensor:
        """A checkpoint scale as ``[out, groups]`` (groups: 1, or ``ceil(in / bk)``)."""
        kind = self.scheme.scale_kind
        if kind == "block" and self.scheme.block is not None:
            bn, bk = self.scheme.block
            want = (-(-out // bn), -(-inp // bk))
            if tuple(s.shape) != want:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(s.shape)}, expected {want}")
            return s.repeat_interleave(bn, dim=0)[:out]
        if s.numel() == 1:
            return s.reshape(1, 1).expand(out, 1)
        if s.numel() == out:
            return s.reshape(out, 1)
        raise ValueError(
            f"weight {hf_name!r} has shape {tuple(s.shape)}, expected one scale or {out} (one per output channel)"
        )

    def missing(self) -> list[str]:
        """Scale tensors the checkpoint should have had and did not."""
        return sorted(set(self.expected) - self.seen)


def finish_layers(layers: Iterable[Fp8Layer]) -> None:
    """After loading: each layer's ``fp8`` map (fused name -> :class:`Fp8Weight`) over its
    e4m3 parameters and scales, for the forward (:func:`linear`)."""
    for layer in layers:
        layer.fp8 = {
            name: Fp8Weight(
                getattr(layer, name).data,
                getattr(layer, name + "_scale").data,
                layer.fp8_groups[name],
                layer.fp8_input_scales.get(name),
            )
            for name in layer.fp8_names
        }


def quantize_layers_online(layers: Sequence[Fp8Layer], scheme: Fp8Scheme) -> None:
    """``--quantization fp8`` / ``fp8_block`` after a high-precision load: each quantized
    fused parameter becomes e4m3 with one scale per output channel
    (:func:`quantize_per_channel`), or per output row and 128 input columns
    (``fp8_block``: :func:`quantize_block` with :data:`ONLINE_BLOCK`), in place of its
    high-precision copy, which is freed."""
    for i, layer in enumerate(layers):
        names = quantized_names(scheme, i, layer)
        layer.fp8_names = names
        for name in names:
            p = getattr(layer, name)
            if p.device.type == "meta":
                continue
            if scheme.scale_kind == "block" and scheme.block is not None:
                group = min(scheme.block[1], p.shape[1])
                q, scale = quantize_block(p.data, (1, group))
            else:
                group = p.shape[1]
                q, scale = quantize_per_channel(p.data)
            p.data = q
            setattr(layer, name + "_scale", nn.Parameter(scale, requires_grad=False))
            layer.fp8_groups[name] = group
    finish_layers(layers)


# ------------------------------------------------------------------ KV-cache scales
_KV_SCALE = re.compile(
    r"model\.layers\.(\d+)\.self_attn\.(?:(k|v)_scale|kv_scale|(k|v)_proj\.output_scale)$"
)


def kv_scale_of(hf_name: str) -> tuple[int, str] | None:
    """``(layer, "k" | "v" | "kv")`` when ``hf_name`` is a KV-cache scale of an FP8
    checkpoint (``model.layers.N.self_attn.k_scale`` / ``v_scale`` / ``kv_scale``, or the
    older ``k_proj.output_scale`` / ``v_proj.output_scale``), else None."""
    m = _KV_SCALE.match(hf_name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) or m.group(3) or "kv"


# ------------------------------------------------------------------ matmul
def scaled_mm_min_rows(n: int, k: int) -> int:
    """Rows from which a one-group ``[n, k]`` FP8 weight runs ``torch._scaled_mm``."""
    return SCALED_MM_MIN_ROWS.get((n, k), DEFAULT_SCALED_MM_MIN_ROWS)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 quantization of activations ``x [M, K]``: ``(xq [M, K]
    float8_e4m3fn, scale [M, 1] fp32)`` with ``x ≈ xq.float() * scale``."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ real(w).T + bias`` through ``torch._scaled_mm`` (CUDA, one-group
    weights; K and N multiples of 16): activations quantized per token, the weight's
    per-channel scales applied by cuBLAS, output in x's dtype."""
    xq, xs = quantize_rows(x)
    out: torch.Tensor = torch._scaled_mm(
        xq, w.weight.t(), scale_a=xs, scale_b=w.scale_row(), out_dtype=x.dtype
    )
    return out if bias is None else out.add_(bias)


def linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ real(w).T + bias`` -> ``[M, N]`` in x's dtype (see the module doc for
    which path runs where)."""
    if not x.is_cuda:
        return F.linear(x, w.dequantize(x.dtype), bias)
    n, k = w.weight.shape
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    if (
        w.one_group
        and x.dtype == torch.bfloat16  # _scaled_mm's row-wise scaling writes bf16 only
        and m >= scaled_mm_min_rows(n, k)
        and n % 16 == 0
        and k % 16 == 0
    ):
        return scaled_mm(x, w, bias)
    from pdserve.model import triton_fp8

    return triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group, bias)


def _time_us(fn: Any, iters: int = 10) -> float:
    """Mean µs of ``fn()`` on the current CUDA stream (after one warm-up call)."""
    fn()  # compile / warm up
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return 1e3 * float(start.elapsed_time(end)) / iters


def _scaled_mm_wins(w: Fp8Weight, m: int) -> bool:
    """Whether ``_scaled_mm`` beats the Triton kernel on ``m`` bf16 rows times ``w``."""
    from pdserve.model import triton_fp8

    x = torch.randn(m, w.weight.shape[1], device=w.weight.device, dtype=torch.bfloat16)
    tri = _time_us(lambda: triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group))
    return _time_us(lambda: scaled_mm(x, w, None)) < tri


def choose_paths(weights: Iterable[Fp8Weight]) -> dict[tuple[int, int], int]:
    """At start, on CUDA: for each one-group weight shape ``(N, K)`` that
    :data:`SCALED_MM_MIN_ROWS` does not list, time the Triton kernel and ``_scaled_mm`` at
    :data:`PROBE_ROWS` rows (bf16 activations, 10 calls each) and record the first row
    count where ``_scaled_mm`` is faster (past the last: never) in the table, which
    :func:`linear` reads. Returns what it recorded. A failure (a shape cuBLAS refuses, no
    GPU) is logged and leaves the default for that shape."""
    chosen: dict[tuple[int, int], int] = {}
    seen: set[tuple[int, int]] = set()
    for w in weights:
        n, k = w.weight.shape
        if not (w.weight.is_cuda and w.one_group) or (n, k) in seen or (n, k) in SCALED_MM_MIN_ROWS:
            continue
        seen.add((n, k))
        try:
            rows = next((m for m in PROBE_ROWS if _scaled_mm_wins(w, m)), PROBE_ROWS[-1] + 1)
        except Exception as exc:  # noqa: BLE001 keep the default for this shape
            logger.warning(
                "FP8 path choice for shape (%d, %d) failed (%s); default kept", n, k, exc
            )
            continue
        SCALED_MM_MIN_ROWS[(n, k)] = chosen[(n, k)] = rows
    if chosen:
        logger.info("FP8 linears: _scaled_mm from these rows on, by shape: %s", chosen)
    return chosen
