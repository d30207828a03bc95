"""Attention over a paged KV cache: per-step metadata, backend ABC + registry, torch SDPA backend.

Cache (one layer): ``k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]``, strided
views into the pool whose strides come from ``pdserve.engine.kv_layout.KVCacheLayout``
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
    slots: list[int] = []
    for b, (q, s, pages) in enumerate(zip(query_lens, seq_lens, page_tables)):
        if q < 1 or s < q:
            raise ValueError(
                f"query_lens[{b}]={q} / seq_lens[{b}]={s}: need 1 <= query_len <= seq_len"
            )
        if len(pages) * page_size < s:
            raise ValueError(f"page_tables[{b}] has {len(pages)} pages, too few for {s} tokens")
        for pos in range(s - q, s):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    max_pages = max((len(p) for p in page_tables), default=0)
    table = torch.zeros((len(page_tables), max(max_pages, 1)), dtype=torch.int32)
    for b, pages in enumerate(page_tables):
        if pages:
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32).to(device, non_blocking=True),
        page_table=table.to(device, non_blocking=True),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        query_lens_host=tuple(int(q) for q in query_lens),
        seq_lens_host=tuple(int(s) for s in seq_lens),
    )


class AttentionBackend(abc.ABC):
    """Paged attention implementation; one instance per model.

    ``plan`` runs once per forward step (derives gather indices, masks, ...); ``forward`` runs
    once per layer with that plan.
    """

    name: str = ""

    @abc.abstractmethod
    def plan(self, attn: AttentionMetadata, page_size: int) -> Any:
        """Precompute per-step data for :meth:`forward` (called once per model forward)."""

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
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend.

        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``; k_cache, v_cache: ``[P, page_size, Hkv, D]``
        strided views of the pool (``KVCacheLayout.layer_views``; written in place at
        ``attn.slot_mapping``). Returns ``[T, Hq * D]`` in q's dtype.
        Query head ``h`` uses KV head ``h // (Hq // Hkv)`` (HF ``repeat_kv`` order).
        """


_REGISTRY: dict[str, str] = {
    "torch_sdpa": "pdserve.model.sdpa_backend:TorchSDPABackend",
}


def available_backends() -> tuple[str, ...]:
    """Names accepted by :func:`get_attention_backend`."""
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
