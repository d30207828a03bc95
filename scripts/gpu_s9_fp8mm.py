"""Issue 26, session 9 (branch fp8mm): the skinny GEMM on e4m3 weights (``fp8`` path kind
``skinny``: bf16 activations, the weight tile converted in registers, per-channel scale in the
epilogue, split-K partials left to the next add + RMSNorm, gate/up with SwiGLU) at 64 decode
rows against the current w8a8 paths, alone and in the FP8 engine.

Modes (``python scripts/gpu_s9_fp8mm.py MODE ...``):

``micro``   no model: for Llama-3.1-8B's four FP8 linears at 64 rows, random e4m3 weights in
            enough copies (``--rotate-mb``) that L2 does not hold them, each variant timed in
            a CUDA graph cycling over the copies (``fp8.time_us``), beside a torch copy of the
            same bytes. ``current`` is what the engine runs today for these rows
            (``fp8_paths_table``'s entry): qkv and gate/up their w8a8 kernel on rows quantized
            before (the quantization sits in the add + RMSNorm before them), gate/up then
            ``fused_ops.silu_mul``; o and down ``quantize_rows`` + w8a8 (+ its split-K
            reduce). ``w8a8_only`` is the w8a8 kernel alone on pre-quantized rows (what the
            others cost besides it). The ``skinny`` tiles: qkv whole; o and down as the
            engine runs a split tile (partials, no reduce: the next norm sums them); gate/up
            with its SwiGLU epilogue. Each output is compared with the dequantized fp32
            product. The tiles' kernels are compiled first by ``--precompile-procs``
            processes (small N, the real K and rows: the same kernels). -> ``fp8mm_micro.json``
``engine``  one FP8 + e4m3-KV engine (``random:llama-3.1-8b``): waits for the micro JSON,
            picks per shape the fastest skinny tile beating ``current`` by ``--margin``, then
            the 64x200 all-decoding step (``gpu_step_profile.profile_shapes``) and bench
            offline's 64-prompt row (its workload, 128 tokens) with ``fp8.PATHS`` as loaded
            (``off``) and with the picks in the 64-row entries (``on``; graphs captured again),
            then, while time is left, the step with every shape's best tile (``all``, when
            some were not kept: o's and down's partials take the quantization out of the
            norm before gate/up and qkv), off and on again; greedy tokens of the 64 prompts
            (bench's row, 128 tokens) on vs off.
            -> ``fp8mm.json`` (the micro JSON inside)
``write``   ``--write-table JSON [--keep qkv,o,...]``: the picks of a returned JSON into
            ``pdserve/model/fp8_paths_table.py`` (the 64-row entries of those shapes).

``--device cpu --toy`` checks the script on CPU (interpreter, tiny shapes, ``random:tiny``).
Every JSON is written after each measurement; progress lines carry the seconds since start.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from pdserve.model import fp8, fp8_paths_table, fused_ops, triton_skinny, triton_w8a8

T0 = time.perf_counter()
CARD = "NVIDIA H200"
# name -> (N, K, swiglu): Llama-3.1-8B's fused FP8 linears
SHAPES = {
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "down": (4096, 14336, False),
    "gate_up": (28672, 4096, True),
}
TOY_SHAPES = {
    "qkv": (128, 64, False),
    "o": (64, 64, False),
    "down": (64, 128, False),
    "gate_up": (256, 64, True),
}  # fmt: skip  (random:tiny's)
# skinny tiles (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages, PREFETCH) at 64 rows
CANDS = {
    "qkv": [(64, 64, 256, 1, 4, 4, 4), (64, 64, 256, 2, 4, 4, 4), (64, 64, 128, 2, 4, 4, 4),
            (64, 128, 128, 1, 4, 4, 4), (64, 32, 256, 1, 4, 4, 4), (64, 64, 256, 1, 4, 3, 2)],
    "o": [(64, 64, 256, 2, 4, 4, 4), (64, 64, 256, 4, 4, 4, 4), (64, 64, 128, 2, 4, 4, 4),
          (64, 32, 256, 2, 4, 4, 4), (64, 64, 256, 1, 4, 4, 4), (64, 128, 128, 4, 4, 4, 4)],
    "down": [(64, 64, 256, 2, 4, 4, 4), (64, 64, 256, 4, 4, 4, 4), (64, 64, 128, 2, 4, 4, 4),
             (64, 32, 256, 2, 4, 4, 4), (64, 64, 256, 7, 4, 4, 4), (64, 128, 128, 2, 4, 4, 4)],
    "gate_up": [(64, 64, 256, 1, 4, 3, 4), (64, 64, 256, 1, 8, 3, 4), (64, 64, 128, 1, 4, 4, 4),
                (64, 128, 128, 1, 8, 3, 4), (64, 32, 256, 1, 4, 4, 4), (64, 64, 128, 1, 8, 4, 4)],
}  # fmt: skip
# skinny8 tiles (the activations quantized in the kernel, FP8 dots), ``--kind skinny8``
CANDS8 = {
    "qkv": [(64, 64, 256, 1, 4, 4, 4), (64, 64, 128, 1, 4, 4, 4), (64, 64, 128, 2, 4, 4, 4),
            (64, 128, 128, 1, 4, 4, 4), (64, 64, 256, 2, 4, 4, 4)],
    "o": [(64, 64, 256, 2, 4, 4, 4), (64, 64, 128, 2, 4, 4, 4), (64, 64, 128, 4, 4, 4, 4),
          (64, 64, 256, 1, 4, 4, 4), (64, 128, 128, 4, 4, 4, 4)],
    "down": [(64, 64, 256, 2, 4, 4, 4), (64, 64, 128, 2, 4, 4, 4), (64, 64, 256, 4, 4, 4, 4),
             (64, 64, 128, 4, 4, 4, 4), (64, 64, 256, 1, 4, 4, 4)],
    "gate_up": [(64, 128, 128, 1, 4, 4, 4), (64, 64, 256, 1, 4, 3, 4), (64, 64, 128, 1, 4, 4, 4),
                (64, 128, 128, 1, 8, 4, 4), (64, 64, 256, 1, 8, 3, 4)],
}  # fmt: skip
KIND = ["skinny"]  # the path kind swept: --kind
TOY_CANDS = {k: [(16, 16, 32, 1, 4, 2, 0), (16, 16, 32, 2, 4, 2, 0)] for k in SHAPES}
TOY_CANDS["gate_up"] = [(16, 16, 32, 1, 4, 2, 0)]


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def save(path: str, res: dict) -> None:
    res["elapsed_s"] = round(elapsed(), 1)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def make_weights(n: int, k: int, copies: int, device) -> list[fp8.Fp8Weight]:
    out = []
    g = torch.Generator(device=device).manual_seed(n + k)
    for _ in range(copies):
        w = torch.randn(n, k, generator=g, device=device, dtype=torch.float32) * 0.02
        q, s = fp8.quantize_per_channel(w)
        del w
        out.append(fp8.Fp8Weight(q, s, k))
    return out


def current_path(n: int, k: int, m: int, cpu: bool) -> tuple:
    """The engine's path for m rows of [n, k] today (the H200 table; on CPU a w8a8 tile)."""
    for m_max, path in fp8_paths_table.TABLE.get((CARD, n, k), ()):
        if m <= m_max:
            return path
    return ("w8a8", triton_w8a8.default_w8a8_config(m, n, k))


