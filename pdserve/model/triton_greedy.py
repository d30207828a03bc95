"""Greedy pick in one pass over the logits: each row's argmax and that token's log-probability.

The greedy token of a row is the argmax of its logits ``x``, and its log-probability under
``log_softmax`` is ``x[argmax] - max(x) - log(sum_j exp(x_j - max(x)))`` = ``-log(sum_j
exp(x_j - max(x)))``, since ``x[argmax] == max(x)``. So no ``[R, V]`` softmax needs to be
written: one read of the logits gives both (an online maximum and a rescaled sum of
exponentials, as FlashAttention's softmax; Milakov & Gimelshein 2018, arXiv:1805.02867).

Two kernels: :func:`greedy_partial_kernel` over a grid ``(R, splits)``, each program one
chunk of a row's vocabulary (its maximum, the first index of it, and the sum of
``exp(x - maximum)``), then :func:`greedy_merge_kernel` (one program a row) combining the
chunks. The split count depends on the row count only (:func:`greedy_splits`), so a
captured CUDA graph stays valid. The token is exactly ``torch.argmax``'s (the lowest index
among equal maxima); the log-probability equals ``log_softmax(x).gather(argmax)`` up to
fp32 rounding (the sum is added in another order). Logits must be finite (a NaN is not
picked as ``torch.argmax`` would pick it).

Runs on CUDA, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.model import decode_attn_table
from pdserve.model.pdl import launch_options, pdl_enter

# Programs a pick aims at (about 8 per SM of an H200's 132), the vocabulary a program reads
# per iteration and its warps: the H200's measured pick (decode_attn_table.GREEDY), the
# defaults for a caller that names none.
GREEDY_TARGET_PROGRAMS = 1056
GREEDY_BLOCK_V = 1024
GREEDY_NUM_WARPS = 4
_MAX_SPLITS = 64


def greedy_splits(
    rows: int, vocab: int, target: int = GREEDY_TARGET_PROGRAMS, block_v: int = GREEDY_BLOCK_V
) -> int:
    """Chunks each row's vocabulary is cut into: about ``target`` programs in all, at most
    64, at most one per ``block_v`` entries; 1 when ``rows >= target``."""
    by_rows = -(-target // max(1, rows))
    by_vocab = max(1, -(-vocab // block_v))
    return max(1, min(_MAX_SPLITS, by_rows, by_vocab))


@functools.cache
def _cuda_params(index: int) -> tuple[int, int, int] | None:
    return decode_attn_table.GREEDY.get(torch.cuda.get_device_name(index))


def measured_params(device: torch.device) -> tuple[int, int, int] | None:
    """``(target programs, block_v, num_warps)`` of the greedy pick measured faster than
    ``argmax`` + ``log_softmax`` on ``device`` (``decode_attn_table.GREEDY``, by the CUDA
    device's name, read once a process), or ``None``: keep torch's ops (and off CUDA)."""
    if device.type != "cuda":
        return None
    return _cuda_params(device.index if device.index is not None else 0)


@triton.jit(do_not_specialize=("s_lr", "vocab", "chunk"))
def greedy_partial_kernel(
    logits_ptr,
    part_m_ptr,
    part_i_ptr,
    part_s_ptr,
    s_lr,
    vocab,
    chunk,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(R, splits)``: program ``(r, s)`` reads ``logits[r, s*chunk : (s+1)*chunk]``
    (fp32, row stride ``s_lr``, ``chunk`` a multiple of ``BLOCK_V``) and writes its maximum
    ``part_m[r, s]`` (fp32; ``-inf`` for an empty chunk), the lowest index holding it
    ``part_i[r, s]`` (int32) and ``part_s[r, s]`` = sum of ``exp(x - maximum)`` (fp32)."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, vocab)
    vv = tl.arange(0, BLOCK_V)
    row = logits_ptr + r.to(tl.int64) * s_lr
    m_v = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: its maximum so far,
    i_v = tl.zeros([BLOCK_V], tl.int32)  # the first index of it (lanes go up in index),
    s_v = tl.zeros([BLOCK_V], tl.float32)  # and the sum of exp(x - that maximum)
    for start in range(lo, hi, BLOCK_V):
        idx = start + vv
        x = tl.load(row + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_v, x)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_v = s_v * tl.exp(m_v - base) + tl.exp(x - base)
        i_v = tl.where(x > m_v, idx, i_v)  # strictly greater: an equal later one loses
        m_v = m_new
    m = tl.max(m_v, 0)
    base = tl.where(m == float("-inf"), 0.0, m)
    first = tl.min(tl.where(m_v == m, i_v, 2147483647), 0)
    total = tl.sum(s_v * tl.exp(m_v - base), 0)
    out = r * tl.num_programs(1) + s
    tl.store(part_m_ptr + out, m)
    tl.store(part_i_ptr + out, first)
    tl.store(part_s_ptr + out, total)


@triton.jit(do_not_specialize=("num_splits",))
def greedy_merge_kernel(
    part_m_ptr,
    part_i_ptr,
    part_s_ptr,
    out_ptr,
    s_or,
    num_splits,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(R,)``: combine row ``r``'s ``num_splits`` chunks (``<= BLOCK_S``) into ``out[r, 0]`` = the argmax (as
    float64) and ``out[r, 1]`` = its log-probability ``-log(sum_s part_s * exp(part_m -
    max))`` (float64 of an fp32 value)."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    ss = tl.arange(0, BLOCK_S)
    smask = ss < num_splits
    pm = tl.load(part_m_ptr + r * num_splits + ss, mask=smask, other=float("-inf"))
    pi = tl.load(part_i_ptr + r * num_splits + ss, mask=smask, other=2147483647)
    ps = tl.load(part_s_ptr + r * num_splits + ss, mask=smask, other=0.0)
    m = tl.max(pm, 0)
    base = tl.where(m == float("-inf"), 0.0, m)
    first = tl.min(tl.where((pm == m) & smask, pi, 2147483647), 0)
    total = tl.sum(tl.where(smask, ps * tl.exp(pm - base), 0.0), 0)
    tl.store(out_ptr + r * s_or, first.to(tl.float64))
    tl.store(out_ptr + r * s_or + 1, (-tl.log(total)).to(tl.float64))


def greedy_pick(
    logits: torch.Tensor,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    block_v: int = GREEDY_BLOCK_V,
    num_warps: int = GREEDY_NUM_WARPS,
) -> torch.Tensor:
    """Each row's argmax and its log-softmax value, in one read of ``logits``.

    logits: ``[R, V]`` float32 (any row stride, unit column stride), finite. out: optional
    ``[R, 2]`` float64 to write (a CUDA graph's static buffer). splits: chunks a row is cut
    into (default :func:`greedy_splits`; fixed by ``R`` and ``V`` only, so a graph may
    capture it). Returns ``[R, 2]`` float64: column 0 the argmax id (``torch.argmax``'s,
    the lowest index among equal maxima), column 1 ``log_softmax(logits)[r, id]`` (to fp32
    rounding). ValueError for logits that are not 2-D float32 with unit column stride."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"logits: expected [R, V] float32 with unit column stride, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    R, V = logits.shape
    if out is None:
        out = torch.empty(R, 2, dtype=torch.float64, device=logits.device)
    if R == 0:
        return out
    S = splits or greedy_splits(R, V, block_v=block_v)
    if not 1 <= S <= _MAX_SPLITS:
        raise ValueError(f"splits: {S} is outside 1..{_MAX_SPLITS}")
    if out.shape != (R, 2) or out.dtype != torch.float64 or out.stride(1) != 1:
        raise ValueError(f"out: expected [{R}, 2] float64 with unit column stride")
    per = -(-V // S)
    chunk = -(-per // block_v) * block_v
    part_m = torch.empty(R, S, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(R, S, dtype=torch.int32, device=logits.device)
    part_s = torch.empty(R, S, dtype=torch.float32, device=logits.device)
    opts = launch_options(logits)
    greedy_partial_kernel[(R, S)](
        logits,
        part_m,
        part_i,
        part_s,
        logits.stride(0),
        V,
        chunk,
        BLOCK_V=block_v,
        num_warps=num_warps,
        **opts,
    )
    greedy_merge_kernel[(R,)](
        part_m,
        part_i,
        part_s,
        out,
        out.stride(0),
        S,
        BLOCK_S=_MAX_SPLITS,
        **opts,
    )
    return out
