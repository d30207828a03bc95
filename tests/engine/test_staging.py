"""The staged step buffer: every segment starts 16-byte aligned and holds what it says."""

from __future__ import annotations

import itertools

import numpy as np

from pdserve.engine.worker.model_runner import StepHeader


def test_every_segment_starts_16_byte_aligned_and_segments_do_not_overlap():
    # Odd and even counts of every kind: a segment after an odd-length one used to start at
    # an odd int64 offset (8 bytes), and Triton compiled a kernel again for that alignment.
    for B, T, width, n_sample, n_chunks in itertools.product(
        (1, 2, 3), (1, 5, 8), (1, 3), (0, 1, 3), (0, 1)
    ):
        h = StepHeader(B, T, width, n_sample, n_chunks)
        offs = h.offsets
        assert len(offs) == len(h.sizes) + 1 and offs[0] == 0
        assert all(int(o) * 8 % 16 == 0 for o in offs[:-1])
        for i, n in enumerate(h.sizes):
            assert offs[i] + n <= offs[i + 1]
        assert h.total == offs[-1] < sum(h.sizes) + 2 * len(h.sizes)
        roundtrip = StepHeader.from_array(h.to_array())
        assert np.array_equal(roundtrip.offsets, offs)
