"""Issues 26 / 24, session 8: the split-KV decode attention alone per variant, then the
32 x 4,096 FP8-KV engine step with the fastest e4m3 variant against the current kernel.

``sweep`` (no model): one step's decode attention (32 layers) as the engine's decode graph
runs it, over a page-major pool of Llama-3.1-8B's shapes laid out as the engine lays it
(``KVCacheLayout``: ``[P, L=32, 2, Hkv=8, 128, 128]``, 128-token pages; each row's pages in
order), the KV stored already (``TritonBackend.forward(..., kv_stored=True)``: the split
kernel and its merge); the 32 layers captured in one CUDA graph and replayed:

- shapes ``32x4096`` e4m3 (issue 26) and bf16 (the reference), ``256x200`` and ``64x200``
  bf16 (issue 24); ``ROWSxCONTEXT``: every row decodes one token over CONTEXT tokens;
- variants (:data:`VARIANTS`): fields of :class:`~pdserve.model.triton_backend.DecodeConfig`
  replaced in the configuration the engine runs now at that shape (``current``): tiles,
  warps, stages, splits, pieces, ``widen`` (an e4m3 tile converted before its layout change
  for the dots), ``fma`` (no dots); or a backend switch (``KV16_ALIGNED_LOADS``);
- per variant: µs a step (32 layers) and a layer, the KV bytes read per second and their
  fraction of a torch d2d copy's bytes moved (read + write) per second measured in the same
  run (``copy``: before and after), and the largest difference of its output from the
  current kernel's over the largest |output| (``diff_vs_current``);
- ``best``: the fastest variant per shape; ``current`` is timed first and again last
  (``current_again``: drift, e.g. from the engine loading beside it).

Writes ``$OUT/<--json>`` after each variant; ``--done FILE`` says when the first shape and
when the whole sweep are done (the engine part waits for the latter, so that its steps do
not run beside the sweep's kernels).

``engine``: one engine (``random:llama-3.1-8b``, ``--quantization fp8``, ``--kv-cache-dtype
fp8_e4m3``, 32 running requests, graphs), started beside the sweep; then, for the current
kernel and for the sweep's fastest e4m3 variant at 32 x 4,096 (its fields applied to the
long-context rule's e4m3 configuration, ``fp8_decode_config``; the decode graphs captured
again): the all-decoding step as ``bench offline`` measures it
(``roofline.steady_decode_step``, 32 random prompts of 4,096 tokens) and the greedy tokens
of the same 32 prompts (``--greedy-tokens`` each), compared token for token.

``--device cpu`` (under ``TRITON_INTERPRET=1``, ``--toy``: 2 layers, toy shapes, few
variants; ``engine --model random:tiny``) checks the script itself: the times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model import triton_backend as tb
from pdserve.model.attention import build_attention_metadata, quantize_kv

T0 = time.perf_counter()
HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 128, 32
_FP8_CONFIG = tb.fp8_decode_config  # the backend's own, restored after each variant

# shape -> kind ("bf16" / "fp8") -> variants: name -> DecodeConfig fields replaced in the
# current configuration ({"aligned16": True}: the backend's KV16_ALIGNED_LOADS on instead).
_FP8_LONG: dict[str, dict[str, Any]] = {  # most promising first: a deadline cuts the tail
    "current": {},
    "widenV": {"widen": 1},
    "balance768 widenV": {"balance": 768, "widen": 1},
    "n32 widenV": {"block_n": 32, "widen": 1},
    "w4 widenV": {"num_warps": 4, "widen": 1},
    "balance2048 widenV": {"balance": 2048, "widen": 1},
    "n32 w4 widenV": {"block_n": 32, "num_warps": 4, "widen": 1},
    "widenKV": {"widen": 3},
    "n32 w1 widenV": {"block_n": 32, "num_warps": 1, "widen": 1},
    "balance768 n32 widenV": {"balance": 768, "block_n": 32, "widen": 1},
    "n128 w4 widenV": {"block_n": 128, "num_warps": 4, "widen": 1},
    "balance768": {"balance": 768},
    "fma n16 w4": {"block_n": 16, "num_warps": 4, "fma": True},
    "n32": {"block_n": 32},
}
_BF16_LONG: dict[str, dict[str, Any]] = {"current": {}}
_BF16_ROWS: dict[str, dict[str, Any]] = {
    "current": {},
    "aligned16": {"aligned16": True},
    "n32 w4 s3": {"block_n": 32, "num_warps": 4, "num_stages": 3},
    "n16 w2 s3": {"block_n": 16, "num_warps": 2, "num_stages": 3},
    "n16 w1 s3": {"block_n": 16, "num_warps": 1, "num_stages": 3},
    "n32 w1 s3": {"block_n": 32, "num_warps": 1, "num_stages": 3},
    "n32 w2 s4": {"block_n": 32, "num_warps": 2, "num_stages": 4},
    "n64 w4 s3": {"block_n": 64, "num_warps": 4, "num_stages": 3},
    "n128 w4 s2": {"block_n": 128, "num_warps": 4, "num_stages": 2},
    "splits2 n32 w2 s3": {"splits": 2, "block_n": 32, "num_warps": 2, "num_stages": 3},
    "splits2 n64 w4 s2": {"splits": 2, "block_n": 64, "num_warps": 4, "num_stages": 2},
}
_BF16_64: dict[str, dict[str, Any]] = {
    "current": {},
    "n32 w2 s3": {"block_n": 32, "num_warps": 2, "num_stages": 3},
    "n128 w4 s2": {"block_n": 128, "num_warps": 4, "num_stages": 2},
    "splits2 n64 w4 s2": {"splits": 2, "block_n": 64, "num_warps": 4, "num_stages": 2},
    "splits4 n64 w4 s2": {"splits": 4, "block_n": 64, "num_warps": 4, "num_stages": 2},
    "splits2 n32 w2 s3": {"splits": 2, "block_n": 32, "num_warps": 2, "num_stages": 3},
}
VARIANTS: dict[str, list[tuple[str, dict[str, dict[str, Any]]]]] = {
    "32x4096": [("bf16", _BF16_LONG), ("fp8", _FP8_LONG)],
    "256x200": [("bf16", _BF16_ROWS)],
    "64x200": [("bf16", _BF16_64)],
}
TOY_SHAPES = {"32x4096": "2x300", "256x200": "8x40", "64x200": "4x40"}


def elapsed() -> float:
    return time.perf_counter() - T0


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_graph(fn, dev: torch.device, reps: int) -> float:
    """Mean seconds of one ``fn()`` (called once before: compiles), replayed ``reps`` times
    as one CUDA graph; on CPU one eager call."""
    fn()
    _sync(dev)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    g.replay()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / reps


def copy_rate(dev: torch.device, nbytes: int) -> dict:
    """A torch d2d copy of ``nbytes`` in fp32 elements (a uint8 ``copy_`` moved only 2.7 TB/s
    on the H200 in session 8, below what the attention kernels read; ``roofline``'s copy
    measured 4.07 TB/s in session 6): seconds and bytes moved (read + write) per second."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1)
    dst = torch.empty_like(src)
    s = time_graph(lambda: dst.copy_(src), dev, 10)
    return {"bytes": nbytes, "s": s, "moved_gb_s": 2 * nbytes / s / 1e9}


