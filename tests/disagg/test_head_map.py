"""Which prefill rank writes which KV heads into which decode rank (pure arithmetic)."""

from __future__ import annotations

import pytest

from pdserve.disagg.bootstrap import HeadSlice, is_writer, reads_from, writes_into
from pdserve.parallel import TPRank, kv_head_range

SIZES = (1, 2, 4, 8)  # powers of two: every pair is a split the rules allow


@pytest.mark.parametrize("heads", SIZES)
@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("d", SIZES)
def test_every_decode_head_has_exactly_one_writer_holding_it(heads, p, d):
    for s in range(d):
        got = writes_into(heads, p, TPRank(s, d))
        covered = [h for sl in got for h in range(sl.start, sl.end)]
        assert covered == list(range(*kv_head_range(heads, TPRank(s, d))))
        for sl in got:
            start, end = kv_head_range(heads, TPRank(sl.src_rank, p))
            assert start <= sl.start < sl.end <= end  # the writer holds those heads
            assert is_writer(heads, TPRank(sl.src_rank, p))
    # the prefill view lists the same slices
    from_prefill = sorted(
        (sl for r in range(p) for sl in reads_from(heads, TPRank(r, p), d)),
        key=lambda sl: (sl.dst_rank, sl.start),
    )
    from_decode = [sl for s in range(d) for sl in writes_into(heads, p, TPRank(s, d))]
    assert from_prefill == from_decode


def test_replicas_write_nothing_and_the_lowest_rank_writes():
    # 2 heads over 4 prefill ranks: ranks 0,1 hold head 0, ranks 2,3 head 1
    assert [is_writer(2, TPRank(r, 4)) for r in range(4)] == [True, False, True, False]
    assert reads_from(2, TPRank(1, 4), 1) == []
    assert writes_into(2, 4, TPRank(0, 1)) == [HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 2)]
    # 4 heads, prefill TP 1, decode TP 2: rank 0 writes both decode ranks
    assert reads_from(4, TPRank(0, 1), 2) == [HeadSlice(0, 0, 0, 2), HeadSlice(0, 1, 2, 4)]
