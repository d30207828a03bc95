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
multiplied (correct, not fast). On CUDA, a one-group weight under bf16 activations runs one
of five paths (:data:`Path`), chosen per shape and row count when the model loads by timing
them on the card (:func:`choose_paths`): the one-row FP8 GEMV, the w8a8 Triton GEMM and its
tiles on bf16 activations of :mod:`pdserve.model.triton_w8a8`, ``torch._scaled_mm``, or the
w8a16 kernel of :mod:`pdserve.model.triton_fp8` (e4m3 weights converted in registers); ``w8a8`` and
``_scaled_mm`` quantize the activations per token (:func:`quantize_rows`: one Triton
launch on CUDA). Block-scaled weights and other activation dtypes run the w8a16 kernel.
Static ``input_scale`` values are read and kept (``Fp8Weight``) but the activations are
quantized per token whatever the checkpoint says.
"""

from __future__ import annotations

import logging
import math
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
# A path of ``linear`` for one-group weights under bf16 activations on CUDA: (kind, config)
# with kind ``scaled_mm`` (torch._scaled_mm, activations quantized per token by
# triton_w8a8.quantize_rows; config None), ``w8a8`` (triton_w8a8.w8a8, same activations;
# config a triton_w8a8.W8a8Config), ``w8a16s`` (triton_w8a8.linear_w8a16: the w8a8 kernel's
# tiles on bf16 activations, the weight tile converted in registers; a W8a8Config), ``gemv``
# (one row, bf16 activations; triton_w8a8.GemvConfig) or ``w8a16`` (triton_fp8.fp8_matmul,
# bf16 activations; its Config, None for its own choice).
Path = tuple[str, Any]
PATH_KINDS = ("scaled_mm", "w8a8", "w8a16s", "gemv", "w8a16")
# (N, K) -> ((largest M, path), ...) ascending in M: the path of a call with M rows is that of
# the first entry whose largest M is >= M, past the last that of the last. Filled at start on
# CUDA for the model's shapes by :func:`choose_paths` (each path timed on the card at
# :data:`PROBE_ROWS`); a shape it does not list runs :func:`default_path`.
PATHS: dict[tuple[int, int], tuple[tuple[int, Path], ...]] = {}
# From this many rows on :func:`default_path` takes ``_scaled_mm`` (issue 26's H200 figures:
# cuBLAS's FP8 path beats bf16 from about 16-64 rows).
DEFAULT_SCALED_MM_MIN_ROWS = 32
# Row counts :func:`choose_paths` times at start (the decode graphs' buckets are powers of
# two up to 64, then multiples; a count between two probes takes the larger probe's path, a
# count past 1,024 (prefill) that of 1,024: on the H200 _scaled_mm, which also measured
# fastest of every candidate at 4,096 and 16,384 rows, docs/benchmarks.md row AK).
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
# What :func:`choose_paths` measured: (N, K) -> {rows: {str(path): µs}} (for logs and scripts).
PATH_TIMINGS: dict[tuple[int, int], dict[int, dict[str, float]]] = {}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 quantization of activations ``x [M, K]``: ``(xq [M, K]
    float8_e4m3fn, scale [M, 1] fp32)`` with ``x ≈ xq.float() * scale``, ``scale =
    max(amax(|row|), 1e-12) * fp32(1 / 448)``. On CUDA one Triton launch
    (:func:`pdserve.model.triton_w8a8.quantize_rows`, the same bits); elsewhere torch."""
    if x.is_cuda:
        from pdserve.model import triton_w8a8

        return triton_w8a8.quantize_rows(x)
    return quantize_rows_torch(x)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in torch operations (any device; the reference of the Triton
    kernel). The scale is ``amax`` times the fp32 reciprocal of 448 (what torch's CUDA
    division by a scalar computes, written so that CPU and CUDA give the same bits)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12)
    scale = amax * (1.0 / FP8_MAX)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ real(w).T + bias`` through ``torch._scaled_mm`` (CUDA, one-group
    weights; K and N multiples of 16): activations quantized per token
    (:func:`quantize_rows`), the weight's per-channel scales applied by cuBLAS, output in
    x's dtype."""
    xq, xs = quantize_rows(x)
    return scaled_mm_quantized(xq, xs, w, bias, x.dtype)


