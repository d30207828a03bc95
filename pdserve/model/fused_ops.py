"""Fused elementwise kernels of the decoder on CUDA (Triton): RoPE in place (optionally
after Qwen3's per-head q/k RMSNorm, and optionally storing the rotated K and V into the
paged KV cache, in the same kernel), SiLU-and-mul, residual add + RMSNorm (optionally with
its output quantized per token to e4m3 for an FP8 linear: :func:`add_rms_norm_quant`).

Each small elementwise kernel costs a launch gap inside a CUDA graph, so RoPE, SwiGLU's
``silu(gate) * up`` and each residual add with the RMSNorm after it become one kernel each
(figures: docs/benchmarks.md). Each operation is rounded to the input dtype where torch
rounds it; bf16 results may still differ from torch's by one rounding of the products,
fp32 in the last bits (fused multiply-add). The model uses them for CUDA tensors only;
tests also run them on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.model import pdl
from pdserve.model.pdl import pdl_enter
from pdserve.model.triton_act import silu_mul_rounded
from pdserve.model.triton_w8a8 import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX, _round_e4m3


@triton.jit
def _rope_kernel(
    x_ptr,
    table_ptr,
    pos_ptr,
    v_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    qw_ptr,
    kw_ptr,
    eps,
    k_inv,
    v_inv,
    s_xt,
    s_xh,
    s_tp,
    s_vt,
    s_vh,
    s_kcp,
    s_kct,
    s_kch,
    s_vcp,
    s_vct,
    s_vch,
    H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QK_NORM: tl.constexpr,
    NQ: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: rotate its ``H`` heads in place by the table row of its
    position (``table[pos] = cos[HALF] | sin[HALF]``). With ``QK_NORM`` each head is first
    RMS-normalised over its ``2 * HALF`` values (eps ``eps``) and scaled by ``qw`` (the first
    ``NQ`` heads) or ``kw`` (the others), as transformers' per-head q/k norm: fp32
    statistics, the normalised head rounded to x's dtype, then times the weight. With ``STORE`` the last ``HKV`` of
    them are K heads: the rotated K and the token's V ``[HKV, D]`` are also written to the
    paged cache at slot ``slot_mapping[t]`` (a negative slot, a padded row of a captured
    batch, writes nothing), the same bytes the attention backend's store would write: with
    ``FP8`` (an e4m3 cache) the rotated K rounded to x's dtype, times ``k_inv`` (1 / the
    K scale), saturated to +-448 and cast (V likewise with ``v_inv``), as
    ``attention.quantize_kv``."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    dmask = dd < HALF
    mask = (hh < H) & dmask
    cos = tl.load(table_ptr + pos * s_tp + dd, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(table_ptr + pos * s_tp + HALF + dd, mask=dmask, other=0.0).to(tl.float32)
    base = x_ptr + t * s_xt + hh * s_xh + dd
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    ty = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if QK_NORM:
        r = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        is_q = hh < NQ
        w1 = tl.where(
            is_q,
            tl.load(qw_ptr + dd, mask=dmask, other=0.0),
            tl.load(kw_ptr + dd, mask=dmask, other=0.0),
        ).to(tl.float32)
        w2 = tl.where(
            is_q,
            tl.load(qw_ptr + HALF + dd, mask=dmask, other=0.0),
            tl.load(kw_ptr + HALF + dd, mask=dmask, other=0.0),
        ).to(tl.float32)
        a = (w1 * (a * r[:, None]).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        b = (w2 * (b * r[:, None]).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    # Round where torch rounds: each product, then each difference/sum.
    o1 = (a * cos).to(ty).to(tl.float32) - (b * sin).to(ty).to(tl.float32)
    o2 = (b * cos).to(ty).to(tl.float32) + (a * sin).to(ty).to(tl.float32)
    tl.store(base, o1.to(ty), mask=mask)
    tl.store(base + HALF, o2.to(ty), mask=mask)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        # K: rows HQ .. HQ + HKV of the tile, written at their KV head (row - HQ).
        slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # a tensor mask (the
        kmask = mask & (hh >= HQ) & (slots >= 0)  # interpreter rejects a scalar one)
        kbase = kc_ptr + page * s_kcp + off * s_kct + tl.where(hh >= HQ, hh - HQ, 0) * s_kch + dd
        cty = kc_ptr.dtype.element_ty
        k1 = o1.to(ty)
        k2 = o2.to(ty)
        if FP8:  # quantize_kv: x.float() * (1 / scale), saturated to e4m3's range
            k1 = tl.clamp(k1.to(tl.float32) * k_inv, -448.0, 448.0)
            k2 = tl.clamp(k2.to(tl.float32) * k_inv, -448.0, 448.0)
        tl.store(kbase, k1.to(cty), mask=kmask)
        tl.store(kbase + HALF, k2.to(cty), mask=kmask)
        vh = tl.arange(0, BLOCK_KV)[:, None]
        vd = tl.arange(0, BLOCK_DV)[None, :]
        vslots = tl.zeros([BLOCK_KV, BLOCK_DV], tl.int64) + slot
        vmask = (vh < HKV) & (vd < D) & (vslots >= 0)
        v = tl.load(v_ptr + t * s_vt + vh * s_vh + vd, mask=vmask)
        if FP8:
            v = tl.clamp(v.to(tl.float32) * v_inv, -448.0, 448.0)
        tl.store(
            vc_ptr + page * s_vcp + off * s_vct + vh * s_vch + vd,
            v.to(vc_ptr.dtype.element_ty),
            mask=vmask,
        )


QKNorm = tuple[torch.Tensor, torch.Tensor, float, int]
"""``(q_weight [D], k_weight [D], eps, n_q_heads)``: per-head RMSNorm of the q and k heads
(Qwen3), applied by the RoPE kernel before it rotates them."""


def rope_inplace(
    x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, qk_norm: QKNorm | None = None
) -> None:
    """Rotate ``x`` ``[T, H, D]`` (any token/head strides, dim stride 1) in place by the rows
    ``positions`` ``[T]`` of ``table`` ``[max_positions, D]`` (cos half, then sin half, in
    x's dtype): ``x*cos + rotate_half(x)*sin`` as ``pdserve.model.rope.apply_rope``.
    qk_norm: first ``llama.rms_norm`` of each head with the q weight (the first
    ``n_q_heads`` heads) or the k weight (the rest), in the same kernel."""
    _rope(x, table, positions, None, qk_norm)


def rope_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: QKNorm | None = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> None:
    """:func:`rope_inplace` of ``qk`` (with ``qk_norm`` as there) ``[T, Hq + Hkv, D]`` (query heads, then KV heads), and
    in the same kernel the rotated K heads and ``v`` ``[T, Hkv, D]`` written into one
    layer's paged cache views ``k_cache`` / ``v_cache`` ``[P, page_size, Hkv, D]`` (any
    strides, dim stride 1; ``KVCacheLayout.layer_views``) at ``slot_mapping`` ``[T]`` int64
    (``page * page_size + offset``; negative: not written). Replaces the attention backend's
    KV store (one kernel a layer fewer); the cache gets the bytes that store would write
    (cast to the cache's dtype; an e4m3 cache ``attention.quantize_kv`` of K and V with
    the per-tensor scales ``kv_scale`` = ``(k_scale, v_scale)``, both > 0, in the same
    kernel: the unfused path's four elementwise kernels a tensor are not run)."""
    _rope(qk, table, positions, (v, slot_mapping, k_cache, v_cache), qk_norm, kv_scale)


def _rope(
    qk: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    qk_norm: QKNorm | None = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> None:
    """The launch of both: ``store`` is ``(v, slot_mapping, k_cache, v_cache)`` of
    :func:`rope_store_kv`, or None (rotate only; the store's pointers are ``qk``'s, unused)."""
    T, H, D = qk.shape
    if T == 0:
        return
    v, slots, k_cache, v_cache = store or (qk, positions, qk, qk)
    assert all(t.stride(-1) == 1 for t in (qk, table, v, k_cache, v_cache))
    Hkv = v.shape[1] if store else 1
    qw, kw, eps, nq = qk_norm or (table, table, 0.0, 0)
    if qk_norm is not None:
        assert qw.shape == kw.shape == (D,) and qw.stride(0) == kw.stride(0) == 1
    fp8 = store is not None and k_cache.dtype == torch.float8_e4m3fn
    if fp8 and not (kv_scale[0] > 0 and kv_scale[1] > 0):
        raise ValueError(f"kv_scale must be two positive scales, got {kv_scale}")
    _rope_kernel[(T,)](
        qk,
        table,
        positions,
        v,
        slots,
        k_cache,
        v_cache,
        qw,
        kw,
        float(eps),
        1.0 / kv_scale[0],
        1.0 / kv_scale[1],
        qk.stride(0),
        qk.stride(1),
        table.stride(0),
        *((v.stride(0), v.stride(1)) if store else (0, 0)),
        *(k_cache.stride()[:3] if store else (0, 0, 0)),
        *(v_cache.stride()[:3] if store else (0, 0, 0)),
        H=H,
        HALF=D // 2,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_D=triton.next_power_of_2(D // 2),
        STORE=store is not None,
        HQ=H - Hkv if store else 0,
        HKV=Hkv,
        D=D,
        PAGE_SIZE=k_cache.shape[1] if store else 1,
        BLOCK_KV=triton.next_power_of_2(Hkv),
        BLOCK_DV=triton.next_power_of_2(D) if store else 1,
        QK_NORM=qk_norm is not None,
        NQ=nq,
        FP8=fp8,
        **pdl.launch_options(qk),
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, s_xt, s_ot, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(T, cdiv(N, BLOCK))``: ``out[t, n] = silu(x[t, n]) * x[t, N + n]``."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    nn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = nn < N
    g = tl.load(x_ptr + t * s_xt + nn, mask=mask, other=0.0)
    u = tl.load(x_ptr + t * s_xt + N + nn, mask=mask, other=0.0)
    tl.store(out_ptr + t * s_ot + nn, silu_mul_rounded(g, u), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` ``[T, 2N]`` (row-contiguous) -> ``[T, N]``."""
    T, two_n = x.shape
    n = two_n // 2
    out = x.new_empty(T, n)
    if T == 0:
        return out
    assert x.stride(-1) == 1
    block = 1024
    grid = (T, triton.cdiv(n, block))
    _silu_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, **pdl.launch_options(x)
    )
    return out


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    h_ptr,
    y_ptr,
    s_x,
    s_r,
    s_h,
    s_y,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row: ``h = x + r`` (rounded to x's dtype, as torch's add; stored
    when ``HAS_RES``), ``y = w * (h * rsqrt(mean(h^2) + eps))`` with fp32 statistics and the
    normalised value rounded to x's dtype before the weight (transformers' order)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0)
    ty = x.dtype
    if HAS_RES:
        r = tl.load(r_ptr + t * s_r + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
        tl.store(h_ptr + t * s_h + cols, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (hf * rstd).to(ty).to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + t * s_y + cols, y.to(ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h))`` with ``h = x + residual`` (``h = x`` when ``residual`` is None),
    in one kernel. x, residual ``[T, N]`` (dim stride 1, same dtype), weight ``[N]``; both
    outputs new ``[T, N]`` tensors in x's dtype (h is x itself when residual is None).
    RMSNorm: Zhang & Sennrich 2019, in transformers' Llama order (see the kernel)."""
    T, N = x.shape
    y = x.new_empty(T, N)
    h = x if residual is None else x.new_empty(T, N)
    if T == 0:
        return h, y
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    block = triton.next_power_of_2(N)
    r = x if residual is None else residual
    _add_rms_norm_kernel[(T,)](
        x,
        r,
        weight,
        h,
        y,
        x.stride(0),
        r.stride(0),
        h.stride(0),
        y.stride(0),
        N,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
        **pdl.launch_options(x),
    )
    return h, y


@triton.jit
def _add_rms_norm_router_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    g_ptr,
    h_ptr,
    y_ptr,
    l_ptr,
    s_x,
    s_r,
    s_h,
    s_y,
    s_g,
    s_l,
    N,
    E,
    eps,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(t, b)``: ``_add_rms_norm_kernel``'s row ``t`` (stored by ``b == 0``),
    then the router logits ``l[t, e] = y[t] . g[e]`` of experts ``e`` in block ``b``
    (``BLOCK_E`` of them; fp32 accumulation, rounded to x's dtype as ``F.linear``). The
    normalised row is recomputed chunk by chunk (``CHUNK`` columns) for the product."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    b = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0)
    ty = x.dtype
    r = tl.load(r_ptr + t * s_r + cols, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps)
    if b == 0:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(h_ptr + t * s_h + cols, h, mask=mask)
        y = (hf * rstd).to(ty).to(tl.float32) * w.to(tl.float32)
        tl.store(y_ptr + t * s_y + cols, y.to(ty), mask=mask)
    ev = b * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ev < E
    ks = tl.arange(0, CHUNK)
    acc = tl.zeros((BLOCK_E, CHUNK), dtype=tl.float32)
    for k0 in range(0, N, CHUNK):
        kk = k0 + ks
        kmask = kk < N
        xc = tl.load(x_ptr + t * s_x + kk, mask=kmask, other=0.0).to(tl.float32)
        rc = tl.load(r_ptr + t * s_r + kk, mask=kmask, other=0.0).to(tl.float32)
        wc = tl.load(w_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        hc = (xc + rc).to(ty).to(tl.float32)
        yc = ((hc * rstd).to(ty).to(tl.float32) * wc).to(ty).to(tl.float32)
        g = tl.load(
            g_ptr + ev[:, None].to(tl.int64) * s_g + kk[None, :],
            mask=emask[:, None] & kmask[None, :],
            other=0.0,
        )
        acc += g.to(tl.float32) * yc[None, :]
    logits = tl.sum(acc, axis=1)
    tl.store(l_ptr + t * s_l + ev, logits.to(l_ptr.dtype.element_ty), mask=emask)


# add_rms_norm_router's bound: each program re-reads its row, so the fused kernel's cost grows
# with the tokens; on the H200 (h200_s5/moe_layer_ab.json) it took 3.4 us against 7.5 for the
# two kernels at 1 token and 11.3 against 8.0 at 64: kept where the line between them says it wins
ROUTER_FUSE_MAX_TOKENS = 16


def add_rms_norm_router(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor,
    block_e: int = 4,
    chunk: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` with a residual, and the mixture-of-experts router's logits of
    the normalised rows in the same kernel: returns ``(h, y, logits)``, logits ``[T, E] =
    y @ gate.T`` in x's dtype (fp32 accumulation, ``F.linear``'s rounding). gate ``[E, N]``
    (dim stride 1, x's dtype). For decode batches (``T <= ROUTER_FUSE_MAX_TOKENS``): each of
    the ``cdiv(E, block_e)`` programs of a row re-reads the row; one launch fewer a layer.
    Default tiles: 4 experts a program, the whole row of 2,048 in one chunk (one load of
    the program's gate rows in flight; sm_90 build: no spills), untimed."""
    T, N = x.shape
    E = gate.shape[0]
    y = x.new_empty(T, N)
    h = x.new_empty(T, N)
    logits = x.new_empty(T, E)
    if T == 0:
        return h, y, logits
    assert x.stride(-1) == 1 and residual.stride(-1) == 1 and gate.stride(-1) == 1
    block = triton.next_power_of_2(N)
    _add_rms_norm_router_kernel[(T, triton.cdiv(E, block_e))](
        x,
        residual,
        weight,
        gate,
        h,
        y,
        logits,
        x.stride(0),
        residual.stride(0),
        h.stride(0),
        y.stride(0),
        gate.stride(0),
        logits.stride(0),
        N,
        E,
        eps,
        BLOCK=block,
        BLOCK_E=block_e,
        CHUNK=min(chunk, block),
        num_warps=min(16, max(1, block // 512)),
        **pdl.launch_options(x),
    )
    return h, y, logits


@triton.jit
def _add_rms_norm_quant_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    h_ptr,
    q_ptr,
    s_ptr,
    s_x,
    s_r,
    s_h,
    s_q,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row: ``h`` and ``y`` as :func:`_add_rms_norm_kernel` (y rounded to
    x's dtype), then y quantized per token as ``triton_w8a8._quant_rows_kernel`` does:
    ``s = max(amax|y|, 1e-12) * fp32(1 / 448)``, ``q = e4m3(clamp(y / s))``; y itself is not
    stored."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * s_x + cols, mask=mask, other=0.0)
    ty = x.dtype
    if HAS_RES:
        r = tl.load(r_ptr + t * s_r + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
        tl.store(h_ptr + t * s_h + cols, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = ((hf * rstd).to(ty).to(tl.float32) * w.to(tl.float32)).to(ty).to(tl.float32)
    y = tl.where(mask, y, 0.0)
    scale = tl.maximum(tl.max(tl.abs(y), 0), AMAX_FLOOR) * INV_FP8_MAX
    tl.store(s_ptr + t, scale)
    q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(y, scale), -FP8_MAX), FP8_MAX))
    tl.store(q_ptr + t * s_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` with its normalised output quantized per token in the same
    kernel, for an FP8 linear that takes e4m3 rows (``triton_w8a8.w8a8``): ``(h, q, s)``
    with ``h = x + residual`` ``[T, N]`` in x's dtype (x itself when ``residual`` is None),
    ``q [T, N]`` float8_e4m3fn and ``s [T, 1]`` fp32 such that ``(q, s)`` are the bits
    ``triton_w8a8.quantize_rows(add_rms_norm(x, residual, weight, eps)[1])`` gives (the
    16-bit normalised row is not written). x, residual ``[T, N]`` bf16/fp16 (dim stride 1),
    weight ``[N]``. One launch instead of two."""
    T, N = x.shape
    q = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    h = x if residual is None else x.new_empty(T, N)
    if T == 0:
        return h, q, s
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    block = triton.next_power_of_2(N)
    r = x if residual is None else residual
    _add_rms_norm_quant_kernel[(T,)](
        x,
        r,
        weight,
        h,
        q,
        s,
        x.stride(0),
        r.stride(0),
        h.stride(0),
        q.stride(0),
        N,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
        **pdl.launch_options(x),
    )
    return h, q, s


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    s_xt,
    s_qt,
    N,
    BLOCK: tl.constexpr,
    ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row ``t`` of ``x = [gate | up]`` ``[T, 2N]``: ``a = silu(gate) * up``
    rounded to x's dtype (:func:`silu_mul_rounded`, as ``_silu_mul_kernel``), then quantized
    per token as ``triton_w8a8._quant_rows_kernel`` does: ``s[t] = max(amax|a|, 1e-12) *
    fp32(1 / 448)``, ``q[t] = e4m3(clamp(a / s))``; ``a`` is not stored. ``ONE_TILE``: N <=
    BLOCK, the row is read once and kept in registers; else twice (amax, then quantize;
    the activation computed again)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    xr = x_ptr + t * s_xt
    qr = q_ptr + t * s_qt
    if ONE_TILE:
        mask = cols < N
        g = tl.load(xr + cols, mask=mask, other=0.0)
        u = tl.load(xr + N + cols, mask=mask, other=0.0)
        a = silu_mul_rounded(g, u).to(tl.float32)  # silu(0) * 0 = 0 where masked
        amax = tl.max(tl.abs(a), 0)
    else:
        amax_v = tl.zeros([BLOCK], tl.float32)
        for n0 in range(0, N, BLOCK):
            nn = n0 + cols
            m = nn < N
            g = tl.load(xr + nn, mask=m, other=0.0)
            u = tl.load(xr + N + nn, mask=m, other=0.0)
            amax_v = tl.maximum(amax_v, tl.abs(silu_mul_rounded(g, u).to(tl.float32)))
        amax = tl.max(amax_v, 0)
    scale = tl.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX
    tl.store(s_ptr + t, scale)
    if ONE_TILE:
        q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(a, scale), -FP8_MAX), FP8_MAX))
        tl.store(qr + cols, q.to(q_ptr.dtype.element_ty), mask=cols < N)
    else:
        for n0 in range(0, N, BLOCK):
            nn = n0 + cols
            m = nn < N
            g = tl.load(xr + nn, mask=m, other=0.0)
            u = tl.load(xr + N + nn, mask=m, other=0.0)
            a2 = silu_mul_rounded(g, u).to(tl.float32)
            q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(a2, scale), -FP8_MAX), FP8_MAX))
            tl.store(qr + nn, q.to(q_ptr.dtype.element_ty), mask=m)


# The widest row :func:`silu_mul_quant` keeps in registers (one read of gate/up); a wider
# one is read twice. 16,384 covers Llama-3.1-8B's 14,336 (16 warps: 32 values a thread).
SILU_QUANT_ONE_TILE_MAX = 16384


def silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`silu_mul` with its output quantized per token in the same kernel, for an FP8
    linear that takes e4m3 rows (the down projection's ``_scaled_mm`` or ``w8a8``): ``x =
    [gate | up]`` ``[T, 2N]`` bf16/fp16 (dim stride 1) -> ``(q [T, N] float8_e4m3fn, s [T, 1]
    fp32)``, the bits of ``triton_w8a8.quantize_rows(silu_mul(x))`` (the 16-bit activation is
    not written: one launch and one ``[T, N]`` write and read fewer). One program a row."""
    T, two_n = x.shape
    n = two_n // 2
    q = torch.empty(T, n, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    if T == 0:
        return q, s
    assert x.stride(-1) == 1
    block = min(SILU_QUANT_ONE_TILE_MAX, triton.next_power_of_2(max(n, 16)))
    _silu_mul_quant_kernel[(T,)](
        x,
        q,
        s,
        x.stride(0),
        q.stride(0),
        n,
        BLOCK=block,
        ONE_TILE=block >= n,
        num_warps=min(16, max(1, block // 1024)),
        **pdl.launch_options(x),
    )
    return q, s
