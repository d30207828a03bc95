"""Routing and alignment of the fused MoE experts on CUDA (Triton), split out of
``pdserve.model.triton_moe`` (which re-exports every name here).

:func:`align` (torch ops) and :func:`route_align` (one or two Triton launches for decode
batches) sort a batch's ``N = T * k`` assignments by expert and pad each expert's group to
a multiple of ``BLOCK_M`` (an :class:`Alignment`), the input of the grouped GEMMs; the
routing is :func:`pdserve.model.moe.route`'s (softmax in fp32, top-k, optional
renormalisation). :func:`moe_pdl`: the launch options of the grouped path's kernels.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.model import pdl
from pdserve.model.pdl import pdl_enter
from pdserve.model.triton_moe_gemv import _count_forward


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
    stats_ptr,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    RANK_DOT: tl.constexpr,
    ROUTE: tl.constexpr,
    STATS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: :func:`align` of ``T <= BLOCK_T`` tokens, after their routing
    (:func:`pdserve.model.moe.route`, ``_route_topk``) when ``ROUTE`` (routing and alignment
    in one launch instead of ~20 small torch kernels per layer), else of the routed ``ids
    [T, k]`` (the second launch of the split :func:`route_align`; logits_ptr and w_ptr
    unused). From the ``[BLOCK_T, BLOCK_E]`` grids ``chosen`` (1 where the token chose the
    expert) and ``order`` (its rank j among the token's choices): per expert its count and
    padded end (cumsum), each assignment's rank among its expert's tokens (an exclusive
    cumsum over tokens: a token chooses an expert at most once; with ``RANK_DOT`` as a
    product with the strictly lower triangle of ones on tensor cores, exact for these small
    counts), so assignment ``t * k + j`` lands at ``start[e] + rank``: the order of
    :func:`align`. ``STATS``: the experts with a count and one forward added to
    ``stats_ptr``'s two float64 routing counters."""
    pdl_enter(PDL)
    tv = tl.arange(0, BLOCK_T)
    t = tv[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    if ROUTE:
        chosen, order = _route_topk(
            logits_ptr, w_ptr, ids_ptr, tv, T, E, s_lt, TOP_K, RENORM, BLOCK_E, BLOCK_K
        )
    else:
        chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
        order = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            idj = tl.load(ids_ptr + tv * TOP_K + j, mask=tv < T, other=-1)
            hit = e == idj[:, None]
            chosen = tl.where(hit, 1, chosen)
            order = tl.where(hit, j, order)
    counts = tl.sum(chosen, axis=0)
    if STATS:
        _count_forward(stats_ptr, tl.sum((counts > 0).to(tl.int32), axis=0).to(tl.float64))
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
def _align_experts_kernel(
    ids_ptr,
    sorted_ptr,
    bexp_ptr,
    used_ptr,
    T,
    E,
    ROWS,
    stats_ptr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TB: tl.constexpr,
    BLOCK_RP: tl.constexpr,
    BLOCK_BP: tl.constexpr,
    STATS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(E,)``: :func:`align` of the routed ``ids [T, k]`` with one program per
    expert (``RouteAlignConfig.align_kind == "experts"``) instead of ``_route_align_kernel``'s
    one program, whose serial work grows with the ``[T, E]`` grid. Every program reads the
    ``N = T * k`` ids (``BLOCK_N`` >= N) and counts each expert's assignments (a histogram
    over ``BLOCK_E`` bins), so it knows its expert ``e``'s padded start; it stores its
    assignments at ``start + rank`` (rank: an exclusive cumsum in flat-id order, the order
    of :func:`align`), its padding rows (``N``) and its row blocks' expert (at most
    ``cdiv(T, BLOCK_M)`` blocks: a token chooses an expert once); and its share
    (``BLOCK_RP`` rows, ``BLOCK_BP`` blocks) of the rows and blocks past the used ones
    (``N``, ``-1``). Program 0 stores ``used`` (and with ``STATS`` adds the experts with a
    count and one forward to ``stats_ptr``'s two float64 routing counters)."""
    pdl_enter(PDL)
    e = tl.program_id(0)
    N = T * TOP_K
    n = tl.arange(0, BLOCK_N)
    ids = tl.load(ids_ptr + n, mask=n < N, other=0).to(tl.int32)
    counts = tl.histogram(ids, BLOCK_E, mask=n < N)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ev = tl.arange(0, BLOCK_E)
    start = tl.sum(tl.where(ev < e, padded, 0), axis=0)
    mine = tl.sum(tl.where(ev == e, counts, 0), axis=0)
    my_pad = tl.sum(tl.where(ev == e, padded, 0), axis=0)
    used = tl.sum(padded, axis=0)
    hit = ((ids == e) & (n < N)).to(tl.int32)
    rank = tl.cumsum(hit, axis=0) - hit
    tl.store(sorted_ptr + start + rank, n.to(tl.int32), mask=hit > 0)
    pm = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + mine + pm, tl.zeros_like(pm) + N, mask=mine + pm < my_pad)
    bv = tl.arange(0, BLOCK_TB)
    tl.store(bexp_ptr + start // BLOCK_M + bv, tl.zeros_like(bv) + e,
             mask=bv * BLOCK_M < my_pad)  # fmt: skip
    r = e * BLOCK_RP + tl.arange(0, BLOCK_RP)
    tl.store(sorted_ptr + r, tl.zeros_like(r) + N, mask=(r >= used) & (r < ROWS))
    b = e * BLOCK_BP + tl.arange(0, BLOCK_BP)
    past = (b * BLOCK_M >= used) & (b * BLOCK_M < ROWS)
    tl.store(bexp_ptr + b, tl.zeros_like(b) - 1, mask=past)
    if e == 0:
        tl.store(used_ptr, used)
        if STATS:
            _count_forward(stats_ptr, tl.sum((counts > 0).to(tl.int32), axis=0).to(tl.float64))