def scaled_mm_quantized(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(xq [M, K] e4m3 * xs [M, 1]) @ real(w).T + bias`` -> ``[M, N]`` in ``out_dtype``
    through ``torch._scaled_mm`` (rows quantized already, e.g. by the add + RMSNorm
    kernel: :func:`add_rms_norm_linear`); the weight's per-channel scales applied by
    cuBLAS."""
    out: torch.Tensor = torch._scaled_mm(
        xq, w.weight.t(), scale_a=xs, scale_b=w.scale_row(), out_dtype=out_dtype
    )
    return out if bias is None else out.add_(bias)


def default_path(m: int, n: int, k: int) -> Path:
    """The path of ``m`` rows of an ``[n, k]`` one-group weight that :func:`choose_paths`
    did not time: ``_scaled_mm`` from :data:`DEFAULT_SCALED_MM_MIN_ROWS` rows on (N and K
    multiples of 16), else the w8a16 Triton kernel with its own configuration."""
    if m >= DEFAULT_SCALED_MM_MIN_ROWS and n % 16 == 0 and k % 16 == 0:
        return ("scaled_mm", None)
    return ("w8a16", None)


def path_for(m: int, n: int, k: int) -> Path:
    """The path :func:`linear` takes for ``m`` bf16 rows of a one-group ``[n, k]`` weight on
    CUDA: the :data:`PATHS` entry of the smallest listed M >= ``m``, past the last the last
    one (a path timed, so one that runs); for a shape not listed, :func:`default_path`."""
    entries = PATHS.get((n, k))
    if not entries:
        return default_path(m, n, k)
    for m_max, path in entries:
        if m <= m_max:
            return path
    return entries[-1][1]


def run_path(path: Path, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ real(w).T + bias`` by ``path`` (see :data:`Path`; CUDA, one-group
    weights for every kind but ``w8a16``). ValueError for an unknown kind."""
    kind, config = path
    if kind == "scaled_mm":
        return scaled_mm(x, w, bias)
    if kind in ("w8a8", "w8a16s", "gemv"):
        from pdserve.model import triton_w8a8

        if kind == "gemv":
            return triton_w8a8.gemv(x, w.weight, w.scale, bias, config)
        if kind == "w8a16s":
            return triton_w8a8.linear_w8a16(x, w.weight, w.scale, bias, config)
        return triton_w8a8.linear_w8a8(x, w.weight, w.scale, bias, config)
    if kind == "w8a16":
        from pdserve.model import triton_fp8

        return triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group, bias, config)
    raise ValueError(f"FP8 path kind {kind!r} is not one of {', '.join(PATH_KINDS)}")


def linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ real(w).T + bias`` -> ``[M, N]`` in x's dtype (see the module doc for
    which path runs where)."""
    if not x.is_cuda:
        return F.linear(x, w.dequantize(x.dtype), bias)
    n, k = w.weight.shape
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    if w.one_group and x.dtype == torch.bfloat16:
        return run_path(path_for(m, n, k), x, w, bias)
    from pdserve.model import triton_fp8

    return triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group, bias)


# Whether a one-row step's SwiGLU activation runs inside the down projection's FP8 gemv
# (linear_silu_mul) when that shape's one-row path is the gemv: one launch a layer fewer
# for recomputing silu(gate) * up in each of its programs (~N / BLOCK_N times over).
# Off: the H200 timed both the same (scripts/gpu_fp8_attn_probe.py, 2026-12-03: [4096,
# 14336] with the one-row tile 8 x 1024, silu_mul then gemv 18.6 µs, fused 18.7 µs a layer;
# in the engine's one-row step under PDL, scripts/gpu_s7_fp8row.sh: 2.769 ms fused, 2.745 not).
FUSE_SILU_GEMV = False


def linear_silu_mul(
    gate_up: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``(silu(gate) * up) @ real(w).T + bias`` of one row ``gate_up = [gate | up]``
    ``[1, 2K]`` bf16 -> ``[1, N]`` in one launch (the FP8 gemv with the activation computed
    as x is loaded) when :data:`FUSE_SILU_GEMV` is on and :func:`path_for` gives this
    shape's one row the gemv (CUDA, one-group weight); None otherwise (the caller runs the
    activation, then :func:`linear`)."""
    if not (FUSE_SILU_GEMV and gate_up.is_cuda and gate_up.dim() == 2):
        return None
    n, k = w.weight.shape
    if gate_up.shape != (1, 2 * k) or gate_up.dtype != torch.bfloat16 or not w.one_group:
        return None
    kind, config = path_for(1, n, k)
    if kind != "gemv":
        return None
    from pdserve.model import triton_w8a8

    return triton_w8a8.gemv(gate_up, w.weight, w.scale, bias, config, silu_mul=True)


