"""Weight-streaming skinny matmul ``x @ w.T`` for M <= 64 rows through Hopper's TMA, in Triton.

The ``tma*`` kernel kinds of :mod:`pdserve.model.triton_gemv` (same configuration tuple
``(kind, BLOCK_N, BLOCK_K, num_warps, num_stages)``, same ``gemv`` entry point, used only
where a measured ``gemv_table`` entry names them). Why: at M = 32..64 the pointer-load
kinds stayed behind cuBLAS, whose kernels feed the tensor cores from bulk tensor copies
(TMA) issued by producer warps (figures: docs/benchmarks.md).

Design:

- ``w [N, K]`` is read through a host-side ``TensorDescriptor`` in ``[BLOCK_N, BLOCK_K]``
  boxes, ``num_stages`` in flight (Triton's pipeliner); out-of-range boxes are zero-filled,
  so the N and K tails need no masks. TMA wants a 16-byte aligned base and row stride
  (ValueError otherwise).
- x ``[M, K]`` is re-read from L2 by every tile: through a second descriptor, or by masked
  pointer loads when it is not 16-byte aligned or ``silu_mul`` computes
  ``silu(gate) * up`` on the fly (``_load_x``).
- The product is taken swapped, ``acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile.T``: ``wgmma``
  has M = 64 per warpgroup, so the weight's BLOCK_N >= 64 fills the M side and the 16..64
  rows the N side.
- Persistent grid: ``min(#SMs, work)`` programs walk the work with a grid stride, so the
  copy pipeline runs across tile boundaries (``tl.range(..., flatten=True)``).
- Work split (the kind's name): ``tma``, one unit a ``BLOCK_N`` tile over all of K, one
  launch; ``tma_skS``, a unit is (tile, one of S K slices), fp32 partials ``[S, M, N]``
  summed in slice order by the split-K reduce (``triton_gemv_parts``), two launches;
  ``tma_stream``, stream-K: the ``tiles * K/BLOCK_K`` box iterations cut into equal
  ranges, one a program, so every SM streams the same weight bytes whatever the tile
  count; a shared first or last tile goes to the program's two fp32 partial slots and a
  fixup kernel sums them in program order (deterministic), two launches.
  ``_ws`` (``tma_ws``, ``tma_ws_sk4``, ``tma_ws_stream``) asks for automatic warp
  specialization of the persistent loop (``warp_specialize=True``; flattening off).
  Whether it builds and pays per configuration is the sweep's (``scripts/gpu_gemv_sweep.py``
  skips a configuration that fails to build or run; ``scripts/sm90_build_check.py``).

Correctness is tested on CPU under ``TRITON_INTERPRET=1``, which does not model TMA,
mbarriers, warp specialization or the pipeliner; speed is the GPU sweep's and the
``gpu``-marked tests' (docs/benchmarks.md).
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
from pdserve.model.triton_gemv_parts import REDUCE_BLOCK, _load_x, _splitk_reduce_kernel

CPU_PROGRAMS = 3  # persistent programs under the interpreter: a test sees several units each
_KIND = re.compile(r"tma(_ws)?(?:_sk([0-9]+)|_(stream))?")
MAX_SPLITS = 32


def parse_kind(kind: str) -> tuple[int, bool, bool] | None:
    """``(K slices, stream-K, warp-specialized)`` of a ``tma*`` kind name, None for another
    name: ``tma`` (1, False, False), ``tma_sk4`` (4, False, False), ``tma_ws_stream``
    (1, True, True). ValueError for ``tma_skS`` with S outside 2..32."""
    m = _KIND.fullmatch(kind)
    if m is None:
        return None
    split = int(m.group(2)) if m.group(2) else 1
    if m.group(2) and not 2 <= split <= MAX_SPLITS:
        raise ValueError(f"{kind!r}: K slices must be 2..{MAX_SPLITS}")
    return split, m.group(3) is not None, m.group(1) is not None


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@triton.jit
def _x_tile(x_desc, x_ptr, k0, M, K, s_xm, X_DESC: tl.constexpr, SILU: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """x ``[BLOCK_M, BLOCK_K]`` at column k0, zeros past M and K."""
    if X_DESC:
        x = x_desc.load([0, k0])
    else:
        rm = tl.arange(0, BLOCK_M)
        kk = k0 + tl.arange(0, BLOCK_K)
        mask = (rm < M)[:, None] & (kk < K)[None, :]
        x = _load_x(x_ptr, rm[:, None] * s_xm + kk[None, :], mask, K, SILU)
    return x


@triton.jit
def _mma(w, x, acc, IEEE: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x [BLOCK_M, BLOCK_K].T`` in fp32."""
    if IEEE:
        acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton.jit
