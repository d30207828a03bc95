"""``pdserve bench quality``: what FP8 (weights, KV cache) costs in accuracy, on the same
weights, position by position.

Texts: the parity prompts (those the PD parity tests send, plus GSM8K questions under the
chat template), each followed by the greedy continuation of the first variant (``fp32``,
``--continuation`` tokens), and a fixed English paragraph (:data:`FIXED_TEXT`) for
perplexity. Every variant reads every text teacher-forced (one prefill, ``prompt_logprobs``
of 1): at each position its top-1 token and the log-probability of the actual next token.
Reported for each pair of variants: top-1 agreement (fraction of positions whose top-1
tokens are equal) and mean |Δ logprob| of the actual tokens; for each variant: the
perplexity of the fixed text, ``exp(mean NLL)`` over its tokens after the first, and its
ratio to the second variant's (bf16).

Variants (``--variants``): ``fp32``; ``bf16``; ``fp8`` (bf16 activations, e4m3 weights
quantized at load, e4m3 KV cache); ``fp8w`` (FP8 weights, bf16 KV); ``fp8kv`` (bf16
weights, FP8 KV); ``fp8b`` (``fp8`` with ``--quantization fp8_block``: one weight scale
per output row and 128 input columns). On CPU the FP8 weights are dequantized for each matmul (the same
numbers as the GPU's Triton kernel up to summation order) and the activations stay bf16: on
CUDA a per-channel weight runs with per-token e4m3 activations (``_scaled_mm`` or the w8a8
Triton GEMM) at the row counts where ``fp8.choose_paths`` timed those fastest, which these
CPU figures leave out
(``scripts/fp8_quality_probe.py`` emulates it).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from typing import Any

from pdserve.bench.cli import write_json
from pdserve.cli import Flag, add_flags

# The prompts of the PD parity tests (tests/e2e/test_pd_parity.py and the TP e2e tests).
PARITY_PROMPTS = (
    "The capital of France is",
    "Once upon a time",
    "Numbers: one two",
    "A seeded story",
    "Three samples",
    "Check the prompt logprobs here",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away,",
    "Hello there",
)
# A fixed text of our own for perplexity (plain English prose, 150-odd tokens).
FIXED_TEXT = (
    "The river runs through the middle of the old town, and most of its bridges are older "
    "than the houses beside them. In the morning the market opens on the eastern bank: "
    "farmers bring vegetables, cheese and bread, and the fishermen sell what they caught "
    "during the night. Children walk to school along the water, and the teachers say that "
    "the river is the first thing every pupil learns to draw. In winter the water rises, "
    "the lower streets are closed for a few days, and the town waits patiently until the "
    "river goes back to its bed. Nobody remembers a year without a flood, and nobody would "
    "want to live anywhere else."
)
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "fp8": {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    "fp8w": {"dtype": "bfloat16", "quantization": "fp8"},
    "fp8kv": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
    "fp8b": {"dtype": "bfloat16", "quantization": "fp8_block", "kv_cache_dtype": "fp8_e4m3"},
}

FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model of every variant (the same weights)", default="smollm2-135m-instruct"),
    Flag("--device", "cpu or cuda", default="cpu"),
    Flag(
        "--variants",
        f"comma-separated variants, the first the reference of the continuations, the second "
        f"that of the perplexity ratio; of {', '.join(VARIANTS)}",
        default="fp32,bf16,fp8",
    ),
    Flag("--continuation", "greedy tokens appended to each parity prompt", int, default=32),
    Flag("--gsm8k", "GSM8K test questions added to the parity prompts", int, default=8),
    Flag("--json", "write the results here; unset: not written", metavar="FILE"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench quality``."""
    p = subparsers.add_parser(
        "quality", help="top-1 agreement and perplexity of fp32, bf16 and FP8 on the same weights"
    )
    add_flags(p, FLAGS)
    p.set_defaults(func=run_quality)