# Whether an FP8 linear whose path quantizes its rows (``w8a8``) takes them from the add +
# RMSNorm kernel before it (``fused_ops.add_rms_norm_quant``: one launch a linear fewer,
# the same bits). On: the H200's one-row FP8 step under PDL 2.712 ms with it, 2.745
# without, 364 -> 332 kernels, the same greedy tokens (scripts/gpu_s7_fp8row.sh).
FUSE_NORM_QUANT = True
# The same for a linear whose path is ``_scaled_mm`` (from 128-256 rows on the H200: large
# decode batches and prefill chunks): the norm's kernel writes the e4m3 rows and their
# scales, ``quantize_rows``'s launch (a read of the 16-bit rows, a write of the 8-bit ones)
# is saved; the same bits. On: the H200's 1,024-row FP8 + e4m3-KV decode step (graphs
# captured again in one engine, scripts/gpu_s9_fp8big.py) 22.08 ms with it against 22.60
# without (medians of 8 steps); quantize_rows alone at 1,024 x 4,096 6.5 µs a launch.
FUSE_NORM_QUANT_SCALED_MM = True


def add_rms_norm_linear(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: Fp8Weight | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(h + delta, rms_norm(h + delta) @ real(w).T + bias)`` with the norm's output
    quantized per token inside the add + RMSNorm kernel (``fused_ops.add_rms_norm_quant``)
    and handed to the ``w8a8`` kernel (or ``_scaled_mm``) as e4m3 rows: the bits of the add
    + RMSNorm kernel followed by :func:`linear`. h, delta ``[T, K]`` bf16 on CUDA; ``[T, N]``
    out. Only when :data:`FUSE_NORM_QUANT` is on, w is a one-group FP8 weight and
    :func:`path_for` gives these rows ``w8a8`` (or ``scaled_mm`` with
    :data:`FUSE_NORM_QUANT_SCALED_MM` on); None otherwise (the caller runs the norm, then
    :func:`linear`)."""
    if not (FUSE_NORM_QUANT and w is not None and w.one_group and h.is_cuda):
        return None
    if h.dim() != 2 or h.dtype != torch.bfloat16 or h.shape[0] == 0:
        return None
    n, k = w.weight.shape
    kind, config = path_for(h.shape[0], n, k)
    if kind != "w8a8" and not (kind == "scaled_mm" and FUSE_NORM_QUANT_SCALED_MM):
        return None
    from pdserve.model import fused_ops, triton_w8a8

    h, xq, xs = fused_ops.add_rms_norm_quant(h, delta, norm_weight, eps)
    if kind == "scaled_mm":
        return h, scaled_mm_quantized(xq, xs, w, bias, h.dtype)
    return h, triton_w8a8.w8a8(xq, xs, w.weight, w.scale, bias, h.dtype, config)


# Whether an FP8 linear whose path quantizes its rows (``scaled_mm`` or ``w8a8``) and whose
# input is SwiGLU's output (the down projection) takes its e4m3 rows and scales from the
# SwiGLU kernel (``fused_ops.silu_mul_quant``: one launch and a 16-bit [T, I] write and read
# fewer; the same bits as silu_mul then quantize_rows). On: the H200 (scripts/gpu_s10_fp8big.py,
# [T, 2 x 14,336] bf16, µs) 8.3 -> 6.3 at 16 rows, 10.5 -> 6.4 at 64, 50.8 -> 39.2 at 1,024,
# 722 -> 557 at a 16,384-token chunk, the same bits at every T; in one FP8 + e4m3-KV engine
# the 1,024-prompt run's first token 1.988 / 1.989 s against 2.046 with it off.
FUSE_SILU_QUANT = True


def silu_mul_linear(
    gate_up: torch.Tensor, w: Fp8Weight | None, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``(silu(gate) * up) @ real(w).T + bias`` of ``gate_up = [gate | up]`` ``[T, 2K]`` bf16
    on CUDA -> ``[T, N]``, with SwiGLU's output quantized per token inside the SwiGLU kernel
    (``fused_ops.silu_mul_quant``) and handed as e4m3 rows to ``_scaled_mm`` or the ``w8a8``
    kernel: the bits of ``fused_ops.silu_mul`` followed by :func:`linear`. Only when
    :data:`FUSE_SILU_QUANT` is on, w is a one-group FP8 ``[N, K]`` weight and :func:`path_for`
    gives these rows ``scaled_mm`` or ``w8a8``; None otherwise (the caller runs the
    activation, then :func:`linear`)."""
    if not (FUSE_SILU_QUANT and w is not None and w.one_group and gate_up.is_cuda):
        return None
    if gate_up.dim() != 2 or gate_up.dtype != torch.bfloat16 or gate_up.shape[0] == 0:
        return None
    n, k = w.weight.shape
    if gate_up.shape[1] != 2 * k or gate_up.stride(1) != 1:
        return None
    kind, config = path_for(gate_up.shape[0], n, k)
    if kind not in ("scaled_mm", "w8a8"):
        return None
    from pdserve.model import fused_ops, triton_w8a8

    xq, xs = fused_ops.silu_mul_quant(gate_up)
    if kind == "scaled_mm":
        return scaled_mm_quantized(xq, xs, w, bias, gate_up.dtype)
    return triton_w8a8.w8a8(xq, xs, w.weight, w.scale, bias, gate_up.dtype, config)


def time_us(fns: Sequence[Any], reps: int = 24) -> float:
    """Mean µs of one call, calling ``fns[i % len(fns)]`` (e.g. the same matmul over
    several weights, so that they do not all sit in L2), replayed in a CUDA graph of
    ``reps`` calls (launch costs as in the engine's decode graphs); eager calls timed on the
    stream when the capture fails. Each fn is called once before (compiles, warm-up)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    try:
        g = torch.cuda.CUDAGraph()
        # thread_local: another thread of the process allocating meanwhile is not an error
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for i in range(reps):
                fns[i % len(fns)]()
        g.replay()
        start.record()
        for _ in range(3):
            g.replay()
        end.record()
        end.synchronize()
        return 1e3 * float(start.elapsed_time(end)) / (3 * reps)
    except RuntimeError:
        torch.cuda.synchronize()
    start.record()
    for i in range(reps):
        fns[i % len(fns)]()
    end.record()
    end.synchronize()
    return 1e3 * float(start.elapsed_time(end)) / reps


def candidate_paths(m: int, n: int, k: int) -> list[Path]:
    """The paths :func:`choose_paths` times for ``m`` rows of an ``[n, k]`` one-group
    weight: the w8a16 kernel's own choice; at one row the gemv tiles
    (:data:`pdserve.model.triton_w8a8.GEMV_CANDIDATES`); w8a8 tiles
    (:func:`pdserve.model.triton_w8a8.candidate_configs`), the first two of them (64 weight
    rows, K whole or split) on bf16 activations too (``w8a16s``) from 2 to 64 rows;
    ``_scaled_mm`` from 16 rows on when N and K are multiples of 16."""
    from pdserve.model import triton_w8a8

    paths: list[Path] = [("w8a16", None)]
    if m == 1:
        paths += [("gemv", c) for c in triton_w8a8.GEMV_CANDIDATES]
    tiles = triton_w8a8.candidate_configs(m, n, k)
    paths += [("w8a8", c) for c in tiles]
    if 2 <= m <= 64:
        paths += [("w8a16s", c) for c in tiles[:2]]
    if m >= 16 and n % 16 == 0 and k % 16 == 0:
        paths.append(("scaled_mm", None))
    return paths


# A candidate whose output is further than this from ``x @ real(w).T`` (largest |error| ÷
# largest |output|) is not chosen: per-token e4m3 activations cost ~0.02-0.035 on random
# weights (issue 26's H200 figures); a kernel that computes garbage is far above.
CHOICE_MAX_ERROR = 0.1


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in fp32 (a float; inf when ref is all zero and out
    is not)."""
    diff = (out.float() - ref.float()).abs().max()
    scale = ref.float().abs().max()
    return float(diff / scale) if float(scale) > 0 else (0.0 if float(diff) == 0 else math.inf)


def _time_path(path: Path, fns: Sequence[Any]) -> float:
    return time_us(fns)


def choose_paths(
    weights: Iterable[Fp8Weight],
    rows: Sequence[int] = PROBE_ROWS,
    copies: int = 8,
    timer: Any = _time_path,
) -> dict[tuple[int, int], tuple[tuple[int, Path], ...]]:
    """At start, on CUDA: for each one-group weight shape ``(N, K)`` that :data:`PATHS` does
    not list, the measured entry of :data:`pdserve.model.fp8_paths_table.TABLE` for this
    card when it has one; else time every :func:`candidate_paths` at each of ``rows`` (bf16 activations, in a
    CUDA graph, over up to ``copies`` weights of that shape so that L2 does not hold them)
    and record the fastest per row count in :data:`PATHS`, which :func:`linear` reads.
    Returns what it recorded. A candidate that fails (a tile Triton cannot build, a shape
    cuBLAS refuses, an output further than :data:`CHOICE_MAX_ERROR` from the dequantized
    product) is logged and left out; a shape where all fail keeps
    :func:`default_path`. timer: ``timer(path, fns) -> µs`` (default :func:`time_us` of
    fns; tests pass their own). Weights on CUDA only (the caller checks)."""
    from pdserve.model import fp8_paths_table

    by_shape: dict[tuple[int, int], list[Fp8Weight]] = {}
    for w in weights:
        n, k = w.weight.shape
        if w.one_group and (n, k) not in PATHS:
            group = by_shape.setdefault((n, k), [])
            if len(group) < copies:
                group.append(w)
    chosen: dict[tuple[int, int], tuple[tuple[int, Path], ...]] = {}
    for (n, k), ws in by_shape.items():
        dev = ws[0].weight.device
        card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
        measured = fp8_paths_table.TABLE.get((card, n, k))
        if measured is not None:
            PATHS[(n, k)] = chosen[(n, k)] = measured
            continue
        entries: list[tuple[int, Path]] = []
        timings: dict[int, dict[str, float]] = {}
        real = ws[0].dequantize(torch.float32)
        for m in sorted(rows):
            x = torch.randn(m, k, device=ws[0].weight.device, dtype=torch.bfloat16)
            ref = x.float() @ real.T
            best: tuple[float, Path] | None = None
            for path in candidate_paths(m, n, k):
                try:
                    err = relative_error(run_path(path, x, ws[0], None), ref)
                    if not err < CHOICE_MAX_ERROR:
                        raise ValueError(f"wrong result: error {err:.3g} of the largest output")
                    us = timer(path, [lambda w=w, p=path, x=x: run_path(p, x, w, None) for w in ws])
                except Exception as exc:  # noqa: BLE001 leave this candidate out
                    logger.warning(
                        "FP8 path %s for (%d, %d) x %d rows failed: %s", path, n, k, m, exc
                    )
                    if x.is_cuda:
                        torch.cuda.synchronize()
                    continue
                timings.setdefault(m, {})[str(path)] = us
                if best is None or us < best[0]:
                    best = (us, path)
            if best is not None:
                entries.append((m, best[1]))
        if entries:
            PATHS[(n, k)] = chosen[(n, k)] = tuple(entries)
        PATH_TIMINGS[(n, k)] = timings
        logger.debug("FP8 path timings for (%d, %d), µs: %s", n, k, timings)
    if chosen:
        logger.info(
            "FP8 linears, path by shape and rows: %s",
            {shape: [(m, p[0]) for m, p in e] for shape, e in chosen.items()},
        )
    return chosen