ROUTE_ALIGN_MAX_CELLS = 8192  # T * next_pow2(E) one program of route_align holds


class RouteAlignConfig(NamedTuple):
    """How :func:`route_align` runs. ``kind``: ``"one"`` (routing and alignment in one
    program, ``num_warps`` warps; 0: :func:`route_align_warps`) or ``"split"`` (the routing
    in programs of ``tokens_per_program`` tokens with ``num_warps`` warps each, then the
    alignment in one program of ``align_warps`` warps: two launches). ``rank_dot``: each
    assignment's rank within its expert as a tensor-core product instead of a cumsum.
    ``align_kind`` (``"split"`` only): the alignment in that one program (``"one"``) or in
    one program per expert (``"experts"``: ``_align_experts_kernel``, ``align_warps`` each;
    ``rank_dot`` unused)."""

    kind: str = "one"
    num_warps: int = 0
    rank_dot: bool = False
    tokens_per_program: int = 4
    align_warps: int = 4
    align_kind: str = "one"


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
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """:func:`pdserve.model.moe.route` then :func:`align`, in one or two Triton launches
    (when :func:`route_align_fits`). router_logits ``[T, E]``, last dim contiguous. Returns
    ``(weights [T, k] float32, ids [T, k] int64, Alignment)``, equal to the torch pair's
    (ids and order; weights to fp32 rounding). config: a :class:`RouteAlignConfig`
    (default :func:`route_align_config`); num_warps: overrides its ``num_warps``. Raises
    ValueError for an unknown ``config.kind``. stats: ``[2]`` float64 routing counters (one
    row of ``SparseMoeBlock.routing_stats``) that the alignment adds this forward's distinct
    experts and one forward to."""
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
    counters = stats if stats is not None else weights
    align_ptrs = (router_logits, weights, ids, sorted_ids, block_expert, used, T, E, rows,
                  router_logits.stride(0), counters)  # fmt: skip
    align_args = dict(
        TOP_K=top_k,
        RENORM=renormalize,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_M=block_m,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_R=triton.next_power_of_2(rows),
        BLOCK_B=triton.next_power_of_2(rows // block_m),
        RANK_DOT=cfg.rank_dot,
        STATS=stats is not None,
    )
    opts = moe_pdl(router_logits)
    if cfg.kind == "one":
        _route_align_kernel[(1,)](
            *align_ptrs, ROUTE=True, num_warps=cfg.num_warps or route_align_warps(T, E),
            **align_args, **opts,
        )  # fmt: skip
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
        if cfg.align_kind == "experts":
            nb = rows // block_m
            _align_experts_kernel[(E,)](
                ids, sorted_ids, block_expert, used, T, E, rows, counters, TOP_K=top_k,
                BLOCK_M=block_m, STATS=stats is not None,
                BLOCK_N=triton.next_power_of_2(N), BLOCK_E=triton.next_power_of_2(E),
                BLOCK_TB=triton.next_power_of_2(triton.cdiv(T, block_m)),
                BLOCK_RP=triton.next_power_of_2(triton.cdiv(rows, E)),
                BLOCK_BP=triton.next_power_of_2(triton.cdiv(nb, E)),
                num_warps=cfg.align_warps, **opts,
            )  # fmt: skip
        elif cfg.align_kind == "one":
            _route_align_kernel[(1,)](
                *align_ptrs, ROUTE=False, num_warps=cfg.align_warps, **align_args, **opts
            )
        else:
            raise ValueError(
                f"RouteAlignConfig.align_kind: 'one' or 'experts', got {cfg.align_kind!r}"
            )
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
