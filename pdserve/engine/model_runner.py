"""Executes a :class:`BatchPlan`: one model forward, logits only where needed, sampling."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.kv_pool import KVPool
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampler import (
    SampledToken,
    plain_greedy,
    sample,
    sample_request_of,
    top_logprobs,
)
from pdserve.engine.scheduler import BatchPlan
from pdserve.model.attention import AttentionMetadata, page_table_array, token_slots

if TYPE_CHECKING:
    from pdserve.engine.cuda_graph import CUDAGraphRunner
    from pdserve.model.llama import LlamaForCausalLM

# Prompt-logprob rows go through the LM head in chunks so a long prompt never makes a
# [prompt_len, vocab] fp32 logits tensor at once.
_PROMPT_LOGITS_CHUNK = 256


@dataclass
class StepResult:
    """What a step produced: a sampled token per sampling sequence, and prompt logprobs
    (one ``TokenLogprob`` per target token of the plan) per request that asked for them."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


class ModelRunner:
    """Runs ``model`` (a ``pdserve.model.llama.LlamaForCausalLM``) over the pool's KV cache.

    Per step: the step's token ids, positions, slots, lengths and page table are built with
    numpy (no per-token Python loop) into one pinned staging buffer and copied to the device
    at once; the attention plan is built here, outside the model's forward; then the
    forward, logits for the last token of each sampling sequence (plus the prompt positions
    whose logprobs were asked), and sampling. A decode-only step replays a captured CUDA
    graph when ``graphs`` is given (see ``engine/cuda_graph.py``).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        device: torch.device,
        generator: torch.Generator | None = None,
        graphs: CUDAGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = torch.device(device)
        self.generator = generator  # draws of unseeded random rows (seeded rows own theirs)
        self.graphs = graphs  # CUDAGraphRunner | None
        self._pin = self.device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.int64)
        # The last host-to-device copy out of the staging buffer. A step that samples ends
        # with a device read, but a step that does not (a middle chunk of a chunked prefill)
        # returns at once: the buffer must not be rewritten until that copy has run.
        self._staged_copy: torch.cuda.Event | None = None

    def _stage(self, n: int) -> torch.Tensor:
        """The pinned (on CUDA) int64 staging buffer, at least ``n`` long; grows by doubling
        (each step ends with a device read, so the previous copy out of it is complete)."""
        if self._staged_copy is not None:
            self._staged_copy.synchronize()
            self._staged_copy = None
        if self._staging.numel() < n:
            size = max(n, 2 * self._staging.numel(), 4096)
            buf = torch.empty(size, dtype=torch.int64)
            self._staging = buf.pin_memory() if self._pin else buf
        return self._staging

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
        sample_reqs = [sample_request_of(s) for s in plan.seqs if s.sample]
        if logits is None:
            logits = self._eager_step(plan, result)
        if sample_reqs:
            assert logits is not None  # sampling rows have logits
            sampled = sample(logits, sample_reqs, self.generator)
            seq_ids = [s.request_id for s in plan.seqs if s.sample]
            result.sampled = dict(zip(seq_ids, sampled))
        return result

    def _eager_step(self, plan: BatchPlan, result: StepResult) -> torch.Tensor | None:
        """Run the forward eagerly; fill prompt logprobs into ``result``; return the logits
        of the sampling rows (None when no row samples)."""
        seqs = plan.seqs
        B = len(seqs)
        q = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=B)
        start = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=B)
        s_lens = start + q
        tables = [s.pages for s in seqs]
        width = max(1, max((len(t) for t in tables), default=1))
        if any(len(t) * self.pool.page_size < n for t, n in zip(tables, s_lens.tolist())):
            raise ValueError("a sequence's pages are too few for its tokens")
        table = page_table_array(tables, width)
        qsl, positions, slots = token_slots(q, s_lens, table, self.pool.page_size)
        T = int(qsl[-1])
        sample_rows = (qsl[1:] - 1)[[s.sample for s in seqs]]
        n_sample = len(sample_rows)
        # One staging buffer: ids | positions | slots | seq_lens | qsl | sample rows | table.
        sizes = (T, T, T, B, B + 1, n_sample, B * width)
        offs = np.concatenate(([0], np.cumsum(sizes)))
        buf = self._stage(int(offs[-1]))
        host = buf.numpy()
        host[offs[0] : offs[1]] = np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=T
        )
        for i, arr in enumerate((positions, slots, s_lens, qsl, sample_rows, table.reshape(-1))):
            host[offs[i + 1] : offs[i + 2]] = arr
        dev = buf[: int(offs[-1])].to(self.device, non_blocking=True)
        if self._pin:
            self._staged_copy = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._staged_copy.record()
        ids_t, pos_t, slots_t, lens_t, qsl_t, rows_t, table_t = torch.split(dev, list(sizes))
        attn = AttentionMetadata(
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            page_table=table_t.view(B, width),
            slot_mapping=slots_t,
            query_lens_host=tuple(q.tolist()),
            seq_lens_host=tuple(s_lens.tolist()),
        )
        attn_plan = self.model.backend.plan(attn, self.pool.page_size)  # outside the forward
        hidden = self.model(ids_t, pos_t, attn, self.pool.layer_caches, attn_plan)  # [T, H]

        for seq, row0 in zip(seqs, qsl[:-1].tolist()):
            if seq.prompt_logprobs_targets:
                result.prompt_logprobs[seq.request_id] = self._prompt_logprobs(
                    hidden,
                    row0 + seq.prompt_logprobs_start - seq.start_pos,
                    seq.prompt_logprobs_targets,
                    seq.params.prompt_logprobs or 0,
                )
        if not n_sample:
            return None
        if n_sample == T:  # every token is sampled (a decode step): no gather
            return self.model.compute_logits(hidden)  # [B, V] fp32
        return self.model.compute_logits(hidden.index_select(0, rows_t))

    def _prompt_logprobs(
        self, hidden: torch.Tensor, row0: int, targets: list[int], k: int
    ) -> list[TokenLogprob]:
        out: list[TokenLogprob] = []
        for c in range(0, len(targets), _PROMPT_LOGITS_CHUNK):
            tgt = targets[c : c + _PROMPT_LOGITS_CHUNK]
            h = hidden[row0 + c : row0 + c + len(tgt)]
            logprobs = torch.log_softmax(self.model.compute_logits(h), dim=-1)  # [n, V]
            tgt_t = torch.tensor(tgt, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
            chosen = logprobs.gather(1, tgt_t).squeeze(1).tolist()
            tops = top_logprobs(logprobs, [k] * len(tgt))
            out.extend(TokenLogprob(t, lp, top) for t, lp, top in zip(tgt, chosen, tops))
        return out
