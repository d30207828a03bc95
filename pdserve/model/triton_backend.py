"""``triton`` attention backend: our own paged kernels (``triton_kernels.py``), CUDA-graph safe.

A step is planned once (outside the model's forward). A decode-only step runs the split-KV
decode kernel and, with more than one split, its merge; any other step (prefill, chunked
prefill over a cached prefix) runs the varlen extend kernel. A mixed step (decode rows
first, as the scheduler orders a batch, then prefill chunks) runs both: the leading
one-token rows through the decode kernel, the rest through the extend kernel. The extend
kernel pads every row's queries to a tile of ``_EXTEND_BLOCK_M`` and reads K/V once per
query head, so a decode row there costs about 64 x its compute and G x its KV reads; with
long contexts that made a mixed step (rows that decode beside a later prompt's chunk)
several times slower than the chunk alone. Both read K/V in place from the paged cache,
through its strides; this step's K/V are stored first by the store kernel, or, on CUDA,
by the model's RoPE kernel (``fused_ops.rope_store_kv``: one kernel a layer fewer, for
an FP8 cache five fewer, its quantization in that kernel; ``forward(..., kv_stored=True)``).

CUDA graphs: :meth:`TritonBackend.plan_for_capture` builds a decode plan whose launch shapes
depend only on the batch size and the context bound it is captured for (the split count is
fixed per graph; each program derives its range from ``seq_lens`` on the device, for long
contexts from the batch's total too: ``decode_config``), so a graph captured over static
buffers stays valid for any context length that fits the page table. Padded rows carry
slot ``-1`` (the store writes nothing) and ``seq_len`` 0 (their output is 0).

Runs on CUDA, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from pdserve.model import decode_attn_table, pdl
from pdserve.model.attention import AttentionBackend, AttentionMetadata, is_fp8, quantize_kv
from pdserve.model.triton_kernels import (
    decode_merge_kernel,
    decode_split_kernel,
    extend_kernel,
    store_kv_kernel,
)

# The rules of decode_rule whose e4m3 decode takes the kernel's F16_DOT under bf16 queries
# (dots in fp16: one packed conversion a pair of values instead of three). H200, one layer,
# µs (docs/figures/h200_s7/fp8kv.json, 16-byte loads on, 4 warps): bf16 dots / fp16 dots
# 5.5 / 5.3 at 1 x 200 ("split"), 15.9 / 15.2 at 1 x 8,192 and 123.8 / 124.3 at 32 x 4,096
# ("long": with 2 warps, below, 96.3), but 18.4 / 20.8 at 64 x 200 ("one": left out).
FP8_KV_F16_DOTS: frozenset[str] = frozenset({"split", "long"})
# The decode kernel's ALIGNED (each token's K/V row loaded 16 bytes a thread, where
# :func:`kv_rows_aligned` holds) for an e4m3 cache and for a 16-bit one. Triton 3.9's sm_90
# build of the kernel without it loads one element an instruction (it cannot tell that a
# row read through the page table starts on 16 bytes) and spills registers; Triton 3.6's
# (the H200's) runs the same either way (fp8kv.json: 123.1 vs 123.8 µs at 32 x 4,096, 18.0
# vs 18.4 at 64 x 200, 5.5 and 15.9 both at 1 x 200 and 1 x 8,192; bf16 144.9 vs 144.8).
# On for e4m3, where it is part of every configuration measured faster; off for bf16.
FP8_KV_ALIGNED_LOADS = True
KV16_ALIGNED_LOADS = False
# The rules of decode_rule (among FP8_DECODE_TILES') whose e4m3 decode runs a split's whole
# tiles without masks (DecodeConfig.even). Session 10 (h200_s10/fp8kv.json: one step's 32
# layers on a page-major pool, 32 x 4,096, µs a layer, each compiled kernel's registers
# beside): the (64, 2, 2) tiles 95.1 (238 registers, 4 programs an SM; bf16 138.1) against
# 19 variants, none faster by more than 1 %: the tile loop unrolled 2 / 4 times 102.4 /
# 173.8, prefetch at 64 / 32 / 16 tokens 389.5 (spills) / 141.7 / 174.3, evict-first loads
# 95.0, 1 / 3 stages 126.1 / 98.0, 32-token tiles of 1 warp 110.8 (12 programs an SM),
# 128-token tiles 94.2, 512 / 2,048 pieces 94.1 / 99.4 (the engine's step 6.296 vs 6.327
# ms: not taken). Triton 3.6's sm_90 build issues about as many instructions a 64-token
# tile as the bf16 cache's (2 warps x 2,152 against 4 x 1,152) for half its bytes, an
# eighth of them the masks' selects and predicates, which "even" drops. Session 13
# (scripts/gpu_s10_fp8kv2.sh, h200_s13/fp8kv2.json): "long" with even 92.7 against 95.2 µs
# a layer (5 interleaved rounds, every one lower; 255 registers against 238, still 4
# programs an SM), the FP8 + e4m3-KV engine's 32 x 4,096 all-decoding step 6.244 against
# 6.329 ms (0.987; 3 of 3 paired rounds faster). Not the same bits on the H200 (the
# interpreter's are: tests/model/test_fp8_attention.py): the compiled maskless loop rounds
# differently, the attention output within 3e-3 of the masked loop's (one bf16 step), and
# the random-weight engine's greedy tokens part after a median 4 of 8 (4 of 32 rows whole),
# as any change of rounding does with near-tied random logits. Prefill and decode, PD and
# mixed, run the same kernel, so PD's exactness holds. The bf16 cache's "long" decode is
# 1.8 % faster with even too (133.5 vs 136.0 µs): not taken without an engine check.
FP8_KV_EVEN: frozenset[str] = frozenset({"long"})
# The rules of decode_rule whose 16-bit-cache decode runs whole tiles without masks
# (DecodeConfig.even, as FP8_KV_EVEN for an e4m3 cache). Session 13 (h200_s13/kv16even.json,
# ENGINE_ARGS="--quantization none --kv-dtype auto" with scripts/gpu_s10_fp8kv2.sh): "long"
# 133.5 against 136.0 µs a layer at 32 x 4,096 alone (5 rounds, each lower; 125 registers
# against 88: 4 programs an SM instead of 5), the bf16 engine's 32 x 4,096 all-decoding step
# 8.904 against 9.011 ms (0.988, 3 of 3 paired rounds faster). Not the same bits on the
# H200 (output within 1.5e-3 of the masked loop's; the random-weight engine's 8 greedy
# tokens part after a median 7, 15 of 32 rows whole), as for FP8_KV_EVEN.
KV16_EVEN: frozenset[str] = frozenset({"long"})
# The rules of decode_rule (among FP8_DECODE_TILES') whose e4m3 decode converts each V tile
# to 16 bits in registers, in the coalesced layout it was loaded in, before its layout change
# for the p @ v dot (DecodeConfig.vmul: the same bits). Why: the dot's B operand wants pairs
# of tokens of one dim, which lie a token's row apart; an 8-bit V tile goes through shared
# memory in bytes and Triton 3.6 reads it back one byte an instruction (LDS.U8), then packs
# the bytes; a 16-bit tile is read back by ldmatrix's transposing form (no cache layout
# change needed). Triton 3.6's sm_90 build (scripts/sm90_build_check.py --decode with
# triton==3.6.0, the long rule's (8, 64, 2, 2) tiles with fp16 dots and 16-byte loads):
# instructions in a 64-token tile's loop, one warp's: 1,209 -> 984 (1,049 -> 957 with even's
# whole tiles), registers 238 -> 184 (255 -> 168 with even), shared memory 22.5 -> 38 KB:
# 5 programs an SM instead of 4; no LDS.U8 left (128 a tile before), 64 HMUL2 added (the
# multiply by 1.0 that keeps the conversion ahead of the layout change; WIDEN's select an
# element instead cost 1,223). Measured on the H200 in session 13 (scripts/gpu_s11_fp8v.sh,
# h200_s13/fp8v.json, 32 x 4,096, µs a layer): vmul 103.4 against 95.8 (the fewer
# instructions do not pay for the 16-bit tile's shared memory: 5 programs an SM by
# registers, 5 by shared memory), its best form (32-token tiles of 1 warp) 99.6, with even
# 113.0; the engine's step 6.640 against 6.362 ms (0 of 3 paired rounds faster; greedy
# identical): not taken.
FP8_KV_VMUL: frozenset[str] = frozenset()

# The extend kernel's tiles.
_EXTEND_BLOCK_M = 64
_EXTEND_BLOCK_N = 64
# Splits of a decode step: about 8 programs per SM of an H200 (132 SMs) for latency hiding,
# at most 32 splits (``capture_reserve_bytes`` counts scratch for 32).
_TARGET_PROGRAMS = 1024
_MAX_SPLITS = 32
# The longest context (tokens) a large decode batch runs as one split (see decode_config),
# and the context bound every captured batch size gets a graph of its own for.
ONE_SPLIT_MAX_CONTEXT = 1024
# Long contexts: programs launched at most per step when the lengths are not known (a
# graph), so that one long row among short ones can still take up to 32 splits; the
# kernel cuts the batch's KV into about _TARGET_PROGRAMS pieces on the device.
_BALANCED_LAUNCH = 2048
# Context lengths each balanced program sums at a time (a loop: one compiled variant for
# every batch size).
_BALANCE_BLOCK_B = 64
# An e4m3 cache's decode tiles, by the rule decode_config used: "split" (short contexts,
# more than one split), "one" (short contexts, one split, large batches), "long" (the
# balanced rule) -> (block_n, num_warps, num_stages) in place of the bf16 cache's; a rule
# not listed keeps them. A tile of block_n tokens reads half the bytes in e4m3, so it may
# want more tokens a tile (scripts/gpu_fp8_attn_probe.py --kernel-variants times the
# candidates). "long": 64 tokens, 2 warps (the bf16 cache's 4 hold twice the threads for
# half the bytes). H200, one layer, µs, fp16 dots and 16-byte loads (h200_s7/fp8kv.json):
# 32 x 4,096 (8 splits) 96.3 (2,788 GB/s) against 124.3 with 4 warps, 130.4 with 8, 110.1
# with 128-token tiles, 144.9 with the next tile prefetched, 124.9 with twice the pieces
# (the e4m3 default before: 123.1; the bf16 cache: 144.9); 1 x 8,192 15.0 against 15.2
# (128-token tiles 14.2; before 15.9). "one": 2 warps took 15.0 against 18.0 at 64 x 200,
# the only bucket measured: not listed. "split" (1 x 200): 2 warps 6.0 against 5.3.
# A value may add (widen, fma): DecodeConfig's fields of those names (both off if absent).
# Session 8 (h200_s8/attn.json: one step's 32 layers on a page-major pool, 32 x 4,096, µs a
# layer): the (64, 2, 2) tiles 95.4 / 95.5 (2.81 TB/s of KV read; the bf16 cache 134.7,
# 3.99 TB/s); widen V 126.8 (Triton 3.6 builds it slower, though 3.9's sm_90 build drops
# V's byte loads from shared memory), widen K and V 151.1, 4 warps + widen 121.2, 32-token
# tiles 94.9 (the engine's step 6.212 vs 6.220 ms: noise), 1 warp + 32 + widen 96.8, 768 /
# 2,048 pieces 116.2 / 115.5 (+ widen 130.5), 128-token tiles of 4 warps + widen 111.2,
# fma (16-token tiles, 4 warps) 903.7: nothing kept.
FP8_DECODE_TILES: dict[str, tuple[int, ...]] = {"long": (64, 2, 2)}


def kv_rows_aligned(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether every token's row of K and V (``[P, page_size, Hkv, D]`` views, dim stride 1)
    starts on 16 bytes: both bases and the page, token and head strides (in bytes) are
    multiples of 16 (the decode kernel's ``ALIGNED`` then holds for every page the table
    names)."""
    for t in (k_cache, v_cache):
        size = t.element_size()
        if t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:3]):
            return False
    return True


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the split-KV decode kernel for one step.

    splits: programs per (row, KV head), 1..32 (1: the kernel writes the output, no merge);
    block_n: context tokens a program reads per iteration (a power of two >= 16);
    num_warps / num_stages: Triton launch options; min_split: fewest tokens a split covers
    (a multiple of ``block_n``; 0: none), so short contexts leave later splits empty;
    balance: 0, or the number of equal pieces the kernel cuts the batch's whole KV into
    (a split then covers at least ``total context * Hkv / balance`` tokens, computed on the
    device from ``seq_lens``: ``decode_split_kernel``'s ``BALANCE_PROGRAMS``); prefetch: the
    kernel loads the next tile before this one's math (``decode_split_kernel``'s
    ``PREFETCH``); widen: which tiles of an 8-bit cache are converted before their layout
    change for the dots (bit 1: V, bit 2: K; ``WIDEN``); fma: scores and output by fp32
    products and sums instead of dots, over the G query heads only (``FMA``); unroll: the
    tile loop unrolled that many times (``UNROLL``; 1: not); evict: K/V loaded with the
    ``evict_first`` policy (``EVICT``); even: a split's whole tiles without masks, its last
    partial one with them (``EVEN``, where the head dim is a power of two; the same
    arithmetic, not the same bits on the H200: see ``FP8_KV_EVEN``);
    vmul: an 8-bit cache's V tiles converted to 16 bits in registers before their layout
    change for the ``p @ v`` dot (``VMUL``; ignored for a 16-bit cache; the same bits)."""

    splits: int
    block_n: int
    num_warps: int
    num_stages: int
    min_split: int = 0
    balance: int = 0
    prefetch: bool = False
    widen: int = 0
    fma: bool = False
    unroll: int = 1
    evict: bool = False
    even: bool = False
    vmul: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.splits <= _MAX_SPLITS:
            raise ValueError(f"splits: {self.splits} is outside 1..{_MAX_SPLITS}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n: {self.block_n} is not a power of two >= 16")
        if self.min_split < 0 or self.min_split % self.block_n:
            raise ValueError(f"min_split: {self.min_split} is not a multiple of {self.block_n}")
        if self.balance < 0:
            raise ValueError(f"balance: {self.balance} is negative")
        if not 0 <= self.widen <= 3:
            raise ValueError(f"widen: {self.widen} is not a mask of bits 1 (V) and 2 (K)")
        if self.unroll not in (1, 2, 4):
            raise ValueError(f"unroll: {self.unroll} is not 1, 2 or 4")


@dataclass(frozen=True)
class DecodePicks:
    """The measured picks of :mod:`pdserve.model.decode_attn_table` for one device and
    head shape. short: ``((largest B * Hkv, DecodeConfig), ...)`` ascending, for contexts
    up to ``ONE_SPLIT_MAX_CONTEXT`` and ``B * Hkv >= short_min`` (empty: the rule);
    long_prefetch: the balanced long-context configurations prefetch the next tile."""

    short: tuple[tuple[int, DecodeConfig], ...] = ()
    long_prefetch: bool = False
    short_min: int = 0
    fp8_one: tuple[tuple[int, tuple[int, int, int]], ...] = ()

    def fp8_one_tile(self, rows: int) -> tuple[int, int, int] | None:
        """An e4m3 cache's ``(block_n, num_warps, num_stages)`` for a one-split short-context
        step of ``rows`` = ``B * Hkv`` (``fp8_one``: the entry with the largest least not
        above ``rows``); None below the first (or none listed)."""
        tile = None
        for least, t in self.fp8_one:
            if rows >= least:
                tile = t
        return tile


NO_PICKS = DecodePicks()


@functools.cache
def _cuda_picks(index: int, group: int, head_dim: int) -> DecodePicks:
    key = (torch.cuda.get_device_name(index), group, head_dim)
    least, entries = decode_attn_table.SHORT.get(key, (0, ()))
    short = tuple((n, DecodeConfig(*c)) for n, c in entries)
    fp8_one = decode_attn_table.FP8_ONE.get(key, ())
    return DecodePicks(short, key in decode_attn_table.LONG_PREFETCH, least, fp8_one)


def device_picks(device: torch.device, group: int, head_dim: int) -> DecodePicks:
    """The measured decode picks for ``device`` (a CUDA device's name, read once a
    process) and heads of ``group`` query heads per KV head of ``head_dim``;
    :data:`NO_PICKS` for a device or shape the table does not list (and off CUDA)."""
    if device.type != "cuda":
        return NO_PICKS
    return _cuda_picks(device.index if device.index is not None else 0, group, head_dim)


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int | None) -> int:
    """Split count of a decode step: ``B * Hkv * splits`` near 1024 programs (about 8 per SM
    of an H200's 132, so loads of one program overlap another's math), at most 32, no more
    splits than ``max_seq_len`` has blocks of 64 tokens when that bound is known (eager
    steps); a captured graph passes ``None``."""
    splits = max(1, min(_MAX_SPLITS, -(-_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))))
    if max_seq_len is not None:
        splits = max(1, min(splits, -(-max_seq_len // 64)))
    return splits


def decode_config(
    num_seqs: int,
    num_kv_heads: int,
    page_size: int,
    max_seq_len: int | None,
    total_context: int | None = None,
    picks: DecodePicks = NO_PICKS,
) -> DecodeConfig:
    """The decode kernel's configuration for ``num_seqs`` rows (``max_seq_len``: the longest
    context of an eager step, or the bound a graph is captured for; ``None``: a graph for
    any context; ``total_context``: the sum of an eager step's contexts, else ``None``;
    ``picks``: the device's measured picks, :func:`device_picks`).

    Measured picks first: short contexts at ``B * Hkv >= picks.short_min`` take the entry
    of ``picks.short`` whose bound holds ``B * Hkv`` (past the last: the last), and the
    long-context configurations prefetch when ``picks.long_prefetch``; else the rule below.

    Short contexts (``max_seq_len <= ONE_SPLIT_MAX_CONTEXT``): splits as
    :func:`num_decode_splits`; 64-token tiles, 4 warps, 2 stages; once the rows alone make
    256 programs or more (``B * Hkv``, batch 32 and up at 8 KV heads) one split of 3 stages
    and no merge. These tiles, warps and stages were the fastest of a sweep on the H200
    (docs/benchmarks.md, "Notes moved from model/server/router docstrings"); a merge fused
    into the split kernel was slower in every case, so the merge stays a kernel of its own.

    Long or unknown contexts: the splits follow the batch's context lengths, so that every
    SM streams KV however the lengths are spread. The kernel cuts the batch's KV (``total *
    Hkv`` token-heads) into about 1024 equal pieces (``balance``) of at least 64 tokens (256
    from 256 rows x KV heads, where the rows alone fill the SMs), and a row takes as many
    splits as its length needs, up to ``splits``. An eager step knows its lengths:
    ``splits`` = the longest row's pieces, no program launched empty. A graph does not:
    ``splits`` = up to 2048 programs launched (``B * Hkv * splits``), at most 32 and at
    most the bound's pieces of 64 tokens; a uniform batch then gets the same split length
    as an eager step, and one long row among short ones up to 32 splits instead of the
    few that the batch size alone would give it. The bounds a graph is captured for:
    :meth:`TritonBackend.capture_context_bounds`."""
    rows = num_seqs * num_kv_heads
    large = rows >= 256
    if max_seq_len is not None and max_seq_len <= ONE_SPLIT_MAX_CONTEXT:
        if picks.short and rows >= picks.short_min:
            return next((c for n, c in picks.short if rows <= n), picks.short[-1][1])
        if large:
            return DecodeConfig(1, 64, 4, 3)
        return DecodeConfig(num_decode_splits(num_seqs, num_kv_heads, max_seq_len), 64, 4, 2)
    floor = 256 if large else 64
    if max_seq_len is not None and total_context is not None:
        piece = max(floor, -(-total_context * num_kv_heads // _TARGET_PROGRAMS))
        piece = -(-piece // 64) * 64
        splits = max(1, min(_MAX_SPLITS, -(-max_seq_len // piece)))
    else:
        splits = max(1, min(_MAX_SPLITS, _BALANCED_LAUNCH // max(1, rows)))
        if max_seq_len is not None:
            splits = max(1, min(splits, -(-max_seq_len // 64)))
    return DecodeConfig(
        splits, 64, 4, 2, floor if large else 0, _TARGET_PROGRAMS, picks.long_prefetch
    )


def eager_config(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` (an eager step's :func:`decode_config`) with its split count rounded up to a
    power of two (1..32). ``NUM_SPLITS`` is a compile-time constant of the decode and merge
    kernels, and an eager step's count follows its rows and longest context (1 decode row
    of 512..640 tokens: 8, 9 or 10 splits), so each new count compiled both kernels while
    serving (~0.3-1.5 s on the H200). Rounded, an eager step runs one of
    :func:`eager_decode_configs`, all compiled at start-up (``TritonBackend.warm_up``);
    the extra splits of a short context are empty (the kernel's split length is
    ``cdiv(seq_len, NUM_SPLITS)`` rounded up to ``block_n``: later splits read nothing)."""
    return replace(cfg, splits=min(_MAX_SPLITS, _pow2(cfg.splits, 1)))


