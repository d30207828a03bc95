"""Which prefill rank writes which KV heads into which decode rank (tensor parallelism).

A prefill worker of TP size ``p`` and a decode worker of TP size ``d`` hold the same
model's KV heads split by :func:`pdserve.parallel.kv_head_range`.  Every head a decode
rank holds gets exactly one writer: the lowest prefill rank holding it (prefill ranks
past ``num_kv_heads`` hold replicas; the others stay idle for that head).  Both sides
compute the map with these functions, so it is never sent over the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.parallel import TPRank, kv_head_range


@dataclass(frozen=True)
class HeadSlice:
    """Model KV heads ``[start, end)`` that prefill rank ``src_rank`` writes into decode
    rank ``dst_rank`` (global head ids; each side subtracts its own range's start)."""

    src_rank: int
    dst_rank: int
    start: int
    end: int


def writer_of(num_kv_heads: int, prefill_tp_size: int, head: int) -> int:
    """The prefill rank that writes ``head``: the lowest one holding it."""
    for r in range(prefill_tp_size):
        start, end = kv_head_range(num_kv_heads, TPRank(r, prefill_tp_size))
        if start <= head < end:
            return r
    raise ValueError(f"head {head} is outside num_key_value_heads={num_kv_heads}")


def writes_into(num_kv_heads: int, prefill_tp_size: int, decode: TPRank) -> list[HeadSlice]:
    """The slices decode rank ``decode`` receives, one per writer, in head order.

    Raises ValueError (from :func:`kv_head_range`) for a TP size the split rules refuse."""
    ds, de = kv_head_range(num_kv_heads, decode)
    out: list[HeadSlice] = []
    for h in range(ds, de):
        r = writer_of(num_kv_heads, prefill_tp_size, h)
        if out and out[-1].src_rank == r and out[-1].end == h:
            out[-1] = HeadSlice(r, decode.rank, out[-1].start, h + 1)
        else:
            out.append(HeadSlice(r, decode.rank, h, h + 1))
    return out


def reads_from(num_kv_heads: int, prefill: TPRank, decode_tp_size: int) -> list[HeadSlice]:
    """The slices prefill rank ``prefill`` writes, over every decode rank (decode rank
    order); empty for a replica that writes nothing."""
    return [
        s
        for d in range(decode_tp_size)
        for s in writes_into(num_kv_heads, prefill.size, TPRank(d, decode_tp_size))
        if s.src_rank == prefill.rank
    ]


def is_writer(num_kv_heads: int, prefill: TPRank) -> bool:
    """Whether prefill rank ``prefill`` writes any head (whatever the decode TP size):
    True unless a lower rank holds the same heads (a replica)."""
    start, _ = kv_head_range(num_kv_heads, prefill)
    return writer_of(num_kv_heads, prefill.size, start) == prefill.rank