def run_current(name: str, path: tuple, x, xq, w: fp8.Fp8Weight, only: bool = False):
    """What the engine runs for this layer today (see the module doc); ``only``: the w8a8
    kernel alone on pre-quantized rows."""
    kind, cfg = path
    swiglu = SHAPES_NOW[name][2]
    if kind == "w8a8" and (only or name in ("qkv", "gate_up")):
        y = triton_w8a8.w8a8(xq[0], xq[1], w.weight, w.scale, None, x.dtype, cfg)
    else:
        y = fp8.run_path(path, x, w, None)
    return fused_ops.silu_mul(y) if swiglu and not only else y


def run_skinny(name: str, cfg, x, w: fp8.Fp8Weight, partials: bool = True):
    """The skinny kernel as the engine would run it (o/down split: partials kept)."""
    swiglu = SHAPES_NOW[name][2]
    return triton_skinny.run(x, w.weight, None, cfg, swiglu=swiglu, keep_partials=partials,
                             scale=w.scale_row(), quant_x=KIND[0] == "skinny8")  # fmt: skip


SHAPES_NOW = dict(SHAPES)


def time_fns(fns, cuda: bool) -> float:
    if not cuda:
        t = time.perf_counter()
        for f in fns:
            f()
        return 1e6 * (time.perf_counter() - t) / len(fns)
    return fp8.time_us(fns, reps=max(24, 2 * len(fns)))


