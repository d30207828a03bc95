"""Issue 24, session 8 (bf16 decode at 64-256 rows, the linear layers): two modes.

``micro`` (no model; run beside the engine's load): for each Llama-3.1-8B linear shape (qkv
6144x4096, o 4096x4096, gate_up 28672x4096 (also as ``swiglu``: gate/up with SwiGLU in the
epilogue, ``pdserve/model/triton_skinny.py``), down 4096x14336) at 64 / 128 / 256 rows, each
variant timed alone: a CUDA graph of back-to-back launches over weight copies together
> 256 MB (every launch reads HBM), median of 3 replays: ``F.linear`` (cuBLAS; for swiglu
F.linear + ``fused_ops.silu_mul``), ``torch.mm`` on a pre-transposed weight ``[K, N]``,
F.linear under ``preferred_blas_library('cublaslt')``, and the skinny Triton GEMM's
configurations (under PDL, as the engine launches it). Output checked against F.linear
(fp32 reference error within 2x cuBLAS's + 1e-3). A torch d2d copy and a bf16 8192^3 matmul
measured in the same run give bytes / time and TFLOP/s fractions. -> ``$OUT/mm64_micro.json``.

``engine`` (one ``random:llama-3.1-8b`` load, 256 running requests, graphs to 256 rows):
1. ``base``: the 64x200 and 256x200 decode step profile (``gpu_step_profile``), 64
   prompts' greedy tokens (bench offline's workload, 128 tokens); the 256-prompt
   all-decoding step (``bench.roofline.steady_decode_step``'s procedure, each step timed
   alone, with the rows each step ran) as bench offline measures it (max_tokens = the
   context room) and with max_tokens 160 (the S7 19.66 vs 9.67 ms question).
2. ``skinny``: the micro sweep's winners (faster than the best cuBLAS variant by >=
   ``--min-gain``) put into ``skinny_table.TABLE`` (at 64 rows, if none wins, the best
   skinny configuration per shape anyway: labelled ``forced``), graphs captured again: the
   step profiles, greedy tokens compared with base, ``bench offline``'s 64 / 256 rows.
3. ``base_again``: the table off, the first graphs swapped back: the step profiles (A, B, A).
-> ``$OUT/mm64.json`` (the micro JSON merged in). Run by ``scripts/gpu_s8_mm64.sh``;
``--device cpu`` (TRITON_INTERPRET=1, ``--model random:tiny --toy``) checks both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.perf_counter()
SHAPES = {  # name: (N, K, swiglu); gate_up runs as swiglu (its F.linear alone also timed)
    "qkv": (6144, 4096, False),
    "o_proj": (4096, 4096, False),
    "swiglu": (28672, 4096, True),
    "down": (4096, 14336, False),
}
TOY_SHAPES = {"qkv": (96, 64, False), "o_proj": (64, 64, False), "swiglu": (192, 64, True)}
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages, PREFETCH lines) per row count and
# shape: a few each (every one is a compile, and the sweep runs beside the model load),
# chosen so the grid fills the 132 SMs in about one wave (1 or 2 CTAs an SM by shared memory)
CANDS: dict[int, dict[str, list[tuple[int, int, int, int, int, int, int]]]] = {
    64: {
        "qkv": [(64, 64, 128, 2, 4, 3, 4), (64, 32, 128, 1, 4, 4, 4), (64, 64, 128, 4, 4, 3, 4)],
        "o_proj": [(64, 64, 128, 2, 4, 4, 4), (64, 32, 128, 2, 4, 4, 4), (64, 64, 128, 4, 4, 3, 4)],
        "swiglu": [(64, 128, 64, 1, 8, 4, 4), (64, 64, 64, 1, 4, 4, 4)],
        "down": [(64, 64, 128, 2, 4, 4, 4), (64, 64, 128, 4, 4, 3, 4), (64, 32, 128, 2, 4, 4, 4)],
    },
    128: {
        "qkv": [(128, 64, 64, 2, 4, 4, 4)],
        "o_proj": [(128, 64, 64, 2, 4, 4, 4), (128, 64, 64, 4, 4, 4, 4)],
        "swiglu": [(128, 64, 64, 1, 8, 3, 4)],
        "down": [(128, 64, 64, 4, 4, 4, 4)],
    },
    256: {"qkv": [], "o_proj": [], "swiglu": [(128, 128, 64, 1, 8, 3, 4)], "down": []},
}
TOY_CANDS = {16: {k: [(16, 16, 32, 1, 4, 2, 0), (16, 16, 32, 2, 4, 2, 0)] for k in TOY_SHAPES}}


def elapsed() -> float:
    return time.perf_counter() - T0


def save(path: str, res: dict) -> None:
    res["elapsed_s"] = elapsed()
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def graph_time_us(fn_list, cuda: bool, reps: int = 3) -> float:
    """Mean microseconds per call of ``fn_list`` (one call each, in order) replayed as one
    CUDA graph (median of ``reps`` replays); on CPU plain wall time of one pass."""
    if not cuda:
        t = time.perf_counter()
        for fn in fn_list:
            fn()
        return (time.perf_counter() - t) / len(fn_list) * 1e6
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fn_list[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fn_list))
    del g
    return statistics.median(times)


def micro(args) -> None:
    from pdserve.model import fused_ops, triton_skinny

    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {"t_start_wall": time.time(), "rows": [], "errors": {}}
    if cuda:
        res["device"] = torch.cuda.get_device_name(0)
        res["torch"] = torch.__version__
        import triton

        res["triton"] = triton.__version__
        # the rates of this run: a d2d copy (bytes counted once) and a bf16 matmul
        a = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        res["copy_gbps"] = a.numel() / graph_time_us([lambda: b.copy_(a)] * 8, True) / 1e3
        del a, b
        ma = torch.randn(8192, 8192, device=dev, dtype=dtype)
        mb = torch.randn(8192, 8192, device=dev, dtype=dtype)
        res["matmul_tflops"] = 2 * 8192**3 / graph_time_us([lambda: ma @ mb] * 6, True) / 1e6
        del ma, mb
        print(f"copy {res['copy_gbps']:.0f} GB/s, bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s",
              flush=True)  # fmt: skip
    shapes = TOY_SHAPES if args.toy else SHAPES
    cands = TOY_CANDS if args.toy else CANDS
    ms = [int(m) for m in args.ms.split(",")] if args.ms else sorted(cands)
    gen = torch.Generator().manual_seed(0)
    for M in ms:
        for name, (N, K, sw) in shapes.items():
            if elapsed() > args.budget_s:
                res["errors"][f"{name}@{M}"] = "budget"
                continue
            wbytes = N * K * (2 if cuda else 4)
            copies = max(2, -(-(256 << 20) // wbytes)) if cuda else 1
            w0 = (torch.randn(N, K, generator=gen) / K**0.5).to(dev, dtype)
            ws = [w0] + [w0.clone() for _ in range(copies - 1)]
            wts = [w.t().contiguous() for w in ws[:copies]] if not sw else None
            x = torch.randn(M, K, generator=gen).to(dev, dtype)
            ref32 = F.linear(x.float(), w0.float())
            if sw:
                g32, u32 = ref32.chunk(2, dim=-1)
                ref32 = F.silu(g32) * u32

            def cublas(w, x=x, sw=sw):
                y = F.linear(x, w)
                return fused_ops.silu_mul(y) if (sw and cuda) else (
                    F.silu(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1] if sw else y)  # fmt: skip

            cub = cublas(w0)
            cub_err = (cub.float() - ref32).abs().max().item()
            row: dict[str, Any] = {"shape": name, "M": M, "N": N, "K": K, "swiglu": sw,
                                   "weight_bytes": wbytes, "flop": 2 * M * N * K,
                                   "cublas_err": cub_err, "us": {}, "err": {},
                                   "t_wall": time.time()}  # fmt: skip
            variants: dict[str, Any] = {"cublas": lambda i, ws=ws: cublas(ws[i])}
            if wts is not None:
                variants["mm_t"] = lambda i, x=x, wts=wts: torch.mm(x, wts[i])
            if cuda and not sw:
                variants["cublaslt"] = "lt"
            if sw:  # gate_up's F.linear alone (no activation): its bandwidth, not a candidate
                variants["gate_up_only"] = lambda i, x=x, ws=ws: F.linear(x, ws[i])
            for cfg in cands.get(M, {}).get(name, []):
                try:
                    triton_skinny.check(cfg, M, N // 2 if sw else N, K, sw)
                except ValueError:
                    continue
                variants[str(cfg)] = lambda i, cfg=cfg, x=x, ws=ws, sw=sw: triton_skinny.run(
                    x, ws[i], None, cfg, swiglu=sw
                )
            for vname, fn in variants.items():
                try:
                    if fn == "lt":
                        prev = torch.backends.cuda.preferred_blas_library()
                        torch.backends.cuda.preferred_blas_library("cublaslt")
                        try:
                            y = F.linear(x, w0)
                            us = graph_time_us(
                                [
                                    lambda i=i, x=x, ws=ws, c=copies: F.linear(x, ws[i % c])
                                    for i in range(4 * copies)
                                ],
                                cuda,
                            )
                        finally:
                            torch.backends.cuda.preferred_blas_library(prev)
                    else:
                        y = fn(0)
                        n_calls = 4 * copies if cuda else 2
                        us = graph_time_us(
                            [lambda i=i, fn=fn, c=copies: fn(i % c) for i in range(n_calls)], cuda
                        )
                    err = (y.float() - ref32).abs().max().item() if vname != "gate_up_only" else 0.0
                    row["err"][vname] = err
                    if err > 2 * cub_err + 1e-3:
                        res["errors"][f"{name}@{M}:{vname}"] = (
                            f"error {err:.4g} vs cuBLAS {cub_err:.4g}"
                        )
                        continue
                    row["us"][vname] = us
                except Exception as exc:  # noqa: BLE001 (one failed variant must not end the sweep)
                    res["errors"][f"{name}@{M}:{vname}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            torch_best = min(
                (v for k, v in row["us"].items() if not k.startswith("(") and k != "gate_up_only"),
                default=None,
            )
            sk = {k: v for k, v in row["us"].items() if k.startswith("(")}
            if sk:
                bk = min(sk, key=lambda k: sk[k])
                row["best_skinny"], row["best_skinny_us"] = bk, sk[bk]
                row["speedup_vs_cublas"] = row["us"].get("cublas", float("nan")) / sk[bk]
                row["speedup_vs_best_torch"] = (torch_best or float("nan")) / sk[bk]
            if cuda:
                row["gbps"] = {k: wbytes / v / 1e3 for k, v in row["us"].items()}
                row["tflops"] = {k: 2 * M * N * K / v / 1e6 for k, v in row["us"].items()}
                row["bw_fraction"] = {k: g / res["copy_gbps"] for k, g in row["gbps"].items()}
                row["flop_fraction"] = {
                    k: t / res["matmul_tflops"] for k, t in row["tflops"].items()
                }
            res["rows"].append(row)
            us = "  ".join(
                f"{k} {v:.1f}" for k, v in sorted(row["us"].items(), key=lambda kv: kv[1])[:4]
            )
            print(f"[{elapsed():5.1f} s] {name:8s} M={M:4d}: {us}", flush=True)
            save(out_path, res)
            del ws, wts, x
            if cuda:
                torch.cuda.empty_cache()
    res["t_end_wall"] = time.time()
    save(out_path, res)


def picks(micro_res: dict, min_gain: float, force_m: int | None) -> tuple[dict, list[str]]:
    """skinny_table.TABLE entries from the micro rows: a configuration where it beat the
    best torch variant by ``min_gain``; at ``force_m`` rows the best skinny one anyway when
    none won there (labelled in the returned notes)."""
    from ast import literal_eval

    from pdserve.model import triton_skinny  # noqa: F401 (the kernel module must import)

    entries: dict[tuple, list] = {}
    notes: list[str] = []
    for r in micro_res.get("rows", []):
        if "best_skinny" not in r:
            continue
        cfg = literal_eval(r["best_skinny"])
        won = r["speedup_vs_best_torch"] >= min_gain
        forced = not won and r["M"] == force_m
        if won or forced:
            kind = "swiglu" if r["swiglu"] else "linear"
            dt = "bfloat16" if "device" in micro_res else "float32"
            entries.setdefault((kind, dt, r["N"], r["K"]), []).append((r["M"], cfg))
            notes.append(f"{r['shape']}@{r['M']}: {cfg} x{r['speedup_vs_best_torch']:.3f}"
                         + (" (forced)" if forced else ""))  # fmt: skip
    table = {}
    for key, rows in entries.items():
        rows.sort()
        full: list = []
        prev = 0
        for m, cfg in rows:
            below = m - 16 if m <= 64 else m // 2  # the buckets up to it: not this kernel
            if below > prev:
                full.append((below, None))
            full.append((m, cfg))
            prev = m
        table[key] = tuple(full)
    return table, notes


def steady(llm, prompts, steps: int, max_tokens: int | None, warm: int = 2) -> dict:
    """bench.roofline.steady_decode_step's procedure, each step timed alone, with the rows
    running and waiting at each step; max_tokens None = the context room (as bench offline)."""
    from pdserve.engine.sampling_params import SamplingParams

    core = llm.engine
    n = len(prompts)
    room = core.max_model_len - max(len(p) for p in prompts)
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens or room, ignore_eos=True)
    ids = [f"s8-{time.time()}-{i}" for i in range(n)]
    for rid, p in zip(ids, prompts):
        core.add_request(rid, list(p), params)
    reqs = [core._requests[rid] for rid in ids]
    pre_steps = 0
    while any(len(r.output_token_ids) == 0 for r in reqs):
        core.step()
        pre_steps += 1
    for _ in range(warm):
        core.step()
    cuda = core.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t_steps, running, waiting = [], [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        t_steps.append((time.perf_counter() - t) * 1e3)
        running.append(len(core.scheduler.running))
        waiting.append(len(getattr(core.scheduler, "waiting", [])))
    sync()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in ids:
        core.abort_request(rid)
    while core.has_unfinished_requests():
        core.step()
    return {"max_tokens": max_tokens or room, "step_ms": step_ms, "step_ms_each": t_steps,
            "running": running, "waiting": waiting, "prefill_steps": pre_steps,
            "max_model_len": core.max_model_len, "kv_capacity_tokens": getattr(core, "kv_capacity", None)}  # fmt: skip


def engine(args) -> None:
    import dataclasses

    from gpu_step_profile import profile_shapes

    from pdserve.bench.offline import _time_ours, workload_prompts
    from pdserve.engine.llm import LLM
    from pdserve.model import skinny_table

    toy = args.toy
    out_dir = os.environ.get("OUT", ".")
    out_path = os.path.join(out_dir, args.json)
    res: dict[str, Any] = {"parts_done": [], "skipped": {}, "errors": {}}
    counts = [4, 8] if toy else [64, 256]
    shapes = ["4x20", "8x20"] if toy else ["64x200", "256x200"]
    steps = 4 if toy else 20
    skinny_table.TABLE = {}
    t0 = time.perf_counter()
    res["engine_load_wall"] = [time.time()]
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_running_requests=max(counts) if toy else 256,
              kv_cache_memory=2 if toy else 24, max_num_batched_tokens=64 if toy else 4096)  # fmt: skip
    res["engine_start_s"] = time.perf_counter() - t0
    res["engine_load_wall"].append(time.time())
    print(f"engine up in {res['engine_start_s']:.0f} s (at {elapsed():.0f} s)", flush=True)
    # the micro sweep (beside the load) ends before anything here is timed
    done = os.path.join(out_dir, args.micro_json + ".done")
    t = time.perf_counter()
    while not os.path.exists(done) and time.perf_counter() - t < args.micro_wait_s:
        time.sleep(0.5)
    res["micro_wait_s"] = time.perf_counter() - t
    save(out_path, res)
    g = llm.engine.executor.rank0.runner.graphs
    sets: dict[str, tuple] = {}
    state: dict[str, Any] = {"cur": "base", "table": {}}

    def swap(name: str) -> float:
        if g is None:
            return 0.0
        sets[state["cur"]] = (g._graphs, g._logits, g._greedy, g._pool)
        state["cur"] = name
        if name in sets:
            g._graphs, g._logits, g._greedy, g._pool = sets[name]
            return 0.0
        g._graphs, g._logits, g._greedy, g._pool = {}, {}, {}, None
        torch.cuda.synchronize()
        g._rows.zero_()
        g._rows[2].fill_(-1)
        g._table.zero_()
        t = time.perf_counter()
        g.capture()
        return time.perf_counter() - t

    def left() -> float:
        return args.deadline_s - elapsed()

    def part(name: str, need: float, fn) -> None:
        if left() < need:
            res["skipped"][name] = f"{left():.0f} s left, needs ~{need:.0f}"
            print(f"== {name}: skipped ({left():.0f} s left)", flush=True)
            save(out_path, res)
            return
        print(f"== {name} (at {elapsed():.0f} s)", flush=True)
        try:
            fn()
            res["parts_done"].append(name)
        except Exception as exc:  # noqa: BLE001 (a failed part must not lose the others)
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"
        save(out_path, res)

    def brief(prof: dict) -> dict:
        return {s: {k: r[k] for k in ("step_ms", "step_ms_spans", "kernel_ms", "gap_ms", "kernels_per_step")}
                | {"top_kernels_ms": dict(list(r["top_kernels_ms"].items())[:12])} for s, r in prof.items()}  # fmt: skip

    def row(n: int) -> dict:
        prompts = workload_prompts(llm, n, None, None)
        _time_ours(llm, prompts, 1)
        first = _time_ours(llm, prompts, 1)[0]
        secs, ids = _time_ours(llm, prompts, args.max_tokens)
        r = {"num_prompts": n, "first_token_s": first, "full_s": secs,
             "tok_s": n * args.max_tokens / secs,
             "decode_ms_per_step": (secs - first) / (args.max_tokens - 1) * 1e3}  # fmt: skip
        print(f"   {n} prompts: {r['tok_s']:.0f} tok/s, first {first * 1e3:.1f} ms, "
              f"decode {r['decode_ms_per_step']:.2f} ms/step", flush=True)  # fmt: skip
        return r | {"_ids": ids}

    def p_base() -> None:
        res["base_profile"] = brief(profile_shapes(llm, shapes, steps, 14))
        save(out_path, res)
        r = row(counts[0])
        res["base_ids_64"] = r.pop("_ids")
        res["base_offline"] = [r]

    def p_steady() -> None:
        prompts = workload_prompts(llm, counts[-1], None, None)
        res["steady_256"] = [steady(llm, prompts, 8 if toy else 24, None),
                             steady(llm, prompts, 8 if toy else 24, 160 if not toy else 20)]  # fmt: skip
        for s in res["steady_256"]:
            print(f"   steady {counts[-1]} (max_tokens {s['max_tokens']}): {s['step_ms']:.2f} ms/step, "
                  f"running {s['running'][:3]}..., waiting {s['waiting'][:3]}...", flush=True)  # fmt: skip

    def p_skinny() -> None:
        path = os.path.join(out_dir, args.micro_json)
        with open(path) as f:
            mres = json.load(f)
        res["micro"] = mres
        table, notes = picks(mres, args.min_gain, 16 if toy else 64)
        res["skinny_table"] = {str(k): v for k, v in table.items()}
        res["skinny_notes"] = notes
        print(f"   table: {notes}", flush=True)
        if not table:
            return
        skinny_table.TABLE = table
        state["table"] = table
        res["skinny_capture_s"] = swap("skinny")
        res["skinny_profile"] = brief(profile_shapes(llm, shapes, steps, 14))
        save(out_path, res)
        r = row(counts[0])
        ids = r.pop("_ids")
        base_ids = res.get("base_ids_64") or []
        res["skinny_same_outputs"] = [sum(a == b for a, b in zip(ids, base_ids)), len(base_ids)]
        res["skinny_same_first16"] = sum(a[:16] == b[:16] for a, b in zip(ids, base_ids))
        print(f"   greedy outputs identical to base: {res['skinny_same_outputs']}", flush=True)
        res["skinny_offline"] = [r]
        save(out_path, res)
        res["skinny_offline"].append(row(counts[-1]) | {"_ids": None})

    def p_base_again() -> None:
        skinny_table.TABLE = {}
        swap("base")
        res["base_again_profile"] = brief(profile_shapes(llm, shapes, steps, 14))
        r = row(counts[-1])
        r.pop("_ids")
        res["base_offline"].append(r)

    def p_one(key) -> None:
        """The 64-row step with one shape's entry of the table alone."""
        full = state["table"]
        skinny_table.TABLE = {key: full[key]}
        swap(f"one:{key}")
        prof = profile_shapes(llm, shapes[:1], steps, 14)
        res.setdefault("one_shape_profile", {})[str(key)] = brief(prof)
        skinny_table.TABLE = {}
        swap("base")

    try:
        for name, need, fn in (("base", 12, p_base), ("skinny", 20, p_skinny),
                               ("base_again", 10, p_base_again), ("steady", 8, p_steady)):  # fmt: skip
            part(name, need, fn)
        # each shape's 64-row entry alone, while time is left (qkv, o, swiglu, down)
        for key in list(state["table"])[: 1 if toy else 4]:
            part(f"one:{key[0]}:{key[2]}x{key[3]}", 6, lambda key=key: p_one(key))
    finally:
        res.pop("base_ids_64", None)
        for r in res.get("skinny_offline", []):
            r.pop("_ids", None)
        save(out_path, res)
        llm.shutdown()
    _ = dataclasses  # (kept for a budget swap, as gpu_s7_bf16rows)
    print(f"== done at {elapsed():.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["micro", "engine"])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--toy", action="store_true", help="small shapes and counts (CPU check)")
    ap.add_argument("--ms", default="", help="micro: row counts (default: 64,128,256)")
    ap.add_argument(
        "--budget-s", type=float, default=45.0, help="micro: stop starting shapes after"
    )
    ap.add_argument("--deadline-s", type=float, default=85.0, help="engine: skip parts after")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-gain", type=float, default=1.02)
    ap.add_argument("--micro-json", default="mm64_micro.json")
    ap.add_argument("--micro-wait-s", type=float, default=20.0)
    ap.add_argument("--json", default="", help="file name under $OUT")
    args = ap.parse_args()
    args.json = args.json or ("mm64_micro.json" if args.mode == "micro" else "mm64.json")
    (micro if args.mode == "micro" else engine)(args)


if __name__ == "__main__":
    main()
