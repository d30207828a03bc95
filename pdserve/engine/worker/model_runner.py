"""One rank's execution of a :class:`BatchPlan`: its inputs staged into one flat int64
buffer, one model forward, logits only where needed, sampling (:class:`ModelRunner`).

The staging lives here because the runner writes and reads it on every rank (the executor
and the rank loop use only the header layout): the step's layout (:class:`StepHeader`), the
pinned buffer it is written into (:class:`StagingBuffer`) and the staging of a plan
(:func:`stage_plan`).  The buffer holds, each segment 16-byte aligned:
ids | positions | slots | seq_lens | qsl | sample rows | page table | prompt-logprob chunks
(row start, rows) pairs.  That is what every rank's forward needs and no sampling state: one
host-to-device copy per step (``ModelRunner.run_staged``), and under tensor parallelism
exactly what rank 0 sends each other rank after the header
(``engine/worker/multiproc_executor.py``, ``engine/worker/rank_worker.py``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.spec.verify import VerifySpan, verify, verify_greedy_packed, verify_rows
from pdserve.engine.step import (
    BatchPlan,
    InFlightTokens,
    SampledToken,
    ScheduledSeq,
    StepResult,
    TokenLogprob,
)
from pdserve.engine.worker.kv_storage import KVStorage
from pdserve.engine.worker.sampler import (
    SampleRequest,
    plain_greedy,
    sample,
    sample_request_of,
    top_logprobs,
)
from pdserve.model.attention import AttentionMetadata, page_table_array, token_slots

if TYPE_CHECKING:
    from pdserve.engine.worker.cuda_graph import CUDAGraphRunner
    from pdserve.model.llama import LlamaForCausalLM

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
    if any(s.draft_token_ids for s in seqs):  # verify rows: every position's logits
        sample_rows = np.fromiter(
            (
                r
                for s, end in zip(seqs, qsl[1:].tolist())
                if s.sample
                for r in range(end - 1 - len(s.draft_token_ids), end)
            ),
            dtype=np.int64,
        )
    else:
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


def greedy_pack(logits: torch.Tensor) -> torch.Tensor:
    """``[B, 2]`` float64 (argmax id, its logprob) of ``logits [B, V]`` fp32: the sampler's
    own greedy ops (``argmax``, ``log_softmax`` + ``gather``), so the numbers are equal."""
    ids = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
    chosen = torch.log_softmax(logits, dim=-1).gather(1, ids)  # [B, 1]
    return torch.cat((ids.double(), chosen.double()), dim=1)


class ModelRunner:
    """Runs ``model`` (a ``pdserve.model.llama.LlamaForCausalLM``) over the rank's KV cache (``storage``).

    Per step: the step's token ids, positions, slots, lengths and page table are built with
    numpy (no per-token Python loop) into one pinned staging buffer and copied to the device
    at once; the attention plan is built here, outside the model's forward; then the
    forward, logits for the last token of each sampling sequence (plus the prompt positions
    whose logprobs were asked), and sampling. A decode-only step replays a captured CUDA
    graph when ``graphs`` is given (see ``engine/worker/cuda_graph.py``).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        storage: KVStorage,
        device: torch.device,
        generator: torch.Generator | None = None,
        graphs: CUDAGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.storage = storage
        self.device = torch.device(device)
        self.generator = generator  # draws of unseeded random rows (seeded rows own theirs)
        self.graphs = graphs  # CUDAGraphRunner | None
        self._staging = StagingBuffer(pin=self.device.type == "cuda")
        # Called with each eager step's staged inputs before its forward (a TP executor
        # sends them to the other ranks here); None for TP=1.
        self.on_staged: Callable[[StepHeader, np.ndarray], None] | None = None
        # Overlap scheduling: two pinned [n, 2] float64 buffers that launched steps' tokens
        # are copied into, used in turn (step N's is read after step N+1 is launched).
        self._token_hosts: list[torch.Tensor] = [torch.empty(0, 2, dtype=torch.float64)] * 2
        self._token_turn = 0
        # verify steps run through a verify graph / eagerly (benchmarks report them)
        self.verify_steps = {"graph": 0, "eager": 0}

    def _graph_step(self, plan: BatchPlan) -> torch.Tensor | None:
        """Logits ``[B, V]`` of a decode-only step through a CUDA graph, or None when the step
        is not one a graph runs (prefill/mixed rows, prompt logprobs, batch too large)."""
        g = self.graphs
        seqs = plan.seqs
        if g is None or not seqs or len(seqs) > g.max_batch:
            return None
        if any(len(s.token_ids) != 1 or not s.sample or s.prompt_logprobs_targets for s in seqs):
            return None
        tables = [s.pages for s in seqs]
        if not g.fits(len(seqs), max(len(t) for t in tables)):
            return None
        ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=len(seqs))
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        return g.replay(ids, pos, tables)

    def can_launch(self, plan: BatchPlan, rows_checked: bool = False) -> bool:
        """Whether :meth:`launch_greedy` runs ``plan`` (decode-only rows, all plain greedy):
        on CUDA through a captured graph only; on CPU always (tests force overlap there).
        rows_checked: the caller knows the rows qualify (only the graph's fit is checked)."""
        seqs = plan.seqs
        if not seqs:
            return False
        if not rows_checked and not all(
            len(s.token_ids) == 1 and s.sample and not s.prompt_logprobs_targets and plain_greedy(s)
            for s in seqs
        ):
            return False
        if self.device.type == "cpu":
            return True
        g = self.graphs
        return g is not None and g.fits(len(seqs), max(len(s.pages) for s in seqs))

    @torch.inference_mode()
    def launch_greedy(self, plan: BatchPlan, prev: InFlightTokens | None) -> InFlightTokens:
        """Launch a step that :meth:`can_launch` accepts without waiting for it. With
        ``plan.input_rows`` the rows' input ids are ``prev``'s tokens at those rows, read on
        the device (``prev`` = the step launched just before); else the plan's token ids.
        The tokens' copy to the host is queued right after the step."""
        seqs = plan.seqs
        B = len(seqs)
        src = plan.input_rows
        ids_from = None
        if src is not None:
            assert prev is not None and len(src) == B  # rows of the previous step
            ids_from = prev.device
        g = self.graphs
        if g is not None and self.device.type == "cuda":
            ids = np.asarray(src if src is not None else [s.token_ids[0] for s in seqs])
            pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=B)
            g.replay(ids.astype(np.int64), pos, [s.pages for s in seqs], ids_from=ids_from)
            packed = g.greedy_packed(B)
        else:
            header, host = self.stage(plan)
            if src is not None:  # staged ids are row indices into ids_from
                host[: header.num_tokens] = src
            logits = self.run_staged(header, host, input_from=ids_from)
            assert logits is not None  # every row samples
            packed = greedy_pack(logits)
        if self.device.type != "cuda":
            return InFlightTokens(packed, packed, None)
        turn, self._token_turn = self._token_turn, 1 - self._token_turn
        if self._token_hosts[turn].shape[0] < B:
            self._token_hosts[turn] = torch.empty(max(B, 256), 2, dtype=torch.float64).pin_memory()
        host_tokens = self._token_hosts[turn][:B]
        host_tokens.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return InFlightTokens(packed, host_tokens, ready)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        """Run one step.  Every sequence of ``plan`` gets its KV written into its pages."""
        result = StepResult()
        logits = self._graph_step(plan)
        if logits is not None and all(plain_greedy(s) for s in plan.seqs):
            assert self.graphs is not None  # a graph ran: its argmax is every row's token
            tokens = self.graphs.greedy_tokens(len(plan.seqs))
            result.sampled = dict(zip((s.request_id for s in plan.seqs), tokens))
            return result
        if any(s.draft_token_ids for s in plan.seqs):
            return self._verify_step(plan, result)
        if logits is None:
            logits = self._eager_step(plan, result)
        sampling = [s for s in plan.seqs if s.sample]
        if sampling:
            assert logits is not None  # sampling rows have logits
            if all(plain_greedy(s) for s in sampling):
                # the sampler's own greedy ops (greedy_pack: the same bits as sample's
                # argmax and raw logprob), without a SampleRequest per row
                sampled = [SampledToken(int(t), lp, ()) for t, lp in greedy_pack(logits).tolist()]
            else:
                rows = [sample_request_of(s) for s in sampling]
                sampled = sample(logits, rows, self.generator)
            result.sampled = dict(zip((s.request_id for s in sampling), sampled))
        return result

    def _graph_verify(self, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logits ``[R, V]`` and greedy pick ``[R, 2]`` of every position of a verify
        step through a verify graph (``CUDAGraphRunner.replay_verify``), or None when the
        step is not one a graph runs (a prefill or prompt-logprob row, a row of more than
        ``k + 1`` tokens, too many rows or pages, no verify graphs)."""
        g = self.graphs
        seqs = plan.seqs
        if g is None or not g.q or not seqs:
            return None
        if any(
            not s.sample
            or s.prompt_logprobs_targets
            or len(s.token_ids) != 1 + len(s.draft_token_ids)
            or len(s.token_ids) > g.q
            for s in seqs
        ):
            return None
        if not g.fits_verify(len(seqs), max(len(s.pages) for s in seqs)):
            return None
        pos = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        return g.replay_verify([s.token_ids for s in seqs], pos, [s.pages for s in seqs])

    def _verify_step(self, plan: BatchPlan, result: StepResult) -> StepResult:
        """A step with verify rows (speculative decoding): the logits of every position of
        each verify row (through a verify graph when one runs the step, else eagerly),
        then ``engine/spec/verify.py``'s acceptance rule for every sampling row (a row
        without drafts is a span of one position); plain greedy rows of a graph step take
        the graph's own greedy pick (``verify_greedy_packed``)."""
        graph = self._graph_verify(plan)
        packed: torch.Tensor | None = None
        logits: torch.Tensor | None
        if graph is not None:
            logits, packed = graph
            self.verify_steps["graph"] += 1
        else:
            logits = self._eager_step(plan, result)
            self.verify_steps["eager"] += 1
        rows: list[SampleRequest] = []
        spans: list[VerifySpan] = []
        ids: list[str] = []
        for seq in plan.seqs:
            if not seq.sample:
                continue
            ids.append(seq.request_id)
            spans.append(
                VerifySpan(len(rows), seq.draft_token_ids, seq.draft_q, seq.draft_reference)
            )
            rows.extend(verify_rows(seq))
        assert logits is not None and logits.shape[0] == len(rows)
        sampling = [s for s in plan.seqs if s.sample]
        if packed is not None and all(plain_greedy(s) and s.draft_masks is None for s in sampling):
            kept = verify_greedy_packed(packed, logits, spans)
        else:
            kept = verify(logits, rows, spans, self.generator)
        result.reference_mismatches = kept.reference_mismatches
        for rid, seq, tokens in zip(ids, (s for s in plan.seqs if s.sample), kept):
            result.sampled[rid] = tokens[0]
            if seq.draft_token_ids:
                result.verified[rid] = tokens
        return result

    def _eager_step(self, plan: BatchPlan, result: StepResult) -> torch.Tensor | None:
        """Run the forward eagerly; fill prompt logprobs into ``result``; return the logits
        of the sampling rows (None when no row samples)."""
        header, host = self.stage(plan)
        if self.on_staged is not None:
            self.on_staged(header, host)
        chunks = self._prompt_chunk_targets(plan)

        def on_chunk(i: int, logits: torch.Tensor) -> None:
            rid, targets, k = chunks[i]
            result.prompt_logprobs.setdefault(rid, []).extend(_chunk_logprobs(logits, targets, k))

        return self.run_staged(header, host, on_chunk)

    def stage(self, plan: BatchPlan) -> tuple[StepHeader, np.ndarray]:
        """The step's inputs as flat int64 in the staging buffer: its header and the host
        view of its first ``header.total`` values (the segments: module doc).
        A TP executor sends exactly these to the other ranks
        (``engine/worker/multiproc_executor.py``)."""
        return stage_plan(plan, self.storage.page_size, self._staging)

    def staging_view(self, n: int) -> np.ndarray:
        """The host view of the first ``n`` values of the staging buffer (grown as needed),
        for a rank that receives a step's inputs instead of staging a plan."""
        return self._staging.reserve(n)[:n]

    def run_staged(
        self,
        header: StepHeader,
        host: np.ndarray,
        on_chunk: Callable[[int, torch.Tensor], None] | None = None,
        input_from: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The forward of staged inputs (``host`` is the staging buffer's view, see
        :meth:`stage`), then ``compute_logits`` of each prompt-logprob chunk (passed to
        ``on_chunk(i, logits [n, V])`` when given) and of the sampling rows, in that order
        (under TP each is a collective every rank makes).  Returns the sampling rows'
        logits ``[n_sample, V]`` fp32, or None when no row samples.  input_from: the
        previous step's ``[B', 2]`` (id, logprob) rows on the device; then the staged ids
        are row indices into it (overlap scheduling, :meth:`launch_greedy`)."""
        B, T, width, n_sample = header.num_seqs, header.num_tokens, header.width, header.n_sample
        offs = header.offsets
        dev = self._staging.to_device(int(offs[-1]), self.device)
        ids_t, pos_t, slots_t, lens_t, qsl_t, rows_t, table_t = (
            dev[o : o + n] for o, n in zip(offs[:7].tolist(), header.sizes)
        )
        if input_from is not None:
            ids_t = input_from.index_select(0, ids_t)[:, 0].to(torch.int64)
        attn = AttentionMetadata(
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            page_table=table_t.view(B, width),
            slot_mapping=slots_t,
            query_lens_host=tuple(np.diff(host[offs[4] : offs[4] + B + 1]).tolist()),
            seq_lens_host=tuple(host[offs[3] : offs[3] + B].tolist()),
        )
        attn_plan = self.model.backend.plan(attn, self.storage.page_size)  # outside the forward
        hidden = self.model(ids_t, pos_t, attn, self.storage.layer_caches, attn_plan)  # [T, H]
        chunks = host[offs[7] : offs[7] + 2 * header.n_chunks].reshape(-1, 2).tolist()
        for i, (row0, n) in enumerate(chunks):
            logits = self.model.compute_logits(hidden[row0 : row0 + n])  # [n, V] fp32
            if on_chunk is not None:
                on_chunk(i, logits)
        if not n_sample:
            return None
        if n_sample == T:  # every token is sampled (a decode step): no gather
            return self.model.compute_logits(hidden)  # [B, V] fp32
        return self.model.compute_logits(hidden.index_select(0, rows_t))

    @staticmethod
    def _prompt_chunk_targets(plan: BatchPlan) -> list[tuple[str, list[int], int]]:
        """Per prompt-logprob chunk (the order of ``_prompt_chunks``): request id,
        target tokens, top-k."""
        out: list[tuple[str, list[int], int]] = []
        if not any(s.prompt_logprobs_targets for s in plan.seqs):
            return out
        for seq in plan.seqs:
            tg = seq.prompt_logprobs_targets
            for c in range(0, len(tg), PROMPT_LOGITS_CHUNK):
                out.append(
                    (
                        seq.request_id,
                        tg[c : c + PROMPT_LOGITS_CHUNK],
                        seq.params.prompt_logprobs or 0,
                    )
                )
        return out


def _chunk_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Prompt logprobs of one chunk: ``logits [n, V]`` fp32 of the positions before
    ``targets`` (n tokens), with the top ``k`` of each."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [n, V]
    tgt_t = torch.tensor(targets, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, tgt_t).squeeze(1).tolist()
    tops = top_logprobs(logprobs, [k] * len(targets))
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(targets, chosen, tops)]