def eager_decode_configs(picks: DecodePicks = NO_PICKS) -> tuple[DecodeConfig, ...]:
    """Every configuration :func:`decode_config` + :func:`eager_config` can give an eager
    step (under ``picks``): short contexts' power-of-two splits (2 stages) and the one
    split of 3 stages of 256 rows x KV heads; long contexts' balanced splits, with and
    without the 256-token floor of large batches (prefetching with
    ``picks.long_prefetch``); then each of ``picks.short`` not listed yet (split counts
    rounded up to a power of two)."""
    short = tuple(DecodeConfig(1 << i, 64, 4, 2) for i in range(6))
    long = tuple(
        DecodeConfig(1 << i, 64, 4, 2, floor, _TARGET_PROGRAMS, picks.long_prefetch)
        for floor in (0, 256)
        for i in range(6)
    )
    out = (*short, DecodeConfig(1, 64, 4, 3), *long)
    extra = tuple(
        dict.fromkeys(eager_config(c) for _, c in picks.short if eager_config(c) not in out)
    )
    return out + extra


def decode_rule(cfg: DecodeConfig) -> str:
    """The rule of :func:`decode_config` that gave ``cfg``: ``"long"`` (balanced), ``"one"``
    (short contexts, one split) or ``"split"`` (short contexts, several)."""
    if cfg.balance:
        return "long"
    return "one" if cfg.splits == 1 else "split"


