"""Attention over a paged KV cache: per-step metadata, backend ABC + registry, torch SDPA backend.

Cache (one layer): ``k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]``, strided
views into the pool whose strides come from ``pdserve.engine.kv.layout.KVCacheLayout``
(``view_strides``; never assume contiguity, never flatten); token ``j`` of sequence ``b`` lives
at ``[page_table[b, j // page_size], j % page_size]``, i.e. slot
``page_table[b, j // page_size] * page_size + j % page_size``.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about one forward step (plain data, built once per step).

    B sequences, T new tokens in total, tokens of sequence ``b`` are rows
    ``query_start_loc[b]:query_start_loc[b+1]`` of the step's input.

    query_start_loc: ``[B+1]`` int32/int64, cumulative query lengths, starting at 0.
    seq_lens: ``[B]`` int32/int64, context length of each sequence *including* this step's
        tokens; the new tokens of ``b`` sit at positions ``seq_lens[b] - q_len_b .. seq_lens[b]-1``.
    page_table: ``[B, max_pages]`` int32, page ids of each sequence in order; unused entries
        may hold any value (they are never read unmasked).
    slot_mapping: ``[T]`` int64, ``page * page_size + offset`` where each new token's K/V is written.
    query_lens_host / seq_lens_host: optional host copies (tuples of int) of the per-sequence
        query and context lengths; when given, planning never reads the device tensors back.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_host: tuple[int, ...] | None = None
    seq_lens_host: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def host_lens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Return ``(query_lens, seq_lens)`` as tuples of int (one device read if not given)."""
        q, s = self.query_lens_host, self.seq_lens_host
        if q is None:
            q = tuple(torch.diff(self.query_start_loc).tolist())
        if s is None:
            s = tuple(self.seq_lens.tolist())
        return q, s

    @property
    def max_seq_len(self) -> int:
        return max(self.host_lens()[1], default=0)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.host_lens()[0])


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` from host lists (no device reads).

    query_lens[b]: new tokens of sequence b this step (>= 1); seq_lens[b]: context length after
    this step (>= query_lens[b]); page_tables[b]: page ids of b, enough for seq_lens[b] tokens.
    Raises ``ValueError`` naming the argument when lengths disagree or pages are missing.
    """
    if not (len(query_lens) == len(seq_lens) == len(page_tables)):
        raise ValueError("query_lens, seq_lens and page_tables must have one entry per sequence")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    s_ = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((q < 1) | (s_ < q))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"query_lens[{b}]={q[b]} / seq_lens[{b}]={s_[b]}: need 1 <= query_len <= seq_len"
        )
    n_pages = np.fromiter((len(p) for p in page_tables), dtype=np.int64, count=len(page_tables))
    short = np.flatnonzero(n_pages * page_size < s_)
    if short.size:
        b = int(short[0])
        raise ValueError(f"page_tables[{b}] has {n_pages[b]} pages, too few for {s_[b]} tokens")
    table = page_table_array(page_tables, int(n_pages.max(initial=1)))
    qsl, positions, slots = token_slots(q, s_, table, page_size)
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(s_.astype(np.int32)).to(device, non_blocking=True),
        page_table=torch.from_numpy(table).to(device, non_blocking=True),
        slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
        query_lens_host=tuple(q.tolist()),
        seq_lens_host=tuple(s_.tolist()),
    )


def page_table_array(page_tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """``[B, max(width, 1)]`` int32 page table; row ``b`` starts with ``page_tables[b]``, the
    rest is 0 (never read unmasked). One C-level copy per row, no per-page Python work."""
    table = np.zeros((len(page_tables), max(width, 1)), dtype=np.int32)
    for b, pages in enumerate(page_tables):
        if pages:
            table[b, : len(pages)] = pages
    return table


def token_slots(
    query_lens: np.ndarray, seq_lens: np.ndarray, table: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised per-token indices of a step (no Python loop over tokens).

    query_lens, seq_lens ``[B]`` int64; table ``[B, W]`` page ids. Returns
    ``(query_start_loc [B+1], positions [T], slot_mapping [T])`` int64, where token ``i`` of
    sequence ``b`` sits at position ``seq_lens[b] - query_lens[b] + i`` and is written at slot
    ``table[b, pos // page_size] * page_size + pos % page_size``.
    """
    B, W = len(query_lens), table.shape[1]
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    # token i of the step (row b): position i - qsl[b] + start_b; its page is entry
    # b * W + position // page_size of the flat table (per-row offsets repeated once each)
    positions = np.repeat(seq_lens - query_lens - qsl[:-1], query_lens)
    positions += np.arange(int(qsl[-1]), dtype=np.int64)
    flat = positions // page_size
    flat += np.repeat(np.arange(0, B * W, W, dtype=np.int64), query_lens)
    slots = table.reshape(-1)[flat].astype(np.int64)
    slots *= page_size
    slots += positions % page_size
    return qsl, positions, slots


class AttentionBackend(abc.ABC):
    """Paged attention implementation; one instance per model.

    ``plan`` runs once per step, outside the model's forward (the model runner calls it and
    passes the plan to ``model.forward``); ``forward`` runs once per layer with that plan.

    CUDA graphs (capture hooks): a backend with ``supports_cuda_graphs`` implements
    :meth:`plan_for_capture`, a decode plan that reads no host values, so its launches are
    the same for every replay of a captured batch size; its ``forward`` then does no host
    synchronisation and allocates nothing whose shape depends on the contents of ``attn``.
    """

    name: str = ""
    supports_cuda_graphs: bool = False
    # Whether the model may write this step's K/V itself, inside its RoPE kernel
    # (``fused_ops.rope_store_kv``, CUDA only), and call :meth:`forward` with ``kv_stored``.
    accepts_stored_kv: bool = False

    @abc.abstractmethod
    def plan(self, attn: AttentionMetadata, page_size: int) -> Any:
        """Precompute per-step data for :meth:`forward` (called once per model forward)."""

    def plan_for_capture(
        self,
        attn: AttentionMetadata,
        page_size: int,
        max_seq_len: int | None = None,
        query_len: int = 1,
    ) -> Any:
        """Plan a step of ``attn.num_seqs`` rows of ``query_len`` tokens each for
        CUDA-graph capture over static buffers: no host lengths are read.  ``query_len``
        1: a decode step; more: a verify step (speculative decoding), each row's queries
        at the last ``query_len`` positions of its context (``seq_lens``).
        ``max_seq_len``: the graph will only run steps whose longest context is at most
        this many tokens (one of :meth:`capture_context_bounds`; ``None``: any context).
        NotImplementedError unless ``supports_cuda_graphs``."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured")

    def capture_context_bounds(self, num_seqs: int, num_kv_heads: int) -> tuple[int, ...]:
        """Context bounds (tokens, ascending) for which a decode graph of ``num_seqs`` rows
        launches differently from the unbounded one, so the graph runner captures one graph
        per bound besides it and replays the smallest that holds the step's longest
        context. Default: none (one graph per batch size)."""
        return ()

    def warm_up(self, k_cache: Any, v_cache: Any, num_q_heads: int, dtype: Any) -> int:
        """Run once, at start-up, every launch variant an eager step of this backend can
        need that one ordinary step does not (a kernel compiled later stalls a step while
        serving). k_cache/v_cache: one layer's ``[P, page_size, Hkv, D]`` views (read only,
        nothing is written); num_q_heads: this rank's query heads; dtype: q's. Returns the
        variants run. Default: none (a backend without per-shape compiles)."""
        return 0

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        plan: Any,
        scale: float,
        kv_stored: bool = False,
        kv_scale: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Write this step's K/V into the cache (unless ``kv_stored``: the caller already
        wrote them at ``attn.slot_mapping``), then attend.

        An FP8 cache (``float8_e4m3fn`` views) stores ``k / kv_scale[0]`` and
        ``v / kv_scale[1]`` (saturated to +-448) and is dequantized on load; every token,
        this step's included, is then read from the cache (:func:`quantize_kv`).

        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``; k_cache, v_cache: ``[P, page_size, Hkv, D]``
        strided views of the pool (``KVCacheLayout.layer_views``; written in place at
        ``attn.slot_mapping``). Returns ``[T, Hq * D]`` in q's dtype.
        Query head ``h`` uses KV head ``h // (Hq // Hkv)`` (HF ``repeat_kv`` order).
        """


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds FP8 (e4m3) K or V."""
    return cache.dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` saturated to e4m3's range (+-448) and cast to ``float8_e4m3fn``: what an
    FP8 cache stores for K or V ``x`` (any shape) with per-tensor ``scale``."""
    # a copy even when x is fp32 and the scale 1 (clamped in place below: x.float() would
    # be x itself, and the caller's fp32 K/V past +-448 would be saturated too)
    y = x.to(torch.float32, copy=True) if scale == 1.0 else x.float() / scale
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


_REGISTRY: dict[str, str] = {
    "torch_sdpa": "pdserve.model.sdpa_backend:TorchSDPABackend",
    "triton": "pdserve.model.triton_backend:TritonBackend",
}


def default_backend(device: torch.device | str) -> str:
    """``triton`` on CUDA, ``torch_sdpa`` elsewhere (the CPU backend and the oracle)."""
    return "triton" if torch.device(device).type == "cuda" else "torch_sdpa"


def available_backends() -> tuple[str, ...]:
    """Names accepted by :func:`get_attention_backend` (``config.ATTENTION_BACKENDS``)."""
    return tuple(_REGISTRY)


def get_attention_backend(name: str = "torch_sdpa") -> AttentionBackend:
    """Instantiate the backend registered as ``name`` (imported lazily).

    Raises ``ValueError`` naming ``name`` and the known backends when it is unknown.
    """
    if name not in _REGISTRY:
        raise ValueError(f"attention backend {name!r} is unknown; known: {', '.join(_REGISTRY)}")
    module_name, cls_name = _REGISTRY[name].split(":")
    cls: type[AttentionBackend] = getattr(importlib.import_module(module_name), cls_name)
    return cls()
