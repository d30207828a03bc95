"""Issue 26, session 7: the one-row decode step with each kernel lever on and off, in one
engine (one model load), then ``pdserve bench offline`` again with the fastest deployable
variant. Session 7's run (docs/figures/h200_s7/fp8row.json) also measured two levers
dropped after it: ``tf`` (every kernel letting the next launch before its own wait) and
``gpreN`` (the gemv asking for N lines of each weight row in L2 before the wait).

Usage: ``python scripts/gpu_s7_fp8row.py --key fp8 --variants base,pdl,pdl+fq [--shape
1x200] [--json fp8row.json] -- BENCH-OFFLINE-FLAGS...``. The flags after ``--`` are
``pdserve bench offline``'s (``--json`` is set here). Steps, on bench offline's engine:

1. bench offline's rows with every lever off (the defaults);
2. per variant (``+``-joined words, see :func:`set_variant`): the levers set, the CUDA graphs
   captured again, ``gpu_step_profile.profile_shapes`` at ``--shape`` (step wall time, GPU
   kernels by name, kernels a step), and the greedy tokens of one prompt (32 tokens) against
   the first variant's (``same_tokens_as_first``: which levers keep the bits);
3. ``--combine``: the levers (:data:`LEVERS`) that each beat ``pdl`` alone by more than
   0.005 ms, together, measured the same way; then the ``--late`` variants;
4. :func:`kernel_checks` (bits of the new kernels under PDL against the old ones);
5. the fastest measured variant without ``attn`` words (those change the decode split count
   of a graph that serves contexts up to 1,024 tokens: measured for what one split would
   give, not deployable as is): bench offline's rows again with it.

Variants stop once ``--budget`` seconds have passed (the rerun of step 5 still runs).
Everything goes to ``$OUT/JSON`` under ``--key`` (the file is read first and the key
replaced, so several runs share one file), written after each item. A variant that fails
(a kernel that does not build) is recorded with its error and the rest go on.
``--device cpu`` with ``random:tiny`` checks the script (no graphs: the profile runs eager).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_step_profile import profile_shapes

from pdserve.bench import offline
from pdserve.cli import build_parser
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model import fp8, pdl, triton_backend, triton_w8a8

BASE_PATHS: dict = {}
DEFAULT_DECODE_CONFIG = triton_backend.decode_config
SUMMARY_KEYS = ("step_ms", "kernel_ms", "kernels_per_step", "same_tokens_as_first", "error")
WORDS = ("base", "pdl", "early", "wpre", "fq", "silu", "a8", "s3")
WORDS += ("attn1", "attn2", "attn4")
# the single levers --combine may put together (a8+fq counts as one)
LEVERS = ("fq", "early", "wpre", "silu", "a8+fq", "s3")


def _one_row_paths(words: list[str]) -> None:
    """``a8``: the one-row FP8 gemv shapes take their 2-row w8a8 tile (activations quantized
    per token; with ``fq`` inside the norm); ``s3``: the gemv tiles with 3 pipeline stages."""
    fp8.PATHS.clear()
    fp8.PATHS.update(BASE_PATHS)
    for shape, entries in BASE_PATHS.items():
        (m1, (kind, cfg)), rest = entries[0], entries[1:]
        if m1 != 1 or kind != "gemv":
            continue
        if "a8" in words and rest and rest[0][1][0] == "w8a8":
            fp8.PATHS[shape] = ((1, rest[0][1]), *rest)
        elif "s3" in words and cfg is not None:
            fp8.PATHS[shape] = ((1, ("gemv", (*cfg[:4], 3))), *rest)


def _forced_splits(splits: int):
    def config(num_seqs, num_kv_heads, page_size, max_seq_len, total_context=None, picks=None):
        kw = {} if picks is None else {"picks": picks}
        cfg = DEFAULT_DECODE_CONFIG(
            num_seqs, num_kv_heads, page_size, max_seq_len, total_context, **kw
        )
        short = max_seq_len is not None and max_seq_len <= triton_backend.ONE_SPLIT_MAX_CONTEXT
        if short and num_seqs * num_kv_heads < 256:
            cfg = dataclasses.replace(cfg, splits=splits)
        return cfg

    return config


def set_variant(variant: str) -> None:
    """Words: ``base`` (every lever off), ``pdl`` (PDSERVE_TRITON_PDL=1), ``early``
    (triton_w8a8.GEMV_EARLY_WEIGHTS), ``wpre`` (triton_w8a8.W8A8_PREFETCH), ``fq`` (fp8.FUSE_NORM_QUANT), ``silu``
    (fp8.FUSE_SILU_GEMV), ``a8`` / ``s3`` (:func:`_one_row_paths`), ``attnN`` (N decode
    splits at short contexts below 256 rows x KV heads)."""
    words = variant.split("+")
    bad = [w for w in words if w not in WORDS]
    if bad:
        raise ValueError(f"unknown variant words {bad}: not in {WORDS}")
    os.environ["PDSERVE_TRITON_PDL"] = "1" if "pdl" in words else "0"
    pdl._options.cache_clear()
    triton_w8a8.GEMV_EARLY_WEIGHTS = "early" in words
    triton_w8a8.W8A8_PREFETCH = "wpre" in words
    fp8.FUSE_NORM_QUANT = "fq" in words
    fp8.FUSE_SILU_GEMV = "silu" in words
    _one_row_paths(words)
    attn = [int(w[4:]) for w in words if w.startswith("attn")]
    triton_backend.decode_config = _forced_splits(attn[0]) if attn else DEFAULT_DECODE_CONFIG


def kernel_checks(device) -> dict:
    """Bit-equality on the device, under PDL, at Llama-3.1-8B's shapes: the fused add +
    RMSNorm + quantization against the two kernels; the one-row gemv with its first weight
    tile read early against the plain one; the w8a8 kernel with and
    without its prefetch. ``{check: True/False}`` (an exception: its text)."""
    import torch

    from pdserve.model import fused_ops

    out: dict = {}
    set_variant("pdl")
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)

    try:
        x, r, nw = rnd(3, 4096), rnd(3, 4096), 1 + 0.1 * rnd(4096)
        h0, y0 = fused_ops.add_rms_norm(x, r, nw, 1e-5)
        q0, s0 = triton_w8a8.quantize_rows(y0)
        h1, q1, s1 = fused_ops.add_rms_norm_quant(x, r, nw, 1e-5)
        out["norm_quant_bits"] = bool(
            torch.equal(h0, h1)
            and torch.equal(s0, s1)
            and torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
        )
        for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
            wq, ws = fp8.quantize_per_channel(0.05 * rnd(n, k).float())
            xv = rnd(1, k)
            cfg = ("gemv", 8, 512 if n == 6144 else 1024, 4, 1)
            ref = triton_w8a8.gemv(xv, wq, ws, None, cfg)
            triton_w8a8.GEMV_EARLY_WEIGHTS = True
            got = triton_w8a8.gemv(xv, wq, ws, None, cfg)
            triton_w8a8.GEMV_EARLY_WEIGHTS = False
            out[f"gemv_early_bits_{n}x{k}"] = bool(torch.equal(ref, got))
        wq, ws = fp8.quantize_per_channel(0.05 * rnd(28672, 4096).float())
        xq, xs = triton_w8a8.quantize_rows(rnd(1, 4096))
        cfg8 = ("w8a8", 16, 64, 128, 1, True, 4, 4)
        ref = triton_w8a8.w8a8(xq, xs, wq, ws, None, torch.bfloat16, cfg8)
        triton_w8a8.W8A8_PREFETCH = True
        got = triton_w8a8.w8a8(xq, xs, wq, ws, None, torch.bfloat16, cfg8)
        out["w8a8_prefetch_bits"] = bool(torch.equal(ref, got))
    except Exception as exc:  # noqa: BLE001 recorded, the run goes on
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    set_variant("base")
    print(f"CHECKS {json.dumps(out)}", flush=True)
    return out


def recapture(llm) -> None:
    """The engine's decode graphs captured again under the levers now set."""
    g = llm.engine.executor.rank0.runner.graphs
    if g is None:
        return
    g._graphs.clear(), g._logits.clear(), g._greedy.clear()
    g._pool = None  # a fresh pool: the old one went with its graphs
    gc.collect()
    g.capture()