@functools.lru_cache(maxsize=256)
def fp8_decode_config(
    cfg: DecodeConfig, one_tile: tuple[int, int, int] | None = None
) -> DecodeConfig:
    """``cfg`` (the bf16 cache's decode configuration) for an e4m3 cache: the tile, warps and
    stages of :data:`FP8_DECODE_TILES` for its :func:`decode_rule` (``min_split`` rounded
    up to a multiple of the tile), the same splits; ``cfg`` itself when the rule is not
    listed. ``one_tile``: ``(block_n, num_warps, num_stages)`` in place of the rule's for a
    one-split short-context step ("one"; the device's measured pick for its rows,
    :meth:`DecodePicks.fp8_one_tile`). Applied wherever the decode kernel launches (eager
    steps, graph captures, ``TritonBackend.warm_up``), so the variants compiled at start-up
    are those that run. Cached: the table is read once per configuration (tests clear the
    cache)."""
    rule = decode_rule(cfg)
    tile = one_tile if one_tile is not None and rule == "one" else FP8_DECODE_TILES.get(rule)
    if tile is None:
        return cfg
    bn, warps, stages, *rest = tile
    widen, fma = (*rest, 0, False)[:2]
    min_split = -(-cfg.min_split // bn) * bn if cfg.min_split else 0
    return replace(
        cfg,
        block_n=bn,
        num_warps=warps,
        num_stages=stages,
        min_split=min_split,
        widen=int(widen),
        fma=bool(fma),
        even=decode_rule(cfg) in FP8_KV_EVEN,
        vmul=decode_rule(cfg) in FP8_KV_VMUL,
    )


@functools.lru_cache(maxsize=256)
def kv16_decode_config(cfg: DecodeConfig) -> DecodeConfig:
    """``cfg`` for a 16-bit cache: with ``even`` where its :func:`decode_rule` is in
    :data:`KV16_EVEN`, else ``cfg`` itself. Applied wherever the decode kernel launches, as
    :func:`fp8_decode_config` is; cached likewise (no new config a launch on an eager step's
    hot path; tests and scripts that change the table clear the cache)."""
    return replace(cfg, even=True) if decode_rule(cfg) in KV16_EVEN else cfg


@dataclass
class TritonPlan:
    """Per-step plan: ``decode`` (all rows one token) or extend; scratch of the decode splits.

    max_seq_len: longest context of an eager decode step (when captured: the graph's
    context bound, or ``None``); total_context: the sum of an eager step's contexts
    (``None`` when captured); config: the decode kernel's
    :class:`DecodeConfig`, fixed on the first layer (``None`` until then); max_q_len:
    longest query of an extend step.
    mid_o ``[B, Hq, S, D]`` fp32 / mid_lse ``[B, Hq, S]`` fp32: decode scratch of ``S > 1``
    splits, reused by every layer (allocated lazily on the first layer, once per step or
    once per graph); ``None`` with one split (the kernel writes the output).
    """

    decode: bool
    max_seq_len: int | None
    max_q_len: int
    total_context: int | None = None
    config: DecodeConfig | None = None
    mid_o: torch.Tensor | None = None
    mid_lse: torch.Tensor | None = None
    num_decode_rows: int = 0


class TritonBackend(AttentionBackend):
    """Paged attention with our Triton kernels (see the module docstring)."""

    name = "triton"
    supports_cuda_graphs = True
    accepts_stored_kv = True

    def plan(self, attn: AttentionMetadata, page_size: int) -> TritonPlan:
        """Plan an eager step (reads the host lengths; one device read when absent)."""
        q_lens, s_lens = attn.host_lens()
        decode = all(q == 1 for q in q_lens)
        lead = 0 if decode else next(i for i, q in enumerate(q_lens) if q != 1)
        if lead:  # mixed: the leading decode rows get the decode kernel
            return TritonPlan(
                decode=False,
                max_seq_len=max(s_lens[:lead]),
                max_q_len=max(q_lens[lead:]),
                total_context=sum(s_lens[:lead]),
                num_decode_rows=lead,
            )
        return TritonPlan(decode, max(s_lens, default=1), max(q_lens, default=1), sum(s_lens))

    def plan_for_capture(
        self,
        attn: AttentionMetadata,
        page_size: int,
        max_seq_len: int | None = None,
        query_len: int = 1,
    ) -> TritonPlan:
        """Plan a step of ``attn.num_seqs`` rows for CUDA-graph capture: no host lengths
        are read.  Decode (``query_len`` 1): the split count depends on the batch size
        and on the bound ``max_seq_len`` the graph is captured for (``None``: any context)
        only.  Verify (``query_len`` > 1): the extend kernel, its grid fixed by the batch
        size and ``query_len`` (each program reads its row's query start and context
        length on the device)."""
        if query_len > 1:
            return TritonPlan(decode=False, max_seq_len=None, max_q_len=query_len)
        return TritonPlan(decode=True, max_seq_len=max_seq_len, max_q_len=1)

    def capture_context_bounds(self, num_seqs: int, num_kv_heads: int) -> tuple[int, ...]:
        """``(ONE_SPLIT_MAX_CONTEXT,)`` for every batch size: :func:`decode_config` runs
        short contexts by the measured short-context rule (one split from 256 rows x KV
        heads, a few at smaller batches) and longer ones by the balanced rule, so each
        bucket gets a graph of each."""
        return (ONE_SPLIT_MAX_CONTEXT,)

    def warm_up(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, dtype: torch.dtype
    ) -> int:
        """Launch the decode kernel (and its merge) once in each of
        :func:`eager_decode_configs` (under the device's :func:`device_picks`; an e4m3 cache
        also in the one-split tiles of its ``fp8_one`` entries), as an eager
        step launches it (int64 page table and lengths, as ``ModelRunner.run_staged``
        stages them), over one row of one token that reads page 0: the variants are
        compiled at start-up, not in a request's step (the graphs' variants are captured
        already: their page table is int32). Writes no KV. Returns the configurations run."""
        dev, D, Hkv = k_cache.device, k_cache.shape[3], k_cache.shape[2]
        # q as the model's qkv projection lays it out: [T, Hq + 2 Hkv, D], q the first heads
        qkv = torch.zeros(1, num_q_heads + 2 * Hkv, D, dtype=dtype, device=dev)
        q = qkv[:, :num_q_heads]
        attn = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int64, device=dev),
            seq_lens=torch.ones(1, dtype=torch.int64, device=dev),
            page_table=torch.zeros(1, 2, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=dev),
        )
        picks = device_picks(dev, num_q_heads // Hkv, D)
        configs = eager_decode_configs(picks)
        if is_fp8(k_cache):  # the e4m3 tiles of large one-split steps (one row here)
            configs += tuple(DecodeConfig(1, *t) for _, t in picks.fp8_one)
        for cfg in configs:
            plan = TritonPlan(True, 1, 1, total_context=1, config=cfg)
            kv = qkv[:, num_q_heads : num_q_heads + Hkv]
            self.forward(q, kv, kv, k_cache, v_cache, attn, plan, D**-0.5, kv_stored=True)
        return len(configs)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        plan: TritonPlan,
        scale: float,
        kv_stored: bool = False,
        kv_scale: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (any
        row/head strides, dim stride 1); k_cache/v_cache ``[P, page_size, Hkv, D]`` views of
        any strides with dim stride 1. With ``kv_stored`` (the model's RoPE kernel wrote K/V,
        ``fused_ops.rope_store_kv``) k and v are not read. Returns ``[T, Hq * D]`` in q's
        dtype. An FP8 cache stores ``quantize_kv(k, kv_scale[0])`` (and V likewise); the
        kernels convert what they load to q's dtype, ``kv_scale[0]`` is folded into the
        softmax scale and the output is multiplied by ``kv_scale[1]``."""
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        page_size = k_cache.shape[1]
        if q.stride(-1) != 1:
            q = q.contiguous()
        block_d = _pow2(D)
        if T and not kv_stored:
            if k.stride(-1) != 1 or v.stride(-1) != 1:
                k, v = k.contiguous(), v.contiguous()
            if is_fp8(k_cache):
                k, v = quantize_kv(k, kv_scale[0]), quantize_kv(v, kv_scale[1])
            elif k.dtype != k_cache.dtype:
                k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            store_kv_kernel[(T,)](
                k,
                v,
                k_cache,
                v_cache,
                attn.slot_mapping,
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                *k_cache.stride()[:3],
                *v_cache.stride()[:3],
                HKV=Hkv,
                D=D,
                PAGE_SIZE=page_size,
                BLOCK_H=_pow2(Hkv, 1),
                BLOCK_D=block_d,
                **pdl.launch_options(k),
            )
        v_scale = 1.0
        if is_fp8(k_cache):  # scores = q . (k8 * ks): ks joins the softmax scale
            scale, v_scale = scale * kv_scale[0], kv_scale[1]
        out = q.new_empty(T, Hq, D)
        ieee = q.dtype == torch.float32  # fp32 stays exact: no TF32 in the dots
        table = attn.page_table
        B = attn.num_seqs
        if B == 0:
            return out.view(T, Hq * D)
        lead = B if plan.decode else plan.num_decode_rows
        if lead:
            self._decode(q, k_cache, v_cache, out, attn, plan, lead, scale, ieee, G, D)
        if lead < B:
            grid = (B - lead, Hq, -(-plan.max_q_len // _EXTEND_BLOCK_M))
            extend_kernel[grid](  # rows lead.. (token offsets in q/out are absolute)
                q,
                k_cache,
                v_cache,
                out,
                table,
                attn.query_start_loc,
                attn.seq_lens,
                scale,
                q.stride(0),
                q.stride(1),
                *k_cache.stride()[:3],
                *v_cache.stride()[:3],
                table.stride(0),
                out.stride(0),
                out.stride(1),
                lead,
                G=G,
                D=D,
                PAGE_SIZE=page_size,
                BLOCK_M=_EXTEND_BLOCK_M,
                BLOCK_N=_EXTEND_BLOCK_N,
                BLOCK_D=block_d,
                IEEE=ieee,
                **pdl.launch_options(q),
            )
        if v_scale != 1.0:  # sum_j p_j (v8_j * vs) = vs * sum_j p_j v8_j
            out.mul_(v_scale)
        return out.view(T, Hq * D)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        attn: AttentionMetadata,
        plan: TritonPlan,
        B: int,
        scale: float,
        ieee: bool,
        G: int,
        D: int,
    ) -> None:
        """The split-KV decode kernel (and its merge) over rows ``0..B-1``: one query token
        each, the token of row ``b`` at ``q[b]``; writes ``out[b]``."""
        Hq, Hkv, page_size, block_d = q.shape[1], k_cache.shape[2], k_cache.shape[1], _pow2(D)
        table = attn.page_table
        if plan.config is None:
            picks = device_picks(q.device, G, D)
            plan.config = decode_config(
                B, Hkv, page_size, plan.max_seq_len, plan.total_context, picks
            )
            if plan.total_context is not None:  # eager: one of the few warmed split counts
                plan.config = eager_config(plan.config)
        cfg = plan.config
        fp8 = is_fp8(k_cache)
        if fp8:  # its own tiles where measured (the splits are the same)
            tile = device_picks(q.device, G, D).fp8_one_tile(B * Hkv)
            cfg = fp8_decode_config(cfg) if tile is None else fp8_decode_config(cfg, tile)
        else:
            cfg = kv16_decode_config(cfg)
        aligned = (FP8_KV_ALIGNED_LOADS if fp8 else KV16_ALIGNED_LOADS) and kv_rows_aligned(
            k_cache, v_cache
        )
        f16_dot = fp8 and q.dtype == torch.bfloat16 and decode_rule(cfg) in FP8_KV_F16_DOTS
        S = cfg.splits
        if S > 1 and (plan.mid_o is None or plan.mid_o.shape[0] != B):
            plan.mid_o = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
            plan.mid_lse = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
        mid_o = out if plan.mid_o is None else plan.mid_o  # unused with one split
        mid_lse = out if plan.mid_lse is None else plan.mid_lse
        decode_split_kernel[(B, Hkv, S)](
            q,
            k_cache,
            v_cache,
            table,
            attn.seq_lens,
            mid_o,
            mid_lse,
            out,
            scale,
            1.0,  # v_mul: VMUL's multiply keeps the values (see decode_split_kernel)
            q.stride(0),
            q.stride(1),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            table.stride(0),
            *mid_o.stride()[:3],
            *mid_lse.stride()[:2],
            out.stride(0),
            out.stride(1),
            B,
            G=G,
            D=D,
            PAGE_SIZE=page_size,
            NUM_SPLITS=S,
            MIN_SPLIT=cfg.min_split,
            BALANCE_PROGRAMS=cfg.balance,
            BLOCK_B=_BALANCE_BLOCK_B if cfg.balance else 1,
            BLOCK_H=_pow2(G, 1) if cfg.fma else _pow2(G),
            BLOCK_N=cfg.block_n,
            BLOCK_D=block_d,
            TILE_IN_PAGE=page_size % cfg.block_n == 0,
            IEEE=ieee,
            F16_DOT=f16_dot,
            PREFETCH=cfg.prefetch,
            ALIGNED=aligned,
            WIDEN=cfg.widen if fp8 else 0,
            FMA=cfg.fma,
            UNROLL=cfg.unroll,
            EVICT=cfg.evict,
            EVEN=cfg.even and block_d == D,
            VMUL=cfg.vmul and fp8,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **pdl.launch_options(q),
        )
        if S > 1:
            decode_merge_kernel[(B, Hq)](
                mid_o,
                mid_lse,
                out,
                *mid_o.stride()[:3],
                *mid_lse.stride()[:2],
                out.stride(0),
                out.stride(1),
                D=D,
                NUM_SPLITS=S,
                BLOCK_S=_pow2(S, 1),
                BLOCK_D=block_d,
                **pdl.launch_options(q),
            )