def precompile(shard: int, procs: int, toy: bool, m: int) -> None:
    device = "cpu" if toy else "cuda"
    cands = TOY_CANDS if toy else (CANDS8 if KIND[0] == "skinny8" else CANDS)
    jobs = [(name, cfg) for name in SHAPES_NOW for cfg in cands[name]]
    jobs += [(name, None) for name in SHAPES_NOW]  # the current path's kernels
    mine = jobs[shard::procs]
    t = time.perf_counter()
    for name, cfg in mine:
        n, k, swiglu = SHAPES_NOW[name]
        small = 256 if not toy else n
        w = make_weights(small, k, 1, device)[0]
        x = torch.randn(m, k, device=device).to(torch.bfloat16 if not toy else torch.float32)
        try:
            if cfg is None:
                xq = fp8.quantize_rows(x)
                run_current(name, current_path(n, k, m, toy), x, xq, w)
                run_current(name, current_path(n, k, m, toy), x, xq, w, only=True)
            else:
                run_skinny(name, cfg, x, w)
        except Exception as exc:  # noqa: BLE001 the sweep records it
            print(f"precompile {name} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"PRECOMPILE {shard}/{procs}: {len(mine)} in {time.perf_counter() - t:.1f} s", flush=True)


def sweep_shape(args, name: str, m: int, dev, g, cands) -> dict:
    """One shape's timings at ``m`` rows (see the module doc)."""
    n, k, swiglu = SHAPES_NOW[name]
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    copies = 2 if args.toy else max(2, min(16, math.ceil(args.rotate_mb * 1e6 / (n * k))))
    ws = make_weights(n, k, copies, dev)
    r: dict[str, Any] = {"N": n, "K": k, "swiglu": swiglu, "bytes": n * k, "copies": copies}
    srcs = [w.weight.view(torch.uint8) for w in ws]
    dsts = [torch.empty_like(srcs[0]) for _ in range(2)]
    cus = time_fns([lambda i=i: dsts[i % 2].copy_(srcs[i]) for i in range(len(srcs))], cuda)
    r["copy_us"] = cus
    r["copy_GBps_once"] = n * k / cus / 1e3
    dsts.clear()
    x = torch.randn(m, k, generator=g, device=dev).to(dtype)
    xq = fp8.quantize_rows(x)
    real = ws[0].dequantize(torch.float32)
    ref = x.float() @ real.T
    if swiglu:
        ref = fused_ops.silu_mul(ref.to(dtype))
    path = current_path(n, k, m, args.toy)
    r["current_path"] = str(path)
    vs: dict[str, Any] = {}
    r["variants"] = vs

    def one(label: str, fn_of_w, check) -> None:
        if elapsed() > args.budget_s:
            vs[label] = {"skipped": True}
            return
        v: dict[str, Any] = {}
        try:
            out = check()
            v["err_vs_ref"] = fp8.relative_error(out, ref)
            us = time_fns([lambda w=w: fn_of_w(w) for w in ws], cuda)
            v |= {"us": us, "GBps": n * k / us / 1e3, "frac_of_copy": cus / us}
        except Exception as exc:  # noqa: BLE001 a variant that fails is recorded
            v["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if cuda:
                torch.cuda.synchronize()
        vs[label] = v
        txt = (f"{v['us']:8.2f} us {v['GBps']:6.0f} GB/s {v['frac_of_copy']:.2f} of copy "
               f"err {v['err_vs_ref']:.1e}" if "us" in v else v.get("error", ""))  # fmt: skip
        log(f"  {name:7s} m={m} {label:36s} {txt}")

    def reduced(out):
        if isinstance(out, torch.Tensor):
            return out
        return out.parts.sum(0).to(dtype)

    one("current", lambda w: run_current(name, path, x, xq, w),
        lambda: run_current(name, path, x, xq, ws[0]))  # fmt: skip
    if path[0] == "w8a8":
        one("w8a8_only", lambda w: run_current(name, path, x, xq, w, only=True),
            lambda: fused_ops.silu_mul(run_current(name, path, x, xq, ws[0], only=True))
            if swiglu else run_current(name, path, x, xq, ws[0], only=True))  # fmt: skip
    for cfg in cands:
        try:
            triton_skinny.check(cfg, m, n // 2 if swiglu else n, k, swiglu)
        except ValueError as exc:
            vs[f"{KIND[0]}{list(cfg)}"] = {"error": str(exc)}
            continue
        one(f"{KIND[0]}{list(cfg)}", lambda w, cfg=cfg: run_skinny(name, cfg, x, w),
            lambda cfg=cfg: reduced(run_skinny(name, cfg, x, ws[0])))  # fmt: skip
    # the current path again: how much the rate moved over the shape's timings
    one("current_again", lambda w: run_current(name, path, x, xq, w),
        lambda: run_current(name, path, x, xq, ws[0]))  # fmt: skip
    log(f"SHAPE {name} {n}x{k}: copy {cus:.2f} us ({r['copy_GBps_once']:.0f} GB/s once), "
        f"current {vs.get('current', {}).get('us', float('nan')):.2f} us")  # fmt: skip
    return r


def micro(args) -> None:
    toy = args.toy
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    m = 16 if toy else 64
    out_path = os.path.join(os.environ.get("OUT", "."), args.micro_json)
    res: dict[str, Any] = {"rows": m, "kind": KIND[0], "shapes": {}, "errors": {}}
    if cuda:
        import triton

        res |= {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "triton": triton.__version__}  # fmt: skip
    procs = []
    me = os.path.abspath(__file__)
    for i in range(args.precompile_procs):
        cmd = [sys.executable, me, "precompile", "--shard", f"{i}/{args.precompile_procs}"]
        cmd += ["--toy", "--device", "cpu"] if toy else []
        cmd += ["--kind", KIND[0]]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    log(f"micro: {len(procs)} precompile processes")
    for p in procs:
        try:
            o, _ = p.communicate(timeout=max(1.0, args.precompile_s - elapsed()))
            res.setdefault("precompile", []).append((o or "").strip().splitlines()[-3:])
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            res.setdefault("precompile", []).append("killed: still compiling")
    log(f"precompile done: {res.get('precompile')}")
    save(out_path, res)
    cands = TOY_CANDS if toy else (CANDS8 if KIND[0] == "skinny8" else CANDS)
    g = torch.Generator(device=dev).manual_seed(1)
    for name in SHAPES_NOW:
        if elapsed() > args.budget_s:
            res["errors"][name] = f"skipped: {elapsed():.0f} s past the budget"
            continue
        res["shapes"][name] = sweep_shape(args, name, m, dev, g, cands[name])
        save(out_path, res)
        if cuda:
            torch.cuda.empty_cache()
    res["picks"] = picks(res, args.margin)
    save(out_path, res)
    log(f"MICRO done: picks {res['picks']}")


def picks(mres: dict, margin: float) -> dict:
    """``{name: {"N", "K", "config", "us", "current_us"}}``: per shape the fastest skinny
    tile, ``kept`` when it beats ``current`` (the mean of its two timings) by more than
    ``margin`` (a fraction); its error against the dequantized product under
    ``fp8.CHOICE_MAX_ERROR``."""
    out = {}
    for name, r in mres.get("shapes", {}).items():
        vs = r.get("variants", {})
        curs = [vs.get(c, {}).get("us") for c in ("current", "current_again")]
        curs = [c for c in curs if c is not None]
        if not curs:
            continue
        cur = statistics.mean(curs)  # before and after the shape's tiles
        ok = [(v["us"], lab) for lab, v in vs.items() if lab.startswith("skinny") and "us" in v
              and v["err_vs_ref"] < fp8.CHOICE_MAX_ERROR]  # fmt: skip
        if ok:
            us, lab = min(ok)
            kind, cfg = lab[: lab.index("[")], lab[lab.index("[") :]
            out[name] = {"N": r["N"], "K": r["K"], "kind": kind, "config": ast.literal_eval(cfg), "us": us,
                         "current_us": cur, "kept": us < cur * (1 - margin)}  # fmt: skip
    return out


def paths_with(base: dict, chosen: dict, m: int) -> dict:
    """fp8.PATHS with the ``m``-row entry of each chosen shape set to its skinny tile."""
    new = dict(base)
    for p in chosen.values():
        key = (p["N"], p["K"])
        entries = list(base.get(key, ())) or [(m, None), (1 << 30, ("w8a16", None))]
        sk = (p.get("kind", "skinny"), tuple(p["config"]))
        entries = [(mm, sk if mm == m else path) for mm, path in entries]
        new[key] = tuple(entries)
    return new


def engine(args) -> None:
    from gpu_step_profile import profile_shapes

    from pdserve.bench.offline import _time_ours, batched_tokens_for, workload_prompts
    from pdserve.engine.llm import LLM

    toy = args.toy
    out_dir = os.environ.get("OUT", ".")
    out_path = os.path.join(out_dir, args.json)
    res: dict[str, Any] = {"parts_done": [], "skipped": {}, "errors": {}}
    count = 8 if toy else 64
    shape = f"{count}x{20 if toy else 200}"
    steps = 4 if toy else 20
    t0 = time.perf_counter()  # (the step's token budget: bench offline's for this row)
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              quantization="fp8", kv_cache_dtype="fp8_e4m3", max_running_requests=count,
              kv_cache_memory=1 if toy else 12,
              max_num_batched_tokens=256 if toy else batched_tokens_for(count))  # fmt: skip
    res["engine_start_s"] = time.perf_counter() - t0
    log(f"engine up in {res['engine_start_s']:.0f} s")
    mpath = os.path.join(out_dir, args.micro_json)
    done = mpath + ".done"
    t = time.perf_counter()
    while not os.path.exists(done) and time.perf_counter() - t < args.micro_wait_s:
        time.sleep(0.5)
    res["micro_wait_s"] = time.perf_counter() - t
    try:
        with open(mpath) as f:
            mres = json.load(f)
    except (OSError, ValueError) as exc:
        mres = {"error": str(exc)}
    res["micro"] = mres
    chosen = mres.get("picks") or picks(mres, args.margin)
    kept = {k: v for k, v in chosen.items() if v["kept"]}
    res["picks"] = chosen
    log(f"picks: {json.dumps(chosen)}")
    save(out_path, res)
    m = 16 if toy else 64
    base = dict(fp8.PATHS)
    res["base_paths_64"] = {f"{n},{k}": str(fp8.path_for(m, n, k)) for (n, k) in base}
    g = llm.engine.executor.rank0.runner.graphs
    sets: dict[str, tuple] = {}
    state: dict[str, Any] = {"cur": "off"}

    def swap(name: str, paths: dict) -> float:
        fp8.PATHS.clear()
        fp8.PATHS.update(paths)
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
            log(f"== {name}: skipped ({left():.0f} s left)")
            save(out_path, res)
            return
        log(f"== {name}")
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
                | {"top_kernels_ms": dict(list(r["top_kernels_ms"].items())[:14])} for s, r in prof.items()}  # fmt: skip

    def step(label: str) -> None:
        p = brief(profile_shapes(llm, [shape], steps, 14))
        res.setdefault("steps", []).append({"label": label} | p[shape])
        log(f"STEP {label} {shape}: {p[shape]['step_ms']:.3f} ms (kernels {p[shape]['kernel_ms']:.3f}, "
            f"{p[shape]['kernels_per_step']:.0f} per step)")  # fmt: skip

    def row(label: str) -> list:
        prompts = workload_prompts(llm, count, None, None)
        first = min(_time_ours(llm, prompts, 1)[0] for _ in range(2))
        secs, ids = _time_ours(llm, prompts, args.max_tokens)
        r = {"label": label, "num_prompts": count, "first_token_s": first, "full_s": secs,
             "tok_s": count * args.max_tokens / secs,
             "decode_ms_per_step": (secs - first) / (args.max_tokens - 1) * 1e3}  # fmt: skip
        res.setdefault("offline", []).append(r)
        log(f"BENCH {label} {count} prompts: {r['tok_s']:.0f} tok/s, first {first * 1e3:.1f} ms, "
            f"decode {r['decode_ms_per_step']:.3f} ms/step")  # fmt: skip
        return [list(t) for t in ids]

    ids: dict[str, list] = {}
    on_set = kept or ({} if not args.force else chosen)
    res["on_shapes"] = sorted(on_set)
    on_paths = paths_with(base, on_set, m)
    res["on_paths_64"] = {f"{n},{k}": str(e) for (n, k), es in on_paths.items()
                          for mm, e in es if mm == m}  # fmt: skip

    def p_off() -> None:
        step("off")

    def p_on() -> None:
        res["on_capture_s"] = swap("on", on_paths)
        step("on")
        ids["on"] = row("on")

    def p_off_row() -> None:
        swap("off", base)
        ids["off"] = row("off")
        a, b = ids["off"], ids.get("on") or []
        if b:
            firsts = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
                      for x, y in zip(a, b)]  # fmt: skip
            res["greedy_on_vs_off"] = {"identical": sum(x == y for x, y in zip(a, b)),
                                       "outputs": len(a),
                                       "mean_first_divergence": statistics.mean(firsts),
                                       "tokens": args.max_tokens}  # fmt: skip
            log(f"GREEDY on vs off: {res['greedy_on_vs_off']}")

    all_paths = paths_with(base, chosen, m)

    def p_all() -> None:  # every shape's best tile, kept or not (a set the sweep cannot time)
        res["all_capture_s"] = swap("all", all_paths)
        step("all")
        swap("off", base)

    def p_off_again() -> None:
        step("off")

    def p_on_again() -> None:
        swap("on", on_paths)
        step("on")

    try:
        part("off", 6, p_off)
        if on_set:
            part("on", 14, p_on)
            part("off_row", 6, p_off_row)
            if set(chosen) != set(on_set):
                part("all", 12, p_all)
            part("off_again", 5, p_off_again)
            part("on_again", 5, p_on_again)
        else:
            res["skipped"]["on"] = "no pick beat the current paths"
            part("off_row", 6, p_off_row)
            if chosen:  # the best tiles in the engine all the same (what the sweep cannot see)
                part("all", 12, p_all)
                part("off_again", 5, p_off_again)
    finally:
        save(out_path, res)
        llm.shutdown()
    log("== engine done")


