"""``torch_sdpa`` attention backend: paged KV cache + ``F.scaled_dot_product_attention`` (CPU, CUDA).

Decode rows (one new token per sequence) of a step are attended in ONE batched SDPA call over
the batch's context gathered into ``[Bd, Hkv, max_len, D]``, with GQA folded into the query
dimension (``[Bd, Hkv, G, D]``), so no repeat of K/V is needed. Prefill rows (several new
tokens) are attended one sequence at a time: causal SDPA on the fresh K/V when there is no
cached prefix, otherwise over the gathered context with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionBackend, AttentionMetadata


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # [Bd] int64 token rows; None when every token is a decode row
    gather: torch.Tensor  # [Bd * max_len] int64 slots of the flattened cache (0 where masked)
    mask: torch.Tensor  # [Bd, 1, 1, max_len] bool, True = attend
    num: int
    max_len: int


@dataclass
class _PrefillSeq:
    start: int  # token rows start:end of this sequence
    end: int
    gather: torch.Tensor | None  # [ctx] int64 slots of positions 0..ctx-1; None = no cached prefix
    mask: torch.Tensor | None  # [q, ctx] bool offset-causal mask; None = plain causal


@dataclass
class SDPAPlan:
    """Per-step plan of :class:`TorchSDPABackend` (built once per forward, used by every layer)."""

    decode: _DecodeGroup | None
    prefills: list[_PrefillSeq]
    num_tokens: int


def _slots(page_table_rows: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of positions ``0..length-1`` for each row of ``page_table_rows`` ``[n, max_pages]``
    -> ``[n, length]`` int64."""
    pos = torch.arange(length, device=page_table_rows.device)
    pages = page_table_rows.index_select(1, pos // page_size).long()
    return pages * page_size + pos % page_size


class TorchSDPABackend(AttentionBackend):
    """Reference paged attention on ``torch.nn.functional.scaled_dot_product_attention``."""

    name = "torch_sdpa"

    def plan(self, attn: AttentionMetadata, page_size: int) -> SDPAPlan:
        """Build the gather indices and masks of this step. Shapes in :class:`SDPAPlan`."""
        q_lens, s_lens = attn.host_lens()
        device = attn.page_table.device
        dec = [b for b, q in enumerate(q_lens) if q == 1]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        decode = None
        if dec:
            max_len = max(s_lens[b] for b in dec)
            all_dec = len(dec) == len(q_lens)
            if all_dec:
                rows, table, lens = None, attn.page_table, attn.seq_lens
            else:
                sel = torch.tensor(dec, dtype=torch.int64).to(device, non_blocking=True)
                rows = torch.tensor([starts[b] for b in dec], dtype=torch.int64).to(
                    device, non_blocking=True
                )
                table, lens = (
                    attn.page_table.index_select(0, sel),
                    attn.seq_lens.index_select(0, sel),
                )
            slots = _slots(table, max_len, page_size)  # [Bd, max_len]
            valid = torch.arange(max_len, device=device)[None, :] < lens[:, None].long()
            gather = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
            decode = _DecodeGroup(rows, gather, valid[:, None, None, :], len(dec), max_len)
        prefills = []
        for b, q in enumerate(q_lens):
            if q == 1:
                continue
            s = s_lens[b]
            ctx_gather: torch.Tensor | None = None
            ctx_mask: torch.Tensor | None = None
            if s > q:
                ctx_gather = _slots(attn.page_table[b : b + 1], s, page_size)[0]
                qi = torch.arange(q, device=device)[:, None]
                ctx_mask = torch.arange(s, device=device)[None, :] <= (s - q) + qi
            prefills.append(_PrefillSeq(starts[b], starts[b + 1], ctx_gather, ctx_mask))
        return SDPAPlan(decode, prefills, starts[-1])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        plan: SDPAPlan,
        scale: float,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq*D]``."""
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        k_flat = k_cache.view(-1, Hkv, D)  # [P * page_size, Hkv, D]
        v_flat = v_cache.view(-1, Hkv, D)
        k_flat.index_copy_(0, attn.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, attn.slot_mapping, v.to(v_flat.dtype))

        dg = plan.decode
        if dg is not None and dg.rows is None:
            return self._decode(q, k_flat, v_flat, dg, scale, Hkv, G).reshape(T, Hq * D)

        out = q.new_empty(T, Hq, D)
        if dg is not None and dg.rows is not None:  # rows is None only in the return above
            qd = q.index_select(0, dg.rows)
            out.index_copy_(
                0, dg.rows, self._decode(qd, k_flat, v_flat, dg, scale, Hkv, G).reshape(-1, Hq, D)
            )
        for p in plan.prefills:
            qp = q[p.start : p.end].transpose(0, 1)  # [Hq, q, D]
            if p.gather is None:
                kp, vp = k[p.start : p.end], v[p.start : p.end]
            else:
                kp, vp = k_flat.index_select(0, p.gather), v_flat.index_select(0, p.gather)
            kp, vp = kp.transpose(0, 1).to(q.dtype), vp.transpose(0, 1).to(q.dtype)  # [Hkv, ctx, D]
            if G > 1:
                kp, vp = kp.repeat_interleave(G, dim=0), vp.repeat_interleave(G, dim=0)
            o = F.scaled_dot_product_attention(
                qp.unsqueeze(0),
                kp.unsqueeze(0),
                vp.unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=scale,
            )  # [1, Hq, q, D]
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out.view(T, Hq * D)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        dg: _DecodeGroup,
        scale: float,
        Hkv: int,
        G: int,
    ) -> torch.Tensor:
        """q ``[Bd, Hq, D]`` -> ``[Bd, Hkv, G, D]`` attended over the gathered context."""
        Bd, _, D = q.shape
        kd = k_flat.index_select(0, dg.gather).view(Bd, dg.max_len, Hkv, D).transpose(1, 2)
        vd = v_flat.index_select(0, dg.gather).view(Bd, dg.max_len, Hkv, D).transpose(1, 2)
        qd = q.view(Bd, Hkv, G, D)  # GQA: the G query heads of a KV head become G query rows
        return F.scaled_dot_product_attention(
            qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=dg.mask, scale=scale
        )
