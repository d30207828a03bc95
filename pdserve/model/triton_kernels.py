"""Triton kernels of the ``triton`` attention backend: KV store, split-KV paged decode, paged
prefill/extend (varlen, causal, over a cached prefix).

Every kernel reads the cache through explicit strides of ONE layer's K and V views
``[num_pages, page_size, num_kv_heads, head_dim]`` (stride of a page, of a token inside its
page, of a head, of a dim), so any pool order (layer-major or page-major) works in place.
Token ``j`` of sequence ``b`` lives at page ``page_table[b, j // page_size]``, offset
``j % page_size``. Query head ``h`` reads KV head ``h // G`` (``G = Hq // Hkv``).

The kernels keep to the part of Triton's API that both 3.6 (the GPU machine) and 3.9 (the
CPU interpreter under ``TRITON_INTERPRET=1``) have. Algorithms: online softmax of
FlashAttention (Dao et al. 2022, arXiv:2205.14135); split-KV decode with a log-sum-exp merge
of the partial results (FlashDecoding, Dao et al. 2023).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.model.pdl import pdl_enter

# Integer arguments that change from step to step (the page table's row stride = its width
# in pages). Triton compiles a kernel again for an int that is 1, or divisible by 16, or
# neither (~0.8 s per compile on the H200, paid by the request whose step first has that
# width); these are only row offsets, so one compiled variant serves every width. The
# decode kernel's row count (``num_rows``) is only a bound of a masked load; the extend
# kernel's first row (``row0``: the decode rows a mixed step leads with) only an offset.
_PER_STEP_INTS = ("s_tb", "row0")
_DECODE_PER_STEP_INTS = ("s_tb", "num_rows")


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_cp,
    s_ct,
    s_ch,
    s_vcp,
    s_vct,
    s_vch,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per new token: copy its ``[Hkv, D]`` K and V into slot
    ``slot_mapping[t]`` (``page * page_size + offset``); a negative slot (a padded row of a
    captured batch) writes nothing. The last dim of every tensor has stride 1."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot  # a tensor mask (the interpreter
    mask = (h < HKV) & (d < D) & (slots >= 0)  # rejects a scalar one broadcast in)
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=mask)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=mask)
    tl.store(k_cache_ptr + page * s_cp + off * s_ct + h * s_ch + d, k, mask=mask)
    tl.store(v_cache_ptr + page * s_vcp + off * s_vct + h * s_vch + d, v, mask=mask)


@triton.jit
def _attend_block(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    pos,
    nmask,
    visible,
    kvh,
    dd,
    dmask,
    scale,
    s_cp,
    s_ct,
    s_ch,
    s_vcp,
    s_vct,
    s_vch,
    PAGE_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One step of the online softmax over a block of context positions ``pos``
    ``[BLOCK_N]`` (``nmask``: inside the range) of one sequence (``table_row_ptr``: its
    page-table row) and KV head ``kvh``: gather their K and V tiles ``[BLOCK_N, BLOCK_D]``
    through the page table, attend the query rows ``q`` ``[R, BLOCK_D]`` where ``visible``
    ``[R, BLOCK_N]`` and fold the result into ``(acc [R, BLOCK_D], m_i [R], l_i [R])``,
    returned updated. A row that sees nothing keeps ``m`` at 0 and adds nothing."""
    page = tl.load(table_row_ptr + pos // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
    off = (pos % PAGE_SIZE).to(tl.int64)
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(
        k_cache_ptr + page[:, None] * s_cp + off[:, None] * s_ct + kvh * s_ch + dd[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)  # [BLOCK_N, BLOCK_D]; an FP8 cache converted in registers
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr + page[:, None] * s_vcp + off[:, None] * s_vct + kvh * s_vch + dd[None, :],
        mask=kv_mask,
        other=0.0,
    ).to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _decode_tile(
    k_head,
    v_head,
    table_row,
    start,
    hi,
    nn,
    dd,
    dmask,
    s_cp,
    s_ct,
    s_vcp,
    s_vct,
    PAGE_SIZE: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    ALIGNED: tl.constexpr = False,
    EVICT: tl.constexpr = False,
    MASKED: tl.constexpr = True,
):
    """K and V tiles ``[BLOCK_N, BLOCK_D]`` of context positions ``start + nn`` (those at or
    past ``hi`` masked: none read, zeros) of one KV head (``k_head`` / ``v_head``: its base
    in the caches) of the sequence whose page-table row is ``table_row``, in the cache's
    dtype. ``TILE_IN_PAGE``: the tile lies in one
    page (one page-table read), else each position reads its own entry. ``ALIGNED``: every
    token's row of ``BLOCK_D`` dims starts on 16 bytes (the caller checked the bases and
    strides), told to the compiler, which cannot prove it through the page-table read
    (without it every element is a load of its own). ``EVICT``: the tiles are loaded with
    the ``evict_first`` policy (KV is read once a step: it need not stay in L2).
    ``MASKED`` False: the caller knows every position is below ``hi`` and ``BLOCK_D == D``:
    no K/V load is predicated (nor, with ``TILE_IN_PAGE``, the page-table read)."""
    pos = start + nn
    nmask = pos < hi
    kv_mask = nmask[:, None] & dmask[None, :]
    if TILE_IN_PAGE and not MASKED:
        page = tl.load(table_row + start // PAGE_SIZE).to(tl.int64)
        off = (start % PAGE_SIZE + nn).to(tl.int64)
        k_rows = k_head + page * s_cp + off * s_ct
        v_rows = v_head + page * s_vcp + off * s_vct
    elif TILE_IN_PAGE:
        page = tl.load(table_row + start // PAGE_SIZE, mask=start < hi, other=0).to(tl.int64)
        off = (start % PAGE_SIZE + nn).to(tl.int64)
        k_rows = k_head + page * s_cp + off * s_ct
        v_rows = v_head + page * s_vcp + off * s_vct
    else:
        pages = tl.load(table_row + pos // PAGE_SIZE, mask=nmask, other=0).to(tl.int64)
        off = (pos % PAGE_SIZE).to(tl.int64)
        k_rows = k_head + pages * s_cp + off * s_ct
        v_rows = v_head + pages * s_vcp + off * s_vct
    k_ptrs = k_rows[:, None] + dd[None, :]
    v_ptrs = v_rows[:, None] + dd[None, :]
    if ALIGNED:  # row starts on 16 bytes, runs of >= 16 contiguous dims
        k_ptrs = tl.max_contiguous(tl.multiple_of(k_ptrs, [16, 16]), [1, 16])
        v_ptrs = tl.max_contiguous(tl.multiple_of(v_ptrs, [16, 16]), [1, 16])
    if not MASKED:  # the caller knows every position is inside: no predicates
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    elif EVICT:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0, eviction_policy="evict_first")
    else:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _decode_fold(
    q,
    k,
    v,
    acc,
    m_i,
    l_i,
    nmask,
    scale,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr = 0,
    MASKED: tl.constexpr = True,
    VMUL: tl.constexpr = False,
    v_mul=1.0,
):
    """One online-softmax step of the decode kernel: the query rows ``q [BLOCK_H, BLOCK_D]``
    against the tiles ``k`` / ``v`` (positions where ``nmask``), folded into ``(acc, m_i,
    l_i)``, returned updated. The tiles are converted to q's dtype here (an FP8 cache in
    registers). ``MASKED`` False: every position is inside (no select on the scores).
    ``WIDEN`` (a bit mask, 1: V, 2: K; for an 8-bit cache): the tile is
    converted before it is laid out for the dot (a select on the mask in between: Triton
    otherwise moves its layout change ahead of the conversion, through shared memory in
    bytes, where V, read across its token rows, is loaded one byte an instruction).
    ``VMUL``: V is converted, then multiplied by the runtime scalar ``v_mul`` (the caller
    passes 1.0: exact, the same values) before its layout change: the same effect as
    ``WIDEN`` bit 1 without a select an element (a packed 16-bit multiply a pair of values
    instead), so whole tiles (``MASKED`` False) keep it too."""
    if WIDEN & 2:
        k = tl.where(nmask[:, None], k.to(q.dtype), 0.0).to(q.dtype)
    else:
        k = k.to(q.dtype)
    if VMUL:
        v = v.to(q.dtype) * tl.cast(v_mul, q.dtype)
    elif WIDEN & 1:
        v = tl.where(nmask[:, None], v.to(q.dtype), 0.0).to(q.dtype)
    else:
        v = v.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
    else:
        s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _decode_fold_fma(q, k, v, acc, m_i, l_i, nmask, scale):
    """:func:`_decode_fold` without tensor cores: ``q`` ``[BLOCK_H, BLOCK_D]`` fp32 (only
    the G heads, no padding to a dot's 16 rows) against the tiles converted to fp32, the
    scores and ``p @ v`` as broadcast products summed in fp32 (no shared-memory layout
    change for the dots)."""
    kf = k.to(tl.float32)
    vf = v.to(tl.float32)
    s = tl.sum(q[:, None, :] * kf[None, :, :], 2)  # [BLOCK_H, BLOCK_N]
    s = tl.where(nmask[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vf[None, :, :], 1)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=_DECODE_PER_STEP_INTS)
def decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    scale,
    v_mul,
    s_qt,
    s_qh,
    s_cp,
    s_ct,
    s_ch,
    s_vcp,
    s_vct,
    s_vch,
    s_tb,
    s_ob,
    s_oh,
    s_os,
    s_lb,
    s_lh,
    s_tt,
    s_th,
    num_rows,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BALANCE_PROGRAMS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    IEEE: tl.constexpr,
    F16_DOT: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    ALIGNED: tl.constexpr = False,
    WIDEN: tl.constexpr = 0,
    FMA: tl.constexpr = False,
    UNROLL: tl.constexpr = 1,
    EVICT: tl.constexpr = False,
    EVEN: tl.constexpr = False,
    VMUL: tl.constexpr = False,
):
    """Grid ``(B, Hkv, NUM_SPLITS)``: the ``G`` query heads of one KV head of sequence ``b``
    (one query token each; K/V read once for the group) over split ``s`` of its context.

    The split length is derived from ``seq_lens[b]`` on the device (so a captured graph
    stays valid for any length): ``cdiv(seq_len, NUM_SPLITS)`` rounded up to ``BLOCK_N``,
    at least ``MIN_SPLIT`` tokens (a multiple of ``BLOCK_N``; 0: no floor), so a short
    context leaves its later splits empty. With ``BALANCE_PROGRAMS > 0`` a split also
    covers at least ``cdiv(total * Hkv, BALANCE_PROGRAMS)`` tokens (rounded up to
    ``BLOCK_N``), ``total`` the sum of the ``num_rows`` contexts (read by every program,
    ``BLOCK_B`` at a time: one compiled variant for every batch size): the batch's KV is
    cut into about ``BALANCE_PROGRAMS`` equal pieces whatever its lengths, so one long row
    among short ones is spread over all ``NUM_SPLITS`` programs while a uniform batch gets
    the same splits as without it. With ``NUM_SPLITS == 1`` the program writes the
    normalised output ``out[b, h, :]`` (q's dtype) itself and no merge runs; otherwise the
    partial output ``mid_o[b, h, s, :]`` (fp32) and its log-sum-exp ``mid_lse[b, h, s]``
    (``-inf`` for an empty split). ``TILE_IN_PAGE`` (``PAGE_SIZE % BLOCK_N == 0``): every
    tile lies inside one page (splits start at multiples of ``BLOCK_N``), so a tile reads
    one page-table entry; else each position reads its own. A row of context 0 (a padded
    row) outputs 0. K and V of a tile are both loaded before its first dot, so their
    memory latencies overlap. ``PREFETCH``: the next tile's page-table entry and K/V are
    loaded (into registers) before this tile's dots, so a program always has one tile in
    flight while it computes (else a tile's page-table read, then its K/V, then its math
    run one after the other: Triton's pipeliner keeps one shared-memory buffer for this
    loop whatever ``num_stages`` is, as its sm_90 build shows). ``F16_DOT`` (an e4m3 cache
    under bf16 queries): q is taken to fp16 (saturated to its range) and the tiles are
    converted to fp16, not bf16, for the dots: e4m3 -> fp16 is one packed conversion a
    pair of values (-> bf16 two more, each through fp16), fp16 holds every e4m3 value and
    a bf16 q in [2^-14, 65504] exactly, and p in fp16 keeps 3 more bits than in bf16.
    ``ALIGNED``: every token's K/V row starts on 16 bytes (bases and strides checked by the
    caller), so a thread loads 16 bytes at once (the compiler cannot see it through the
    page table: else one load an element, as Triton 3.9's sm_90 build shows). ``WIDEN``: see
    :func:`_decode_fold`. ``FMA``: the scores and the output by fp32 products and sums
    instead of dots (:func:`_decode_fold_fma`; ``BLOCK_H`` may then be G itself).
    ``UNROLL`` (> 1, without ``PREFETCH``): the tile loop unrolled that many times
    (``tl.range``'s ``loop_unroll_factor``), so the compiler may issue a later tile's loads
    before an earlier one's math without the registers of an explicit prefetch; ``EVICT``:
    see :func:`_decode_tile`. ``EVEN`` (without ``PREFETCH`` / ``FMA``; the caller passes it
    only when ``D == BLOCK_D``): the split's whole tiles run without masks (no
    predicated loads, no select on the scores: the mask logic is a large share of an e4m3
    tile's instructions, as Triton 3.6's sm_90 build shows), its last partial tile with them;
    the same arithmetic (the interpreter gives the same bits), though the H200's compiled
    loop rounds differently (within one bf16 step: ``triton_backend.FP8_KV_EVEN``). ``VMUL`` (an 8-bit cache; ``v_mul`` 1.0): each V
    tile converted to q's dtype and multiplied by ``v_mul`` in registers, in the layout it was
    loaded in (each token's row of D values contiguous, coalesced), before Triton lays it out
    for the ``p @ v`` dot (see :func:`_decode_fold`): the tile then reaches the dot through
    shared memory in 16 bits, read back by ``ldmatrix``'s transposing form, where an 8-bit
    tile is read back one byte an instruction (the dot's operand wants pairs of tokens of one
    dim, which lie a token's row apart); the same values, so the same bits."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    if BALANCE_PROGRAMS > 0:
        total = tl.zeros([BLOCK_B], tl.int32)
        for r0 in range(0, num_rows, BLOCK_B):
            bb = r0 + tl.arange(0, BLOCK_B)
            total += tl.load(seq_lens_ptr + bb, mask=bb < num_rows, other=0).to(tl.int32)
        total = tl.sum(total, 0)
        chunk = tl.cdiv(total.to(tl.int64) * tl.num_programs(1), BALANCE_PROGRAMS).to(tl.int32)
        per_split = tl.maximum(per_split, tl.cdiv(chunk, BLOCK_N) * BLOCK_N)
    if MIN_SPLIT > 0:
        per_split = tl.maximum(per_split, MIN_SPLIT)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    nn = tl.arange(0, BLOCK_N)
    heads = kvh * G + hh
    hmask = hh < G
    dmask = dd < D
    q = tl.load(
        q_ptr + b * s_qt + heads[:, None] * s_qh + dd[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if FMA:
        q = q.to(tl.float32)
    elif F16_DOT:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = table_ptr + b * s_tb
    k_head = k_cache_ptr + kvh * s_ch
    v_head = v_cache_ptr + kvh * s_vch
    if PREFETCH:  # the next tile's loads are issued before this tile's math
        k, v = _decode_tile(
            k_head, v_head, table_row, lo, hi, nn, dd, dmask, s_cp, s_ct, s_vcp, s_vct,
            PAGE_SIZE, TILE_IN_PAGE, ALIGNED, EVICT,
        )  # fmt: skip
        for start in range(lo, hi, BLOCK_N):
            k_next, v_next = _decode_tile(
                k_head, v_head, table_row, start + BLOCK_N, hi, nn, dd, dmask, s_cp, s_ct,
                s_vcp, s_vct, PAGE_SIZE, TILE_IN_PAGE, ALIGNED, EVICT,
            )  # fmt: skip
            if FMA:
                acc, m_i, l_i = _decode_fold_fma(q, k, v, acc, m_i, l_i, (start + nn) < hi, scale)
            else:
                acc, m_i, l_i = _decode_fold(
                    q, k, v, acc, m_i, l_i, (start + nn) < hi, scale, IEEE, WIDEN, True, VMUL,
                    v_mul,
                )  # fmt: skip
            k, v = k_next, v_next
    elif EVEN and not FMA:  # whole tiles without masks, then the last partial one with them
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, full, BLOCK_N):
            k, v = _decode_tile(
                k_head, v_head, table_row, start, hi, nn, dd, dmask, s_cp, s_ct, s_vcp, s_vct,
                PAGE_SIZE, TILE_IN_PAGE, ALIGNED, EVICT, False,
            )  # fmt: skip
            acc, m_i, l_i = _decode_fold(
                q, k, v, acc, m_i, l_i, (start + nn) < hi, scale, IEEE, WIDEN, False, VMUL, v_mul
            )
        if full < hi:
            k, v = _decode_tile(
                k_head, v_head, table_row, full, hi, nn, dd, dmask, s_cp, s_ct, s_vcp, s_vct,
                PAGE_SIZE, TILE_IN_PAGE, ALIGNED, EVICT,
            )  # fmt: skip
            acc, m_i, l_i = _decode_fold(
                q, k, v, acc, m_i, l_i, (full + nn) < hi, scale, IEEE, WIDEN, True, VMUL, v_mul
            )
    elif UNROLL > 1:
        for start in tl.range(lo, hi, BLOCK_N, loop_unroll_factor=UNROLL):
            k, v = _decode_tile(
                k_head, v_head, table_row, start, hi, nn, dd, dmask, s_cp, s_ct, s_vcp, s_vct,
                PAGE_SIZE, TILE_IN_PAGE, ALIGNED, EVICT,
            )  # fmt: skip
            if FMA:
                acc, m_i, l_i = _decode_fold_fma(q, k, v, acc, m_i, l_i, (start + nn) < hi, scale)
            else:
                acc, m_i, l_i = _decode_fold(
                    q, k, v, acc, m_i, l_i, (start + nn) < hi, scale, IEEE, WIDEN, True, VMUL,
                    v_mul,
                )  # fmt: skip
    else:
        for start in range(lo, hi, BLOCK_N):
            k, v = _decode_tile(
                k_head, v_head, table_row, start, hi, nn, dd, dmask, s_cp, s_ct, s_vcp, s_vct,
                PAGE_SIZE, TILE_IN_PAGE, ALIGNED, EVICT,
            )  # fmt: skip
            if FMA:
                acc, m_i, l_i = _decode_fold_fma(q, k, v, acc, m_i, l_i, (start + nn) < hi, scale)
            else:
                acc, m_i, l_i = _decode_fold(
                    q, k, v, acc, m_i, l_i, (start + nn) < hi, scale, IEEE, WIDEN, True, VMUL,
                    v_mul,
                )  # fmt: skip
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    res = acc / l_safe[:, None]
    omask = hmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * s_tt + heads[:, None] * s_th + dd[None, :],
            res.to(out_ptr.dtype.element_ty),
            mask=omask,
        )
    else:
        lse = tl.where(hi > lo, m_i + tl.log(l_safe), float("-inf"))
        some = (tl.zeros([BLOCK_H], tl.int32) + hi - lo) > 0  # an empty split writes no
        tl.store(  # partial output (the merge skips it by its lse)
            mid_o_ptr + b * s_ob + heads[:, None] * s_oh + split * s_os + dd[None, :],
            res,
            mask=omask & some[:, None],
        )
        tl.store(mid_lse_ptr + b * s_lb + heads * s_lh + split, lse, mask=hmask)


@triton.jit
def decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    s_ob,
    s_oh,
    s_os,
    s_lb,
    s_lh,
    s_tb,
    s_th,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(B, Hq)``: merge the splits' partial outputs by their log-sum-exp weights into
    ``out[b, h, :]`` (q's dtype). A row whose splits are all empty (a padded row) gets 0.
    An empty split's partial output is not read (its memory holds anything)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    smask = ss < NUM_SPLITS
    lse = tl.load(mid_lse_ptr + b * s_lb + h * s_lh + ss, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe))  # [BLOCK_S]
    o = tl.load(
        mid_o_ptr + b * s_ob + h * s_oh + ss[:, None] * s_os + dd[None, :],
        mask=(smask & (lse != float("-inf")))[:, None] & (dd[None, :] < D),
        other=0.0,
    )
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * s_tb + h * s_th + dd, res.to(out_ptr.dtype.element_ty), mask=dd < D)


@triton.jit(do_not_specialize=_PER_STEP_INTS)
def extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    table_ptr,
    qsl_ptr,
    seq_lens_ptr,
    scale,
    s_qt,
    s_qh,
    s_cp,
    s_ct,
    s_ch,
    s_vcp,
    s_vct,
    s_vch,
    s_tb,
    s_ot,
    s_oh,
    row0,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(B, Hq, cdiv(max_q_len, BLOCK_M))``: query rows ``m`` of sequence
    ``b = row0 + program_id(0)`` (its new tokens, at positions ``seq_len - q_len + m``)
    against every cached position up to their own (causal with the cached prefix before
    it). K/V of the new tokens are already in the cache. Output ``out[t, h, :]`` in q's
    dtype. ``row0`` skips a mixed step's leading decode rows (an offset, not sliced views:
    a view that starts at an odd row is another pointer alignment, so another compile)."""
    pdl_enter(PDL)
    b = row0 + tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q0 = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q0
    if mb * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        prefix = seq_len - q_len
        kvh = h // G
        mm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        dd = tl.arange(0, BLOCK_D)
        mmask = mm < q_len
        dmask = dd < D
        q = tl.load(
            q_ptr + (q0 + mm)[:, None] * s_qt + h * s_qh + dd[None, :],
            mask=mmask[:, None] & dmask[None, :],
            other=0.0,
        )
        qpos = prefix + mm  # absolute position of each query row
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)  # last row's causal bound
        nn = tl.arange(0, BLOCK_N)
        for start in range(0, hi, BLOCK_N):
            pos = start + nn
            nmask = pos < hi
            causal = (pos[None, :] <= qpos[:, None]) & nmask[None, :]
            acc, m_i, l_i = _attend_block(
                q,
                acc,
                m_i,
                l_i,
                k_cache_ptr,
                v_cache_ptr,
                table_ptr + b * s_tb,
                pos,
                nmask,
                causal,
                kvh,
                dd,
                dmask,
                scale,
                s_cp,
                s_ct,
                s_ch,
                s_vcp,
                s_vct,
                s_vch,
                PAGE_SIZE,
                IEEE,
            )
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + (q0 + mm)[:, None] * s_ot + h * s_oh + dd[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None] & dmask[None, :],
        )
