"""Which part of the default FP8 costs top-1 agreement, and how much of it is chance (issue 26).

`pdserve bench quality` measures ``fp8`` (per-channel e4m3 weights + e4m3 KV), ``fp8w``
(weights only) and ``fp8kv`` (KV only) on CPU. This probe runs the same texts (the bench's
parity prompts + 8 GSM8K questions, each with fp32's 32-token greedy continuation, read
teacher-forced) against bf16 for:

- ``fp8w x<f>``: per-channel weights with every scale multiplied by ``f`` (``amax / 448 *
  f``): the same precision, another rounding pattern; the spread of these is the chance
  part of one agreement figure;
- ``act``: bf16 weights and KV, the four linears' activations quantized per token to e4m3
  and back (what ``torch._scaled_mm`` and the w8a8 kernel do on CUDA where ``fp8.path_for`` picks them;
  the CPU path of ``fp8.linear`` never quantizes activations, so the bench's CPU figures
  leave this out);
- ``fp8w+act``: both (the GPU's default path for prefill-sized batches, KV aside);
- ``fp8kv``, ``fp8bw`` (``--quantization fp8_block``, weights only).

The activation and scale variants patch ``pdserve.model.fp8`` / ``pdserve.model.linear`` in
this process (a probe, not an engine option). Usage (repository root, CPU, ~10 min)::

    python scripts/fp8_quality_probe.py --json docs/figures/cpu_fp8_quality_probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.bench import quality as bq
from pdserve.bench.gsm8k_data import build_messages, load_gsm8k_test
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model import fp8
from pdserve.model import linear as lin

MODEL = "smollm2-135m-instruct"
SCALE_FACTORS = (1.0, 1.001, 1.003, 0.995, 0.99, 1.01, 1.02, 1.03, 1.05)
_PER_CHANNEL = fp8.quantize_per_channel
_FP8_LINEAR = fp8.linear
_LINEAR = lin.linear
bq.VARIANTS.setdefault("fp8bw", {"dtype": "bfloat16", "quantization": "fp8_block"})


def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    xq, xs = fp8.quantize_rows(x)
    return (xq.float() * xs).to(x.dtype)


def _scaled_per_channel(f: float) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wf = w.float()
        amax = wf.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / fp8.FP8_MAX, torch.ones_like(amax)) * f
        return (wf / scale).clamp_(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), scale

    return quantize


def _act_fp8_linear(x: torch.Tensor, w: fp8.Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return _FP8_LINEAR(_fake_quant_rows(x), w, bias)


def _act_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if w.shape[0] > 16384:  # the LM head (vocab rows) stays in bf16, as on the GPU
        return _LINEAR(x, w, bias, packed)
    return _LINEAR(_fake_quant_rows(x), w, bias, packed)


def _patch(scale: float = 1.0, act: bool = False, act_hp: bool = False) -> None:
    fp8.quantize_per_channel = _scaled_per_channel(scale) if scale != 1.0 else _PER_CHANNEL
    fp8.linear = _act_fp8_linear if act else _FP8_LINEAR
    lin.linear = _act_linear if act_hp else _LINEAR


def probes() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, bench variant, patch) in run order."""
    out = [(f"fp8w x{f:g}", "fp8w", {"scale": f}) for f in SCALE_FACTORS]
    out += [
        ("act", "bf16", {"act_hp": True}),
        ("fp8w+act", "fp8w", {"act": True}),
        ("fp8kv", "fp8kv", {}),
        ("fp8bw", "fp8bw", {}),
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    ref = bq._llm(MODEL, "cpu", "fp32")
    try:
        tok = ref.get_tokenizer()
        prompts = [tok.encode(p) for p in bq.PARITY_PROMPTS]
        prompts += [ref.chat_token_ids(build_messages(q.question)) for q in load_gsm8k_test()[:8]]
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        texts = [p + o.outputs[0].token_ids for p, o in zip(prompts, ref.generate(prompts, greedy))]
    finally:
        ref.shutdown()
    fixed = [tok.encode(bq.FIXED_TEXT)]

    def read(variant: str) -> tuple[Any, Any]:
        llm = bq._llm(MODEL, "cpu", variant)
        try:
            return bq._read(llm, texts), bq._read(llm, fixed)
        finally:
            llm.shutdown()

    _patch()
    base = read("bf16")
    rows = []
    for name, variant, patch in probes():
        t0 = time.time()
        _patch(**patch)
        try:
            got = read(variant)
        finally:
            _patch()
        same = total = 0
        deltas: list[float] = []
        for (ta, la), (tb, lb) in zip(base[0], got[0]):
            same += sum(x == y for x, y in zip(ta, tb))
            total += len(ta)
            deltas += [abs(x - y) for x, y in zip(la, lb)]
        row = {
            "probe": name,
            "top1_agreement_vs_bf16": same / total,
            "mean_abs_dlogprob": statistics.fmean(deltas),
            "positions": total,
            "perplexity": math.exp(-statistics.fmean(got[1][0][1])),
        }
        rows.append(row)
        print(
            f"{name:>12}: top-1 {row['top1_agreement_vs_bf16']:.4f}  mean|dlp| "
            f"{row['mean_abs_dlogprob']:.4f}  ppl {row['perplexity']:.2f}  ({time.time() - t0:.0f} s)",
            flush=True,
        )
    spread = [r["top1_agreement_vs_bf16"] for r in rows if r["probe"].startswith("fp8w x")]
    report = {
        "benchmark": "fp8_quality_probe",
        "model": MODEL,
        "device": "cpu",
        "reference": "bf16",
        "bf16_perplexity": math.exp(-statistics.fmean(base[1][0][1])),
        "probes": rows,
        "per_channel_scale_factors": {
            "min": min(spread),
            "max": max(spread),
            "mean": statistics.fmean(spread),
            "stdev": statistics.stdev(spread),
        },
    }
    print(json.dumps(report["per_channel_scale_factors"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
