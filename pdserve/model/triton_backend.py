"""``triton`` attention backend: our own paged kernels (``triton_kernels.py``), CUDA-graph safe.

A step is planned once (outside the model's forward). A decode-only step runs the split-KV
decode kernel and, with more than one split, its merge; any other step (prefill, chunked
prefill over a cached prefix, mixed decode + prefill) runs the varlen extend kernel over
every sequence. Both read K/V in place from the paged cache, through its strides; this
step's K/V are stored first by the store kernel, or, on CUDA, by the model's RoPE kernel
(``fused_ops.rope_store_kv``: one kernel a layer fewer; ``forward(..., kv_stored=True)``).

CUDA graphs: :meth:`TritonBackend.plan_for_capture` builds a decode plan whose launch shapes
depend only on the batch size (the split count is fixed per batch size; each program derives
its range from ``seq_lens`` on the device), so a graph captured over static buffers stays
valid for any context length that fits the page table. Padded rows carry slot ``-1`` (the
store writes nothing) and ``seq_len`` 0 (their output is 0).

Runs on CUDA, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model import pdl
from pdserve.model.attention import AttentionBackend, AttentionMetadata, is_fp8, quantize_kv
from pdserve.model.triton_kernels import (
    decode_merge_kernel,
    decode_split_kernel,
    extend_kernel,
    store_kv_kernel,
)

# The extend kernel's tiles.
_EXTEND_BLOCK_M = 64
_EXTEND_BLOCK_N = 64
# Splits of a decode step: about 8 programs per SM of an H200 (132 SMs) for latency hiding,
# at most 32 splits (``capture_reserve_bytes`` counts scratch for 32).
_TARGET_PROGRAMS = 1024
_MAX_SPLITS = 32
# The longest context (tokens) a large decode batch runs as one split (see decode_config).
ONE_SPLIT_MAX_CONTEXT = 1024


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the split-KV decode kernel for one step.

    splits: programs per (row, KV head), 1..32 (1: the kernel writes the output, no merge);
    block_n: context tokens a program reads per iteration (a power of two >= 16);
    num_warps / num_stages: Triton launch options; min_split: fewest tokens a split covers
    (a multiple of ``block_n``; 0: none), so short contexts leave later splits empty."""

    splits: int
    block_n: int
    num_warps: int
    num_stages: int
    min_split: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.splits <= _MAX_SPLITS:
            raise ValueError(f"splits: {self.splits} is outside 1..{_MAX_SPLITS}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n: {self.block_n} is not a power of two >= 16")
        if self.min_split < 0 or self.min_split % self.block_n:
            raise ValueError(f"min_split: {self.min_split} is not a multiple of {self.block_n}")


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int | None) -> int:
    """Split count of a decode step: ``B * Hkv * splits`` near 1024 programs (about 8 per SM
    of an H200's 132, so loads of one program overlap another's math), at most 32, no more
    splits than ``max_seq_len`` has blocks of 64 tokens when that bound is known (eager
    steps); a captured graph passes ``None``."""
    splits = max(1, min(_MAX_SPLITS, -(-_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))))
    if max_seq_len is not None:
        splits = max(1, min(splits, -(-max_seq_len // 64)))
    return splits


def decode_config(
    num_seqs: int, num_kv_heads: int, page_size: int, max_seq_len: int | None
) -> DecodeConfig:
    """The decode kernel's configuration for ``num_seqs`` rows (``max_seq_len``: the longest
    context of an eager step, ``None`` when captured: then it depends on the batch only).

    Splits as :func:`num_decode_splits`; 64-token tiles, 4 warps, 2 stages; once the rows
    alone make 256 programs or more (``B * Hkv``, batch 32 and up at 8 KV heads) a split
    covers at least 256 tokens, so a short context runs as one program a (row, KV head)
    and only longer ones are split. There, when every context is known to be at most
    ``ONE_SPLIT_MAX_CONTEXT`` tokens (an eager step, or a graph captured for that bound:
    :meth:`TritonBackend.capture_context_bounds`), one split of 3 stages and no merge: no
    merge launches and a faster split kernel. A longer context stays split, so that one
    long row among short ones is not walked by a few programs alone. These tiles, warps
    and stages were the fastest of a sweep on the H200; the faster choices left out (one
    split at batch 64 whatever the context, 8 splits at batch 1) were not measured on long
    contexts, where one program would walk a long context alone or a quarter of the
    programs would idle. A merge fused into the split kernel was slower in every case, so
    the merge stays a kernel of its own. Figures: docs/benchmarks.md, "Notes moved from
    model/server/router docstrings"."""
    large = num_seqs * num_kv_heads >= 256
    if large and max_seq_len is not None and max_seq_len <= ONE_SPLIT_MAX_CONTEXT:
        return DecodeConfig(1, 64, 4, 3)
    splits = num_decode_splits(num_seqs, num_kv_heads, max_seq_len)
    return DecodeConfig(splits, 64, 4, 2, 256 if large else 0)


@dataclass
class TritonPlan:
    """Per-step plan: ``decode`` (all rows one token) or extend; scratch of the decode splits.

    max_seq_len: longest context of an eager decode step (``None`` when captured: the
    decode configuration then depends on the batch size only); config: the decode kernel's
    :class:`DecodeConfig`, fixed on the first layer (``None`` until then); max_q_len:
    longest query of an extend step.
    mid_o ``[B, Hq, S, D]`` fp32 / mid_lse ``[B, Hq, S]`` fp32: decode scratch of ``S > 1``
    splits, reused by every layer (allocated lazily on the first layer, once per step or
    once per graph); ``None`` with one split (the kernel writes the output).
    """

    decode: bool
    max_seq_len: int | None
    max_q_len: int
    config: DecodeConfig | None = None
    mid_o: torch.Tensor | None = None
    mid_lse: torch.Tensor | None = None


class TritonBackend(AttentionBackend):
    """Paged attention with our Triton kernels (see the module docstring)."""

    name = "triton"
    supports_cuda_graphs = True
    accepts_stored_kv = True

    def plan(self, attn: AttentionMetadata, page_size: int) -> TritonPlan:
        """Plan an eager step (reads the host lengths; one device read when absent)."""
        q_lens, s_lens = attn.host_lens()
        decode = all(q == 1 for q in q_lens)
        return TritonPlan(decode, max(s_lens, default=1), max(q_lens, default=1))

    def plan_for_capture(
        self, attn: AttentionMetadata, page_size: int, max_seq_len: int | None = None
    ) -> TritonPlan:
        """Plan a decode step of ``attn.num_seqs`` rows for CUDA-graph capture: no host
        lengths are read; the split count depends on the batch size and on the bound
        ``max_seq_len`` the graph is captured for (``None``: any context) only."""
        return TritonPlan(decode=True, max_seq_len=max_seq_len, max_q_len=1)

    def capture_context_bounds(self, num_seqs: int, num_kv_heads: int) -> tuple[int, ...]:
        """``(ONE_SPLIT_MAX_CONTEXT,)`` where a batch of ``num_seqs`` rows decodes short
        contexts as one split (``num_seqs * num_kv_heads >= 256``: :func:`decode_config`),
        else ``()`` (smaller batches keep one graph: their split count is fixed by the
        batch alone)."""
        return (ONE_SPLIT_MAX_CONTEXT,) if num_seqs * num_kv_heads >= 256 else ()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        plan: TritonPlan,
        scale: float,
        kv_stored: bool = False,
        kv_scale: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (any
        row/head strides, dim stride 1); k_cache/v_cache ``[P, page_size, Hkv, D]`` views of
        any strides with dim stride 1. With ``kv_stored`` (the model's RoPE kernel wrote K/V,
        ``fused_ops.rope_store_kv``) k and v are not read. Returns ``[T, Hq * D]`` in q's
        dtype. An FP8 cache stores ``quantize_kv(k, kv_scale[0])`` (and V likewise); the
        kernels convert what they load to q's dtype, ``kv_scale[0]`` is folded into the
        softmax scale and the output is multiplied by ``kv_scale[1]``."""
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        page_size = k_cache.shape[1]
        if q.stride(-1) != 1:
            q = q.contiguous()
        block_d = _pow2(D)
        if T and not kv_stored:
            if k.stride(-1) != 1 or v.stride(-1) != 1:
                k, v = k.contiguous(), v.contiguous()
            if is_fp8(k_cache):
                k, v = quantize_kv(k, kv_scale[0]), quantize_kv(v, kv_scale[1])
            elif k.dtype != k_cache.dtype:
                k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            store_kv_kernel[(T,)](
                k,
                v,
                k_cache,
                v_cache,
                attn.slot_mapping,
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                *k_cache.stride()[:3],
                *v_cache.stride()[:3],
                HKV=Hkv,
                D=D,
                PAGE_SIZE=page_size,
                BLOCK_H=_pow2(Hkv, 1),
                BLOCK_D=block_d,
                **pdl.launch_options(k),
            )
        v_scale = 1.0
        if is_fp8(k_cache):  # scores = q . (k8 * ks): ks joins the softmax scale
            scale, v_scale = scale * kv_scale[0], kv_scale[1]
        out = q.new_empty(T, Hq, D)
        ieee = q.dtype == torch.float32  # fp32 stays exact: no TF32 in the dots
        table = attn.page_table
        B = attn.num_seqs
        if B == 0:
            return out.view(T, Hq * D)
        if plan.decode:
            if plan.config is None:
                plan.config = decode_config(B, Hkv, page_size, plan.max_seq_len)
            cfg = plan.config
            S = cfg.splits
            if S > 1 and (plan.mid_o is None or plan.mid_o.shape[0] != B):
                plan.mid_o = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
                plan.mid_lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
            mid_o = out if plan.mid_o is None else plan.mid_o  # unused with one split
            mid_lse = out if plan.mid_lse is None else plan.mid_lse
            decode_split_kernel[(B, Hkv, S)](
                q,
                k_cache,
                v_cache,
                table,
                attn.seq_lens,
                mid_o,
                mid_lse,
                out,
                scale,
                q.stride(0),
                q.stride(1),
                *k_cache.stride()[:3],
                *v_cache.stride()[:3],
                table.stride(0),
                *mid_o.stride()[:3],
                *mid_lse.stride()[:2],
                out.stride(0),
                out.stride(1),
                G=G,
                D=D,
                PAGE_SIZE=page_size,
                NUM_SPLITS=S,
                MIN_SPLIT=cfg.min_split,
                BLOCK_H=_pow2(G),
                BLOCK_N=cfg.block_n,
                BLOCK_D=block_d,
                TILE_IN_PAGE=page_size % cfg.block_n == 0,
                IEEE=ieee,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                **pdl.launch_options(q),
            )
            if S > 1:
                decode_merge_kernel[(B, Hq)](
                    mid_o,
                    mid_lse,
                    out,
                    *mid_o.stride()[:3],
                    *mid_lse.stride()[:2],
                    out.stride(0),
                    out.stride(1),
                    D=D,
                    NUM_SPLITS=S,
                    BLOCK_S=_pow2(S, 1),
                    BLOCK_D=block_d,
                    **pdl.launch_options(q),
                )
        else:
            grid = (B, Hq, -(-plan.max_q_len // _EXTEND_BLOCK_M))
            extend_kernel[grid](
                q,
                k_cache,
                v_cache,
                out,
                table,
                attn.query_start_loc,
                attn.seq_lens,
                scale,
                q.stride(0),
                q.stride(1),
                *k_cache.stride()[:3],
                *v_cache.stride()[:3],
                table.stride(0),
                out.stride(0),
                out.stride(1),
                G=G,
                D=D,
                PAGE_SIZE=page_size,
                BLOCK_M=_EXTEND_BLOCK_M,
                BLOCK_N=_EXTEND_BLOCK_N,
                BLOCK_D=block_d,
                IEEE=ieee,
                **pdl.launch_options(q),
            )
        if v_scale != 1.0:  # sum_j p_j (v8_j * vs) = vs * sum_j p_j v8_j
            out.mul_(v_scale)
        return out.view(T, Hq * D)