def _store_tile(acc, o_ptr, b_ptr, off_n, M, N, s_om, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """``o[m, off_n + n] = acc[n, m] (+ b)`` for m < M, off_n + n < N; rounded to o's dtype
    with ``ROUND`` (else fp32 partials, no bias)."""
    rn = off_n + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    # stored as [BLOCK_M, BLOCK_N], rows of N contiguous: coalesced (the accumulator's own
    # layout holds neighbours along M, a row apart in memory: one 2-byte store each)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    o = o_ptr + rm[:, None] * s_om + rn[None, :]
    if ROUND:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        tl.store(o, tl.trans(acc.to(o_ptr.dtype.element_ty)), mask=mask)
    else:
        tl.store(o, tl.trans(acc), mask=mask)


@triton.jit(do_not_specialize=("M",))  # per-step sizes: no recompile
def _gemv_tma_kernel(
    x_desc, w_desc, x_ptr, b_ptr, o_ptr, M, N, K, K_TILES, s_xm, s_om, s_os, NUM_PROGRAMS,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, X_DESC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    WARP_SPEC: tl.constexpr, FLATTEN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Grid ``(NUM_PROGRAMS,)`` persistent; unit u = (tile u % tiles, slice u // tiles), each
    ``K_TILES`` boxes of K. ``SPLIT_K == 1``: stores ``o [M, N]``; else fp32 partials at
    ``o + slice * s_os`` (the reduce kernel adds the bias)."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    # adjacent programs take adjacent tiles of one slice: they read the same x columns
    for u in tl.range(
        tl.program_id(0),
        n_tiles * SPLIT_K,
        NUM_PROGRAMS,
        flatten=FLATTEN,
        warp_specialize=WARP_SPEC,
    ):
        off_n = (u % n_tiles) * BLOCK_N
        k_lo = (u // n_tiles) * K_TILES * BLOCK_K
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for kt in range(K_TILES):
            k0 = k_lo + kt * BLOCK_K
            w = w_desc.load([off_n, k0])  # [BLOCK_N, BLOCK_K]; a slice past K reads zeros
            x = _x_tile(x_desc, x_ptr, k0, M, K, s_xm, X_DESC, SILU, BLOCK_M, BLOCK_K)
            acc = _mma(w, x, acc, IEEE)
        dst = o_ptr + (u // n_tiles) * s_os
        _store_tile(acc, dst, b_ptr, off_n, M, N, s_om, HAS_BIAS, SPLIT_K == 1, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=("M",))  # per-step sizes: no recompile
def _gemv_tma_stream_kernel(
    x_desc, w_desc, x_ptr, b_ptr, o_ptr, p_ptr, M, N, K, s_xm, s_om, NUM_PROGRAMS,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, X_DESC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WARP_SPEC: tl.constexpr,
    FLATTEN: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Grid ``(NUM_PROGRAMS,)``, stream-K: program p takes box iterations ``[p T / G,
    (p + 1) T / G)`` of ``T = tiles * cdiv(K, BLOCK_K)`` (G = NUM_PROGRAMS <= T), tile-major.
    A tile it covers wholly is stored to ``o``; its first tile, if shared, goes to partial slot
    ``p_ptr[p, 0]``, its last (when another tile) to ``p_ptr[p, 1]``, each ``[BLOCK_N,
    BLOCK_M]`` fp32 (:func:`_stream_fixup_kernel` sums them)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(N, BLOCK_N) * k_tiles
    pid = tl.program_id(0)
    lo = pid * total // NUM_PROGRAMS
    hi = (pid + 1) * total // NUM_PROGRAMS
    t_first = lo // k_tiles
    rn = tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    for t in tl.range(
        t_first,
        (hi - 1) // k_tiles + 1,
        flatten=FLATTEN,
        warp_specialize=WARP_SPEC,
    ):
        kt_lo = tl.maximum(lo - t * k_tiles, 0)
        kt_hi = tl.minimum(hi - t * k_tiles, k_tiles)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for kt in range(kt_lo, kt_hi):
            w = w_desc.load([t * BLOCK_N, kt * BLOCK_K])
            x = _x_tile(x_desc, x_ptr, kt * BLOCK_K, M, K, s_xm, X_DESC, SILU, BLOCK_M, BLOCK_K)
            acc = _mma(w, x, acc, IEEE)
        if kt_lo == 0 and kt_hi == k_tiles:
            _store_tile(
                acc, o_ptr, b_ptr, t * BLOCK_N, M, N, s_om, HAS_BIAS, True, BLOCK_M, BLOCK_N
            )
        else:
            slot = pid * 2 + (t != t_first).to(tl.int32)
            p = p_ptr + slot * (BLOCK_N * BLOCK_M) + rn[:, None] * BLOCK_M + rm[None, :]
            tl.store(p, acc)


@triton.jit(do_not_specialize=("M",))  # per-step sizes: no recompile
def _stream_fixup_kernel(
    p_ptr, b_ptr, o_ptr, M, N, K, s_om, NUM_PROGRAMS,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid ``(tiles,)``: a tile that several programs of :func:`_gemv_tma_stream_kernel`
    shared is the sum of their partial slots in program order, rounded once (+ bias).

    The program holding box iteration i is ``ceil((i + 1) G / T) - 1`` (the p with
    ``floor(p T / G) <= i < floor((p + 1) T / G)``); a contributor's slot is 1 exactly when
    its range began in an earlier tile (the tile is then its last)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(N, BLOCK_N) * k_tiles
    t = tl.program_id(0)
    first_it = t * k_tiles
    p_first = ((first_it + 1) * NUM_PROGRAMS + total - 1) // total - 1
    p_last = ((first_it + k_tiles) * NUM_PROGRAMS + total - 1) // total - 1
    if p_last > p_first:
        rn = tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        tile = rn[:, None] * BLOCK_M + rm[None, :]
        began_before = (p_first * total // NUM_PROGRAMS < first_it).to(tl.int32)
        acc = tl.load(p_ptr + (p_first * 2 + began_before) * (BLOCK_N * BLOCK_M) + tile)
        for p in range(p_first + 1, p_last + 1):
            acc += tl.load(p_ptr + p * 2 * (BLOCK_N * BLOCK_M) + tile)
        _store_tile(acc, o_ptr, b_ptr, t * BLOCK_N, M, N, s_om, HAS_BIAS, True, BLOCK_M, BLOCK_N)


def _aligned(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor meets TMA's rules: 16-byte base and row stride, unit inner stride."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0


def gemv_tma(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: tuple[str, int, int, int, int],
    block_m: int,
    silu_mul: bool,
    num_programs: int | None = None,
) -> None:
    """Write ``x @ weight.T (+ bias)`` into ``out [M, N]`` with the ``tma*`` kernel of
    ``config`` (kind, BLOCK_N, BLOCK_K, num_warps, num_stages) and row tile ``block_m``.

    Called by ``triton_gemv.gemv``, which checks shapes, M and dtypes: x ``[M, K]`` (``[M,
    2K]`` with ``silu_mul``), weight ``[N, K]``, bias ``[N]`` or None. ``num_programs``
    overrides the persistent grid (default: the device's SM count, ``CPU_PROGRAMS`` off
    CUDA), capped at the work. ValueError when the weight is not TMA-aligned (16-byte base
    and row stride) or the kind is not a ``tma*`` one.
    """
    kind, block_n, block_k, warps, stages = config
    parsed = parse_kind(kind)
    if parsed is None:
        raise ValueError(f"{kind!r} is not a tma kernel kind")
    split, stream, ws = parsed
    M, N = out.shape
    K = weight.shape[1]
    if not _aligned(weight):
        raise ValueError(
            "the tma kernels need a weight with a 16-byte aligned base and row stride "
            f"(got stride {weight.stride()}, {weight.element_size()}-byte elements)"
        )
    w_desc = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [block_n, block_k])
    x_desc_ok = not silu_mul and _aligned(x)
    # without a descriptor for x the kernel never reads x_desc: the weight's stands in
    x_desc: Any = (
        TensorDescriptor(x, [M, K], [x.stride(0), 1], [block_m, block_k]) if x_desc_ok else w_desc
    )
    if num_programs is None:
        num_programs = _sm_count(x.device.index or 0) if x.is_cuda else CPU_PROGRAMS
    b: Any = bias if bias is not None else weight
    k_tiles = triton.cdiv(K, block_k)
    n_tiles = triton.cdiv(N, block_n)
    common = dict(
        HAS_BIAS=bias is not None,
        SILU=silu_mul,
        X_DESC=x_desc_ok,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        WARP_SPEC=ws,
        FLATTEN=not ws,  # one loop is either flattened or warp-specialized, not both
        IEEE=x.dtype == torch.float32,
    )
    if stream:
        g = max(1, min(num_programs, n_tiles * k_tiles))
        part = torch.empty(g, 2, block_n, block_m, device=x.device, dtype=torch.float32)
        _gemv_tma_stream_kernel[(g,)](
            x_desc, w_desc, x, b, out, part, M, N, K, x.stride(0), out.stride(0), g,
            num_warps=warps, num_stages=stages, **common,
        )  # fmt: skip
        if n_tiles % g:  # else every program's range is whole tiles: none is shared
            _stream_fixup_kernel[(n_tiles,)](
                part, b, out, M, N, K, out.stride(0), g, HAS_BIAS=bias is not None,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
            )  # fmt: skip
        return
    k_split = triton.cdiv(k_tiles, split)  # boxes per slice (the last slice's tail reads zeros)
    g = max(1, min(num_programs, n_tiles * split))
    dst = out if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    _gemv_tma_kernel[(g,)](
        x_desc, w_desc, x, b, dst, M, N, K, k_split, x.stride(0), N if split > 1 else out.stride(0),
        M * N, g, SPLIT_K=split, num_warps=warps, num_stages=stages, **common,
    )  # fmt: skip
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            dst, b, out, N, M * N, HAS_BIAS=bias is not None, SPLIT_K=split,
            BLOCK=REDUCE_BLOCK, num_warps=4, **pdl.launch_options(x),
        )  # fmt: skip