def build_pool(rows: int, ctx: int, kinds: list[str], layers: int, dev: torch.device) -> dict:
    """A page-major pool (``KVCacheLayout``) of each kind holding ``rows`` sequences of
    ``ctx`` tokens (pages in order, one page to spare a row as the engine's decode step
    has: the token being decoded), random bf16 values (e4m3: the same values quantized);
    the metadata of one decode token a row; q."""
    per_row = -(-(ctx + 1) // PAGE)
    num_pages = rows * per_row
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    md = build_attention_metadata([1] * rows, [ctx] * rows, tables, PAGE, dev)
    torch.manual_seed(rows * 7 + ctx)
    q = (torch.randn(rows, HQ, D, device=dev) * 0.5).to(torch.bfloat16)
    pools: dict[str, Any] = {}
    lay16 = KVCacheLayout("page_major", layers, HKV, D, PAGE, num_pages, torch.bfloat16)
    kv16 = torch.empty(lay16.shape, dtype=torch.bfloat16, device=dev)
    step = max(1, num_pages // 8)
    for p0 in range(0, num_pages, step):  # drawn in pieces: fp32 temporaries stay small
        kv16[p0 : p0 + step].normal_()
    if "fp8" in kinds:
        lay8 = replace(lay16, dtype=torch.float8_e4m3fn)
        kv8 = torch.empty(lay8.shape, dtype=torch.float8_e4m3fn, device=dev)
        for p0 in range(0, num_pages, step):
            kv8[p0 : p0 + step] = quantize_kv(kv16[p0 : p0 + step], 1.0)
        pools["fp8"] = (kv8, lay8.layer_views(kv8))
    if "bf16" in kinds:
        pools["bf16"] = (kv16, lay16.layer_views(kv16))
    else:
        del kv16
    return dict(md=md, q=q, pools=pools, rows=rows, ctx=ctx, layers=layers)


def current_config(rows: int, ctx: int, kind: str, dev: torch.device) -> tb.DecodeConfig:
    """The configuration the engine's decode graph runs at this shape now (its bucket's
    context bound: ONE_SPLIT_MAX_CONTEXT for short contexts, none for long ones)."""
    bound = tb.ONE_SPLIT_MAX_CONTEXT if ctx <= tb.ONE_SPLIT_MAX_CONTEXT else None
    cfg = tb.decode_config(rows, HKV, PAGE, bound, None, tb.device_picks(dev, HQ // HKV, D))
    return _FP8_CONFIG(cfg) if kind == "fp8" else cfg


def variant_config(cur: tb.DecodeConfig, fields: dict[str, Any]) -> tb.DecodeConfig:
    f = {k: v for k, v in fields.items() if k != "aligned16"}
    bn = int(f.get("block_n", cur.block_n))
    f["min_split"] = -(-cur.min_split // bn) * bn if cur.min_split else 0
    return replace(cur, **f)


def run_variant(case: dict, kind: str, cfg: tb.DecodeConfig, aligned16: bool, dev, reps: int):
    """One step's decode attention (every layer of the pool) under ``cfg``: (seconds, the
    last layer's output as fp32)."""
    backend = tb.TritonBackend()
    md, q = case["md"], case["q"]
    kv_new = q[:, :HKV]  # [T, Hkv, D]: not read (kv_stored), its shape gives Hkv
    views = case["pools"][kind][1]
    plan = backend.plan_for_capture(md, PAGE, None)
    plan.config = cfg
    tb.fp8_decode_config = lambda c, t=None: c  # type: ignore[assignment] # cfg is the whole config
    tb.KV16_ALIGNED_LOADS = aligned16
    try:
        out: list[torch.Tensor] = []

        def step() -> None:
            for kc, vc in views:
                o = backend.forward(q, kv_new, kv_new, kc, vc, md, plan, D**-0.5, kv_stored=True)
            out[:] = [o]

        s = time_graph(step, dev, reps)
        step()
        _sync(dev)
        return s, out[0].float()
    finally:
        tb.fp8_decode_config = _FP8_CONFIG  # type: ignore[assignment]
        tb.KV16_ALIGNED_LOADS = False


def sweep(args, dev: torch.device) -> None:
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "layers": LAYERS if not args.toy else 2,
        "shapes": {},
        "errors": {},
    }

    def save() -> None:
        res["elapsed_s"] = elapsed()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    layers = res["layers"]
    res["copy_before"] = copy_rate(dev, 2 << 30 if dev.type == "cuda" else 1 << 20)
    copy_bw = res["copy_before"]["moved_gb_s"]
    print(f"copy: {copy_bw:.0f} GB/s moved (at {elapsed():.1f} s)", flush=True)
    shapes = args.shapes.split(",")
    stop = [float(x) for x in args.shape_deadlines.split(",")] if args.shape_deadlines else []
    stop = (stop + [args.deadline_s] * len(shapes))[: len(shapes)]
    stop = [min(t, args.deadline_s) for t in stop]
    for si, shape in enumerate(shapes):
        real = TOY_SHAPES.get(shape, shape) if args.toy else shape
        rows, ctx = (int(x) for x in real.split("x"))
        kinds = VARIANTS[shape]
        case = build_pool(rows, ctx, [k for k, _ in kinds], layers, dev)
        print(f"== {shape} ({real}): pool built (at {elapsed():.1f} s)", flush=True)
        for kind, variants in kinds:
            key = f"{shape} {kind}"
            r: dict[str, Any] = {"rows": rows, "context": ctx, "kind": kind, "variants": {}}
            res["shapes"][key] = r
            cur = current_config(rows, ctx, kind, dev)
            r["current_config"] = str(cur)
            elt = 1 if kind == "fp8" else 2
            kv_bytes = rows * ctx * HKV * D * 2 * elt * layers
            r["kv_bytes_per_step"] = kv_bytes
            ref = None
            names = list(variants)
            if args.toy:
                names = names[:3] + [n for n in names[3:] if "fma" in n or "splits" in n][:2]
            again = ["current_again"] if len(names) > 1 else []
            for name in [*names, *again]:
                if elapsed() > stop[si]:
                    res["errors"][f"{key} {name}"] = "skipped: deadline"
                    continue
                fields = variants["current" if name == "current_again" else name]
                cfg = variant_config(cur, fields)
                try:
                    s, o = run_variant(
                        case, kind, cfg, bool(fields.get("aligned16")), dev, args.reps
                    )
                except Exception as exc:  # noqa: BLE001 a variant that fails: noted, the rest run
                    r["variants"][name] = {"error": " ".join(str(exc).split())[:300]}
                    print(f"   {name:<28} failed: {r['variants'][name]['error'][:120]}", flush=True)
                    continue
                if ref is None:
                    ref = o
                diff = float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                gbs = kv_bytes / s / 1e9
                r["variants"][name] = {
                    "config": str(cfg),
                    "aligned16": bool(fields.get("aligned16")),
                    "step_us": s * 1e6,
                    "layer_us": s * 1e6 / layers,
                    "kv_gb_s": gbs,
                    "of_copy": gbs / copy_bw,
                    "diff_vs_current": diff,
                }
                print(
                    f"   {kind} {name:<28} {s * 1e6 / layers:8.1f} us/layer {gbs:6.0f} GB/s "
                    f"{gbs / copy_bw:5.2f} of copy  diff {diff:.1e}  (at {elapsed():.1f} s)",
                    flush=True,
                )
                timed = {
                    n: v["step_us"]
                    for n, v in r["variants"].items()
                    if "step_us" in v and n != "current_again" and v["diff_vs_current"] < 0.05
                }
                r["best"] = min(timed, key=timed.__getitem__)
                r["best_fields"] = variants[r["best"]]
                r["best_over_current"] = (
                    timed[r["best"]] / timed["current"] if "current" in timed else None
                )
                save()
        del case
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if si == 0 and args.done:
            with open(args.done, "w") as f:
                f.write("first shape done\n")
    res["copy_after"] = copy_rate(dev, 2 << 30 if dev.type == "cuda" else 1 << 20)
    save()
    if args.done:
        with open(args.done, "a") as f:
            f.write("sweep done\n")
    print(f"== sweep done at {elapsed():.1f} s", flush=True)


def apply_fields(fields: dict[str, Any]) -> None:
    """The engine's e4m3 long-context configuration with ``fields`` replaced (``{}``: the
    backend's own), in this process, before its graphs are captured again."""
    if not fields:
        tb.fp8_decode_config = _FP8_CONFIG  # type: ignore[assignment]
        return

    def cfg_with(c: tb.DecodeConfig, t: Any = None) -> tb.DecodeConfig:
        c = _FP8_CONFIG(c, t)
        return variant_config(c, fields) if tb.decode_rule(c) == "long" else c

    tb.fp8_decode_config = cfg_with  # type: ignore[assignment]


def engine(args, dev: torch.device) -> None:
    from pdserve.bench.offline import _random_prompts, _time_ours
    from pdserve.bench.roofline import steady_decode_step
    from pdserve.engine.llm import LLM

    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {"errors": {}}

    def save() -> None:
        res["elapsed_s"] = elapsed()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    rows, ctx = (int(x) for x in args.engine_shape.split("x"))
    llm = LLM(
        args.model,
        device=args.device,
        dtype="bfloat16",
        max_running_requests=rows,
        kv_cache_memory=args.kv_cache_memory,
        quantization="fp8",
        kv_cache_dtype="fp8_e4m3",
    )
    res["engine_start_s"] = elapsed()
    res["kv_dtype"] = str(llm.engine.executor.rank0.storage.kv.dtype)
    print(f"engine up at {elapsed():.1f} s (KV {res['kv_dtype']})", flush=True)
    save()
    try:
        prompts = _random_prompts(llm.engine.vocab_size, rows, ctx, seed=5)
        t_wait = time.perf_counter()
        best: dict[str, Any] | None = None
        while time.perf_counter() - t_wait < args.wait_s:
            try:
                with open(args.done) as f:
                    finished = "sweep done" in f.read()
            except OSError:
                finished = False
            late = elapsed() > args.deadline_s - args.engine_need_s
            if finished or late:  # the sweep is over (or out of time): no overlap
                try:
                    with open(args.sweep_json) as f:
                        sw = json.load(f)
                    best = next(r for k, r in sw["shapes"].items() if k.endswith(" fp8"))
                except (OSError, ValueError, StopIteration, KeyError):
                    best = None
                break
            time.sleep(0.5)
        name = best.get("best", "current") if best else "current"
        fields = best.get("best_fields", {}) if best else {}
        if args.force_fields:
            name, fields = "forced", json.loads(args.force_fields)
        res["variant"], res["variant_fields"] = name, fields
        print(f"sweep's fastest e4m3 variant: {name} {fields} (at {elapsed():.1f} s)", flush=True)
        g = llm.engine.executor.rank0.runner.graphs
        ids: dict[str, list] = {}
        order = [("current", {})] + ([(name, fields)] if fields else [])
        for tag, f in order:
            if elapsed() > args.deadline_s - 8:
                res["errors"][tag] = "skipped: deadline"
                break
            if tag != "current" and g is not None:
                apply_fields(f)
                torch.cuda.synchronize()
                g._graphs, g._logits, g._greedy, g._pool = {}, {}, {}, None
                g._rows.zero_()
                g._rows[2].fill_(-1)
                g._table.zero_()
                t0 = time.perf_counter()
                g.capture()
                res[f"{tag}_capture_s"] = time.perf_counter() - t0
            steady = steady_decode_step(llm, prompts, args.steady_steps)
            res[f"{tag}_step_ms"] = steady["step_s"] * 1e3
            res[f"{tag}_mean_context"] = steady.get("mean_context")
            print(
                f"   {tag}: all-decoding step {steady['step_s'] * 1e3:.3f} ms (at {elapsed():.1f} s)",
                flush=True,
            )
            save()
            if elapsed() < args.deadline_s - 6:
                ids[tag] = _time_ours(llm, prompts, args.greedy_tokens)[1]
        if len(ids) == 2:
            a, b = ids.values()
            same_tok = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
            res["greedy_same_rows"] = [sum(ra == rb for ra, rb in zip(a, b)), len(a)]
            res["greedy_same_tokens"] = [same_tok, sum(len(r) for r in a)]
            print(
                f"   greedy: {res['greedy_same_rows']} rows, {res['greedy_same_tokens']} tokens identical",
                flush=True,
            )
        if "current_step_ms" in res and f"{name}_step_ms" in res and name != "current":
            res["variant_over_current"] = res[f"{name}_step_ms"] / res["current_step_ms"]
    except Exception as exc:  # noqa: BLE001 what was measured is kept
        import traceback

        traceback.print_exc()
        res["errors"]["engine"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        save()
        apply_fields({})
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("sweep", "engine"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--toy", action="store_true", help="CPU check: 2 layers, toy shapes")
    ap.add_argument("--shapes", default="32x4096,256x200,64x200")
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed per variant")
    ap.add_argument("--deadline-s", type=float, default=60.0)
    ap.add_argument(
        "--shape-deadlines",
        default="",
        help="sweep: seconds after which no further variant of each shape starts (comma-"
        "separated, in --shapes order; unset: --deadline-s for all)",
    )
    ap.add_argument("--json", default="sweep.json", help="file name under $OUT")
    ap.add_argument("--done", default="", help="file touched when the first shape is done")
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--engine-shape", default="32x4096")
    ap.add_argument("--kv-cache-memory", type=float, default=24)
    ap.add_argument("--steady-steps", type=int, default=24)
    ap.add_argument("--greedy-tokens", type=int, default=8)
    ap.add_argument("--sweep-json", default="", help="engine: the sweep's JSON to read")
    ap.add_argument("--wait-s", type=float, default=90.0, help="engine: wait for the sweep")
    ap.add_argument(
        "--engine-need-s",
        type=float,
        default=45.0,
        help="engine: seconds its A/B needs; it stops waiting for the sweep this long before "
        "--deadline-s",
    )
    ap.add_argument("--force-fields", default="", help="engine: JSON fields instead of the sweep's")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.mode == "sweep":
        sweep(args, dev)
    else:
        engine(args, dev)


if __name__ == "__main__":
    sys.exit(main())
