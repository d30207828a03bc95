"""Decode-step kernel picks measured on a GPU: the split-KV decode attention's launch
configuration at short contexts, the long-context rule's tile prefetch, and the greedy pick.

``SHORT[(device name, G, head_dim)]``: ``(least B * Hkv, ((largest B * Hkv, (splits,
block_n, num_warps, num_stages, min_split, balance, prefetch)), ...))``, bounds ascending:
the :class:`~pdserve.model.triton_backend.DecodeConfig` a decode step of ``B`` rows and
``Hkv`` KV heads (``G`` query heads each) runs when every context is at most
``ONE_SPLIT_MAX_CONTEXT`` tokens (an eager step's longest, or the bound of the graph
replayed), for ``B * Hkv`` from the least (the smallest measured; below it: the rule of
``decode_config``) up to each bound (past the last: the last entry). Splits are powers of
two (``eager_config`` keeps them: every entry is compiled at start-up by
``TritonBackend.warm_up``).

``LONG_PREFETCH``: the ``(device name, G, head_dim)`` whose long-context (balanced) decode
configurations load the next tile before this one's math (``DecodeConfig.prefetch``).

``GREEDY[device name]``: ``(target programs, block_v, num_warps)`` of the one-pass greedy pick
(``model/triton_greedy.py``) a decode graph computes its argmax and that token's logprob
with; a device not listed keeps ``argmax`` + ``log_softmax`` + ``gather``.

``FP8_ONE[(device name, G, head_dim)]``: ``((least B * Hkv, (block_n, num_warps,
num_stages)), ...)`` ascending: an e4m3 cache's tiles for a short-context decode step of
one split (``decode_rule`` "one") from that many rows x KV heads on (the entry with the
largest least not above ``B * Hkv``); fewer rows keep ``triton_backend.FP8_DECODE_TILES``'
rule (the bf16 cache's tiles for "one"). Set by hand from ``scripts/gpu_s10_fp8big.py``'s
JSON (the commit that set it names the figures).

``FP32_LOGITS``: devices whose lm_head GEMM writes the fp32 logits itself
(``linear.logits_fp32``: ``torch.mm`` with ``out_dtype``) instead of a 16-bit GEMM and a cast
pass (H200: 288.8 vs 308.5 us at 64 rows x 4,096 -> 128,256, 423.5 vs 491.8 at 256; set by
hand from the same JSON's ``logits`` rows).

Written from ``scripts/gpu_s6_attn_sweep.py``'s JSON (``attn_sweep.json``; the figures and
the rule each pick was taken by are in the commit that set it); do not edit by hand.
"""

from __future__ import annotations

_Config = tuple[int, int, int, int, int, int, bool]

SHORT: dict[tuple[str, int, int], tuple[int, tuple[tuple[int, _Config], ...]]] = {
    ("NVIDIA H200", 4, 128): (
        256,
        (
            (256, (1, 128, 8, 2, 0, 0, False)),
            (512, (1, 64, 4, 3, 0, 0, False)),
            (1024, (1, 32, 2, 3, 0, 0, False)),
            (2048, (1, 32, 2, 3, 0, 0, False)),
        ),
    )
}

LONG_PREFETCH: frozenset[tuple[str, int, int]] = frozenset()

FP8_ONE: dict[tuple[str, int, int], tuple[tuple[int, tuple[int, int, int]], ...]] = {
    ("NVIDIA H200", 4, 128): ((3072, (16, 1, 3)),)
}

GREEDY: dict[str, tuple[int, int, int]] = {"NVIDIA H200": (1056, 1024, 4)}

FP32_LOGITS: frozenset[str] = frozenset({"NVIDIA H200"})
