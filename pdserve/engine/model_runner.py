"""Executes a :class:`BatchPlan`: one model forward, logits only where needed, sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_pool import KVPool
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampler import (
    SampledToken,
    SampleRequest,
    sample,
    sample_request_of,
    top_logprobs,
)
from pdserve.engine.scheduler import BatchPlan
from pdserve.model.attention import build_attention_metadata

if TYPE_CHECKING:
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

    Per step: builds ``input_ids[T]``, ``positions[T]`` and one ``AttentionMetadata``,
    runs the forward, computes logits for the last token of each sampling sequence (plus
    the prompt positions whose logprobs were asked), and samples.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.generator = generator  # draws of unseeded random rows (seeded rows own theirs)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        """Run one step.  Every sequence of ``plan`` gets its KV written into its pages."""
        input_ids: list[int] = []
        positions: list[int] = []
        q_lens, s_lens, tables = [], [], []
        sample_rows: list[int] = []
        sample_reqs: list[SampleRequest] = []
        lp_rows: list[tuple[str, int, list[int], int]] = []  # (request id, first row, targets, k)
        for seq in plan.seqs:
            n = len(seq.token_ids)
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            q_lens.append(n)
            s_lens.append(seq.start_pos + n)
            tables.append(seq.pages)
            if seq.prompt_logprobs_targets:
                lp_rows.append(
                    (
                        seq.request_id,
                        row0 + seq.prompt_logprobs_start - seq.start_pos,
                        seq.prompt_logprobs_targets,
                        seq.params.prompt_logprobs or 0,
                    )
                )
            if seq.sample:
                sample_rows.append(row0 + n - 1)
                sample_reqs.append(sample_request_of(seq))
        attn = build_attention_metadata(q_lens, s_lens, tables, self.pool.page_size, self.device)
        ids_t = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model(ids_t, pos_t, attn, self.pool.layer_caches)  # [T, H]

        result = StepResult()
        for request_id, row0, targets, k in lp_rows:
            result.prompt_logprobs[request_id] = self._prompt_logprobs(hidden, row0, targets, k)
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [B, V] fp32
            sampled = sample(logits, sample_reqs, self.generator)
            seq_ids = [s.request_id for s in plan.seqs if s.sample]
            result.sampled = dict(zip(seq_ids, sampled))
        return result

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
