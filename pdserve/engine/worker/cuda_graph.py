"""CUDA graphs of the decode step: one graph per batch-size bucket, replayed over static buffers.

A decode-only step (every sequence one new token, every sequence sampled) of ``B`` rows runs
the graph of the smallest bucket ``>= B``: the step's token ids, positions, slots, context
lengths and page-table rows are copied into the graph's static buffers (one host-to-device
copy from pinned staging for the per-row values, one for the page-table rows), the graph is
replayed, and the logits of its first ``B`` rows are returned. Padded rows have slot ``-1``
(nothing is written) and context length 0 (their output is ignored).

Greedy inside the graph: each graph also computes the argmax of every row and that token's
logprob, packed as ``[bs, 2]`` float64: on a GPU that ``model/decode_attn_table.py`` lists
for it, by the one-pass Triton greedy pick (``model/triton_greedy.py``: the same token,
the logprob to fp32 rounding, no ``[bs, V]`` log-softmax written); elsewhere by
``log_softmax`` then ``gather``, the sampler's own ops (the eager sampler's numbers bit for
bit). A step whose rows are all plain
greedy (``sampler.plain_greedy``) reads only that (:meth:`CUDAGraphRunner.greedy_tokens`:
one device-to-host copy of ``B x 2`` numbers, no sampler kernels launched after the graph);
any other step samples from the logits as before.

One graph per bucket and context bound, captured whole: splitting a bucket's forward into
pieces launched back to back was tried and removed (slower at large batches; the figures
are in docs/benchmarks.md, "Notes moved from engine docstrings").

Overlap scheduling (``engine/core/overlap.py``): ``replay(..., ids_from=prev)`` takes each row's
input id from the previous replay's ``[B', 2]`` greedy output on the device (``token_ids``
then hold row indices), and ``greedy_packed`` hands out a replay's output without waiting;
the pinned host staging buffers are two sets used in turn, so filling step N+1's never
races step N's queued copies.

Context bounds: where the attention backend launches differently when every context is known
to be short (``capture_context_bounds``: the ``triton`` backend's short-context decode
rule, contexts up to ``ONE_SPLIT_MAX_CONTEXT`` tokens, against its balanced split of long
contexts), a bucket also gets a graph
captured for that bound; a replay runs the smallest bounded graph that holds the step's
longest context, else the bucket's unbounded one.

Verify graphs (speculative decoding, ``engine/spec/``): :meth:`CUDAGraphRunner.capture_verify`
captures, for a fixed ``k`` per engine, one graph per bucket of rows of ``q = k + 1``
tokens each (a row's last token and its drafts), up to ``VERIFY_GRAPH_MAX_TOKENS`` tokens,
into the same memory pool and over the same page-table buffer as the decode graphs; the
attention runs the extend kernel with the backend's capture plan for ``q`` query tokens a
row (``plan_for_capture(..., query_len=q)``: its launch depends on the bucket and ``q``
only).  A row with fewer drafts is **right-aligned** in its window (:func:`verify_window`):
padding tokens first, with slot ``-1`` (nothing written) and the row's context length
counting only its real tokens, so the kernel, which places a row's queries at the last
``q`` positions of its context, puts the real ones where they belong and the padding ones
on earlier positions (their outputs are ignored).  Every position's logits and the
in-graph greedy pick come back for the real positions only (:meth:`replay_verify`).

Buckets: 1, 2, 4, 8, then every 16 up to the largest batch (nano-vllm's spacing); captured
largest first into one shared memory pool (so smaller graphs reuse the largest one's
activations), before any KV transfer thread starts (GPU work from another thread during a
capture would invalidate it). Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from pdserve.engine.step import SampledToken
from pdserve.model.attention import AttentionMetadata
from pdserve.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Buckets ``1, 2, 4, 8, 16, 32, ...`` (every 16 after 8) up to ``max_batch``, which is
    always the last one. ValueError when ``max_batch < 1``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


# A captured graph: (batch-size bucket, longest context it may run in tokens, or None: any).
GraphKey = tuple[int, int | None]

# The most tokens (rows x (k + 1)) a verify graph is captured for: its fp32 logits buffer
# holds one row of the vocabulary per token (Llama-3's: 0.5 MB each).
VERIFY_GRAPH_MAX_TOKENS = 512


def verify_batch_sizes(max_batch: int, query_len: int) -> list[int]:
    """Buckets of the verify graphs of ``query_len`` tokens a row: :func:`graph_batch_sizes`
    up to ``min(max_batch, VERIFY_GRAPH_MAX_TOKENS // query_len)`` (at least 1).
    ValueError when ``query_len < 2``."""
    if query_len < 2:
        raise ValueError(f"query_len must be >= 2 (a token and a draft), got {query_len}")
    return graph_batch_sizes(max(1, min(max_batch, VERIFY_GRAPH_MAX_TOKENS // query_len)))


class VerifyWindow(NamedTuple):
    """Host inputs of a verify graph of ``bs`` rows of ``q`` tokens (:func:`verify_window`).

    ids, positions, slots: int64 ``[bs * q]``; seq_lens: int64 ``[bs]``; rows: int64
    ``[n]``, the flat index of each real token in step order (row 0's tokens, then row 1's...).
    """

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    rows: np.ndarray


def verify_window(
    token_ids: Sequence[Sequence[int]],
    start_pos: np.ndarray,
    table: np.ndarray,
    page_size: int,
    q: int,
    bs: int,
) -> VerifyWindow:
    """Lay ``B = len(token_ids)`` verify rows out in windows of ``q`` tokens for a graph
    of ``bs >= B`` rows.  Row ``b``'s ``n_b = len(token_ids[b])`` tokens (``1 <= n_b <= q``:
    its last token and its drafts) sit at positions ``start_pos[b] ..`` and take the
    *last* ``n_b`` places of window ``b``; the ``q - n_b`` places before them are padding:
    id 0, position ``start_pos[b]`` (any valid one: only RoPE reads it), slot ``-1``.  The
    row's context length is ``start_pos[b] + n_b``, so an attention kernel that puts a
    row's ``q`` queries at the last ``q`` positions of its context puts the real ones at
    their own positions (the padding ones on earlier positions, causally masked within
    the row's written context).  Rows ``B .. bs-1``: id 0, position 0, slot -1, context 0.
    table: int ``[B, W]`` page ids (each row covering its tokens).  ValueError when a row
    has no token or more than ``q``, or ``bs < B``."""
    B = len(token_ids)
    if bs < B:
        raise ValueError(f"bs ({bs}) must be >= the rows ({B})")
    n = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=B)
    if B and (n.min() < 1 or n.max() > q):
        raise ValueError(f"every verify row needs 1 .. {q} tokens, got {n.tolist()}")
    start = np.asarray(start_pos, dtype=np.int64)
    pad = q - n
    idx = np.arange(q, dtype=np.int64)[None, :]
    real = idx >= pad[:, None]  # [B, q]
    pos = start[:, None] + np.maximum(idx - pad[:, None], 0)  # [B, q]
    pages = table[np.arange(B)[:, None], pos // page_size].astype(np.int64)
    ids = np.zeros((bs, q), dtype=np.int64)
    ids[:B][real] = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, int(n.sum()))
    positions = np.zeros((bs, q), dtype=np.int64)
    positions[:B] = pos
    slots = np.full((bs, q), -1, dtype=np.int64)
    slots[:B] = np.where(real, pages * page_size + pos % page_size, -1)
    seq_lens = np.zeros(bs, dtype=np.int64)
    seq_lens[:B] = start + n
    rows = np.flatnonzero(real.reshape(-1))
    return VerifyWindow(ids.reshape(-1), positions.reshape(-1), slots.reshape(-1), seq_lens, rows)


def graph_context_bounds(model: LlamaForCausalLM, bs: int) -> tuple[int, ...]:
    """The context bounds bucket ``bs`` gets a graph of its own for (the attention
    backend's ``capture_context_bounds`` at the model's KV heads a rank)."""
    return tuple(model.backend.capture_context_bounds(bs, model.shapes.n_kv_heads))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of ``logits`` ``[R, V]`` fp32 and that token's raw logprob, packed
    ``[R, 2]`` float64 (what a graph hands the plain greedy rows). On a CUDA device that
    ``model/decode_attn_table.py`` lists, the one-pass Triton pick (``model/triton_greedy.py``:
    the same token, the logprob to fp32 rounding, no ``[R, V]`` log-softmax written); else
    the sampler's own ops (``argmax``, ``log_softmax`` + ``gather``: its numbers bit for bit)."""
    if logits.is_cuda:
        from pdserve.model import triton_greedy  # (Triton: with CUDA builds of torch)

        picked = triton_greedy.measured_params(logits.device)
        if picked is not None:
            target, block_v, warps = picked
            splits = triton_greedy.greedy_splits(logits.shape[0], logits.shape[1], target, block_v)
            return triton_greedy.greedy_pick(logits, None, splits, block_v, warps)
    ids = logits.argmax(dim=-1, keepdim=True)  # [R, 1] (the sampler's greedy pick)
    chosen = torch.log_softmax(logits, dim=-1).gather(1, ids)  # [R, 1]
    return torch.cat((ids.double(), chosen.double()), dim=1)


def pick_graph(bs: int, bounds: Sequence[int], max_context: int) -> GraphKey:
    """The key of the graph that runs a step of bucket ``bs`` whose longest context is
    ``max_context`` tokens: the smallest of ``bounds`` (ascending) that holds it, else the
    unbounded graph."""
    return bs, next((b for b in bounds if max_context <= b), None)


@dataclass
class TableRows:
    """What a host page-table buffer holds (:func:`fill_page_table`): the width (pages a
    row) it was last laid out with, and the page list each row was last written from."""

    width: int = 0
    rows: list[Sequence[int] | None] = field(default_factory=list)


def fill_page_table(
    table: np.ndarray, page_tables: Sequence[Sequence[int]], written: TableRows
) -> int:
    """Write ``page_tables[b]`` into row ``b`` of ``table`` ``[B, width]`` (a view of a host
    buffer that keeps its contents between steps), by difference: a row whose list is the
    very object it was last written from is skipped (the scheduler never changes a page
    list in place: it grows a request's pages into a new list), so a decode step's host
    work follows the rows whose pages changed, not the batch's total context. A new width
    lays the buffer out anew: every row is written. Entries past a row's pages are left as
    they are (never read unmasked). ``written`` is updated; returns the rows written."""
    B, width = table.shape
    if written.width != width:
        written.width, written.rows = width, []
    rows = written.rows
    if len(rows) < B:
        rows.extend([None] * (B - len(rows)))
    n = 0
    for b, pages in enumerate(page_tables):
        if rows[b] is not pages:
            table[b, : len(pages)] = pages
            rows[b] = pages
            n += 1
    return n


def capture_reserve_bytes(model: LlamaForCausalLM, max_batch: int, verify_tokens: int = 0) -> int:
    """Upper bound of the graph pool's size (bytes), reserved before the KV pool is sized
    (``verify_tokens``: the largest verify graph's tokens, rows x (k + 1), when verify
    graphs are captured too; the counts below then take the larger of the two):
    the fp32 logits buffer every graph writes (``max_batch * vocab * 4``), the largest
    bucket's logits in the model dtype before that cast and its log-softmax (its greedy
    pick; both counted at 4 bytes), the
    activations of the largest bucket (hidden, fused QKV, gate/up, split-KV scratch of 32
    splits), plus 256 MiB for the allocator's rounding and cuBLAS workspaces."""
    s = model.shapes
    max_batch = max(max_batch, verify_tokens)
    elt = int(torch.empty((), dtype=model.dtype).element_size())
    logits = 3 * max_batch * s.vocab * 4
    per_row = (
        4 * s.hidden + (s.n_heads + 2 * s.n_kv_heads) * s.head_dim + 3 * s.intermediate
    ) * elt + s.n_heads * 32 * (s.head_dim + 1) * 4
    return int(logits + 4 * max_batch * per_row + (256 << 20))


class CUDAGraphRunner:
    """Captured decode graphs of ``model`` over ``kv_cache`` (see the module docstring).

    model: ``LlamaForCausalLM`` whose backend ``supports_cuda_graphs``. kv_cache: the pool's
    per-layer ``(k_cache, v_cache)`` views (their addresses are baked into the graphs, so the
    pool must outlive them).
    max_batch: largest batch captured. max_pages: page-table width (pages of the longest
    context). Raises RuntimeError if the device is not CUDA, unless ``eager``.
    eager: a test hook for machines without CUDA: nothing is captured, and each replay runs
    the forward that would have been captured, eagerly, over the same static buffers
    (the same buffer filling, capture plans and output slicing).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        max_batch: int,
        max_pages: int,
        eager: bool = False,
    ) -> None:
        self.eager = eager
        if kv_cache[0][0].device.type != "cuda" and not eager:
            raise RuntimeError("CUDA graphs need a CUDA device")
        pin = kv_cache[0][0].device.type == "cuda"
        self._pin = pin
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = max_batch
        self.max_pages = max(1, max_pages)
        dev = kv_cache[0][0].device
        # Per-row static values [4, max_batch] int64: token id, position, slot, context length.
        self._rows = torch.zeros(4, max_batch, dtype=torch.int64, device=dev)
        self._rows[2].fill_(-1)
        self._table = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, device=dev)
        self._qsl = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        # Two pinned host staging sets, used in turn: with overlap scheduling the host fills
        # step N+1's while step N's copies may still be queued (``_staged[i]``: the event
        # after the last copy out of set i).
        self._rows_hosts = [_host(torch.zeros(4, max_batch, dtype=torch.int64), pin) for _ in "ab"]
        self._table_hosts = [
            _host(torch.zeros(max_batch * self.max_pages, dtype=torch.int32), pin) for _ in "ab"
        ]
        self._staged: list[Any] = [None, None]
        # What each host table set holds (fill_page_table): rows are rewritten by difference.
        self._table_written: list[TableRows] = [TableRows(), TableRows()]
        self._turn = 0
        self._table_dev = torch.zeros(max_batch * self.max_pages, dtype=torch.int32, device=dev)
        # A graph's key: (bucket, context bound or None); see "Context bounds" above.
        self._bounds = {bs: graph_context_bounds(model, bs) for bs in self.sizes}
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._logits: dict[GraphKey, torch.Tensor] = {}  # views of _logits_out
        self._logits_out: torch.Tensor | None = None  # [max_batch, V] fp32, every graph's
        self._greedy: dict[GraphKey, torch.Tensor] = {}  # [bs, 2] float64: argmax id, logprob
        self._last_key: GraphKey = (0, None)  # the graph of the last replay
        self._pool: Any = None  # the graphs' shared memory pool (a CUDA pool handle)
        # Verify graphs (prepare_verify / capture_verify): q tokens a row, q = 0: none.
        self.q = 0
        self.verify_sizes: list[int] = []
        self.verify_max_batch = 0
        self._vgraphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._vout: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits, greedy

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._qsl[: bs + 1],
            seq_lens=self._rows[3, :bs],
            page_table=self._table[:bs],
            slot_mapping=self._rows[2, :bs],
        )

    def _run(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        bs, bound = key
        md = self._metadata(bs)
        plan = self.model.backend.plan_for_capture(md, self.page_size, bound)
        hidden = self.model(self._rows[0, :bs], self._rows[1, :bs], md, self.kv_cache, plan)
        # [bs, V] fp32, written into the graphs' one shared buffer (a graph's own would
        # keep bucket x V x 4 bytes per graph: 67 GB for Llama-3.1-8B's graphs up to 1,024)
        assert self._logits_out is not None  # made by capture()
        logits = self.model.compute_logits(hidden, out=self._logits_out[:bs])
        return logits, greedy_pick(logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (padded rows only:
        nothing is written to the KV cache)."""
        if self.eager:
            raise RuntimeError("an eager CUDAGraphRunner captures nothing")
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self._ensure_logits_out()
        for key in self.keys():
            self._run(key)  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            self._graphs[key] = self._capture(key, stream)
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s "
            "(also for contexts up to %s tokens at %s)",
            self.sizes,
            sorted({b for bounds in self._bounds.values() for b in bounds}),
            [bs for bs in self.sizes if self._bounds[bs]],
        )

    def keys(self) -> list[GraphKey]:
        """Every graph's key, in capture order: largest bucket first, each bucket's
        unbounded graph before its bounded ones."""
        return [(bs, b) for bs in reversed(self.sizes) for b in (None, *self._bounds[bs])]

    def _capture(self, key: GraphKey, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        """Capture graph ``key`` on ``stream`` into the shared pool (the first capture makes
        the pool)."""
        graph, (self._logits[key], self._greedy[key]) = self._capture_in_pool(
            stream, lambda: self._run(key)
        )
        return graph

    def _capture_in_pool(
        self, stream: torch.cuda.Stream, run: Callable[[], Any]
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Capture ``run()`` on ``stream`` into the one pool every graph shares (the first
        capture makes it); returns ``(graph, what run returned)``."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            if self._pool is None:
                graph.capture_begin()
            else:
                graph.capture_begin(pool=self._pool)
            out = run()
            graph.capture_end()
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    def bucket(self, batch: int) -> int | None:
        """The captured size that runs ``batch`` rows, or ``None`` when it is too large."""
        if batch > self.max_batch:
            return None
        return self.sizes[next(i for i, s in enumerate(self.sizes) if s >= batch)]

    def fits(self, batch: int, max_pages: int) -> bool:
        """Whether a decode step of ``batch`` rows whose longest page list is ``max_pages``
        can replay a graph."""
        return batch <= self.max_batch and max_pages <= self.max_pages

    def replay(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        page_tables: list[list[int]],
        ids_from: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a decode step of ``B = len(token_ids)`` rows: token ``token_ids[b]`` at
        position ``positions[b]`` of a sequence whose pages are ``page_tables[b]``. Returns
        the fp32 logits ``[B, V]`` (a view of the graph's output, valid until the next replay).

        ids_from: the previous step's ``[B', 2]`` float64 (id, logprob) rows on the device
        (:meth:`greedy_packed`); then ``token_ids[b]`` is a row index into it and row b's
        token is that row's id, gathered on the device in stream order (overlap scheduling:
        no host round trip). Returns without waiting for the GPU.
        """
        B = len(token_ids)
        bs = self.bucket(B)
        assert bs is not None
        ps = self.page_size
        width = max(len(p) for p in page_tables)
        turn, self._turn = self._turn, 1 - self._turn
        if self._staged[turn] is not None:
            self._staged[turn].synchronize()  # that set's last copies ran (long ago, in practice)
        rows_host, table_host = self._rows_hosts[turn], self._table_hosts[turn]
        table = table_host[: B * width].numpy().reshape(B, width)
        fill_page_table(table, page_tables, self._table_written[turn])
        pages_of = table[np.arange(B), positions // ps].astype(np.int64)
        rows = rows_host.numpy()
        rows[0, :B] = token_ids
        rows[1, :B] = positions
        rows[2, :B] = pages_of * ps + positions % ps
        rows[3, :B] = positions + 1
        rows[0:2, B:bs] = 0
        rows[2, B:bs] = -1
        rows[3, B:bs] = 0
        self._rows.copy_(rows_host, non_blocking=True)
        dev_table = self._table_dev[: B * width]
        dev_table.copy_(table_host[: B * width], non_blocking=True)
        self._staged[turn] = self._record()
        self._table[:B, :width].copy_(dev_table.view(B, width))
        if ids_from is not None:  # row b's token: row token_ids[b] of the previous step's ids
            self._rows[0, :B].copy_(ids_from.index_select(0, self._rows[0, :B])[:, 0])
        key = pick_graph(bs, self._bounds[bs], int(positions.max()) + 1)
        if self.eager:
            self._ensure_logits_out()
            self._logits[key], self._greedy[key] = self._run(key)
        else:
            self._graphs[key].replay()
        self._last_key = key
        return self._logits[key][:B]

    def _record(self) -> Any:
        """An event after the queued copies (None off CUDA: the copies are done)."""
        if not self._pin:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _ensure_logits_out(self) -> None:
        """The fp32 logits buffer every graph writes: ``[max(max_batch, verify tokens), V]``."""
        rows = max(self.max_batch, self.verify_max_batch * self.q)
        if self._logits_out is None or self._logits_out.shape[0] < rows:
            dev = self.kv_cache[0][0].device
            vocab = self.model.shapes.vocab
            self._logits_out = torch.empty(rows, vocab, dtype=torch.float32, device=dev)

    # --- verify graphs (speculative decoding) ------------------------------------------
    def prepare_verify(self, num_speculative_tokens: int) -> None:
        """The static buffers of verify rows of ``q = num_speculative_tokens + 1`` tokens
        (buckets :func:`verify_batch_sizes`); nothing captured (see :meth:`capture_verify`).
        ValueError when ``num_speculative_tokens < 1`` or another ``k`` was prepared."""
        q = num_speculative_tokens + 1
        if self.q == q:
            return
        if self.q:
            raise ValueError(
                f"num_speculative_tokens: verify graphs were made for {self.q - 1}, not "
                f"{num_speculative_tokens} (one k per engine)"
            )
        self.verify_sizes = verify_batch_sizes(self.max_batch, q)
        self.q, vb = q, self.verify_sizes[-1]
        self.verify_max_batch = vb
        dev = self.kv_cache[0][0].device
        # [3, vb * q] int64 per token: id, position, slot; [vb] context lengths
        self._vtok = torch.zeros(3, vb * q, dtype=torch.int64, device=dev)
        self._vtok[2].fill_(-1)
        self._vlens = torch.zeros(vb, dtype=torch.int64, device=dev)
        self._vqsl = torch.arange(0, (vb + 1) * q, q, dtype=torch.int32, device=dev)
        self._vhost = _host(torch.zeros(3 * vb * q + vb, dtype=torch.int64), self._pin)
        self._vstaged: Any = None
        self._vtable_written = TableRows()
        self._vtable_host = _host(torch.zeros(vb * self.max_pages, dtype=torch.int32), self._pin)
        self._vtable_dev = torch.zeros(vb * self.max_pages, dtype=torch.int32, device=dev)
        self._ensure_logits_out()

    def _run_verify(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward a verify graph of ``bs`` rows captures: logits ``[bs * q, V]`` fp32
        (a view of the shared buffer) and the ``[bs * q, 2]`` float64 greedy pick."""
        q, T = self.q, bs * self.q
        md = AttentionMetadata(
            query_start_loc=self._vqsl[: bs + 1],
            seq_lens=self._vlens[:bs],
            page_table=self._table[:bs],
            slot_mapping=self._vtok[2, :T],
        )
        plan = self.model.backend.plan_for_capture(md, self.page_size, None, query_len=q)
        hidden = self.model(self._vtok[0, :T], self._vtok[1, :T], md, self.kv_cache, plan)
        assert self._logits_out is not None  # made by prepare_verify
        logits = self.model.compute_logits(hidden, out=self._logits_out[:T])
        return logits, greedy_pick(logits)

    @torch.inference_mode()
    def capture_verify(self, num_speculative_tokens: int) -> None:
        """:meth:`prepare_verify`, then capture a verify graph per bucket, largest first,
        into the decode graphs' pool (call it with no other GPU work in flight: before any
        KV transfer thread starts, or between runs)."""
        self.prepare_verify(num_speculative_tokens)
        if self.eager or self._vgraphs:
            return
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        for bs in reversed(self.verify_sizes):
            self._run_verify(bs)  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            self._vgraphs[bs], self._vout[bs] = self._capture_in_pool(
                stream, functools.partial(self._run_verify, bs)
            )
            torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for verify steps of %d tokens a row, batch sizes %s",
            self.q,
            self.verify_sizes,
        )

    def fits_verify(self, batch: int, max_pages: int) -> bool:
        """Whether a verify step of ``batch`` rows (each at most ``q`` tokens) whose
        longest page list is ``max_pages`` can replay a verify graph."""
        return bool(self.q) and batch <= self.verify_max_batch and max_pages <= self.max_pages

    def replay_verify(
        self,
        token_ids: Sequence[Sequence[int]],
        start_pos: np.ndarray,
        page_tables: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a verify step of ``B = len(token_ids)`` rows (row ``b``: its last token at
        position ``start_pos[b]`` and its drafts, ``1 .. q`` tokens; pages
        ``page_tables[b]``).  Returns the logits ``[n, V]`` fp32 and the greedy pick
        ``[n, 2]`` float64 (argmax id, its logprob) of the ``n`` real tokens in step order
        (new tensors, on the device, not waited for)."""
        B = len(token_ids)
        bs = next(s for s in self.verify_sizes if s >= B)
        q, T = self.q, bs * self.q
        width = max(len(p) for p in page_tables)
        if self._vstaged is not None:
            self._vstaged.synchronize()
        table = self._vtable_host[: B * width].numpy().reshape(B, width)
        fill_page_table(table, page_tables, self._vtable_written)
        win = verify_window(token_ids, start_pos, table, self.page_size, q, bs)
        host = self._vhost.numpy()
        host[:T] = win.ids
        host[T : 2 * T] = win.positions
        host[2 * T : 3 * T] = win.slots
        host[3 * T : 3 * T + bs] = win.seq_lens
        dev = self._vhost[: 3 * T + bs].to(self._vtok.device, non_blocking=True)
        dev_table = self._vtable_dev[: B * width]
        dev_table.copy_(self._vtable_host[: B * width], non_blocking=True)
        self._vstaged = self._record()
        self._vtok[:, :T].copy_(dev[: 3 * T].view(3, T))
        self._vlens[:bs].copy_(dev[3 * T :])
        self._table[:B, :width].copy_(dev_table.view(B, width))
        if self.eager:
            logits, greedy = self._run_verify(bs)
        else:
            self._vgraphs[bs].replay()
            logits, greedy = self._vout[bs]
        rows = torch.from_numpy(win.rows).to(logits.device, non_blocking=True)
        return logits.index_select(0, rows), greedy.index_select(0, rows)

    def greedy_packed(self, batch: int) -> torch.Tensor:
        """The last replay's ``[batch, 2]`` float64 (argmax id, its raw logprob) on the
        device, not waited for (a view of the graph's output: read it, or queue a copy of
        it, before the next replay of the same bucket)."""
        return self._greedy[self._last_key][:batch]

    def greedy_tokens(self, batch: int) -> list[SampledToken]:
        """The argmax token of each of the first ``batch`` rows of the last replay and its
        raw logprob (no top logprobs): what ``sampler.sample`` returns for plain greedy rows.
        Waits for the replay (one device-to-host copy)."""
        rows = self._greedy[self._last_key][:batch].tolist()
        return [SampledToken(int(t), lp, ()) for t, lp in rows]

    @staticmethod
    def max_pages_for(max_model_len: int, page_size: int) -> int:
        """Page-table width of a context of ``max_model_len`` tokens."""
        return math.ceil(max_model_len / page_size)


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` in pinned memory when ``pin`` (CUDA), else as it is."""
    return t.pin_memory() if pin else t
