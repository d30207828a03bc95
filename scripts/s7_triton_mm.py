"""Persistent TMA matmul ``x @ w.T`` for decode batches past the GEMV's 64 rows, in Triton:
the candidate that ``scripts/gpu_s7_mm_sweep.py`` timed against cuBLAS (not used by the
engine: on the H200 it lost at every shape and row count from 96 to 256, docs/benchmarks.md
row S7-BF16; kept here, beside its sweep, to run that again).

At 128-256 decode rows a Llama-3.1-8B linear layer is near the H200's ridge point (about
200 FLOP per weight byte): both the weight stream and the tensor cores matter, and
cuBLAS's pick for ``gate_up`` (M = 256, N = 28,672, K = 4,096) was read as about 0.68 of
the measured bf16 matmul rate in an old step profile.

Design (Triton's Hopper persistent matmul): x ``[M, K]``, w ``[N, K]`` and out ``[M, N]``
are read and written through host-side ``TensorDescriptor`` boxes (TMA; out-of-range boxes
zero-filled on load, clipped on store, so no masks); ``tl.dot(x_tile, w_tile.T)`` compiles to
``wgmma`` on sm_90. A persistent grid of ``min(#SMs, tiles)`` programs walks the output tiles
with a grid stride, the M tiles of one N tile adjacent (their programs read the same weight
box, from L2 after the first), so the weight is streamed from HBM about once.
A configuration is ``(kind, BLOCK_N, BLOCK_K, num_warps, num_stages)`` as in
``pdserve/model/gemv_table.py``, the kind ``mmBM`` (``BLOCK_M`` = BM: 64, 128 or 256) or ``mmBM_ws`` (the
persistent loop warp-specialized; not flattened).

Every output element is the fp32 sum over all of K in box order, rounded once: the same
bits whatever the grid, so the result is a function of the shape and the configuration
only. The sweep checks every configuration against ``F.linear`` before timing it; on CPU
it runs under ``TRITON_INTERPRET=1`` (``--device cpu --toy``).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.model import pdl
from pdserve.model.pdl import pdl_enter

Config = tuple[str, int, int, int, int]
CPU_PROGRAMS = 3  # persistent programs under the interpreter: a test sees several tiles each
_KIND = re.compile(r"mm(64|128|256)(_ws)?")


def parse_kind(kind: str) -> tuple[int, bool] | None:
    """``(BLOCK_M, warp-specialized)`` of an ``mm*`` kind name (``mm128`` -> (128, False),
    ``mm256_ws`` -> (256, True)), None for another name."""
    m = _KIND.fullmatch(kind)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) is not None


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@triton.jit(do_not_specialize=("M",))  # per-step sizes: no recompile
def _mm_tma_kernel(
    x_desc, w_desc, o_desc, b_ptr, M, N, K, NUM_PROGRAMS,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, WARP_SPEC: tl.constexpr, FLATTEN: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid ``(NUM_PROGRAMS,)`` persistent; tile t = (m tile t % m_tiles, n tile t //
    m_tiles): ``o[tile] = x[m rows] @ w[n rows].T (+ b)``, fp32 over all of K, rounded once."""
    pdl_enter(PDL)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for t in tl.range(
        tl.program_id(0),
        m_tiles * n_tiles,
        NUM_PROGRAMS,
        flatten=FLATTEN,
        warp_specialize=WARP_SPEC,
    ):
        off_m = (t % m_tiles) * BLOCK_M
        off_n = (t // m_tiles) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in range(k_tiles):
            x = x_desc.load([off_m, kt * BLOCK_K])  # [BLOCK_M, BLOCK_K], zeros past M, K
            w = w_desc.load([off_n, kt * BLOCK_K])  # [BLOCK_N, BLOCK_K], zeros past N, K
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        o_desc.store([off_m, off_n], acc.to(b_ptr.dtype.element_ty))  # b: bias or w, x's dtype


def _aligned(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor meets TMA's rules: 16-byte base and row stride, unit inner stride."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`mm` takes ``x [M, K]`` and ``weight [N, K]``: 2-D, one dtype, both
    TMA-aligned (16-byte base and row stride, unit inner stride)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.dtype == weight.dtype
        and x.shape[1] == weight.shape[1]
        and _aligned(x)
        and _aligned(weight)
    )


def mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config,
    num_programs: int | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the ``mm*`` kernel and tile of ``config``.

    x ``[M, K]``, weight ``[N, K]``, bias ``[N]`` or None, one dtype (bf16/fp16; fp32 with
    IEEE dots); x and weight TMA-aligned (:func:`supported`). Returns a new ``[M, N]`` tensor
    in x's dtype: fp32 accumulation over all of K in ``BLOCK_K`` order, one rounding (with
    the bias added in fp32 before it). ``num_programs`` overrides the persistent grid
    (default: the device's SM count, ``CPU_PROGRAMS`` off CUDA), capped at the tiles.
    ValueError for an unknown kind or operands :func:`supported` refuses.
    """
    kind, block_n, block_k, warps, stages = config
    parsed = parse_kind(kind)
    if parsed is None:
        raise ValueError(f"{kind!r} is not an mm kernel kind (mm64, mm128, mm256, each _ws)")
    block_m, ws = parsed
    if not supported(x, weight):
        raise ValueError(
            "mm needs 2-D x [M, K] and weight [N, K] of one dtype, both with a 16-byte "
            f"aligned base and row stride (got x {tuple(x.shape)} stride {x.stride()}, "
            f"weight {tuple(weight.shape)} stride {weight.stride()})"
        )
    M, K = x.shape
    N = weight.shape[0]
    out = x.new_empty(M, N)
    if M == 0:
        return out
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [block_m, block_k])
    w_desc = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [block_n, block_k])
    o_desc = TensorDescriptor(out, [M, N], [N, 1], [block_m, block_n])
    if num_programs is None:
        num_programs = _sm_count(x.device.index or 0) if x.is_cuda else CPU_PROGRAMS
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    g = max(1, min(num_programs, tiles))
    b: Any = bias if bias is not None else weight
    _mm_tma_kernel[(g,)](
        x_desc, w_desc, o_desc, b, M, N, K, g,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        WARP_SPEC=ws, FLATTEN=not ws, IEEE=x.dtype == torch.float32,
        num_warps=warps, num_stages=stages, **pdl.launch_options(x),
    )  # fmt: skip
    return out
