"""Issue 26's GPU measurements of FP8 (run by ``scripts/gpu_fp8_check.sh``; each part writes
its JSON into OUT as soon as it is done).

``kernels``  the FP8 linear layers at Llama-3.1-8B's four shapes, M = 1..256 rows, each
             timed in a CUDA graph over weight copies that do not fit in L2: bf16
             ``F.linear``, ``torch._scaled_mm`` (e4m3 weight, per-channel scales, dynamic
             per-token activation scales) and the Triton kernel (``model/triton_fp8.py``:
             its default configuration and a small sweep); the suggested crossover row
             count and ``triton_fp8.TABLE`` entries; the sum over the 4 linears x 32
             layers next to issue 26's bf16/``_scaled_mm`` table (the engine's own choice,
             timed at start, and the newer kernels: ``gpu_fp8_kernels2.py``).
``engine``   ``random:llama-3.1-8b``, bf16, ``quantization="fp8"``,
             ``kv_cache_dtype="fp8_e4m3"`` through the offline ``LLM`` (CUDA graphs on):
             output tok/s at 1, 64, 256 and 1,024 prompts (the GSM8K prompts of ``bench
             offline``, 128 output tokens, greedy, EOS ignored) and the decode step of 32 x
             4,096-token random prompts ((time of 33 tokens - time of 1) / 32).
``engine-bf16kv``  the same with the bf16 KV cache at 1 and 64 prompts and the long
             context; the FP8-KV / bf16-KV step ratio lands in its JSON.
``engine-block``  (not run by the .sh) ``quantization="fp8_block"`` with FP8 KV at 1 and 64
             prompts and the long context.
``smoke``    the same code at ``random:tiny`` on CPU (the kernels part skipped), to check
             the script before a GPU call.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

OUT = os.environ.get("OUT", "gpu_fp8_check")
SHAPES = {  # Llama-3.1-8B: (N, K)
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
ROWS = (1, 4, 16, 32, 64, 128, 256)


def _dump(name: str, data: dict) -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {os.path.join(OUT, name)}", flush=True)


def _graph_us(fns, reps: int = 20) -> float:
    """Mean µs of one call of ``fns[i % len(fns)]`` replayed in a CUDA graph."""
    for f in fns:  # compile / warm up outside the capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return 1e3 * t0.elapsed_time(t1) / (5 * reps)


def kernels() -> dict:
    from pdserve.model import fp8, triton_fp8

    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "shapes": {}, "torch": torch.__version__}
    rows_cfgs = [("rows", bn, 512, sp, 4, 2) for bn, sp in ((8, 1), (16, 1), (16, 2), (32, 1))]
    dot_cfgs = [("dot", bn, 128, sp, 4, 3) for bn, sp in ((32, 1), (64, 1), (64, 2), (32, 4))]
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-(256 << 20) // (n * k)))  # > 2 x L2 of fp8 weights per graph
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qw = [fp8.Fp8Weight(*fp8.quantize_per_channel(w), k) for w in w16]
        entry: dict = {}
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row: dict = {"bf16_us": _graph_us([lambda w=w, x=x: F.linear(x, w) for w in w16])}
            try:
                row["scaled_mm_us"] = _graph_us(
                    [lambda q=q, x=x: fp8.scaled_mm(x, q, None) for q in qw]
                )
            except RuntimeError as exc:  # shapes cuBLASLt refuses
                row["scaled_mm_us"], row["scaled_mm_error"] = None, str(exc)[:200]
            default = triton_fp8.config_for(m, n, k, k)
            row["triton_default"] = list(default)
            row["triton_default_us"] = _graph_us(
                [
                    lambda q=q, x=x, k=k, c=default: triton_fp8.fp8_matmul(
                        x, q.weight, q.scale, k, None, c
                    )
                    for q in qw
                ]
            )
            best = (row["triton_default_us"], default)
            cfgs = rows_cfgs if m == 1 else (dot_cfgs if m in (16, 64) else [])
            for cfg in cfgs:
                try:
                    us = _graph_us(
                        [
                            lambda q=q, c=cfg, x=x, k=k: triton_fp8.fp8_matmul(
                                x, q.weight, q.scale, k, None, c
                            )
                            for q in qw
                        ]
                    )
                except Exception as exc:  # noqa: BLE001 a configuration Triton cannot build
                    print(f"{name} M={m} {cfg}: {exc}"[:200], flush=True)
                    continue
                if us < best[0]:
                    best = (us, cfg)
            row["triton_best_us"], row["triton_best"] = best[0], list(best[1])
            row["fp8_weight_bytes"] = n * k
            row["triton_best_gbps"] = n * k / (best[0] * 1e3)
            entry[str(m)] = row
            print(name, m, {kk: v for kk, v in row.items() if kk.endswith("_us")}, flush=True)
        res["shapes"][name] = {"n": n, "k": k, "rows": entry}
        min_rows = next(
            (
                m
                for m in ROWS
                if entry[str(m)]["scaled_mm_us"] is not None
                and entry[str(m)]["scaled_mm_us"] < entry[str(m)]["triton_best_us"]
            ),
            None,
        )
        res["shapes"][name]["suggested_scaled_mm_min_rows"] = min_rows
        _dump("fp8_kernels.json", res)  # after each shape: a cut run keeps what it measured
        del w16, qw
        torch.cuda.empty_cache()
    totals = {}
    for m in ROWS:
        t = {"bf16": 0.0, "scaled_mm": 0.0, "triton_best": 0.0, "fp8_chosen": 0.0}
        for name in SHAPES:
            r = res["shapes"][name]["rows"][str(m)]
            t["bf16"] += r["bf16_us"]
            t["scaled_mm"] += r["scaled_mm_us"] or float("nan")
            t["triton_best"] += r["triton_best_us"]
            t["fp8_chosen"] += min(r["triton_best_us"], r["scaled_mm_us"] or float("inf"))
        totals[str(m)] = {key: 32 * v / 1e3 for key, v in t.items()}  # ms for 32 layers
    res["four_linears_x32_ms"] = totals
    res["note"] = "µs per call in a CUDA graph of 20 calls over weight copies > 256 MiB in all"
    _dump("fp8_kernels.json", res)
    return res


def _decode_step_ms(llm, prompts, steps: int) -> dict:
    from pdserve.bench.offline import _time_ours

    _time_ours(llm, prompts, steps + 1)  # warm-up: graphs of this batch, kernel compiles
    _time_ours(llm, prompts, 1)
    full = _time_ours(llm, prompts, steps + 1)[0]
    first = _time_ours(llm, prompts, 1)[0]
    return {"decode_ms_per_step": 1e3 * (full - first) / steps, "prefill_and_first_s": first}


def engine(
    model, device, kvs, counts, long_n, long_len, max_tokens, name, quantization="fp8"
) -> dict:
    """``LLM(model, quantization="fp8", kv_cache_dtype=kv)`` for each of ``kvs``: out tok/s
    at ``counts`` prompts and the decode step of ``long_n`` random ``long_len``-token
    prompts; JSON into OUT/``name`` after each (with the FP8-KV / bf16-KV step ratio once
    both are in OUT)."""
    from pdserve.bench.offline import _prompts, _random_prompts, _time_ours
    from pdserve.engine.llm import LLM

    res: dict = {
        "model": model,
        "device": device,
        "quantization": quantization,
        "max_tokens": max_tokens,
        "runs": [],
    }
    for kv in kvs:
        t0 = time.perf_counter()
        llm = LLM(
            model,
            dtype="bfloat16" if device == "cuda" else "float32",
            device=device,
            quantization=quantization,
            kv_cache_dtype=kv,
            max_running_requests=max([*counts, long_n]),
            max_model_len=max(long_len, 512) + 64,
        )
        run: dict = {"kv_cache_dtype": kv, "load_s": time.perf_counter() - t0, "throughput": []}
        storage = llm.engine.executor.rank0.storage
        run["kv_pool"] = {
            "dtype": str(storage.kv.dtype),
            "pages": storage.num_pages,
            "page_bytes": storage.page_bytes,
        }
        print(kv, "loaded in", round(run["load_s"], 1), "s", run["kv_pool"], flush=True)
        try:
            all_prompts = _prompts(llm, max(counts))
            for n in counts:
                prompts = all_prompts[:n]
                _time_ours(llm, prompts, max_tokens)  # warm-up
                dt = _time_ours(llm, prompts, max_tokens)[0]
                row = {"num_prompts": n, "out_tok_s": n * max_tokens / dt, "seconds": dt}
                run["throughput"].append(row)
                print(kv, row, flush=True)
                _dump(name, {**res, "runs": [*res["runs"], run]})
            long = _random_prompts(llm.engine.vocab_size, long_n, long_len, seed=5)
            run["long_context"] = {
                "num_prompts": long_n,
                "prompt_len": long_len,
                **_decode_step_ms(llm, long, 32),
            }
            print(kv, run["long_context"], flush=True)
        finally:
            llm.shutdown()
            del llm
            if device == "cuda":
                torch.cuda.empty_cache()
        res["runs"].append(run)
        _dump(name, res)
    steps = {}
    for f in ("fp8_engine.json", "fp8_engine_bf16kv.json", name):
        path = os.path.join(OUT, f)
        if os.path.exists(path):
            with open(path) as fh:
                for r in json.load(fh)["runs"]:
                    steps[r["kv_cache_dtype"]] = r.get("long_context", {}).get("decode_ms_per_step")
    if steps.get("fp8_e4m3") and steps.get("auto"):
        res["long_context_fp8_over_bf16_kv"] = steps["fp8_e4m3"] / steps["auto"]
        _dump(name, res)
    return res


def main() -> int:
    parts = sys.argv[1:] or ["kernels", "engine", "engine-bf16kv"]
    if "smoke" in parts:
        engine("random:tiny", "cpu", ("fp8_e4m3",), [1, 4], 2, 64, 8, "fp8_engine.json")
        engine("random:tiny", "cpu", ("auto",), [1], 2, 64, 8, "fp8_engine_bf16kv.json")
        return 0
    if "kernels" in parts:
        kernels()
    model = "random:llama-3.1-8b"
    if "engine" in parts:  # FP8 weights + FP8 KV: the throughput rows and the long context
        engine(model, "cuda", ("fp8_e4m3",), [1, 64, 256, 1024], 32, 4096, 128, "fp8_engine.json")
    if "engine-bf16kv" in parts:  # FP8 weights + bf16 KV: the long context (and 1, 64 prompts)
        engine(model, "cuda", ("auto",), [1, 64], 32, 4096, 128, "fp8_engine_bf16kv.json")
    if "engine-block" in parts:  # not in the .sh: --quantization fp8_block, 1 and 64 prompts
        engine(model, "cuda", ("fp8_e4m3",), [1, 64], 32, 4096, 128, "fp8_block.json", "fp8_block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
