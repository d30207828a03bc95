"""``torch_sdpa`` attention backend: paged KV cache + ``F.scaled_dot_product_attention`` (CPU, CUDA).

The caches are the pool's per-layer views ``[P, page_size, Hkv, D]`` in whatever physical
order the pool has (``pdserve.engine.kv.layout``): they are strided, never flattened, and
read a whole page at a time. Decode rows (one new token per sequence) of a step are
attended in ONE batched SDPA call over the batch's pages gathered into
``[Bd, Hkv, max_pages * page_size, D]``, with GQA folded into the query dimension
(``[Bd, Hkv, G, D]``), so no repeat of K/V is needed. Prefill rows (several new tokens) are
attended one sequence at a time: causal SDPA on the fresh K/V when there is no cached
prefix, otherwise over the gathered context with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionBackend, AttentionMetadata, is_fp8, quantize_kv


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # [Bd] int64 token rows; None when every token is a decode row
    pages: torch.Tensor  # [Bd, max_pages] int64 page ids (0 past a row's last page)
    mask: torch.Tensor  # [Bd, 1, 1, max_pages * page_size] bool, True = attend


@dataclass
class _PrefillSeq:
    start: int  # token rows start:end of this sequence
    end: int
    pages: torch.Tensor | None  # [1, ceil(ctx / page_size)] int64; None = no cached prefix
    ctx: int  # context length (cached prefix + this step's tokens)
    mask: torch.Tensor | None  # [q, ctx] bool offset-causal mask; None = plain causal
    all_pages: torch.Tensor  # [1, ceil(ctx / page_size)] int64 (an FP8 cache reads them all)


@dataclass
class SDPAPlan:
    """Per-step plan of :class:`TorchSDPABackend` (built once per forward, used by every layer)."""

    decode: _DecodeGroup | None
    prefills: list[_PrefillSeq]
    num_tokens: int
    write_pages: torch.Tensor  # [T] int64 page of each new token
    write_offsets: torch.Tensor  # [T] int64 offset inside that page


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Pages ``pages`` ``[n, m]`` of one layer's cache view ``[P, ps, H, D]`` as
    ``[n, H, m * ps, D]`` (positions in page-table order), reading each page as a block in
    the cache's physical order (token-inner ``[H, ps, D]`` or head-inner ``[ps, H, D]``)."""
    n, m = pages.shape
    _, ps, H, D = cache.shape
    flat = pages.reshape(-1)
    if cache.stride(1) < cache.stride(2):  # head-major inside a page (page_major order)
        # One gather per head straight into a head-outer buffer: a head's pages are
        # contiguous [ps, D] blocks, and the result is a strided [n, H, m * ps, D] view of
        # it, so nothing is copied twice (gathering [n*m, H, ps, D] and then swapping m and
        # H cost a second full copy: 20-30 % of a CPU decode step at 16 sequences).
        by_head = cache.transpose(1, 2)  # [P, H, ps, D]
        out = cache.new_empty(H, n * m, ps, D)
        for h in range(H):
            torch.index_select(by_head[:, h], 0, flat, out=out[h])
        return out.view(H, n, m * ps, D).transpose(0, 1)
    g = cache.index_select(0, flat)  # [n*m, ps, H, D]
    return g.view(n, m * ps, H, D).transpose(1, 2)


