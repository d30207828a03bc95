"""Fused mixture-of-experts experts on CUDA (Triton): tokens grouped by expert, two grouped GEMMs.

For ``T`` tokens routed to ``k`` experts each there are ``N = T * k`` assignments (flat id
``a = t * k + j``). :func:`align` sorts the assignments by expert and pads each expert's
group to a multiple of ``BLOCK_M``, so every ``BLOCK_M`` rows of the sorted list belong to
one expert (the block's expert). Then:

1. ``_gate_up_kernel``: per (row block, column block of I) one program loads the block's
   token rows of x, multiplies them by the block expert's gate and up rows of ``w13``
   (fp32 accumulators) and writes ``silu(gate) * up`` to ``act[a]`` ``[N, I]``;
2. ``_down_kernel``: per (row block, column block of H) ``act[a] @ w2[e].T`` times the
   assignment's routing weight, written to ``out[a]`` ``[N, H]``;
3. the ``k`` rows of each token are summed (``out.view(T, k, H).sum(1)``, or
   ``_topk_sum_kernel`` when the plan says so: faster on the H200 at every decode size).

The tiles are a :class:`MoEPlan` per assignment count (:func:`pick_plan`, at decode sizes
from ``pdserve.model.moe_table``, measured by scripts/gpu_s6_moe.sh).

For decode batches (up to :data:`ROUTE_ALIGN_MAX_CELLS` router logits) the routing and the
alignment are one launch (``_route_align_kernel``) instead of ~20 small torch kernels per
layer; that one program's serial rounds grow with the tokens, so :class:`RouteAlignConfig`
can also split it into the routing in many programs and the alignment in one, or take each
assignment's rank within its expert from a tensor-core product (``moe_table.ROUTE_ALIGN``
says which per token count). Each program reads its expert's weights once for up to ``BLOCK_M`` tokens, so a decode step
(few tokens per expert) reads each routed expert's weights once per column block: the
decode path is the same kernels with a small ``BLOCK_M``. Buffers are sized from ``T``,
``k`` and ``E`` only (at most ``N + min(N, E) * (BLOCK_M - 1)`` sorted rows) and the used
length stays on the device (programs past it return at once), so a step's launch has fixed
shapes for a fixed ``T`` and no host sync: CUDA-graph capturable per batch bucket.

A few tokens (at most ``PDSERVE_MOE_GEMV_MAX_TOKENS``) skip the sort: :func:`route_experts_gemv`
routes inside the gate/up GEMV and applies the routing weights and the top-k sum inside the
down GEMV (two launches, see the section below).

Tested on CPU under ``TRITON_INTERPRET=1`` against ``pdserve.model.moe.experts_loop``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.model import pdl
from pdserve.model.pdl import pdl_enter


class Alignment(NamedTuple):
    """Assignments sorted by expert, padded per expert to a multiple of ``block_m``.

    sorted_ids ``[max_rows]`` int32: flat assignment ids (``t * k + j``) grouped by expert;
    padding rows hold ``N`` (no assignment). block_expert ``[max_rows // block_m]`` int32:
    the expert of each row block (``-1`` past the used rows). used ``[1]`` int32: the used
    rows (a multiple of ``block_m``), on the device."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    used: torch.Tensor
    block_m: int


def max_rows(n_assign: int, n_experts: int, block_m: int) -> int:
    """Upper bound of the padded sorted rows: each of at most ``min(N, E)`` used experts
    pads fewer than ``block_m`` rows; rounded up to a whole block."""
    rows = n_assign + min(n_assign, n_experts) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align(ids: torch.Tensor, n_experts: int, block_m: int) -> Alignment:
    """Group the assignments of ``ids`` ``[T, k]`` (int, values in ``[0, n_experts)``) by
    expert (ascending; within an expert in flat-id order), each group padded to a multiple of
    ``block_m``. Torch ops with shapes fixed by ``T``, ``k``, ``n_experts`` and ``block_m``
    only (no host sync, CUDA-graph capturable)."""
    dev = ids.device
    flat = ids.flatten().long()
    N = flat.numel()
    rows = max_rows(N, n_experts, block_m)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # unpadded start of each expert
    dest = (ends - padded)[expert] + torch.arange(N, device=dev) - first[expert]
    sorted_ids = torch.full((rows,), N, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < n_experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_ids, block_expert, ends[-1:].to(torch.int32), block_m)


@triton.jit
def _route_topk(
    logits_ptr,
    w_ptr,
    ids_ptr,
    tv,
    T,
    E,
    s_lt,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Routing of the tokens ``tv`` (``[BLOCK_T]``, those ``< T`` real): softmax of their
    router logits in fp32, ``TOP_K`` rounds of argmax (each chosen expert masked out), the
    weights renormalised when ``RENORM``; stores ``ids [T, k]`` (int64) and ``w [T, k]``.
    Returns ``(chosen, order)`` ``[BLOCK_T, BLOCK_E]`` int32: 1 where the token chose the
    expert, and its rank ``j`` among the token's choices."""
    t = tv[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    tmask = t < T
    valid = tmask & (e < E)
    x = tl.load(logits_ptr + t * s_lt + e, mask=valid, other=-float("inf")).to(tl.float32)
    x = tl.where(tmask, x, 0.0)  # rows past T: finite, never stored
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.where(valid, p, 0.0)
    den = tl.sum(p, axis=1)
    p = p / tl.where(den > 0, den, 1.0)[:, None]
    left = tl.where(valid, p, -1.0)
    total = tl.sum(tl.zeros_like(p), axis=1)
    order = tl.zeros_like(t + e).to(tl.int32)
    chosen = tl.zeros_like(order)
    for j in tl.static_range(TOP_K):
        top = tl.max(left, axis=1)
        arg = tl.argmax(left, axis=1)
        hit = e == arg[:, None]
        total += top
        order = tl.where(hit, j, order)
        chosen = tl.where(hit, 1, chosen)
        left = tl.where(hit, -1.0, left)
        tl.store(ids_ptr + tv * TOP_K + j, arg.to(tl.int64), mask=tv < T)
        tl.store(w_ptr + tv * TOP_K + j, top, mask=tv < T)
    if RENORM:
        tl.debug_barrier()
        kk = tl.arange(0, BLOCK_K)[None, :]
        kmask = tmask & (kk < TOP_K)
        wp = w_ptr + t * TOP_K + kk
        tl.store(wp, tl.load(wp, mask=kmask, other=0.0) / total[:, None], mask=kmask)
    return tl.where(tmask, chosen, 0), order


@triton.jit
def _align_store(
    chosen,
    order,
    sorted_ptr,
    bexp_ptr,
    used_ptr,
    T,
    E,
    ROWS,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    RANK_DOT: tl.constexpr,
):
    """:func:`align`'s outputs from ``chosen``/``order`` ``[BLOCK_T, BLOCK_E]`` (see
    ``_route_topk``): per expert its count and padded end (cumsum), each assignment's rank
    among its expert's tokens (an exclusive cumsum over tokens: a token chooses an expert at
    most once; with ``RANK_DOT`` as a product with the strictly lower triangle of ones on
    tensor cores, exact for these small counts), so assignment ``t * k + j`` lands at
    ``start[e] + rank``: the order of :func:`align`."""
    t = tl.arange(0, BLOCK_T)[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    counts = tl.sum(chosen, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    if RANK_DOT:
        lower = (tl.arange(0, BLOCK_T)[None, :] < t).to(tl.float16)  # [t, t'] t' < t
        rank = tl.dot(lower, chosen.to(tl.float16), out_dtype=tl.float32).to(tl.int32)
    else:
        rank = tl.cumsum(chosen, axis=0) - chosen
    r = tl.arange(0, BLOCK_R)
    tl.store(sorted_ptr + r, tl.zeros((BLOCK_R,), dtype=tl.int32) + T * TOP_K, mask=r < ROWS)
    tl.debug_barrier()
    dest = (ends - padded)[None, :] + rank
    keep = (chosen > 0) & (t < T) & (e < E)
    tl.store(sorted_ptr + dest, (t * TOP_K + order).to(tl.int32), mask=keep)
    bv = tl.arange(0, BLOCK_B)
    past = (ends[None, :] <= bv[:, None] * BLOCK_M) & (e < E)
    be = tl.sum(past.to(tl.int32), axis=1)
    tl.store(bexp_ptr + bv, tl.where(be < E, be, -1), mask=bv * BLOCK_M < ROWS)
    tl.store(used_ptr, tl.sum(padded, axis=0))


@triton.jit(do_not_specialize=("T", "ROWS"))  # per-step sizes: no recompile
def _route_align_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    sorted_ptr,
    bexp_ptr,
    used_ptr,
    T,
    E,
    ROWS,
    s_lt,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    RANK_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: :func:`pdserve.model.moe.route` and :func:`align` of ``T <= BLOCK_T``
    tokens in one launch (~20 small torch kernels per layer otherwise, a visible share of a
    decode step): ``_route_topk`` then ``_align_store``."""
    pdl_enter(PDL)
    tv = tl.arange(0, BLOCK_T)
    chosen, order = _route_topk(
        logits_ptr, w_ptr, ids_ptr, tv, T, E, s_lt, TOP_K, RENORM, BLOCK_E, BLOCK_K
    )
    _align_store(
        chosen, order, sorted_ptr, bexp_ptr, used_ptr, T, E, ROWS,
        TOP_K, BLOCK_M, BLOCK_T, BLOCK_E, BLOCK_R, BLOCK_B, RANK_DOT,
    )  # fmt: skip


@triton.jit(do_not_specialize=("T",))  # per-step sizes: no recompile
def _route_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    T,
    E,
    s_lt,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_T),)``: the routing (``_route_topk``) of ``BLOCK_T`` tokens a
    program, the first launch of the split :func:`route_align`."""
    pdl_enter(PDL)
    tv = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_topk(logits_ptr, w_ptr, ids_ptr, tv, T, E, s_lt, TOP_K, RENORM, BLOCK_E, BLOCK_K)


@triton.jit(do_not_specialize=("T", "ROWS"))  # per-step sizes: no recompile
def _align_ids_kernel(
    ids_ptr,
    sorted_ptr,
    bexp_ptr,
    used_ptr,
    T,
    E,
    ROWS,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    RANK_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: :func:`align` of the routed ``ids [T, k]`` (the second launch of the
    split :func:`route_align`): the chosen/order grids from the ids, then ``_align_store``."""
    pdl_enter(PDL)
    tv = tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)[None, :]
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    order = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        idj = tl.load(ids_ptr + tv * TOP_K + j, mask=tv < T, other=-1)
        hit = e == idj[:, None]
        chosen = tl.where(hit, 1, chosen)
        order = tl.where(hit, j, order)
    _align_store(
        chosen, order, sorted_ptr, bexp_ptr, used_ptr, T, E, ROWS,
        TOP_K, BLOCK_M, BLOCK_T, BLOCK_E, BLOCK_R, BLOCK_B, RANK_DOT,
    )  # fmt: skip


ROUTE_ALIGN_MAX_CELLS = 8192  # T * next_pow2(E) one program of route_align holds


class RouteAlignConfig(NamedTuple):
    """How :func:`route_align` runs. ``kind``: ``"one"`` (routing and alignment in one
    program, ``num_warps`` warps; 0: :func:`route_align_warps`) or ``"split"`` (the routing
    in programs of ``tokens_per_program`` tokens with ``num_warps`` warps each, then the
    alignment in one program of ``align_warps`` warps: two launches). ``rank_dot``: each
    assignment's rank within its expert as a tensor-core product instead of a cumsum."""

    kind: str = "one"
    num_warps: int = 0
    rank_dot: bool = False
    tokens_per_program: int = 4
    align_warps: int = 4


def route_align_fits(tokens: int, n_experts: int) -> bool:
    """Whether :func:`route_align` takes ``tokens`` rows of ``n_experts`` logits (decode
    batches: up to 64 tokens at 128 experts); larger batches route and align in torch."""
    return 0 < tokens * int(triton.next_power_of_2(n_experts)) <= ROUTE_ALIGN_MAX_CELLS


def route_align(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
    num_warps: int | None = None,
    config: RouteAlignConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """:func:`pdserve.model.moe.route` then :func:`align`, in one or two Triton launches
    (when :func:`route_align_fits`). router_logits ``[T, E]``, last dim contiguous. Returns
    ``(weights [T, k] float32, ids [T, k] int64, Alignment)``, equal to the torch pair's
    (ids and order; weights to fp32 rounding). config: a :class:`RouteAlignConfig`
    (default :func:`route_align_config`); num_warps: overrides its ``num_warps``. Raises
    ValueError for an unknown ``config.kind``."""
    T, E = router_logits.shape
    cfg = config or route_align_config(T, E)
    if num_warps:
        cfg = cfg._replace(num_warps=num_warps)
    dev = router_logits.device
    N = T * top_k
    rows = max_rows(N, E, block_m)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=dev)
    sorted_ids = torch.empty((rows,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((rows // block_m,), dtype=torch.int32, device=dev)
    used = torch.empty((1,), dtype=torch.int32, device=dev)
    # a tensor-core rank needs 16-row tiles
    block_t = max(triton.next_power_of_2(max(T, 1)), 16 if cfg.rank_dot else 1)
    block_e = max(triton.next_power_of_2(E), 16 if cfg.rank_dot else 1)
    align_args = dict(
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_R=triton.next_power_of_2(rows),
        BLOCK_B=triton.next_power_of_2(rows // block_m),
        RANK_DOT=cfg.rank_dot,
    )
    opts = moe_pdl(router_logits)
    if cfg.kind == "one":
        _route_align_kernel[(1,)](
            router_logits,
            weights,
            ids,
            sorted_ids,
            block_expert,
            used,
            T,
            E,
            rows,
            router_logits.stride(0),
            RENORM=renormalize,
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=cfg.num_warps or route_align_warps(T, E),
            **align_args,
            **opts,
        )
    elif cfg.kind == "split":
        tpp = min(cfg.tokens_per_program, triton.next_power_of_2(max(T, 1)))
        _route_kernel[(triton.cdiv(T, tpp),)](
            router_logits,
            weights,
            ids,
            T,
            E,
            router_logits.stride(0),
            TOP_K=top_k,
            RENORM=renormalize,
            BLOCK_T=tpp,
            BLOCK_E=triton.next_power_of_2(E),
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=cfg.num_warps or 1,
            **opts,
        )
        _align_ids_kernel[(1,)](
            ids, sorted_ids, block_expert, used, T, E, rows,
            num_warps=cfg.align_warps, **align_args, **opts,
        )  # fmt: skip
    else:
        raise ValueError(f"RouteAlignConfig.kind: 'one' or 'split', got {cfg.kind!r}")
    return weights, ids, Alignment(sorted_ids, block_expert, used, block_m)


def route_align_config(tokens: int, n_experts: int) -> RouteAlignConfig:
    """The :class:`RouteAlignConfig` of ``tokens`` rows of ``n_experts`` logits:
    ``moe_table.ROUTE_ALIGN``'s entry of the smallest bound >= ``tokens`` (measured on the
    H200 by scripts/gpu_s7_moe.py), else one program of :func:`route_align_warps` warps."""
    from pdserve.model import moe_table

    for bound, row in getattr(moe_table, "ROUTE_ALIGN", ()):
        if tokens <= bound:
            return RouteAlignConfig(*row)
    return RouteAlignConfig()


def route_align_warps(tokens: int, n_experts: int) -> int:
    """Warps of :func:`route_align`'s one program: ``moe_table.ROUTE_ALIGN_WARPS``'s entry
    of the smallest bound >= ``tokens * n_experts`` logits (measured: its reductions are
    serial rounds, where fewer warps exchange less through shared memory); past the table
    8 beyond 2,048 logits, else 4."""
    from pdserve.model import moe_table

    cells = tokens * n_experts
    for bound, warps in moe_table.ROUTE_ALIGN_WARPS:
        if cells <= bound:
            return warps
    return 8 if cells > 2048 else 4


def moe_pdl(t: torch.Tensor) -> dict[str, Any]:
    """Launch options of the grouped path's kernels (``route_align``'s, gate/up, down, the
    top-k sum) for tensors on ``t``'s device: :func:`pdserve.model.pdl.launch_options` when
    ``moe_table.PDL`` (a measured pick; the few-token kernels always take PDL), else PDL off.
    Read at each launch, so a sweep can flip it and capture again."""
    from pdserve.model import moe_table

    return pdl.launch_options(t) if getattr(moe_table, "PDL", False) else {"PDL": False}


@triton.jit(do_not_specialize=("N",))  # per-step sizes: no recompile
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    ids_ptr,
    bexp_ptr,
    used_ptr,
    N,
    K,
    INTER,
    s_xt,
    s_we,
    s_wn,
    s_an,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[a, n] = silu(x[a // k] . w13[e, n]) * (x[a // k] . w13[e, INTER + n]) for the
    block's rows a and columns n; fp32 accumulation, rounded to act's dtype once."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_ids = tl.load(ids_ptr + rows)
    valid = a_ids < N
    tok = (a_ids // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * s_xt + ks[None, :]
    g_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
    u_ptrs = g_ptrs + INTER * s_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        xa = tl.load(x_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & cmask[None, :]
        g = tl.load(g_ptrs, mask=wmask, other=0.0)
        u = tl.load(u_ptrs, mask=wmask, other=0.0)
        if IEEE:
            acc_g = tl.dot(xa, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(xa, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(xa, g, acc_g)
            acc_u = tl.dot(xa, u, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # silu and the product rounded to the dtype where torch rounds them (silu(gate) * up)
    gate = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(act_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
    out = (silu * up).to(act_ptr.dtype.element_ty)
    a_ptrs = act_ptr + a_ids[:, None].to(tl.int64) * s_an + cols[None, :]
    tl.store(a_ptrs, out, mask=valid[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=("N",))  # per-step sizes: no recompile
def _down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    bexp_ptr,
    used_ptr,
    N,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[a, n] = routing_weight[a] * (act[a] . w2[e, n]) for the block's rows a and
    hidden columns n (fp32 accumulation; the product in fp32, rounded once)."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_ids = tl.load(ids_ptr + rows)
    valid = a_ids < N
    a64 = a_ids.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + a64[:, None] * s_an + ks[None, :]
    w_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    rw = tl.load(rw_ptr + a64, mask=valid, other=0.0)
    out = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * rw[:, None]
    o_ptrs = out_ptr + a64[:, None] * s_on + cols[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


class MoEConfig(NamedTuple):
    """Tile sizes of one launch: rows per block (``block_m``: tokens of one expert), the
    output-column and reduction tiles, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(n_assign: int, n_experts: int) -> MoEConfig:
    """The gate/up tiles of :func:`pick_plan` (its ``block_m`` is the alignment's)."""
    return pick_plan(n_assign, n_experts).up


# The one-launch down projection + routing weights + top-k sum: (kind, BLOCK_N, BLOCK_K,
# num_warps, num_stages); kind "rows" (elementwise fp32 products, all k experts' tiles in
# one load; num_stages unused) or "dot" (tensor cores, 16-row tiles, pipelined loads).
DownSum = tuple[str, int, int, int, int]


class MoEPlan(NamedTuple):
    """How :func:`grouped_experts` runs: the gate/up kernel's tiles (``up``; its ``block_m``
    is the alignment's), the down kernel's (``down``, same ``block_m``), and ``down_sum``:
    the one-launch down projection + routing weights + top-k sum (a :data:`DownSum`; each
    token's k experts read for it alone), or None for the grouped down kernel then the
    top-k sum: in torch, or when ``triton_sum`` in ``_topk_sum_kernel`` (one small launch;
    torch's reduction kernel took 4.4 us a layer at 1 token on the H200)."""

    up: MoEConfig
    down: MoEConfig
    down_sum: DownSum | None = None
    triton_sum: bool = False


def pick_plan(n_assign: int, n_experts: int) -> MoEPlan:
    """The plan for ``n_assign`` assignments over ``n_experts``. While experts see at most 16
    tokens each (decode), ``pdserve.model.moe_table.DECODE``'s row of the smallest bound
    ``>= n_assign`` (the last row past them): tiles measured on the H200 per assignment
    count (scripts/gpu_s6_moe.sh). Larger batches: 32-row blocks up to 64 tokens an
    expert, then 64-row blocks (prefill)."""
    from pdserve.model import moe_table

    per_expert = n_assign / max(n_experts, 1)
    if per_expert <= 16 and moe_table.DECODE:
        row = next((r for r in moe_table.DECODE if r[0] >= n_assign), moe_table.DECODE[-1])
        return MoEPlan(MoEConfig(*row[1]), MoEConfig(*row[2]), row[3], row[4])
    if per_expert <= 64:
        c = MoEConfig(32, 64, 64, 4, 3)
    else:
        c = MoEConfig(64, 128, 64, 8, 3)
    return MoEPlan(c, c)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: MoEConfig | MoEPlan | None = None,
) -> torch.Tensor:
    """The experts' weighted sum with the two grouped-GEMM kernels (same contract as
    ``pdserve.model.moe.experts_loop``).

    x ``[T, H]`` (fp32/bf16/fp16); w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` (x's dtype, last
    dim contiguous); weights ``[T, k]`` float32; ids ``[T, k]`` int. Returns ``[T, H]`` in
    x's dtype. config: tiles of both kernels (a :class:`MoEConfig`) or a :class:`MoEPlan`
    (default :func:`pick_plan`). fp32 runs the dots in IEEE fp32 (no TF32)."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    plan = as_plan(config or pick_plan(ids.numel(), w13.shape[0]))
    al = align(ids, w13.shape[0], plan.up.block_m)
    return grouped_experts(x, w13, w2, weights, al, plan, ids=ids)


def as_plan(config: MoEConfig | MoEPlan) -> MoEPlan:
    """A :class:`MoEPlan` of ``config`` (a :class:`MoEConfig`: the same tiles for both
    kernels, no fused top-k sum)."""
    if isinstance(config, MoEPlan):
        return config
    return MoEPlan(config, config)


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    al: Alignment,
    cfg: MoEConfig | MoEPlan,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The two grouped GEMMs over assignments already aligned (:func:`align` or
    :func:`route_align` with the plan's ``block_m``) and the top-k sum: x ``[T, H]``,
    weights ``[T, k]`` float32 -> ``[T, H]`` in x's dtype (see :func:`fused_experts`).
    cfg: a :class:`MoEPlan` or one :class:`MoEConfig` for both kernels. ids ``[T, k]``
    int64: the routed experts, needed by a plan's ``down_sum`` (ValueError without)."""
    plan = as_plan(cfg)
    up, dn = plan.up, plan.down
    T, H = x.shape
    inter = w13.shape[1] // 2
    k = weights.shape[1]
    N = T * k
    assert al.block_m == up.block_m == dn.block_m, "aligned to another row block"
    x = x.contiguous()
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need a contiguous last dim"
    act = torch.empty((N, inter), dtype=x.dtype, device=x.device)
    n_blocks = al.sorted_ids.numel() // up.block_m
    ieee = x.dtype == torch.float32
    opts = moe_pdl(x)
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, up.block_n))](
        x,
        w13,
        act,
        al.sorted_ids,
        al.block_expert,
        al.used,
        N,
        H,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=k,
        BLOCK_M=up.block_m,
        BLOCK_N=up.block_n,
        BLOCK_K=up.block_k,
        IEEE=ieee,
        num_warps=up.num_warps,
        num_stages=up.num_stages,
        **opts,
    )
    if plan.down_sum is not None:
        if ids is None:
            raise ValueError("a plan with down_sum needs the routed expert ids")
        return _down_sum(act, w2, weights, ids, T, H, k, plan.down_sum)
    out = torch.empty((N, H), dtype=x.dtype, device=x.device)
    _down_kernel[(n_blocks, triton.cdiv(H, dn.block_n))](
        act,
        w2,
        out,
        weights.contiguous().view(-1),
        al.sorted_ids,
        al.block_expert,
        al.used,
        N,
        inter,
        H,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        BLOCK_M=dn.block_m,
        BLOCK_N=dn.block_n,
        BLOCK_K=dn.block_k,
        IEEE=ieee,
        num_warps=dn.num_warps,
        num_stages=dn.num_stages,
        **opts,
    )
    if not plan.triton_sum:
        return out.view(T, k, H).sum(dim=1)
    return topk_sum(out, T, k, opts)


def topk_sum(out: torch.Tensor, T: int, k: int, opts: dict[str, Any]) -> torch.Tensor:
    """``out [T * k, H]`` (contiguous) summed over each token's k rows -> ``[T, H]`` in
    out's dtype (``_topk_sum_kernel``: fp32 sum, one rounding); opts: launch options
    (:func:`moe_pdl`)."""
    H = out.shape[1]
    total = torch.empty((T, H), dtype=out.dtype, device=out.device)
    block = min(1024, triton.next_power_of_2(H))
    _topk_sum_kernel[(T, triton.cdiv(H, block))](
        out, total, H, TOP_K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_H=block, num_warps=4,
        **opts,
    )  # fmt: skip
    return total


@triton.jit
def _topk_sum_kernel(
    src_ptr,
    dst_ptr,
    H,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_H))``: ``dst[t, h] = sum_j src[t * TOP_K + j, h]`` (src
    ``[T * TOP_K, H]``, dst ``[T, H]``, contiguous), summed in fp32 and rounded once, as
    torch's ``sum(dim=1)`` of the ``[T, TOP_K, H]`` view."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_K)
    mask = (j[:, None] < TOP_K) & (h[None, :] < H)
    v = tl.load(src_ptr + (t * TOP_K + j[:, None]) * H + h[None, :], mask=mask, other=0.0)
    total = tl.sum(v.to(tl.float32), axis=0)
    tl.store(dst_ptr + t * H + h, total.to(dst_ptr.dtype.element_ty), mask=h < H)


def _down_sum(
    act: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    T: int,
    H: int,
    k: int,
    tiles: DownSum,
) -> torch.Tensor:
    """The down projection, routing weights and top-k sum in one launch over act
    ``[T * k, I]`` (row ``t * k + j``) -> ``[T, H]`` in act's dtype; tiles: a
    :data:`DownSum` (``"rows"``: ``_down_sum_gemv_kernel``, ``"dot"``:
    ``_down_sum_dot_kernel``)."""
    kind, bn, bk, warps, stages = tiles
    out = torch.empty((T, H), dtype=act.dtype, device=act.device)
    args = (
        act,
        w2,
        out,
        weights.contiguous(),
        ids.contiguous(),
        act.shape[1],
        H,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
    )
    grid = (T, triton.cdiv(H, bn))
    opts = dict(TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl.launch_options(act))
    if kind == "dot":
        ieee = act.dtype == torch.float32
        _down_sum_dot_kernel[grid](*args, IEEE=ieee, num_stages=stages, **opts)
    elif kind == "rows":
        _down_sum_gemv_kernel[grid](*args, BLOCK_J=triton.next_power_of_2(k), **opts)
    else:
        raise ValueError(f"down_sum kind: 'rows' or 'dot', got {kind!r}")
    return out


# ------------------------------------------------------------------ few-token decode path
# For a handful of tokens (decode at batch 1-4) there is nothing to group: each assignment
# reads its own expert's rows. Three launches a layer instead of five (router GEMM,
# route_align, gate_up, down, top-k sum): the router GEMM (cuBLAS), then
#  1. ``_route_gate_up_gemv_kernel``: program (assignment a = t * k + j, column block of I)
#     takes token t's router logits (E values), softmax in fp32, k rounds of argmax (the
#     order of route_align), keeps the j-th expert e and weight, stores them (column block
#     0 only), then the GEMV act[a] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n]);
#  2. ``_down_sum_gemv_kernel``: program (token t, column block of H) sums over j the
#     weighted GEMVs weight[a] * (act[a] . w2[e, n]): the down projection, the routing
#     weights and the top-k sum in one kernel, each token's k experts read once.
# GEMVs as pdserve.model.triton_gemv's ``rows`` kernel does them (no tensor cores: w * x
# elementwise in fp32, one sum at the end; many programs of BLOCK_N output features so the
# weight reads fill the memory system). No sort, no padding, no host sync: CUDA-graph
# capturable, shapes fixed by T.


@triton.jit
def _route_one(
    logits_ptr, s_lt, t, j, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Token ``t``'s ``j``-th expert and its routing weight, from its router logits (row
    ``t`` of ``logits_ptr``, stride ``s_lt``, ``E`` experts): softmax in fp32, the
    ``TOP_K`` largest in order (ties to the lower id, as ``tl.argmax``), renormalised over
    them when ``RENORM``. Returns ``(expert id int32, weight fp32)``."""
    ev = tl.arange(0, BLOCK_E)
    emask = ev < E
    lg = tl.load(logits_ptr + t * s_lt + ev, mask=emask, other=-float("inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = tl.where(emask, p, 0.0)
    p = p / tl.sum(p, axis=0)
    left = tl.where(emask, p, -1.0)
    total = tl.sum(tl.zeros((BLOCK_E,), dtype=tl.float32), axis=0)  # fp32 scalars
    sel_w = total
    sel_e = tl.sum(tl.zeros((BLOCK_E,), dtype=tl.int32), axis=0)
    for jj in tl.static_range(TOP_K):
        top = tl.max(left, axis=0)
        arg = tl.argmax(left, axis=0)
        total += top
        sel_w = tl.where(j == jj, top, sel_w)
        sel_e = tl.where(j == jj, arg, sel_e)
        left = tl.where(ev == arg, -1.0, left)
    if RENORM:
        sel_w = sel_w / total
    return sel_e, sel_w


@triton.jit
def _route_gate_up_gemv_kernel(
    logits_ptr,
    x_ptr,
    w_ptr,
    act_ptr,
    rw_ptr,
    ids_ptr,
    E,
    K,
    INTER,
    s_lt,
    s_xt,
    s_we,
    s_wn,
    s_an,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T * TOP_K, cdiv(INTER, BLOCK_N))``: routing of token ``a // TOP_K`` (its
    ``a % TOP_K``-th expert) and ``act[a, n]`` for the block's columns ``n``."""
    pdl_enter(PDL)
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = a // TOP_K
    sel_e, sel_w = _route_one(logits_ptr, s_lt, t, a % TOP_K, E, TOP_K, RENORM, BLOCK_E)
    if pid_n == 0:
        tl.store(ids_ptr + a, sel_e.to(tl.int64))
        tl.store(rw_ptr + a, sel_w)
    e = sel_e.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * s_we + cols[:, None].to(tl.int64) * s_wn + ks[None, :]
    u_ptrs = g_ptrs + INTER * s_wn
    x_ptrs = x_ptr + t.to(tl.int64) * s_xt + ks
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        xv = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)[None, :]
        wmask = cmask[:, None] & kmask[None, :]
        acc_g += tl.load(g_ptrs, mask=wmask, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(u_ptrs, mask=wmask, other=0.0).to(tl.float32) * xv
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # the roundings of _gate_up_kernel (torch's: gate, up, silu(gate), the product)
    gate = tl.sum(acc_g, axis=1).to(act_ptr.dtype.element_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(act_ptr.dtype.element_ty).to(tl.float32)
    up = tl.sum(acc_u, axis=1).to(act_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        act_ptr + a.to(tl.int64) * s_an + cols, (silu * up).to(act_ptr.dtype.element_ty), mask=cmask
    )


@triton.jit
def _route_gate_up_dot_kernel(
    logits_ptr,
    x_ptr,
    w_ptr,
    act_ptr,
    rw_ptr,
    ids_ptr,
    E,
    K,
    INTER,
    s_lt,
    s_xt,
    s_we,
    s_wn,
    s_an,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_route_gate_up_gemv_kernel``'s work (same grid, routing, roundings and stores) with
    the products on tensor cores: x's row in a 16-row tile (rows 1-15 zero) times
    ``[BLOCK_K, BLOCK_N]`` weight tiles, the loads software-pipelined (``num_stages``)."""
    pdl_enter(PDL)
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = a // TOP_K
    sel_e, sel_w = _route_one(logits_ptr, s_lt, t, a % TOP_K, E, TOP_K, RENORM, BLOCK_E)
    if pid_n == 0:
        tl.store(ids_ptr + a, sel_e.to(tl.int64))
        tl.store(rw_ptr + a, sel_w)
    e = sel_e.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < INTER
    rows = tl.arange(0, 16)
    first = rows[:, None] == 0
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
    u_ptrs = g_ptrs + INTER * s_wn
    x_ptrs = x_ptr + t.to(tl.int64) * s_xt + ks[None, :] + rows[:, None] * 0
    acc_g = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        xa = tl.load(x_ptrs, mask=first & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & cmask[None, :]
        g = tl.load(g_ptrs, mask=wmask, other=0.0)
        u = tl.load(u_ptrs, mask=wmask, other=0.0)
        if IEEE:
            acc_g = tl.dot(xa, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(xa, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(xa, g, acc_g)
            acc_u = tl.dot(xa, u, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    ty = act_ptr.dtype.element_ty
    gate = acc_g.to(ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    up = acc_u.to(ty).to(tl.float32)
    a_ptrs = act_ptr + a.to(tl.int64) * s_an + cols[None, :] + rows[:, None] * 0
    tl.store(a_ptrs, (silu * up).to(ty), mask=first & cmask[None, :])


@triton.jit
def _down_sum_gemv_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_ot,
    TOP_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T, cdiv(HID, BLOCK_N))``: ``out[t, n] = sum_j rw[a] * (act[a] . w2[e_a, n])``
    over the token's assignments ``a = t * TOP_K + j``; each term rounded to out's dtype as
    _down_kernel rounds it, the k terms summed in fp32 and rounded once (the top-k sum).
    The k experts' tiles are one ``[BLOCK_J, BLOCK_N, BLOCK_K]`` load (``BLOCK_J`` = k
    rounded up to a power of two): all k weight reads in flight at once."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    js = tl.arange(0, BLOCK_J)
    jmask = js < TOP_K
    a = t.to(tl.int64) * TOP_K + js  # [BLOCK_J]
    e = tl.load(ids_ptr + a, mask=jmask, other=0)
    rw = tl.load(rw_ptr + a, mask=jmask, other=0.0)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = (
        w_ptr
        + e[:, None, None] * s_we
        + cols[None, :, None].to(tl.int64) * s_wn
        + ks[None, None, :]
    )
    a_ptrs = act_ptr + a[:, None] * s_an + ks[None, :]
    wmask = jmask[:, None, None] & cmask[None, :, None]
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        av = tl.load(a_ptrs, mask=jmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=wmask & kmask[None, None, :], other=0.0)
        acc += w.to(tl.float32) * av[:, None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    ty = out_ptr.dtype.element_ty
    term = tl.sum(acc, axis=2).to(ty).to(tl.float32) * rw[:, None]  # [BLOCK_J, BLOCK_N]
    total = tl.sum(term.to(ty).to(tl.float32), axis=0)  # padded j rows are 0
    tl.store(out_ptr + t.to(tl.int64) * s_ot + cols, total.to(ty), mask=cmask)


@triton.jit
def _down_sum_dot_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_ot,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_down_sum_gemv_kernel``'s work (same grid, roundings and stores) on tensor cores:
    one pipelined loop over the token's k experts times K chunks, the act row in a 16-row
    tile (rows 1-15 zero) times ``[BLOCK_K, BLOCK_N]`` tiles of ``w2[e_j]``; after an
    expert's last chunk its term (rounded, times its weight, rounded) joins the fp32 total."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    rows = tl.arange(0, 16)
    first = rows[:, None] == 0
    ks = tl.arange(0, BLOCK_K)
    nk = tl.cdiv(K, BLOCK_K)
    ty = out_ptr.dtype.element_ty
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for i in range(0, TOP_K * nk):
        j = i // nk
        k0 = (i - j * nk) * BLOCK_K
        a = t * TOP_K + j
        e = tl.load(ids_ptr + a)
        kmask = ks + k0 < K
        av = tl.load(
            act_ptr + a * s_an + k0 + ks[None, :] + rows[:, None] * 0,
            mask=first & kmask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + k0 + ks[:, None],
            mask=kmask[:, None] & cmask[None, :],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(av, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(av, w, acc)
        flush = k0 + BLOCK_K >= K
        rw = tl.load(rw_ptr + a)
        term = (acc.to(ty).to(tl.float32) * rw).to(ty).to(tl.float32)
        total = tl.where(flush, total + term, total)
        acc = tl.where(flush, 0.0, acc)
    o_ptrs = out_ptr + t * s_ot + cols[None, :] + rows[:, None] * 0
    tl.store(o_ptrs, total.to(ty), mask=first & cmask[None, :])


@triton.jit
def _down_assign_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    rw_ptr,
    ids_ptr,
    K,
    HID,
    s_an,
    s_we,
    s_wn,
    s_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(T * TOP_K, cdiv(HID, BLOCK_N))``: ``out[a, n] = rw[a] * (act[a] . w2[e_a, n])``
    for assignment ``a`` (expert ``ids[a]``), rounded as ``_down_kernel`` rounds it (the
    product rounded to out's dtype, times the weight in fp32, rounded); the act row in a
    16-row tile (rows 1-15 zero) on tensor cores, ``num_stages`` pipelined loads. The
    few-token path's down projection when ``GemvConfig.down_kind == "assign"``: one program
    per (assignment, column block), so the k experts' reads spread over k times the
    programs of the one-launch down + sum; the top-k sum follows (``_topk_sum_kernel``)."""
    pdl_enter(PDL)
    a = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    rows = tl.arange(0, 16)
    first = rows[:, None] == 0
    ks = tl.arange(0, BLOCK_K)
    e = tl.load(ids_ptr + a)
    a_ptrs = act_ptr + a * s_an + ks[None, :] + rows[:, None] * 0
    w_ptrs = w_ptr + e * s_we + cols[None, :].to(tl.int64) * s_wn + ks[:, None]
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks + k0 < K
        av = tl.load(a_ptrs, mask=first & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(av, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(av, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    ty = out_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + a)
    o = (acc.to(ty).to(tl.float32) * rw).to(ty)
    o_ptrs = out_ptr + a * s_on + cols[None, :] + rows[:, None] * 0
    tl.store(o_ptrs, o, mask=first & cmask[None, :])


class GemvConfig(NamedTuple):
    """Tiles of the few-token path: output features and reduction chunk per program of the
    gate/up kernel (``up_n``, ``up_k``, ``up_warps``) and of the down + sum kernel
    (``down_n``, ``down_k``, ``down_warps``); ``up_kind``: the gate/up products as
    elementwise fp32 sums (``"rows"``) or on tensor cores in 16-row tiles (``"dot"``,
    ``up_stages`` pipelined loads; ``up_n`` and ``up_k`` >= 16); ``down_kind`` and
    ``down_stages`` likewise for the down + sum kernel (see :data:`DownSum`), or
    ``"assign"``: the down projection per assignment (``_down_assign_kernel``, tensor cores,
    ``down_n`` >= 16) then the top-k sum kernel: three launches with the gate/up.)"""

    up_n: int = 16
    up_k: int = 512
    up_warps: int = 8
    down_n: int = 4
    down_k: int = 256
    down_warps: int = 8
    up_kind: str = "rows"
    up_stages: int = 3
    down_kind: str = "rows"
    down_stages: int = 3


def gemv_config() -> GemvConfig:
    """The few-token path's default tiles: ``moe_table.GEMV`` (a measured pick) when set,
    else :class:`GemvConfig`'s defaults."""
    from pdserve.model import moe_table

    row = getattr(moe_table, "GEMV", None)
    return GemvConfig(*row) if row else GemvConfig()


def gemv_fits(tokens: int) -> bool:
    """Whether a forward of ``tokens`` rows takes the few-token path (:func:`route_experts_gemv`):
    ``0 < tokens <= PDSERVE_MOE_GEMV_MAX_TOKENS`` when that is set, else ``<=
    moe_table.GEMV_MAX_TOKENS`` (a measured pick, 0: never). Each token's experts are read
    for it alone, so past a few tokens sharing experts the grouped kernels read fewer bytes."""
    from pdserve import envs
    from pdserve.model import moe_table

    if envs.MOE_GEMV_MAX_TOKENS.is_set():
        bound = envs.MOE_GEMV_MAX_TOKENS.get()
    else:
        bound = getattr(moe_table, "GEMV_MAX_TOKENS", 0)
    return 0 < tokens <= bound


def route_experts_gemv(
    router_logits: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing and the experts' weighted sum of a few tokens in two launches (no sort).

    router_logits ``[T, E]`` (any float dtype, last dim contiguous); x ``[T, H]``
    (fp32/bf16/fp16); w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` in x's dtype, last dim
    contiguous. Returns ``(out [T, H] in x's dtype, weights [T, k] float32, ids [T, k]
    int64)``: the routing of :func:`pdserve.model.moe.route` (same ids and order, weights
    to fp32 rounding) and the sum of ``pdserve.model.moe.experts_loop`` (fp32
    accumulation, its roundings; summation order differs). Shapes fixed by T: capturable in
    a CUDA graph."""
    cfg = config or gemv_config()
    T, E = router_logits.shape
    H = x.shape[1]
    inter = w13.shape[1] // 2
    dev = x.device
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=dev)
    if T == 0:
        return torch.empty((0, H), dtype=x.dtype, device=dev), weights, ids
    assert router_logits.stride(1) == 1 and x.stride(1) == 1
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need a contiguous last dim"
    act = torch.empty((T * top_k, inter), dtype=x.dtype, device=dev)
    args = (
        router_logits,
        x,
        w13,
        act,
        weights,
        ids,
        E,
        H,
        inter,
        router_logits.stride(0),
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
    )
    grid = (T * top_k, triton.cdiv(inter, cfg.up_n))
    common = dict(
        TOP_K=top_k,
        RENORM=renormalize,
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_N=cfg.up_n,
        BLOCK_K=cfg.up_k,
        num_warps=cfg.up_warps,
        **pdl.launch_options(x),
    )
    if cfg.up_kind == "dot":
        _route_gate_up_dot_kernel[grid](
            *args, IEEE=x.dtype == torch.float32, num_stages=cfg.up_stages, **common
        )
    elif cfg.up_kind == "rows":
        _route_gate_up_gemv_kernel[grid](*args, **common)
    else:
        raise ValueError(f"GemvConfig.up_kind: 'rows' or 'dot', got {cfg.up_kind!r}")
    if cfg.down_kind == "assign":
        opts = pdl.launch_options(x)
        per = torch.empty((T * top_k, H), dtype=x.dtype, device=dev)
        _down_assign_kernel[(T * top_k, triton.cdiv(H, cfg.down_n))](
            act, w2, per, weights, ids, inter, H, act.stride(0), w2.stride(0), w2.stride(1),
            per.stride(0), BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k, IEEE=x.dtype == torch.float32,
            num_warps=cfg.down_warps, num_stages=cfg.down_stages, **opts,
        )  # fmt: skip
        return topk_sum(per, T, top_k, opts), weights, ids
    tiles = (cfg.down_kind, cfg.down_n, cfg.down_k, cfg.down_warps, cfg.down_stages)
    out = _down_sum(act, w2, weights, ids, T, H, top_k, tiles)
    return out, weights, ids
