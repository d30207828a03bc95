"""``pdserve bench offline``: our engine against ``transformers`` ``generate``, side by side.

Same model weights (the engine's ``ModelSource`` loaded into the HF model class), same
prompts (GSM8K test questions under the chat template), same device and dtype, greedy,
fixed output length (EOS ignored).  For each concurrency the two run interleaved,
``--repeats`` times after a warm-up; we report median output tokens/s of each and the
ratio (BENCHMARKS.md: a ratio measured in one run is what means something here), and how
many outputs (and first tokens) are identical — all of them in fp32; in bf16 near-ties of
random weights make whole sequences diverge.

How close to the roofline (what a decode step must read and compute: bench/roofline.py):
per concurrency we report ms per output step (wall time / ``max_tokens``, the prefill
included) of each side; the decode rate alone, from a second timed run of one output token
per prompt (decode ms/step = (full run - that run) / (``max_tokens`` - 1), decode tok/s =
prompts / decode s/step); and ``roofline`` = the roofline's ms per step / our decode ms per
step.
Each of our timed runs starts from an empty prefix cache, so it computes its prompts as
transformers does. ``--prefill NxL`` adds a prefill row: N random prompts of L tokens, one
output token each, prompt tokens/s of each side.

The process's start-up heap is frozen before the first row (``gc.freeze``, as a serving
worker's), so a full garbage collection does not land in a timed run; the JSON's ``gc``
gives the collections and pauses of the rows (``GcWatch.stats``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from pdserve import envs
from pdserve.bench.cli import add_json_flag, write_json
from pdserve.bench.hf_reference import hf_model
from pdserve.bench.roofline import (
    SteadyStepError,
    copy_bandwidth,
    matmul_rate,
    roofline_seconds,
    steady_decode_step,
    step_bytes,
    step_flops,
)
from pdserve.bounds import flag_message
from pdserve.cli import flag_values, int_list
from pdserve.gc_watch import process_watch
from pdserve.server.engine_args import ENGINE_FLAGS, add_engine_flags

# The engine flags of bench offline: those its LLM is built with, then those of
# --speculative (bench/speculative.py).
_LLM_FLAGS = (
    "--model",
    "--dtype",
    "--device",
    "--page-size",
    "--kv-order",
    "--attention-backend",
    "--enforce-eager",
    "--overlap-schedule",
    "--tensor-parallel-size",
    "--quantization",
    "--kv-cache-dtype",
    "--kv-cache-memory",
    "--max-num-batched-tokens",
)
_SPEC_FLAGS = (
    "--num-speculative-tokens",
    "--speculative-model",
    "--speculative-ngram-min",
    "--speculative-ngram-max",
)


SUSTAIN_S = 3.0
"""Seconds of back-to-back matmuls before the roofline's matmul rate is read on a GPU
(:func:`pdserve.bench.roofline.matmul_rate`): long enough for the card to settle under its
power cap, short beside an engine's start."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench offline``; the engine flags are ``serve``'s (``ENGINE_FLAGS``)."""
    p = subparsers.add_parser(
        "offline", help="engine vs transformers generate: output tokens/s and ratio"
    )
    p.add_argument(
        "--num-prompts",
        default="1,16",
        help=f"comma-separated concurrencies, each 1..{MAX_PROMPTS} "
        "(default 1,16; e.g. 1,64,256,1024)",
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=None,
        metavar="N",
        help="every prompt exactly N tokens (random token ids, or the GSM8K prompts cut or "
        "padded to N with --input-source gsm8k); unset: the GSM8K prompts as they are",
    )
    p.add_argument(
        "--input-source",
        choices=("random", "gsm8k"),
        default=None,
        help="prompts of --input-len: random token ids, or GSM8K chat prompts cut to N "
        "tokens or padded by repeating their own tokens; unset: random with --input-len, "
        "GSM8K's prompts as they are without it",
    )
    p.add_argument(
        "--long-context",
        default=None,
        metavar="NxL",
        help="also a decode row of N random prompts of L tokens each, --max-tokens out "
        "(e.g. 32x4096); unset: no such row",
    )
    p.add_argument(
        "--max-tokens", type=int, default=64, help="output tokens per prompt (default 64)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side (default 3)")
    p.add_argument(
        "--steady-steps",
        type=int,
        default=24,
        help="decode steps timed once every prompt of a row decodes (the step the roofline "
        "describes: no prefill chunk beside it), for the 'step ms' and roofline columns "
        "('ours decode ms' is the whole run's: (run - first-token run) / (max_tokens - 1), "
        "the ramp included); a row it cannot measure says why under it; not with "
        "--speculative; 0: off, the roofline is judged against the whole run's decode rate "
        "(default 24)",
    )
    p.add_argument(
        "--ours-only",
        action="store_true",
        help="time our engine only: no transformers side (its columns, the ratio and the "
        "same-output counts are left empty), and the KV pool takes the engine's default share "
        "of device memory; unset: both sides, the pool at 0.4 of it",
    )
    p.add_argument(
        "--moe-routing",
        choices=("model", "uniform"),
        default=None,
        help="mixture-of-experts models: 'uniform' routes each token to a fixed random set of "
        "experts (PDSERVE_MOE_ROUTING), spread as a trained router's load balancing spreads a "
        "batch, where random-weight presets send a batch to a few experts; changes the "
        "outputs, so only with --ours-only; 'model': the router's own; unset: the "
        "environment's (default model)",
    )
    p.add_argument(
        "--prefill",
        default=None,
        metavar="NxL",
        help="also time prefill of N random prompts of L tokens (e.g. 8x2048); unset: no prefill timing",
    )
    add_json_flag(p, "the results and workload")
    p.add_argument(
        "--speculative",
        default=None,
        metavar="MODE",
        help="compare this engine with and without speculative decoding instead of with "
        "transformers (bench/speculative.py): ngram, draft (--speculative-model), or "
        "replay:RATE (acceptance-controlled: the plain run's greedy output proposed back, "
        "each draft token corrupted with probability 1 - RATE; with --speculative-model the "
        "draft model also runs, for its cost), or reference:RATE (the same, but a greedy "
        "verify keeps the recorded tokens up to the first corrupted draft, so the rate holds "
        "in bf16; positions where the target's argmax differed are reported; benchmark "
        "only); unset: the transformers comparison",
    )
    p.add_argument(
        "--spec-workload",
        default=None,
        choices=("copy", "gsm8k"),
        help="prompts of --speculative: copy (repeat a passage with one edit) or gsm8k; "
        "unset: copy for ngram and draft, gsm8k for replay and reference",
    )
    add_engine_flags(
        p,
        (*_LLM_FLAGS, *_SPEC_FLAGS),
        notes={
            "--model": "the transformers side loads the same weights",
            "--tensor-parallel-size": "the transformers side runs whole, in this process; "
            "the roofline counts one rank's weights",
            "--quantization": "ours only: the transformers side runs the unquantized weights",
            "--kv-cache-memory": "here, unset on CUDA: 0.4 of free memory (room for the "
            "transformers side), or the engine's default share with --ours-only",
            "--max-num-batched-tokens": "prompt chunks and decode rows together; unset: "
            f"{CHUNK_TOKENS_PER_PROMPT} x the most prompts of a row, within "
            f"{MIN_BATCHED_TOKENS:,}..{MAX_BATCHED_TOKENS:,} (with the serving default of 2,048, "
            "1,024 prompts of ~126 tokens are admitted over ~90 mixed steps, fewer each step "
            "as the rows already decoding take the budget)",
        },
    )
    # the budget follows the rows (batched_tokens_for) unless given
    p.set_defaults(func=run_offline, max_num_batched_tokens=None)


# The most prompts of one row (--num-prompts, --long-context).
MAX_PROMPTS = 1024
# --max-num-batched-tokens when unset: this many tokens per prompt of the largest row,
# within these bounds (the lower one the serving default, so rows of up to 128 prompts run
# as before).
CHUNK_TOKENS_PER_PROMPT = 16
MIN_BATCHED_TOKENS = 2048
MAX_BATCHED_TOKENS = 16384


def batched_tokens_for(max_prompts: int) -> int:
    """The step's token budget of a run whose largest row has ``max_prompts`` prompts:
    :data:`CHUNK_TOKENS_PER_PROMPT` per prompt within
    ``MIN_BATCHED_TOKENS..MAX_BATCHED_TOKENS`` (2,048 up to 128 prompts, 16,384 from 1,024),
    so that the prompts of a large row are admitted within a few steps, not over a ramp of
    ~90 mixed steps at 1,024 prompts (ValueError when ``max_prompts < 1``)."""
    if max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
    return max(MIN_BATCHED_TOKENS, min(MAX_BATCHED_TOKENS, CHUNK_TOKENS_PER_PROMPT * max_prompts))


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _parse_counts(text: str) -> list[int]:
    return int_list(text, 1, MAX_PROMPTS, name="num-prompts")


def _parse_nxl(
    text: str | None, name: str = "prefill", example: str = "8x2048"
) -> tuple[int, int] | None:
    """``"NxL"`` -> ``(N, L)``; ``None`` stays ``None``; ValueError naming ``name`` unless
    both are integers >= 1 (and N at most ``MAX_PROMPTS``)."""
    if text is None:
        return None
    try:
        n, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        n = length = 0
    if not 1 <= n <= MAX_PROMPTS or length < 1:
        raise ValueError(
            f"{name} must be NxL with N in 1..{MAX_PROMPTS} and L >= 1 (e.g. {example}), "
            f"got {text!r}"
        )
    return n, length


def _random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def _prompts(llm, n: int) -> list[list[int]]:
    from pdserve.bench.gsm8k_data import build_messages, load_gsm8k_test

    items = load_gsm8k_test()
    if n > len(items):
        raise ValueError(f"num-prompts: {n} is more than the {len(items)} GSM8K test prompts")
    return [llm.chat_token_ids(build_messages(item.question)) for item in items[:n]]


def fit_length(ids: list[int], length: int) -> list[int]:
    """``ids`` cut to ``length`` tokens, or padded to it by repeating its own tokens from the
    start (so the padding is text of the same prompt, not one token repeated). ValueError
    when ``ids`` is empty or ``length < 1``."""
    if not ids or length < 1:
        raise ValueError(f"cannot fit {len(ids)} tokens to length {length}")
    reps = -(-length // len(ids))
    return (ids * reps)[:length]


def workload_prompts(
    llm, n: int, input_len: int | None, source: str | None, seed: int = 0
) -> list[list[int]]:
    """The ``n`` prompts (token ids) of one row: GSM8K chat prompts as they are when
    ``input_len`` is ``None``; else every prompt exactly ``input_len`` tokens, random ids
    (``source`` ``None`` or ``"random"``, seeded) or GSM8K prompts cut or padded
    (:func:`fit_length`)."""
    if input_len is None:
        return _prompts(llm, n)
    if source == "gsm8k":
        return [fit_length(p, input_len) for p in _prompts(llm, n)]
    return _random_prompts(llm.engine.vocab_size, n, input_len, seed)


def _time_ours(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate ``max_tokens`` for every prompt, and the output ids. The prefix
    cache is emptied first: every run computes its prompts, as transformers does (a repeat
    would otherwise find the warm-up's prompt pages cached and time decode alone)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def _time_hf(model, prompts, max_tokens: int, pad_id: int, device) -> tuple[float, list[list[int]]]:
    import torch

    width = max(len(p) for p in prompts)  # left padding, as HF batched generation needs
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out[:, width:].tolist()


def _time_prefill(llm, hf, prefill: tuple[int, int], pad_id: int, repeats: int) -> dict:
    """Prompt tokens/s of N random L-token prompts (one output token each), ours and HF's
    (ours alone when ``hf`` is ``None``: its fields ``None``), median of ``repeats``
    interleaved runs after a warm-up. Every run draws new prompts (seed = run number):
    repeated prompts would hit our prefix cache and time nothing (the H200 run of
    2026-12-01 read 554,565 tok/s on a repeat)."""
    n, length = prefill
    engine = llm.engine
    prompts = _random_prompts(engine.vocab_size, n, length)
    _time_ours(llm, prompts, 1)
    if hf is not None:
        _time_hf(hf, prompts, 1, pad_id, engine.device)
    ours, theirs = [], []
    for r in range(repeats):
        prompts = _random_prompts(engine.vocab_size, n, length, seed=1 + r)
        ours.append(n * length / _time_ours(llm, prompts, 1)[0])
        if hf is not None:
            theirs.append(n * length / _time_hf(hf, prompts, 1, pad_id, engine.device)[0])
    row: dict[str, Any] = {
        "num_prompts": n,
        "prompt_len": length,
        "ours_tok_s": statistics.median(ours),
        "hf_tok_s": statistics.median(theirs) if theirs else None,
        "ours_runs": ours,
        "hf_runs": theirs,
    }
    row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"] if theirs else None
    return row


def llm_fields(args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    """The :class:`LLM` keyword arguments of ``bench offline``'s engine flags in ``args``, the
    step's token budget filled in from the largest of ``batches`` (prompts of a row) when
    ``--max-num-batched-tokens`` was not given (:func:`batched_tokens_for`)."""
    fields = flag_values(args, [f for f in ENGINE_FLAGS if f.flag in _LLM_FLAGS])
    if fields.get("max_num_batched_tokens") is None:
        fields["max_num_batched_tokens"] = batched_tokens_for(max(batches))
    return fields


def run_offline(args: argparse.Namespace, after: Callable[[Any], None] | None = None) -> int:
    """Run the comparison, print a table, optionally write JSON; 2 on bad arguments.
    after: called with the ``LLM`` once the rows ran (0 returned), before it shuts down (a
    script that measures more on the same engine, e.g. ``scripts/gpu_step_profile.py``,
    without loading the model again)."""

    from pdserve.engine.llm import LLM

    try:
        counts = _parse_counts(args.num_prompts)
        prefill = _parse_nxl(args.prefill)
        long_ctx = _parse_nxl(args.long_context, "long-context", "32x4096")
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if args.steady_steps < 0:
            raise ValueError(f"--steady-steps must be >= 0, got {args.steady_steps}")
        if args.input_len is not None and args.input_len < 1:
            raise ValueError(f"--input-len must be >= 1, got {args.input_len}")
        if args.input_source is not None and args.input_len is None:
            raise ValueError("--input-source needs --input-len (the length to cut or pad to)")
        if args.moe_routing == "uniform" and not args.ours_only:
            raise ValueError(
                "--moe-routing uniform changes the model's outputs: use it with --ours-only"
            )
        batches = counts + [r[0] for r in (prefill, long_ctx) if r]
        kwargs: dict[str, Any] = {}
        if not args.ours_only:  # on a GPU the pool leaves room for the transformers copy
            kwargs["gpu_memory_utilization"] = 0.4
        fields = llm_fields(args, batches)
        t0 = time.perf_counter()
        # each MoE layer reads PDSERVE_MOE_ROUTING as the engine builds it (TP ranks' processes
        # too, started inside): set for the build only, so nothing leaks into the process
        prev = os.environ.get(envs.MOE_ROUTING.name)
        if args.moe_routing is not None:
            os.environ[envs.MOE_ROUTING.name] = args.moe_routing
        args.moe_routing = envs.MOE_ROUTING.get()
        try:
            llm = LLM(max_running_requests=max(batches), **fields, **kwargs)
        finally:
            if prev is None:
                os.environ.pop(envs.MOE_ROUTING.name, None)
            else:
                os.environ[envs.MOE_ROUTING.name] = prev
        start_s = time.perf_counter() - t0  # the load, the pool, the graph capture
    except ValueError as exc:
        print(f"pdserve bench offline: {flag_message(exc, args)}", file=sys.stderr)
        return 2
    try:
        rows = [
            (n, "gsm8k" if args.input_len is None else args.input_source or "random")
            for n in counts
        ]
        prompt_sets = [workload_prompts(llm, n, args.input_len, args.input_source) for n, _ in rows]
        if long_ctx:
            rows.append((long_ctx[0], "random (long context)"))
            prompt_sets.append(_random_prompts(llm.engine.vocab_size, *long_ctx, seed=7))
        limit = llm.engine.max_model_len
        for (_, source), prompts in zip(rows, prompt_sets):
            longest = max(len(p) for p in prompts)
            if longest + args.max_tokens > limit:
                name = "long-context" if source.endswith("(long context)") else "input-len"
                raise ValueError(
                    f"{name}: prompts of {longest} tokens + max-tokens {args.max_tokens} "
                    f"exceed the context limit max_model_len {limit}"
                )
    except ValueError as exc:
        llm.shutdown()
        print(f"pdserve bench offline: {flag_message(exc, args)}", file=sys.stderr)
        return 2
    try:
        if args.speculative:
            from pdserve.bench.speculative import run_speculative

            return run_speculative(args, llm, counts, _prompts, _time_ours)
        rc = _run(args, llm, rows, prompt_sets, prefill, start_s)
        if rc == 0 and after is not None:
            after(llm)
        return rc
    finally:
        # _run's freeze undone: this engine's objects may be collected again, and the
        # collection that frees them at shutdown (~230 ms on the H200 machine) is not a
        # serving stall to warn of
        process_watch().thaw()
        llm.shutdown()


def _decode_row(args, llm, hf, prompts: list[list[int]], pad_id: int, rates: dict) -> dict:
    """One row of the table: ``len(prompts)`` prompts, ``--max-tokens`` out, ours (and
    transformers' unless ``hf`` is ``None``), timed ``--repeats`` times interleaved after a
    warm-up; the decode rate and the step's roofline (``rates``: measured bandwidth and
    matmul rate)."""
    engine = llm.engine
    n = len(prompts)
    # Warm-up at full length: first-call allocations, kernel selection for every shape.
    # And of one token when the decode rate is measured: its last prefill step has no
    # decode row (every request ends at its first token), a step shape of its own whose
    # first run compiles kernels (on the H200 ~1 s, which made the decode rate invalid).
    for max_tokens in (args.max_tokens, 1) if args.max_tokens > 1 else (1,):
        _time_ours(llm, prompts, max_tokens)
        if hf is not None:
            _time_hf(hf, prompts, max_tokens, pad_id, engine.device)
    ours_runs, hf_runs, ours_first, hf_first = [], [], [], []
    ours_ids: list[list[int]] | None = None
    hf_ids: list[list[int]] | None = None
    for _ in range(args.repeats):  # interleaved, so load changes hit both alike
        dt, ours_ids = _time_ours(llm, prompts, args.max_tokens)
        ours_runs.append(n * args.max_tokens / dt)
        if hf is not None:
            dt, hf_ids = _time_hf(hf, prompts, args.max_tokens, pad_id, engine.device)
            hf_runs.append(n * args.max_tokens / dt)
        if args.max_tokens > 1:  # the prefill and first token alone, for the decode rate
            ours_first.append(_time_ours(llm, prompts, 1)[0])
            if hf is not None:
                hf_first.append(_time_hf(hf, prompts, 1, pad_id, engine.device)[0])
    lens = [len(p) for p in prompts]
    row: dict[str, Any] = {
        "num_prompts": n,
        "ours_tok_s": statistics.median(ours_runs),
        "hf_tok_s": statistics.median(hf_runs) if hf_runs else None,
        "ours_runs": ours_runs,
        "hf_runs": hf_runs,
        "identical_outputs": None,
        "identical_first_tokens": None,
        "ratio": None,
        "prompt_lens": lens,
        "mean_prompt_len": statistics.mean(lens),
    }
    if hf_ids is not None and ours_ids is not None:
        row["identical_outputs"] = sum(a == b for a, b in zip(ours_ids, hf_ids)) / n
        row["identical_first_tokens"] = sum(a[0] == b[0] for a, b in zip(ours_ids, hf_ids)) / n
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    mean_ctx = statistics.mean(lens) + (args.max_tokens + 1) / 2
    row["ours_ms_per_step"] = 1e3 * n / row["ours_tok_s"]
    row["hf_ms_per_step"] = 1e3 * n / row["hf_tok_s"] if hf_runs else None
    row["mean_context"] = mean_ctx
    row["step_bytes"] = step_bytes(engine, n, mean_ctx)
    row["step_flops"] = step_flops(engine, n, mean_ctx)
    row["memory_ms_per_step"] = 1e3 * row["step_bytes"] / rates["bandwidth"]
    row["compute_ms_per_step"] = 1e3 * row["step_flops"] / rates["flop_rate"]
    roof_s, bound = roofline_seconds(
        row["step_bytes"], row["step_flops"], rates["bandwidth"], rates["flop_rate"]
    )
    row["roofline_ms_per_step"] = 1e3 * roof_s
    row["roofline_bound"] = bound
    # Decode alone: (full run - prefill-and-first-token run) / (max_tokens - 1) steps,
    # the full run's time from the same median rate as the tok/s column. Not reported
    # (None, "-") when noise makes it impossible: <= 0, faster than the roofline (less
    # 5 % for the rates' own error), or 1.5 x slower than the full run's mean step.
    for side, first in (("ours", ours_first), ("hf", hf_first)):
        rate = row[f"{side}_tok_s"]
        full = n * args.max_tokens / rate if rate else 0.0
        dec = (full - statistics.median(first)) / (args.max_tokens - 1) if first else 0.0
        floor = 0.95e-3 * row["roofline_ms_per_step"]
        valid = max(floor, 0.0) < dec <= 1.5 * full / args.max_tokens
        row[f"{side}_decode_ms_per_step"] = 1e3 * dec if valid else None
        row[f"{side}_decode_tok_s"] = n / dec if valid else None
        row[f"{side}_first_token_s"] = statistics.median(first) if first else None
    decode_ms = row["ours_decode_ms_per_step"] or row["ours_ms_per_step"]
    row["run_roofline_fraction"] = row["roofline_ms_per_step"] / decode_ms
    row["roofline_fraction"] = row["run_roofline_fraction"]
    # The step the roofline describes: every row decoding, no prefill chunk beside it (in
    # the run's ramp, rows that already decode share steps with later prompts' chunks).
    row["ours_step_ms_all_decoding"] = row["steady_roofline_ms"] = row["steady_error"] = None
    if args.steady_steps:
        try:
            steady = steady_decode_step(llm, prompts, args.steady_steps)
            roof_s, bound = roofline_seconds(
                step_bytes(engine, n, steady["mean_context"]),
                step_flops(engine, n, steady["mean_context"]),
                rates["bandwidth"],
                rates["flop_rate"],
            )
            if steady["step_s"] < 0.95 * roof_s:  # the rates' own error is a few %
                raise SteadyStepError(
                    f"{1e3 * steady['step_s']:.3f} ms is faster than its roofline "
                    f"({1e3 * roof_s:.3f} ms): a measuring error"
                )
        except SteadyStepError as exc:
            row["steady_error"] = str(exc)
        else:
            row["ours_step_ms_all_decoding"] = 1e3 * steady["step_s"]
            row["steady_roofline_ms"] = 1e3 * roof_s
            row["roofline_bound"] = bound
            row["roofline_fraction"] = roof_s / steady["step_s"]
    return row


def best_batch(results: list[dict]) -> dict | None:
    """The decode row of ``results`` (``_decode_row``'s dicts with ``prompt_source``) with
    the most output tokens/s, the long-context row left out: ``{"num_prompts",
    "ours_tok_s"}``, or ``None`` when there is no such row."""
    rows = [r for r in results if not r["prompt_source"].endswith("(long context)")]
    if not rows:
        return None
    top = max(rows, key=lambda r: r["ours_tok_s"])
    return {"num_prompts": top["num_prompts"], "ours_tok_s": top["ours_tok_s"]}


def _run(
    args: argparse.Namespace,
    llm: Any,
    rows: list[tuple[int, str]],
    prompt_sets: list[list[list[int]]],
    prefill: tuple[int, int] | None,
    start_s: float = 0.0,
) -> int:
    import torch

    engine = llm.engine
    hf = None if args.ours_only else hf_model(engine)
    pad_id = engine.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids, default=0)
    results: list[dict[str, Any]] = []
    # FP8 weights on a GPU multiply in e4m3 from a few hundred rows (fp8_paths_table), at
    # about twice bf16's rate; on the CPU they are dequantized to the model's dtype
    fp8 = engine.config.model.quantization == "fp8" and engine.device.type == "cuda"
    mm_dtype = torch.float8_e4m3fn if fp8 else engine.dtype
    rates = {
        "bandwidth": copy_bandwidth(engine.device),
        "flop_rate_burst": matmul_rate(engine.device, mm_dtype),
        # the roofline's compute side: the rate the card holds through a run's compute-bound
        # steps (under its power cap), not the burst (roofline.matmul_rate)
        "flop_rate": matmul_rate(
            engine.device, mm_dtype, sustain_s=SUSTAIN_S if engine.device.type == "cuda" else 0
        ),
    }
    bandwidth = rates["bandwidth"]
    graphs = engine.executor.rank0.runner.graphs is not None
    # Start-up is over (the engine, transformers' copy, the compiled kernels): what lives as
    # long as the process goes to the permanent generation, as in a serving worker
    # (gc_watch), so that a generation-2 collection inside a timed run walks what the runs
    # allocate, not the ~370k start-up objects (the CPU machine, random:tiny: a 329 ms
    # collection inside a timed 256-prompt run; 0.01 ms once frozen). Thawed at the end.
    gc_watch = process_watch()
    gc_watch.freeze()
    print(
        f"model {args.model}  dtype {engine.dtype}  device {engine.device}  threads {torch.get_num_threads()}"
        f"  tp {engine.executor.tp_size}  max_tokens {args.max_tokens}  repeats {args.repeats}"
        f"  quantization {engine.config.model.quantization or '-'}"
        f"  kv dtype {engine.executor.rank0.storage.kv.dtype}"
        f"  moe routing {args.moe_routing}"
        f"  max running {engine.config.scheduler.max_running}"
        f"  step budget {engine.config.scheduler.max_num_batched_tokens} tokens"
        f"  kv pages {engine.executor.rank0.storage.num_pages}"
        f"  engine up in {start_s:.0f} s"
    )
    print(
        f"attention {engine.attention_backend}  kv order {engine.executor.rank0.storage.kv_layout.order}  page size {engine.executor.rank0.storage.page_size}"
        f"  cuda graphs {'on' if graphs else 'off'}"
        f"  copy bandwidth (read+write) {bandwidth / 1e9:.1f} GB/s"
        f"  {mm_dtype} matmul {rates['flop_rate'] / 1e12:.2f} TFLOP/s"
        + (
            f" held ({rates['flop_rate_burst'] / 1e12:.2f} burst)"
            if engine.device.type == "cuda"
            else ""
        )
    )
    print(
        f"{'prompts':>7} {'in len':>7} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6}"
        f" {'same outputs':>12} {'same 1st':>8}"
        f" {'ours ms/step':>12} {'hf ms/step':>10} {'ours decode/s':>14} {'hf decode/s':>12}"
        f" {'ours decode ms':>14} {'step ms':>8} {'roof ms':>8} {'bound':>7} {'roofline':>8}"
    )

    def save(complete: bool, prefill_row: dict | None = None) -> None:
        """The JSON report so far (after each row: a run cut short keeps what it measured;
        ``complete`` once every row ran)."""
        if not args.json:
            return
        report = {
            "benchmark": "offline",
            "model": args.model,
            "dtype": str(engine.dtype),
            "device": str(engine.device),
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "input_len": args.input_len,
            "prompts": "gsm8k test questions 0..N-1, chat template, greedy, ignore_eos"
            if args.input_len is None
            else f"{args.input_len} tokens each ({rows[0][1] if rows else '-'}), greedy, "
            "ignore_eos",
            "long_context": args.long_context,
            "ours_only": args.ours_only,
            "torch_threads": torch.get_num_threads(),
            "tensor_parallel_size": engine.executor.tp_size,
            "machine": platform.processor() or platform.machine(),
            "attention_backend": engine.attention_backend,
            "kv_order": engine.executor.rank0.storage.kv_layout.order,
            "page_size": engine.executor.rank0.storage.page_size,
            "cuda_graphs": graphs,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "matmul_flop_per_s": rates["flop_rate"],
            "matmul_flop_per_s_burst": rates["flop_rate_burst"],
            "matmul_dtype": str(mm_dtype),
            "matmul": f"matmul_flop_per_s: an 8,192-square matmul's rate (in matmul_dtype: e4m3 "
            f"_scaled_mm for FP8 weights on a GPU, else the model's dtype) after {SUSTAIN_S:g} s of "
            "them back to back on a GPU (the clock the card holds under its power cap; the "
            "rate the roofline uses), matmul_flop_per_s_burst: the best of 5 (the boost clock)",
            "roofline": "max(step_bytes (weights + KV of the mean context) / copy_bandwidth, "
            "step_flops (2 per matmul weight + 4 L Hq D context, per row; PaLM appendix B) / "
            "matmul_flop_per_s), over the all-decoding step (see step_all_decoding)",
            "step_all_decoding": "ours_step_ms_all_decoding: milliseconds per step over "
            "--steady-steps steps once every prompt of the row decodes (prefilled outside the "
            "timing); roofline_fraction = steady_roofline_ms (at that span's mean context) / "
            "it, roofline_bound that roofline's bound; steady_error: why it was not measured "
            "(then roofline_fraction = run_roofline_fraction); run_roofline_fraction = "
            "roofline_ms_per_step / the whole run's decode ms per step (ours_decode_ms_per_step)",
            "decode": "(time of max_tokens - time of 1 token) / (max_tokens - 1): steps after "
            "the prefill; each timed run starts with an empty prefix cache",
            "quantization": engine.config.model.quantization,
            "kv_cache_dtype": str(engine.executor.rank0.storage.kv.dtype),
            "moe_routing": args.moe_routing,
            "max_running_requests": engine.config.scheduler.max_running,
            "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
            "kv_pages": engine.executor.rank0.storage.num_pages,
            "engine_start_s": start_s,
            "results": results,
            "complete": complete,
            "best_batch": best_batch(results),
            "prefill": prefill_row,
            "gc": gc_watch.stats(),
        }
        write_json(args.json, report)

    for (n, source), prompts in zip(rows, prompt_sets):
        row = _decode_row(args, llm, hf, prompts, pad_id, rates)
        row["prompt_source"] = source
        results.append(row)
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        print(
            f"{n:>7} {row['mean_prompt_len']:>7.0f} {row['ours_tok_s']:>11.1f} "
            f"{_fmt(row['hf_tok_s']):>9} "
            f"{_fmt(row['ratio'], '.2f'):>6} {pct(row['identical_outputs']):>12} "
            f"{pct(row['identical_first_tokens']):>8} {row['ours_ms_per_step']:>12.2f} "
            f"{_fmt(row['hf_ms_per_step'], '.2f'):>10} {_fmt(row['ours_decode_tok_s']):>14} "
            f"{_fmt(row['hf_decode_tok_s']):>12} {_fmt(row['ours_decode_ms_per_step'], '.2f'):>14} "
            f"{_fmt(row['ours_step_ms_all_decoding'], '.2f'):>8} "
            f"{row['steady_roofline_ms'] or row['roofline_ms_per_step']:>8.2f} {row['roofline_bound']:>7} "
            f"{row['roofline_fraction']:>8.0%}"
        )
        if row["steady_error"]:
            print(f"        step ms of {n} prompts not measured: {row['steady_error']}")
        save(False)
    best = best_batch(results)
    if best is not None:
        print(f"best batch: {best['num_prompts']} prompts, {best['ours_tok_s']:.1f} tok/s")
    prefill_row = None
    if prefill:
        prefill_row = _time_prefill(llm, hf, prefill, pad_id, args.repeats)
        theirs = "-" if prefill_row["hf_tok_s"] is None else f"{prefill_row['hf_tok_s']:.0f}"
        print(
            f"prefill {prefill[0]} x {prefill[1]} tokens: ours {prefill_row['ours_tok_s']:.0f} "
            f"tok/s, hf {theirs} tok/s, ratio {_fmt(prefill_row['ratio'], '.2f')}"
        )
    save(True, prefill_row)
    return 0
