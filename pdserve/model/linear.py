"""CPU weight pre-packing for linear layers (oneDNN), with a plain ``F.linear`` fallback; on
CUDA a measured Triton GEMV for the few-row shapes where it beat cuBLAS (``gemv_table``).

On CPU, a weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) runs faster than ``F.linear`` (same bits in
bf16; in fp32 a larger rounding error, enough to move log-probs off transformers'). Hence
``PDSERVE_CPU_PACKED_LINEAR``: ``auto`` (default) packs bf16 only, ``all`` fp32 too, ``none``
nothing. Packing is also skipped off CPU, for other dtypes, and when the ops are missing.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pdserve import envs
from pdserve.model import decode_attn_table, gemv_table, skinny_table

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Whether a down projection the GEMV runs also computes SwiGLU's ``silu(gate) * up`` (one
# kernel instead of two; see :func:`silu_mul_linear`). Off: slower on the H200, since every
# program recomputes the activation of the whole row (docs/benchmarks.md, "Notes moved from
# model/server/router docstrings").
FUSE_SILU_MUL = False


def packing_mode() -> str:
    """``PDSERVE_CPU_PACKED_LINEAR`` (``auto``, ``all`` or ``none``), read once per model
    load by the caller and passed to :func:`pack`."""
    return envs.CPU_PACKED_LINEAR.get()


def packing_supported(weight: torch.Tensor, mode: str) -> bool:
    """Whether ``weight`` ``[out, in]`` can be pre-packed here (CPU, fp32/bf16, ops present)
    under packing ``mode`` (:func:`packing_mode`)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or mode == "none":
        return False
    if weight.dtype == torch.float32 and mode != "all":
        return False
    # torch.backends.mkldnn.is_available carries no annotations in torch.
    mkldnn_available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if not mkldnn_available or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor, mode: str, batch_hint: int = 16) -> torch.Tensor | None:
    """The oneDNN-packed copy of ``weight`` ``[out, in]``, or ``None`` when unsupported or
    ``mode`` (:func:`packing_mode`) leaves it plain."""
    if not packing_supported(weight, mode):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        return packed
    except RuntimeError as exc:  # e.g. a torch build without this kernel
        logger.info("CPU linear pre-packing unavailable (%s); using F.linear", exc)
        return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias``; x ``[T, in]`` -> ``[T, out]``, through ``packed`` when given.
    On CUDA a shape and row count that ``gemv_table.TABLE`` lists (measured faster than
    cuBLAS there) runs the Triton GEMV of ``triton_gemv``, one that ``skinny_table`` lists
    the skinny GEMM of ``triton_skinny``; everything else ``F.linear``."""
    if packed is not None:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out
    if skinny_table.TABLE and skinny_table.ON and x.is_cuda:
        from pdserve.model import triton_skinny

        y = triton_skinny.linear(x, weight, bias)
        if y is not None:
            return y
    if gemv_table.TABLE and x.is_cuda and x.dim() == 2:
        from pdserve.model import triton_gemv

        config = triton_gemv.pick(gemv_table.TABLE, x, weight)
        if config is not None:
            return triton_gemv.gemv(x, weight, bias, config)
    return F.linear(x, weight, bias)


@functools.cache
def _fp32_gemm_listed(index: int) -> bool:
    return torch.cuda.get_device_name(index) in decode_attn_table.FP32_LOGITS


def logits_fp32(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T`` as float32 ``[T, out_features]`` (the lm_head's logits), written into
    ``out`` (float32, that shape) when given, else a new tensor. On a CUDA device that
    ``decode_attn_table.FP32_LOGITS`` lists, with 16-bit x and weight of one dtype: one GEMM
    writing fp32 (``torch.mm(..., out_dtype=torch.float32)``: the fp32 accumulator, not
    rounded to 16 bits; no cast pass). Elsewhere :func:`linear` (x's dtype) then the cast
    to fp32 (into ``out``: that copy is the cast)."""
    direct = (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and _fp32_gemm_listed(x.device.index if x.device.index is not None else 0)
    )
    if direct:
        if out is None:
            out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        result: torch.Tensor = torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)
        return result
    y = linear(x, weight, None, None)
    return y.float().contiguous() if out is None else out.copy_(y)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``(silu(gate) * up) @ weight.T + bias`` of ``gate_up = [gate | up]`` ``[T, 2I]`` ->
    ``[T, out]`` in one Triton GEMV kernel when ``gemv_table.TABLE`` lists ``weight``'s
    shape at T rows (CUDA); None otherwise (the caller runs the activation, then
    :func:`linear`)."""
    if not (FUSE_SILU_MUL and gemv_table.TABLE and gate_up.is_cuda and gate_up.dim() == 2):
        return None
    from pdserve.model import triton_gemv

    config = triton_gemv.pick(gemv_table.TABLE, gate_up, weight)
    if config is None:
        return None
    return triton_gemv.gemv(gate_up, weight, bias, config, silu_mul=True)
