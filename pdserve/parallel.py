"""Tensor-parallel (TP) facts shared by every room: which rank owns which heads, rows, vocab.

Plain arithmetic, no torch.distributed: ``model/`` (sharded layers), ``engine/`` (rank
workers, KV pool shard) and ``disagg/`` (which prefill rank writes which decode rank's
heads) all import it, so the split is computed in one place.

Splitting rules (Megatron-LM's column/row split, Shoeybi et al. 2019, as vLLM and SGLang
apply it to Llama-family models):
- query heads and the MLP's intermediate size are split evenly (``n % tp_size == 0``);
- KV heads are split evenly when ``tp_size <= num_kv_heads`` (``num_kv_heads % tp_size ==
  0``), else replicated: each rank holds one KV head, ``tp_size // num_kv_heads`` ranks
  share it (``tp_size % num_kv_heads == 0``);
- the vocabulary is split in ``ceil(vocab / tp_size)`` rows per rank, the last rank
  holding fewer (or none); the gathered logits drop the padding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPRank:
    """One rank of a tensor-parallel group: ``rank`` in ``[0, size)``.

    Raises ``ValueError`` naming ``tensor_parallel_size`` / ``tp_rank`` when out of range.
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank must be in [0, {self.size}), got {self.rank}")


def check_divisible(n: int, tp_size: int, what: str) -> None:
    """ValueError naming ``what`` unless ``n`` splits evenly over ``tp_size`` ranks."""
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={tp_size}")


def even_range(n: int, tp: TPRank, what: str) -> tuple[int, int]:
    """``[start, end)`` of rank ``tp.rank``'s share of ``n`` items split evenly.

    Raises ``ValueError`` naming ``what`` when ``n % tp.size != 0``.
    """
    check_divisible(n, tp.size, what)
    per = n // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def kv_head_range(num_kv_heads: int, tp: TPRank) -> tuple[int, int]:
    """``[start, end)`` of the KV heads rank ``tp.rank`` holds (replicated past
    ``num_kv_heads`` ranks: then one head, shared by ``tp.size // num_kv_heads`` ranks).

    Raises ``ValueError`` naming ``num_key_value_heads`` when neither count divides the other.
    """
    if tp.size <= num_kv_heads:
        return even_range(num_kv_heads, tp, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp.size} is neither a divisor nor a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    head = tp.rank // (tp.size // num_kv_heads)
    return head, head + 1


def vocab_range(vocab: int, tp: TPRank) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows rank ``tp.rank`` holds: ``ceil(vocab /
    tp.size)`` per rank, clipped at ``vocab`` (the last ranks may hold fewer, or none)."""
    per = -(-vocab // tp.size)
    start = min(vocab, tp.rank * per)
    return start, min(vocab, start + per)


def vocab_shard_rows(vocab: int, tp_size: int) -> int:
    """Rows of every rank's (padded) vocabulary shard: ``ceil(vocab / tp_size)``."""
    return -(-vocab // tp_size)
