"""The aux record's bytes (``AuxRecord.pack``): the record without top-k alternatives,
packed by its short path, is byte for byte the record the full format packs, and every
record reads back as itself."""

from __future__ import annotations

import struct

import pytest

from pdserve.disagg.base import _AUX_FMT, AUX_RECORD_BYTES, MAX_TOP_LOGPROBS, AuxRecord


@pytest.mark.parametrize(
    "room,token,logprob", [(7, 42, -0.5), (2**64 - 1, -(2**63), 3.25), (0, 0, float("-inf"))]
)
def test_a_record_without_top_k_packs_as_the_full_format_does(room, token, logprob):
    zeros = [0] * MAX_TOP_LOGPROBS + [0.0] * MAX_TOP_LOGPROBS
    data = AuxRecord(room, token, logprob).pack()
    assert data == struct.pack(_AUX_FMT, room, token, logprob, 0, *zeros)
    assert len(data) == AUX_RECORD_BYTES
    assert AuxRecord.unpack(data) == AuxRecord(room, token, logprob)


def test_records_with_top_k_read_back_and_bad_ones_are_refused():
    rec = AuxRecord(3, 5, -1.0, (5, 9), (-1.0, -2.5))
    assert AuxRecord.unpack(rec.pack()) == rec
    full = tuple(range(MAX_TOP_LOGPROBS))
    assert AuxRecord.unpack(AuxRecord(3, 5, -1.0, full, (-1.0,) * len(full)).pack()).top_ids == full
    for ids, lps in (((1,), ()), (full + (1,), (0.0,) * (len(full) + 1))):
        with pytest.raises(ValueError, match="equal length"):
            AuxRecord(3, 5, -1.0, ids, lps).pack()
    with pytest.raises(struct.error):
        AuxRecord(-1, 5, -1.0).pack()  # a room id is unsigned, as before
