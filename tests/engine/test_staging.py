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


def test_token_slots_match_a_per_token_reference():
    """``token_slots``' vectorised positions and slots equal the per-token rule (token i
    of row b at position ``seq_len - q_len + i``, slot ``table[b, pos // ps] * ps +
    pos % ps``) over ragged rows, every page size and an empty step."""
    from pdserve.model.attention import token_slots

    rng = np.random.default_rng(0)
    for ps in (1, 4, 16, 128):
        for _ in range(40):
            B = int(rng.integers(0, 9))
            q = rng.integers(1, 3 * ps + 2, size=B).astype(np.int64)
            s = q + rng.integers(0, 4 * ps, size=B)
            W = int(max(1, *(-(-s // ps)))) if B else 1
            table = rng.integers(0, 5000, size=(B, W)).astype(np.int32)
            qsl, pos, slots = token_slots(q, s, table, ps)
            ref_pos = [int(s[b] - q[b] + i) for b in range(B) for i in range(q[b])]
            rows = [b for b in range(B) for _ in range(q[b])]
            ref_slots = [int(table[b, p // ps]) * ps + p % ps for b, p in zip(rows, ref_pos)]
            assert qsl.tolist() == [0, *itertools.accumulate(q.tolist())]
            assert pos.dtype == slots.dtype == np.int64
            assert pos.tolist() == ref_pos and slots.tolist() == ref_slots