def write_table(json_path: str, keep: str) -> None:
    """The picks of ``json_path`` named by ``keep`` (``qkv,o,...`` or ``kept``: those the
    micro sweep kept) into fp8_paths_table's 64-row entries (the module text rewritten)."""
    with open(json_path) as f:
        doc = json.load(f)
    chosen = doc.get("picks") or doc.get("micro", {}).get("picks") or {}
    names = [n for n, p in chosen.items() if p["kept"]] if keep == "kept" else keep.split(",")
    table = dict(fp8_paths_table.TABLE)
    changed = []
    for name in names:
        p = chosen[name]
        key = (CARD, p["N"], p["K"])
        if key not in table:
            print(f"{name}: {key} not in the table, left out")
            continue
        sk = (p.get("kind", "skinny"), tuple(p["config"]))
        table[key] = tuple((mm, sk if mm == 64 else path) for mm, path in table[key])
        changed.append(f"{name} {p['config']} {p['us']:.2f} us (was {p['current_us']:.2f})")
    with open(fp8_paths_table.__file__) as f:
        src = f.read()
    head = src[: src.index("TABLE: dict")]
    body = "TABLE: dict[tuple[str, int, int], tuple[tuple[int, tuple[str, Any]], ...]] = {\n"
    for key, entries in table.items():
        body += f"    {key!r}: (\n"
        for m_max, path in entries:
            body += f"        ({m_max}, {path!r}),\n"
        body += "    ),\n"
    body += "}\n"
    with open(fp8_paths_table.__file__, "w") as f:
        f.write(head + body)
    print(f"wrote {fp8_paths_table.__file__}: " + "; ".join(changed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["micro", "engine", "precompile", "write"])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--toy", action="store_true", help="tiny shapes (CPU check)")
    ap.add_argument("--shard", default="0/1", help="precompile: i/P")
    ap.add_argument("--precompile-procs", type=int, default=8)
    ap.add_argument("--precompile-s", type=float, default=30.0, help="micro: stop waiting after")
    ap.add_argument("--budget-s", type=float, default=50.0, help="micro: no timing after")
    ap.add_argument("--rotate-mb", type=float, default=240.0)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--force", action="store_true", help="engine: the best tiles even if slower")
    ap.add_argument("--kind", default="skinny", choices=["skinny", "skinny8"])
    ap.add_argument("--deadline-s", type=float, default=110.0, help="engine: skip parts after")
    ap.add_argument("--micro-wait-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--micro-json", default="fp8mm_micro.json")
    ap.add_argument("--json", default="fp8mm.json")
    ap.add_argument("--write-table", default="")
    ap.add_argument("--keep", default="kept")
    args = ap.parse_args()
    KIND[0] = args.kind
    if args.toy:
        SHAPES_NOW.clear()
        SHAPES_NOW.update(TOY_SHAPES)
    if args.mode == "precompile":
        i, p = (int(v) for v in args.shard.split("/"))
        precompile(i, p, args.toy, 16 if args.toy else 64)
    elif args.mode == "micro":
        micro(args)
    elif args.mode == "engine":
        engine(args)
    else:
        write_table(args.write_table, args.keep)


if __name__ == "__main__":
    main()
