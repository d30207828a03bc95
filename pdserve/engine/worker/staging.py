"""A step's inputs as one flat int64 buffer: its layout (:class:`StepHeader`), the pinned
buffer it is written into (:class:`StagingBuffer`) and the staging of a plan
(:func:`stage_plan`).

The buffer holds, each segment 16-byte aligned: ids | positions | slots | seq_lens | qsl |
sample rows | page table | prompt-logprob chunks (row start, rows) pairs.  That is what every
rank's forward needs and no sampling state: one host-to-device copy per step
(``ModelRunner.run_staged``), and under tensor parallelism exactly what rank 0 sends each
other rank after the header (``engine/worker/multiproc_executor.py``, ``engine/worker/rank_worker.py``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.step import BatchPlan, ScheduledSeq
from pdserve.model.attention import page_table_array, token_slots

# Prompt-logprob rows go through the LM head in chunks so a long prompt never makes a
# [prompt_len, vocab] fp32 logits tensor at once.
PROMPT_LOGITS_CHUNK = 256

HEADER_LEN = 8
_SEGMENT_ALIGN = 2  # int64 values: 16 bytes, the alignment Triton specializes pointers on


@dataclass(frozen=True)
class StepHeader:
    """The fixed-size part of a staged step: sequences, tokens, page-table width, sampling
    rows, prompt-logprob chunks.  ``HEADER_LEN`` int64 values on the wire (``to_array``)."""

    num_seqs: int
    num_tokens: int
    width: int
    n_sample: int
    n_chunks: int

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Length of each of the 8 segments of the staged buffer (int64 values)."""
        B, T = self.num_seqs, self.num_tokens
        return (T, T, T, B, B + 1, self.n_sample, B * self.width, 2 * self.n_chunks)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Start of each segment of the staged buffer and its total length (int64 ``[9]``).
        Each start is a multiple of ``_SEGMENT_ALIGN`` values (16 bytes): Triton compiles a
        kernel once per alignment of its pointer arguments, so a segment at an odd offset
        would cost a new compile (~0.8 s on the H200) whenever the alignment changed."""
        starts = [0]
        for n in self.sizes:
            starts.append(-(-(starts[-1] + n) // _SEGMENT_ALIGN) * _SEGMENT_ALIGN)
        return np.array(starts, dtype=np.int64)

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    def to_array(self, kind: int = 0) -> np.ndarray:
        """``[kind, num_seqs, num_tokens, width, n_sample, n_chunks, 0, 0]`` int64."""
        out = np.zeros(HEADER_LEN, dtype=np.int64)
        out[:6] = (kind, self.num_seqs, self.num_tokens, self.width, self.n_sample, self.n_chunks)
        return out

    @classmethod
    def from_array(cls, a: np.ndarray) -> StepHeader:
        return cls(*(int(x) for x in a[1:6]))


class StagingBuffer:
    """The int64 host buffer a step is staged into (pinned when ``pin``, on CUDA), grown by
    doubling, and its copy to the device.

    A step that samples ends with a device read, but a step that does not (a middle chunk
    of a chunked prefill) returns at once: the buffer is not rewritten until the last copy
    out of it has run (the event recorded by :meth:`to_device`)."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buf = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None

    def reserve(self, n: int) -> np.ndarray:
        """The host view of the whole buffer, at least ``n`` int64 long, once the last copy
        out of it is complete (safe to write)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._buf.numel() < n:
            size = max(n, 2 * self._buf.numel(), 4096)
            buf = torch.empty(size, dtype=torch.int64)
            self._buf = buf.pin_memory() if self._pin else buf
        return self._buf.numpy()

    def to_device(self, n: int, device: torch.device) -> torch.Tensor:
        """The first ``n`` values on ``device`` (int64 ``[n]``; a non-blocking copy from a
        pinned buffer, whose completion the next :meth:`reserve` waits for)."""
        dev = self._buf[:n].to(device, non_blocking=True)
        if self._pin:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()
        return dev


def stage_plan(
    plan: BatchPlan, page_size: int, buffer: StagingBuffer
) -> tuple[StepHeader, np.ndarray]:
    """Fill ``buffer`` with ``plan``'s inputs (module docstring); returns the header and
    the host view of the first ``header.total`` values.  ValueError when a sequence's pages
    (``page_size`` tokens each) are too few for its tokens."""
    seqs = plan.seqs
    B = len(seqs)
    q = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=B)
    start = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=B)
    s_lens = start + q
    tables = [s.pages for s in seqs]
    width = max(1, max((len(t) for t in tables), default=1))
    if any(len(t) * page_size < n for t, n in zip(tables, s_lens.tolist())):
        raise ValueError("a sequence's pages are too few for its tokens")
    table = page_table_array(tables, width)
    qsl, positions, slots = token_slots(q, s_lens, table, page_size)
    T = int(qsl[-1])
    sample_rows = (qsl[1:] - 1)[[s.sample for s in seqs]]
    chunks = _prompt_chunks(seqs, qsl[:-1].tolist())
    header = StepHeader(B, T, width, len(sample_rows), len(chunks) // 2)
    offs = header.offsets
    host = buffer.reserve(int(offs[-1]))
    host[offs[0] : offs[0] + T] = np.fromiter(
        itertools.chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=T
    )
    segments = (positions, slots, s_lens, qsl, sample_rows, table.reshape(-1), chunks)
    for i, (arr, n) in enumerate(zip(segments, header.sizes[1:]), start=1):
        host[offs[i] : offs[i] + n] = arr
    return header, host[: int(offs[-1])]


def _prompt_chunks(seqs: Sequence[ScheduledSeq], row0s: list[int]) -> np.ndarray:
    """Flat ``(row start, rows)`` pairs of every prompt-logprob chunk (int64 ``[2 * n]``):
    the rows of the step's hidden states whose logits give the prompt logprobs, in chunks
    of at most ``PROMPT_LOGITS_CHUNK``."""
    pairs: list[int] = []
    if not any(s.prompt_logprobs_targets for s in seqs):
        return np.zeros(0, dtype=np.int64)
    for seq, row0 in zip(seqs, row0s):
        n = len(seq.prompt_logprobs_targets)
        if not n:
            continue
        first = row0 + seq.prompt_logprobs_start - seq.start_pos
        for c in range(0, n, PROMPT_LOGITS_CHUNK):
            pairs += (first + c, min(PROMPT_LOGITS_CHUNK, n - c))
    return np.asarray(pairs, dtype=np.int64)