def _llm(model: str, device: str, variant: str) -> Any:
    from pdserve.engine.llm import LLM

    return LLM(model, device=device, enable_prefix_caching=False, **VARIANTS[variant])


def _read(llm: Any, texts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Per text: top-1 token and logprob of the actual token at every position after the
    first (teacher-forced, one prefill each)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    out = []
    for o in llm.generate(texts, params):
        lps = [lp for lp in o.prompt_logprobs or [] if lp is not None]
        out.append(([lp.top[0][0] for lp in lps], [lp.logprob for lp in lps]))
    return out


def quality(model: str, device: str, variants: list[str], continuation: int, gsm8k: int) -> dict:
    """The measurement (see the module doc); returns the report ``--json`` writes."""
    from pdserve.bench.gsm8k_data import build_messages, load_gsm8k_test
    from pdserve.engine.sampling_params import SamplingParams

    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if len(variants) < 2:
        raise ValueError("variants: give at least two")
    ref = _llm(model, device, variants[0])
    try:
        tok = ref.get_tokenizer()
        prompts = [tok.encode(p) for p in PARITY_PROMPTS]
        prompts += [
            ref.chat_token_ids(build_messages(q.question)) for q in load_gsm8k_test()[:gsm8k]
        ]
        greedy = SamplingParams(temperature=0, max_tokens=continuation, ignore_eos=True)
        texts = [p + o.outputs[0].token_ids for p, o in zip(prompts, ref.generate(prompts, greedy))]
        fixed = [tok.encode(FIXED_TEXT)]
        reads = {variants[0]: (_read(ref, texts), _read(ref, fixed))}
    finally:
        ref.shutdown()
    for v in variants[1:]:
        llm = _llm(model, device, v)
        try:
            reads[v] = (_read(llm, texts), _read(llm, fixed))
        finally:
            llm.shutdown()
    pairs = []
    for a, b in itertools.combinations(variants, 2):
        same = total = 0
        deltas: list[float] = []
        for (ta, la), (tb, lb) in zip(reads[a][0], reads[b][0]):
            same += sum(x == y for x, y in zip(ta, tb))
            total += len(ta)
            deltas += [abs(x - y) for x, y in zip(la, lb)]
        pairs.append(
            {
                "a": a,
                "b": b,
                "top1_agreement": same / total,
                "mean_abs_dlogprob": statistics.fmean(deltas),
                "positions": total,
            }
        )
    ppl = {v: math.exp(-statistics.fmean(reads[v][1][0][1])) for v in variants}
    base = variants[1]
    return {
        "benchmark": "quality",
        "model": model,
        "device": device,
        "variants": {v: VARIANTS[v] for v in variants},
        "texts": len(texts),
        "continuation_tokens": continuation,
        "pairs": pairs,
        "perplexity": ppl,
        "perplexity_ratio_to": base,
        "perplexity_ratio": {v: ppl[v] / ppl[base] for v in variants},
        "fixed_text_tokens": len(fixed[0]),
    }


def run_quality(args: argparse.Namespace) -> int:
    """Run, print a table, optionally write JSON; 2 on bad arguments."""
    try:
        report = quality(
            args.model, args.device, args.variants.split(","), args.continuation, args.gsm8k
        )
    except ValueError as exc:
        print(f"pdserve bench quality: {exc}", file=sys.stderr)
        return 2
    print(f"model {report['model']}  device {report['device']}  texts {report['texts']}")
    print(f"{'pair':>12} {'top-1 agreement':>16} {'mean |dlogprob|':>16} {'positions':>9}")
    for p in report["pairs"]:
        print(
            f"{p['a'] + '/' + p['b']:>12} {p['top1_agreement']:>16.3f} "
            f"{p['mean_abs_dlogprob']:>16.4f} {p['positions']:>9}"
        )
    for v, ppl in report["perplexity"].items():
        print(
            f"perplexity {v}: {ppl:.3f} ({report['perplexity_ratio'][v]:.3f} x {report['perplexity_ratio_to']})"
        )
    if args.json:
        write_json(args.json, report)
    return 0
