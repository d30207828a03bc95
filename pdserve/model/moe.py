"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): routing, the experts, and their checkpoint names.

A sparse layer replaces the dense SwiGLU MLP: a router (``gate``, ``[E, H]``, no bias) scores
the ``E`` experts per token; each token runs through its ``top_k`` best experts (each a
SwiGLU MLP of intermediate size ``I``) and their outputs are summed, weighted by the
routing probabilities (Shazeer et al. 2017; Mixtral, Jiang et al. 2024).

Routing follows transformers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``): softmax of the
router logits in fp32, top-k, then (Mixtral always, Qwen3-MoE when ``norm_topk_prob``) the
k probabilities renormalised to sum to 1, which for Mixtral equals a softmax over the k
chosen logits.

Weights: ``w13 [E, 2 * I_rank, H]`` (each expert's gate rows, then its up rows) and ``w2 [E,
H, I_rank]``. Under tensor parallelism every rank holds its slice ``[i0, i1)`` of every
expert's intermediate dimension (gate/up rows, down columns; the router whole), so a rank's
output is a partial sum that the decoder layer all-reduces, as for the dense MLP.

Two ways to run the experts on the same weights: :func:`experts_loop` (per-expert torch
loop, transformers' order of operations: the CPU path and the reference) and
``pdserve.model.triton_moe.fused_experts`` (tokens sorted by expert, two grouped GEMMs;
CUDA, and CPU under ``TRITON_INTERPRET=1``; for a few tokens ``route_experts_gemv``, the
routing and two GEMVs with no sort). ``PDSERVE_MOE_EXPERTS`` picks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import envs
from pdserve.model.weight_map import Target

if TYPE_CHECKING:
    from pdserve.model.fused_splitk_norm import SplitKPartials
    from pdserve.model.shapes import ModelShapes


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of router logits ``[T, E]`` (any float dtype).

    Returns ``(weights [T, top_k] float32, expert ids [T, top_k] int64)``: the softmax
    probabilities (computed in fp32) of each token's ``top_k`` most probable experts, in
    descending order, divided by their sum when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_loop(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum, one expert at a time (torch; the reference).

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows then up rows); w2 ``[E, H, I]``; weights
    ``[T, k]`` float32 and ids ``[T, k]`` int64 from :func:`route`. Returns ``[T, H]`` in
    x's dtype: ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = ids[t, j]``. Experts run in ascending id order and accumulate with ``index_add_``,
    as transformers' ``Qwen3MoeExperts`` does, so fp32 results match it bit for bit. Reads
    the routed expert ids back to the host (a device sync: not CUDA-graph capturable)."""
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # assignment positions grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        pos = order[start : start + n]
        start += n
        tok = pos // ids.shape[1]
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])
        h = h * weights.flatten()[pos, None].to(h.dtype)
        out.index_add_(0, tok, h.to(out.dtype))
    return out


STATS_ROWS = 1025  # routing counters per forward size: 0..1023 tokens, then "1024 or more"


def experts_impl(device: torch.device) -> str:
    """``"fused"`` or ``"loop"``: how experts run on ``device`` (``PDSERVE_MOE_EXPERTS``;
    ``auto`` is fused on CUDA, the loop elsewhere)."""
    choice = envs.MOE_EXPERTS.get()
    if choice == "auto":
        return "fused" if device.type == "cuda" else "loop"
    return choice


class SparseMoeBlock(nn.Module):
    """One layer's experts and router, this rank's slice of each expert.

    Parameters: ``gate [E, H]`` (router, whole on every rank), ``w13 [E, 2 * I_rank, H]``,
    ``w2 [E, H, I_rank]`` with ``I_rank = shapes.moe_intermediate``. :meth:`forward` returns
    this rank's partial output (the caller all-reduces under TP). layer: the layer's index,
    which seeds the uniform routing table of ``PDSERVE_MOE_ROUTING=uniform`` (benchmarks:
    the same table on every TP rank and in every process)."""

    def __init__(
        self, s: ModelShapes, dtype: torch.dtype, device: torch.device | str, layer: int = 0
    ) -> None:
        super().__init__()
        self.s = s
        E, H, inter = s.n_experts, s.hidden, s.moe_intermediate

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.gate = empty(E, H)
        self.w13 = empty(E, 2 * inter, H)
        self.w2 = empty(E, H, inter)
        # PDSERVE_MOE_ROUTING_STATS: per forward size T (row min(T, STATS_ROWS - 1)) the sum
        # of the distinct experts routed to and the number of forwards (float64, on the
        # device; the row is fixed per captured graph; see routed_experts)
        self.routing_stats: torch.Tensor | None = None
        if envs.MOE_ROUTING_STATS.get():
            self.routing_stats = torch.zeros((STATS_ROWS, 2), dtype=torch.float64, device=device)
        # PDSERVE_MOE_ROUTING=uniform (benchmarks): router logits from a fixed table instead
        # of the router's (see uniform_logits)
        self.uniform_table: torch.Tensor | None = None
        if envs.MOE_ROUTING.get() == "uniform":
            self.uniform_table = uniform_routing_table(E, layer, dtype, device)

    def forward(
        self, x: torch.Tensor, logits: torch.Tensor | None = None, rows_out: bool = False
    ) -> torch.Tensor | SplitKPartials:
        """x ``[T, H]`` (post-attention-norm hidden states) -> ``[T, H]`` in x's dtype.
        logits: the router's ``[T, E]`` (``x @ gate.T``) when the caller computed them
        (``fused_ops.add_rms_norm_router``); None: computed here. rows_out: the caller
        hands the output to ``fused_splitk_norm.add_rms_norm`` (no TP): with
        ``fused_splitk_norm.FUSE_TOPK`` on, one token on the few-token path returns its k
        weighted expert rows unsummed (a ``SplitKPartials``), summed by that kernel; with
        ``FUSE_TOPK_GROUPED``, a decode batch on the grouped path (``route_align``'s)
        likewise."""
        s = self.s
        T = x.shape[0]
        if logits is None:
            logits = F.linear(x, self.gate)
        if self.uniform_table is not None:
            logits = uniform_logits(self.uniform_table, T)
        # the routing counters' row of this forward size; the decode kernels add to it
        # themselves (no launches of their own), other paths below
        row = None
        if self.routing_stats is not None:
            row = self.routing_stats[min(T, STATS_ROWS - 1)]
        counted = False
        if experts_impl(x.device) == "fused" and T > 0:
            from pdserve.model import triton_moe as tm

            if tm.gemv_fits(T):  # a few tokens: routing + 2 GEMVs, no sort
                from pdserve.model import fused_splitk_norm

                in_kernel = row if T == 1 else None
                rows = rows_out and T == 1 and fused_splitk_norm.FUSE_TOPK
                gemv_out, weights, ids = tm.route_experts_gemv(
                    logits, x.contiguous(), self.w13, self.w2, s.top_k, s.norm_topk_prob,
                    stats=in_kernel, rows_out=rows,
                )  # fmt: skip
                counted = in_kernel is not None
                if isinstance(gemv_out, tuple):  # counted in the kernel (one token)
                    return gemv_out
                out = gemv_out
            else:
                from pdserve.model import fused_splitk_norm

                plan = tm.pick_plan(T * s.top_k, s.n_experts)
                decode = tm.route_align_fits(T, s.n_experts)
                if decode:  # one launch
                    weights, ids, al = tm.route_align(
                        logits, s.top_k, s.norm_topk_prob, plan.up.block_m, stats=row
                    )
                    counted = True
                else:
                    weights, ids = route(logits, s.top_k, s.norm_topk_prob)
                    al = tm.align(ids, s.n_experts, plan.up.block_m)
                rows = rows_out and decode and fused_splitk_norm.FUSE_TOPK_GROUPED
                grouped = tm.grouped_experts(
                    x, self.w13, self.w2, weights, al, plan, ids=ids, rows_out=rows
                )
                if isinstance(grouped, tuple):  # counted in route_align
                    return grouped
                out = grouped
        else:
            weights, ids = route(logits, s.top_k, s.norm_topk_prob)
            out = experts_loop(x, self.w13, self.w2, weights, ids)
        if row is not None and not counted:
            hit = torch.zeros(s.n_experts, dtype=torch.float64, device=x.device)
            hit.index_fill_(0, ids.flatten(), 1.0)
            row[0] += hit.sum()
            row[1] += 1.0
        return out


# Rows of a uniform routing table (PDSERVE_MOE_ROUTING=uniform): a forward of T tokens
# takes rows 0..T-1 (past the table, rows again from 0)
UNIFORM_ROWS = 4096


def uniform_routing_table(
    n_experts: int, layer: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Router logits ``[UNIFORM_ROWS, n_experts]`` (standard normal draws in ``dtype``, made
    on the CPU from a generator seeded by ``layer``, so every process and TP rank draws the
    same) for ``PDSERVE_MOE_ROUTING=uniform``: each row's top-k is a uniformly random set of
    experts, a batch's rows independent of each other, so a decode batch of T tokens routes
    to about ``E * (1 - (1 - k / E) ** T)`` distinct experts as a load-balanced router would
    (a random-weight model's router sends a batch's tokens to a few)."""
    gen = torch.Generator().manual_seed(1_000_003 + layer)
    return torch.randn(UNIFORM_ROWS, n_experts, generator=gen).to(dtype).to(device)


def uniform_logits(table: torch.Tensor, T: int) -> torch.Tensor:
    """The logits of a forward of ``T`` tokens from a :func:`uniform_routing_table`: its
    first T rows (a view: no launch inside a decode step's graph), cycled past its end."""
    if table.shape[0] >= T:
        return table[:T]
    idx = torch.arange(T, device=table.device) % table.shape[0]
    return table[idx]


def routed_experts(
    blocks: Iterable[SparseMoeBlock], num_seqs: int, reset: bool = True
) -> float | None:
    """Mean number of distinct experts a decode step of ``num_seqs`` sequences routed to,
    per sparse layer, from ``PDSERVE_MOE_ROUTING_STATS``'s counters since the last reset:
    the forwards of the size in ``[num_seqs, 4 * num_seqs]`` that ran most often (the
    decode step's batch, padded to its graph bucket; prefill chunks and start-up warm-ups of
    other sizes are left out; a bucket's padded rows count, their experts are read too).
    None when the counters are off or saw no such forward. ``reset`` zeroes them."""
    stats = [b.routing_stats for b in blocks]
    if not stats or any(t is None for t in stats):
        return None
    total = torch.stack([t for t in stats if t is not None]).sum(0).cpu()  # [rows, 2]
    if reset:
        for t in stats:
            if t is not None:
                t.zero_()
    lo, hi = num_seqs, min(4 * num_seqs, STATS_ROWS - 2)
    if lo > hi:
        return None
    calls = total[lo : hi + 1, 1]
    if calls.max().item() == 0:
        return None
    row = lo + int(calls.argmax())
    return float(total[row, 0] / total[row, 1])


# ------------------------------------------------------------------ checkpoint names
# Per family: the sparse block's prefix in hub checkpoints, and each expert's gate / up /
# down tensor names there (transformers 5 renames Mixtral's block to ``mlp`` and fuses the
# experts into ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``: those
# names, which random presets and GGUF conversions produce, are split by hub_names).
_HUB = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def moe_weight_targets(
    s: ModelShapes, model_type: str, layers: dict[int, SparseMoeBlock]
) -> dict[str, Target]:
    """Hub checkpoint name -> :class:`~pdserve.model.weight_map.Target` for the sparse
    layers ``layers`` (layer index -> block): the router whole, each expert's gate/up
    rows ``[i0, i1)`` (dim 0) and down columns ``[i0, i1)`` (dim 1) of this rank."""
    block, (g, u, d) = _HUB[model_type]
    i0, i1 = s.moe_intermediate_range
    n, ti, H = i1 - i0, s.total_moe_intermediate, s.hidden
    t: dict[str, Target] = {}
    for i, moe in layers.items():
        pre = f"model.layers.{i}.{block}."
        E = moe.gate.shape[0]
        t[pre + "gate.weight"] = Target(moe.gate, 0, E, 0, 0, E, E)
        for e in range(E):
            ex = f"{pre}experts.{e}."
            w13, w2 = moe.w13[e], moe.w2[e]
            t[ex + g + ".weight"] = Target(w13, 0, n, 0, i0, i1, ti)
            t[ex + u + ".weight"] = Target(w13, n, 2 * n, 0, i0, i1, ti)
            t[ex + d + ".weight"] = Target(w2, 0, H, 1, i0, i1, ti)
    return t


def hub_names(
    weights: Iterable[tuple[str, torch.Tensor]], model_type: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with transformers-5 expert names rewritten to hub names (views, no copy):
    ``mlp.experts.gate_up_proj [E, 2I, H]`` -> per expert ``gate`` ``[I, H]`` and ``up``;
    ``mlp.experts.down_proj [E, H, I]`` -> per expert ``down`` ``[H, I]``; Mixtral's
    ``mlp.`` -> ``block_sparse_moe.``. Other names pass unchanged. (Fused tensors arrive
    whole: a TP rank narrows each expert's slice as it copies.)"""
    block, (g, u, d) = _HUB[model_type]
    for name, t in weights:
        pre, _, leaf = name.rpartition(".mlp.")
        if not pre.startswith("model.layers."):
            yield name, t
        elif leaf == "experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                yield f"{pre}.{block}.experts.{e}.{g}.weight", gate[e]
                yield f"{pre}.{block}.experts.{e}.{u}.weight", up[e]
        elif leaf == "experts.down_proj":
            for e in range(t.shape[0]):
                yield f"{pre}.{block}.experts.{e}.{d}.weight", t[e]
        elif leaf == "gate.weight":
            yield f"{pre}.{block}.gate.weight", t
        else:
            yield name, t