class TorchSDPABackend(AttentionBackend):
    """Reference paged attention on ``torch.nn.functional.scaled_dot_product_attention``."""

    name = "torch_sdpa"

    def plan(self, attn: AttentionMetadata, page_size: int) -> SDPAPlan:
        """Build the page lists and masks of this step. Shapes in :class:`SDPAPlan`."""
        q_lens, s_lens = attn.host_lens()
        device = attn.page_table.device
        dec = [b for b, q in enumerate(q_lens) if q == 1]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        decode = None
        if dec:
            max_pages = -(-max(s_lens[b] for b in dec) // page_size)
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
            span = max_pages * page_size
            valid = torch.arange(span, device=device)[None, :] < lens[:, None].long()
            page_valid = (
                torch.arange(max_pages, device=device)[None, :] * page_size < lens[:, None].long()
            )
            dec_pages = table[:, :max_pages].long()
            dec_pages = torch.where(page_valid, dec_pages, torch.zeros_like(dec_pages))
            decode = _DecodeGroup(rows, dec_pages, valid[:, None, None, :])
        prefills = []
        for b, q in enumerate(q_lens):
            if q == 1:
                continue
            s = s_lens[b]
            pages: torch.Tensor | None = None
            mask: torch.Tensor | None = None
            all_pages = attn.page_table[b : b + 1, : -(-s // page_size)].long()
            if s > q:
                pages = all_pages
                qi = torch.arange(q, device=device)[:, None]
                mask = torch.arange(s, device=device)[None, :] <= (s - q) + qi
            prefills.append(_PrefillSeq(starts[b], starts[b + 1], pages, s, mask, all_pages))
        slots = attn.slot_mapping
        return SDPAPlan(decode, prefills, starts[-1], slots // page_size, slots % page_size)

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
        kv_stored: bool = False,
        kv_scale: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq*D]``.
        An FP8 cache is dequantized after each gather (``* kv_scale``), and a prompt with
        no cached prefix reads its own K/V back from it too."""
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        fp8 = is_fp8(k_cache)
        if not kv_stored:
            idx = (plan.write_pages, plan.write_offsets)
            if fp8:
                k_cache.index_put_(idx, quantize_kv(k, kv_scale[0]))
                v_cache.index_put_(idx, quantize_kv(v, kv_scale[1]))
            else:  # strided views: writes land in the pool
                k_cache.index_put_(idx, k.to(k_cache.dtype))
                v_cache.index_put_(idx, v.to(v_cache.dtype))
        scales = kv_scale if fp8 else None

        dg = plan.decode
        if dg is not None and dg.rows is None:
            o = self._decode(q, k_cache, v_cache, dg, scale, Hkv, G, scales)
            return o.reshape(T, Hq * D)

        out = q.new_empty(T, Hq, D)
        if dg is not None and dg.rows is not None:  # rows is None only in the return above
            qd = q.index_select(0, dg.rows)
            out.index_copy_(
                0,
                dg.rows,
                self._decode(qd, k_cache, v_cache, dg, scale, Hkv, G, scales).reshape(-1, Hq, D),
            )
        for p in plan.prefills:
            qp = q[p.start : p.end].transpose(0, 1)  # [Hq, q, D]
            if p.pages is None and not fp8:
                kp = k[p.start : p.end].transpose(0, 1)  # [Hkv, q, D]
                vp = v[p.start : p.end].transpose(0, 1)
            else:
                kp = _gather(k_cache, p.all_pages)[0, :, : p.ctx]  # [Hkv, ctx, D]
                vp = _gather(v_cache, p.all_pages)[0, :, : p.ctx]
            kp, vp = _dequant(kp, q.dtype, scales, 0), _dequant(vp, q.dtype, scales, 1)
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
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        dg: _DecodeGroup,
        scale: float,
        Hkv: int,
        G: int,
        scales: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """q ``[Bd, Hq, D]`` -> ``[Bd, Hkv, G, D]`` attended over the gathered pages
        (``scales``: an FP8 cache's ``(k_scale, v_scale)``, None otherwise)."""
        Bd, _, D = q.shape
        kd = _gather(k_cache, dg.pages)  # [Bd, Hkv, max_pages * ps, D]
        vd = _gather(v_cache, dg.pages)
        qd = q.view(Bd, Hkv, G, D)  # GQA: the G query heads of a KV head become G query rows
        return F.scaled_dot_product_attention(
            qd,
            _dequant(kd, q.dtype, scales, 0),
            _dequant(vd, q.dtype, scales, 1),
            attn_mask=dg.mask,
            scale=scale,
        )


def _dequant(
    x: torch.Tensor, dtype: torch.dtype, scales: tuple[float, float] | None, which: int
) -> torch.Tensor:
    """Gathered K (``which`` 0) or V (1) in ``dtype``: an FP8 cache's values times their
    per-tensor scale (``scales``), a plain cache's as they are."""
    if scales is None or scales[which] == 1.0:
        return x.to(dtype)
    return (x.float() * scales[which]).to(dtype)