def greedy_tokens(llm, n: int = 32) -> list[int]:
    prompt = [1 + (j * 37) % 3000 for j in range(120)]
    llm.reset_prefix_cache()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--key", required=True, help="this run's key in the JSON (fp8, bf16)")
    ap.add_argument("--variants", default="base,pdl", help="comma-separated, first: reference")
    ap.add_argument("--combine", action="store_true", help="also the winning levers together")
    ap.add_argument(
        "--late", default="", help="variants measured after --combine's, if time is left"
    )
    ap.add_argument("--shape", default="1x200", help="ROWSxCONTEXT profiled")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default="fp8row.json", help="file name under $OUT")
    ap.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds from the start after which no further variant is measured (the rerun "
        "of bench offline with the best one still runs); 0: no limit",
    )
    own = ap.parse_args(argv[:split])
    args = build_parser().parse_args(["bench", "offline", *argv[split + 1 :]])
    out = os.environ.get("OUT", ".")
    path = os.path.join(out, own.json)
    bench_tmp = os.path.join(out, f"_bench_{own.key}.json")
    args.json = bench_tmp
    doc: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    res: dict = {"variants": {}, "argv": argv}
    doc[own.key] = res

    def save() -> None:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    def take_bench(name: str) -> None:
        if os.path.exists(bench_tmp):
            with open(bench_tmp) as f:
                b = json.load(f)
            os.remove(bench_tmp)
            keep = ("num_prompts", "ours_tok_s", "ours_runs", "ours_decode_ms_per_step")
            keep += ("ours_step_ms_all_decoding", "roofline_fraction", "steady_roofline_ms")
            keep += ("ours_first_token_s",)
            res[name] = {
                "engine_start_s": b.get("engine_start_s"),
                "copy_bandwidth_bytes_per_s": b.get("copy_bandwidth_bytes_per_s"),
                "rows": [{k: r.get(k) for k in keep} for r in b.get("results", [])],
            }
            save()

    t0 = time.time()

    def measure(llm, variant: str, ref: list[int] | None) -> dict:
        t = time.time()
        try:
            set_variant(variant)
            recapture(llm)
            prof = profile_shapes(llm, [own.shape], own.steps, top_n=14)[own.shape]
            r = {k: prof[k] for k in ("step_ms", "step_ms_spans", "kernel_ms", "gap_ms")}
            r["kernels_per_step"] = prof["kernels_per_step"]
            r["top_kernels_ms"] = prof["top_kernels_ms"]
            r["kernel_counts_per_step"] = {
                k: c for k, c in prof["kernel_counts_per_step"].items() if c >= 1
            }
            toks = greedy_tokens(llm)
            r["same_tokens_as_first"] = None if ref is None else toks == ref
            r["tokens"] = toks
        except Exception as exc:  # noqa: BLE001 a variant that fails is recorded, the rest go on
            traceback.print_exc()
            r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        r["seconds"] = round(time.time() - t, 1)
        res["variants"][variant] = r
        save()
        brief = {k: v for k, v in r.items() if k in SUMMARY_KEYS}
        print(f"VARIANT {own.key} {variant}: {json.dumps(brief)}", flush=True)
        return r

    def after(llm) -> None:
        res["engine_up_s"] = round(time.time() - t0, 1)
        take_bench("bench_default")
        BASE_PATHS.update(fp8.PATHS)
        ref = None
        names = [v for v in own.variants.split(",") if v]
        for i, variant in enumerate(names):
            if own.budget and time.time() - t0 > own.budget:
                res["skipped"] = names[i:]
                print(
                    f"SKIPPED {own.key} {names[i:]}: past --budget {own.budget:.0f} s", flush=True
                )
                break
            r = measure(llm, variant, ref)
            if i == 0 and "tokens" in r:
                ref = r["tokens"]
        ok = {v: r["step_ms"] for v, r in res["variants"].items() if "step_ms" in r}
        if own.combine and "pdl" in ok:
            wins = [w for w in LEVERS if ok.get(f"pdl+{w}", 1e9) < ok["pdl"] - 0.005]
            if "gpre16" in wins and "gpre32" in wins:  # one prefetch depth: the faster
                wins.remove(max(("gpre16", "gpre32"), key=lambda w: ok[f"pdl+{w}"]))
            words = [x for w in wins for x in w.split("+")]
            combo = "+".join(["pdl", *dict.fromkeys(words)])
            if len(wins) > 1 and not (own.budget and time.time() - t0 > own.budget):
                measure(llm, combo, ref)
        late = [v for v in own.late.split(",") if v]
        for i, variant in enumerate(late):
            if own.budget and time.time() - t0 > own.budget:
                res["skipped"] = res.get("skipped", []) + late[i:]
                print(f"SKIPPED {own.key} {late[i:]}: past --budget {own.budget:.0f} s", flush=True)
                break
            measure(llm, variant, ref)
        if llm.engine.device.type == "cuda":  # (minutes under the CPU interpreter)
            res["kernel_checks"] = kernel_checks(llm.engine.device)
            save()
        ok = {
            v: r["step_ms"]
            for v, r in res["variants"].items()
            if "step_ms" in r and "attn" not in v
        }
        if not ok:
            return
        best = min(ok, key=lambda v: ok[v])
        res["best"] = best
        save()
        print(f"BEST {own.key} {best}: step {ok[best]:.3f} ms", flush=True)
        if best.split("+") == ["base"]:
            return
        set_variant(best)
        recapture(llm)
        counts = offline._parse_counts(args.num_prompts)
        prompts = [offline.workload_prompts(llm, n, None, None) for n in counts]
        rc = offline._run(args, llm, [(n, "gsm8k") for n in counts], prompts, None)
        res["bench_best_rc"] = rc
        take_bench("bench_best")

    rc = offline.run_offline(args, after)
    res["bench_default_rc"] = rc
    res["total_s"] = round(time.time() - t0, 1)
    save()
    return rc


if __name__ == "__main__":
    sys.exit(main())
