"""Issue 26, session 10: the e4m3 split-KV decode attention alone per variant at 32 x 4,096,
then the FP8-KV engine step with the fastest e4m3 variant against the current kernel.

``sweep`` (no model): one step's decode attention (32 layers) as the engine's decode graph
runs it, over a page-major pool of Llama-3.1-8B's shapes laid out as the engine lays it
(``KVCacheLayout``: ``[P, L=32, 2, Hkv=8, 128, 128]``, 128-token pages; each row's pages in
order), the KV stored already (``TritonBackend.forward(..., kv_stored=True)``: the split
kernel and its merge); the 32 layers captured in one CUDA graph and replayed:

- shape ``32x4096`` (``ROWSxCONTEXT``: every row decodes one token over CONTEXT tokens),
  e4m3 and bf16 (the reference for the ratio);
- variants (:data:`VARIANTS`): fields of :class:`~pdserve.model.triton_backend.DecodeConfig`
  replaced in the configuration the engine runs now at that shape (``current``): ``unroll``
  (the tile loop unrolled), ``prefetch`` (the next tile loaded before this one's math),
  ``evict`` (evict-first loads), tiles, warps, stages, pieces (``balance``);
- per variant: µs a step (32 layers) and a layer, the KV bytes read per second and their
  fraction of a torch d2d copy's bytes moved (read + write) per second measured in the same
  run (``copy``: before and after), the largest difference of its output from the current
  kernel's over the largest |output| (``diff_vs_current``), and the compiled kernel's
  registers a thread, spills and shared memory, with the programs an SM holds by each
  (``kernel``: the split-KV kernel is latency-bound when few programs fit an SM);
- ``confirm``: the current kernel and the 3 fastest variants again, in interleaved rounds;
  ``best``: the fastest median (``current`` is also timed again last: ``current_again``).

Writes ``$OUT/<--json>`` after each variant; ``--done FILE`` says when the sweep is done
(the engine part waits for it, so that its steps do not run beside the sweep's kernels).

``engine``: one engine (``random:llama-3.1-8b``, ``--quantization fp8``, ``--kv-cache-dtype
fp8_e4m3``, 32 running requests, graphs of the 32-row bucket only), started beside the sweep;
then the sweep's fastest e4m3 variant (its fields applied to the long-context rule's e4m3
configuration, ``fp8_decode_config``) captured as a second graph of the 32-row long-context
key beside the current one; 32 random 4,096-token prompts decoding, spans of
``--span-steps`` steps under each graph interleaved for ``--rounds`` rounds (the step after
each switch untimed; medians, rounds in which the variant was faster); then the greedy
tokens of the same prompts (``--greedy-tokens`` each) under each graph, compared token for
token (their prompts' K/V from the prefix cache: the same for both). ``--quantization none
--kv-dtype auto`` (session 13): a bf16 engine with a bf16 cache, where ``--force-fields
toggle-even`` flips ``triton_backend.KV16_EVEN``'s long rule instead.

``--device cpu`` (under ``TRITON_INTERPRET=1``, ``--toy``: 2 layers, toy shapes, few
variants; ``engine --model random:tiny``, no graphs: the current kernel only) checks the
script itself: the times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
_KV16_EVEN = tb.KV16_EVEN
_KERNEL = tb.decode_split_kernel  # wrapped while a variant runs: its compiled form is read

# kind -> variants: name -> DecodeConfig fields replaced in the current configuration
# (the engine's at 32 x 4,096 now: 8 splits launched, pieces of 1,024 tokens (balance
# 1,024, floor 256), e4m3 tiles (64, 2 warps, 2 stages)). Most promising first.
_FP8_LONG: dict[str, dict[str, Any]] = {
    "current": {},
    "unroll2": {"unroll": 2},
    "n32 w1": {"block_n": 32, "num_warps": 1},
    "n32 w1 unroll2": {"block_n": 32, "num_warps": 1, "unroll": 2},
    "n32 unroll2": {"block_n": 32, "unroll": 2},
    "prefetch": {"prefetch": True},
    "n32 prefetch": {"block_n": 32, "prefetch": True},
    "n32 w1 prefetch": {"block_n": 32, "num_warps": 1, "prefetch": True},
    "evict": {"evict": True},
    "s1": {"num_stages": 1},
    "s3": {"num_stages": 3},
    "unroll4": {"unroll": 4},
    "balance512": {"balance": 512},
    "balance2048": {"balance": 2048},
    "n32 w1 balance2048": {"block_n": 32, "num_warps": 1, "balance": 2048},
    "n16 w1": {"block_n": 16, "num_warps": 1},
    "w4 unroll2": {"num_warps": 4, "unroll": 2},
    "n128 w2": {"block_n": 128},
    "n32 prefetch evict": {"block_n": 32, "prefetch": True, "evict": True},
    "n16 prefetch": {"block_n": 16, "prefetch": True},
    "n32 prefetch balance2048": {"block_n": 32, "prefetch": True, "balance": 2048},
}
_BF16_LONG: dict[str, dict[str, Any]] = {"current": {}, "unroll2": {"unroll": 2}}
VARIANTS: dict[str, list[tuple[str, dict[str, dict[str, Any]]]]] = {
    "32x4096": [("bf16", _BF16_LONG), ("fp8", _FP8_LONG)],
    "8x4096": [("fp8", {"current": {}})],
}
# Round 2 (--set even): whole tiles without masks (DecodeConfig.even) on and off, whatever the
# engine's own configuration is, e4m3 and bf16.
EVEN_VARIANTS: dict[str, list[tuple[str, dict[str, dict[str, Any]]]]] = {
    "32x4096": [
        ("fp8", {"current": {}, "even on": {"even": True}, "even off": {"even": False}}),
        ("bf16", {"current": {}, "even on": {"even": True}, "even off": {"even": False}}),
    ],
}
VARIANT_SETS = {"round1": VARIANTS, "even": EVEN_VARIANTS}
TOY_SHAPES = {"32x4096": "2x300", "8x4096": "1x300"}


class _Recorder:
    """``decode_split_kernel`` as the backend launches it (``kernel[grid](...)``), keeping
    what the launch returns (Triton's compiled kernel: registers, spills, shared memory)."""

    def __init__(self) -> None:
        self.compiled: Any = None

    def __getitem__(self, grid):
        launch = _KERNEL[grid]

        def run(*a, **kw):
            self.compiled = launch(*a, **kw)
            return self.compiled

        return run


def kernel_info(compiled: Any) -> dict:
    """Registers a thread, spills, shared memory (bytes) of a compiled kernel and the
    programs an SM holds by each (64K registers, 228 KB); {} off CUDA."""
    try:
        regs, spills = int(compiled.n_regs), int(compiled.n_spills)
        shared = int(compiled.metadata.shared)
        warps = int(compiled.metadata.num_warps)
    except Exception:  # noqa: BLE001 a Triton without these fields: nothing recorded
        return {}
    return {
        "regs": regs,
        "spills": spills,
        "shared": shared,
        "warps": warps,
        "per_sm_by_regs": 65536 // max(1, regs * 32 * warps),
        "per_sm_by_shared": (228 * 1024) // (shared + 1024),
    }


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
    tb.fp8_decode_config = lambda c: c  # type: ignore[assignment] # cfg is the whole config
    tb.KV16_ALIGNED_LOADS = aligned16
    rec = _Recorder()
    tb.decode_split_kernel = rec  # type: ignore[assignment]
    try:
        out: list[torch.Tensor] = []

        def step() -> None:
            for kc, vc in views:
                o = backend.forward(q, kv_new, kv_new, kc, vc, md, plan, D**-0.5, kv_stored=True)
            out[:] = [o]

        s = time_graph(step, dev, reps)
        step()
        _sync(dev)
        return s, out[0].float(), kernel_info(rec.compiled)
    finally:
        tb.fp8_decode_config = _FP8_CONFIG  # type: ignore[assignment]
        tb.KV16_ALIGNED_LOADS = False
        tb.decode_split_kernel = _KERNEL  # type: ignore[assignment]


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
        kinds = VARIANT_SETS[args.set][shape]
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
                names = names[:4] + [n for n in names[4:] if n in ("prefetch", "balance512")]
            again = ["current_again"] if len(names) > 1 else []
            for name in [*names, *again]:
                if elapsed() > stop[si]:
                    res["errors"][f"{key} {name}"] = "skipped: deadline"
                    continue
                fields = variants["current" if name == "current_again" else name]
                cfg = variant_config(cur, fields)
                try:
                    s, o, info = run_variant(
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
                    "kernel": info,
                }
                print(
                    f"   {kind} {name:<22} {s * 1e6 / layers:7.1f} us/layer {gbs:6.0f} GB/s "
                    f"{gbs / copy_bw:5.2f} of copy  diff {diff:.1e}  {info}  (at {elapsed():.1f} s)",
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
            if len(r["variants"]) > 2 and (kind == "fp8" or args.set != "round1"):
                confirm(r, case, kind, cur, variants, args, dev, layers, stop[si] + 10)
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


def confirm(
    r: dict, case: dict, kind: str, cur, variants: dict, args, dev, layers: int, stop: float
) -> None:
    """The current kernel and the 3 fastest variants (output within 5 % of the current's)
    timed again in interleaved rounds (``--confirm-rounds``): ``r["confirm"]`` name ->
    µs a layer each round and their median; ``r["best"]`` is then the fastest median."""
    timed = {
        n: v["step_us"]
        for n, v in r["variants"].items()
        if "step_us" in v and n != "current_again" and v["diff_vs_current"] < 0.05
    }
    top = [n for n in sorted(timed, key=timed.__getitem__) if n != "current"][:3]
    if not top:
        return
    rounds: dict[str, list[float]] = {n: [] for n in ["current", *top]}
    for _ in range(args.confirm_rounds):
        for name in rounds:
            if elapsed() > stop:
                break
            cfg = variant_config(cur, variants[name])
            s, _, _ = run_variant(case, kind, cfg, False, dev, args.reps)
            rounds[name].append(s * 1e6 / layers)
    med = {n: statistics.median(v) for n, v in rounds.items() if v}
    r["confirm"] = {n: {"layer_us": v, "median": med.get(n)} for n, v in rounds.items()}
    if med:
        r["best"] = min(med, key=med.__getitem__)
        r["best_fields"] = variants[r["best"]]
        if "current" in med:
            r["best_over_current"] = med[r["best"]] / med["current"]
    print(
        "   confirm (µs a layer, median): "
        + ", ".join(f"{n} {m:.1f}" for n, m in med.items())
        + f" -> {r.get('best')} (at {elapsed():.1f} s)",
        flush=True,
    )


def apply_fields(fields: dict[str, Any], kv16: bool = False) -> None:
    """The engine's e4m3 long-context configuration with ``fields`` replaced (``{}``: the
    backend's own), in this process, before its graphs are captured again. kv16: a 16-bit
    cache's, where only ``even`` can be set (``triton_backend.KV16_EVEN``)."""
    if not fields:
        tb.fp8_decode_config = _FP8_CONFIG  # type: ignore[assignment]
        tb.KV16_EVEN = _KV16_EVEN  # type: ignore[misc]
        tb.kv16_decode_config.cache_clear()
        return
    if kv16:
        if set(fields) != {"even"}:
            raise ValueError(f"--force-fields: a 16-bit cache takes only even, got {fields}")
        tb.KV16_EVEN = frozenset({"long"}) if fields["even"] else frozenset()  # type: ignore[misc]
        tb.kv16_decode_config.cache_clear()
        return

    def cfg_with(c: tb.DecodeConfig) -> tb.DecodeConfig:
        c = _FP8_CONFIG(c)
        return variant_config(c, fields) if tb.decode_rule(c) == "long" else c

    tb.fp8_decode_config = cfg_with  # type: ignore[assignment]


def engine(args, dev: torch.device) -> None:
    from pdserve.bench.offline import _random_prompts
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.worker import cuda_graph

    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {"errors": {}}

    def save() -> None:
        res["elapsed_s"] = elapsed()
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    rows, ctx = (int(x) for x in args.engine_shape.split("x"))
    cuda_graph.graph_batch_sizes = lambda max_batch: [max_batch]  # type: ignore[assignment]
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=rows,
        kv_cache_memory=args.kv_cache_memory,
        quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_dtype,
    )
    core = llm.engine
    res["engine_start_s"] = elapsed()
    res["kv_dtype"] = str(core.executor.rank0.storage.kv.dtype)
    print(f"engine up at {elapsed():.1f} s (KV {res['kv_dtype']})", flush=True)
    save()
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    try:
        prompts = _random_prompts(core.vocab_size, rows, ctx, seed=5)
        t_wait = time.perf_counter()
        best: dict[str, Any] | None = None
        while time.perf_counter() - t_wait < args.wait_s:
            try:
                with open(args.done) as f:
                    finished = "sweep done" in f.read()
            except OSError:
                finished = False
            if finished or elapsed() > args.deadline_s - args.engine_need_s:
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
        kv16 = "float8" not in res["kv_dtype"]
        if args.force_fields == "toggle-even" and kv16:  # KV16_EVEN's long rule flipped
            on = "long" in tb.KV16_EVEN
            name, fields = ("even_off" if on else "even_on"), {"even": not on}
        elif args.force_fields == "toggle-even":  # the other side of DecodeConfig.even
            long = tb.fp8_decode_config(tb.decode_config(rows, HKV, PAGE, None))
            name = "even_off" if long.even else "even_on"
            fields = {"even": not long.even}
        elif args.force_fields:
            name, fields = "forced", json.loads(args.force_fields)
        res["variant"], res["variant_fields"] = name, fields
        what = "forced" if args.force_fields else "the sweep's fastest"
        kv = "bf16-cache" if kv16 else "e4m3"
        print(f"{what} {kv} variant: {name} {fields} (at {elapsed():.1f} s)", flush=True)
        g = core.executor.rank0.runner.graphs
        key = (rows, None)  # the long-context graph of the batch's bucket
        sets: dict[str, Any] = {}
        if g is not None and key in g._graphs:
            sets["current"] = (g._graphs[key], g._logits[key], g._greedy[key])
            if fields:
                apply_fields(fields, kv16)
                try:
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        g._rows[2].fill_(-1)
                        g._rows[3].zero_()
                        g._run(key)
                        sync()
                        graph, (lg, gr) = g._capture_in_pool(
                            torch.cuda.Stream(),
                            lambda: g._run(key),  # type: ignore[no-untyped-call]
                        )
                        sync()
                    sets[name] = (graph, lg, gr)
                    res["variant_capture_s"] = time.perf_counter() - t0
                finally:
                    apply_fields({})

        def use(tag: str) -> None:
            if tag in sets:
                g._graphs[key], g._logits[key], g._greedy[key] = sets[tag]

        # the all-decoding step: 32 requests decoding, spans of the graphs interleaved
        sp = SamplingParams(temperature=0, max_tokens=args.span_tokens, ignore_eos=True)
        rids = [f"span-{i}" for i in range(rows)]
        for rid, p in zip(rids, prompts):
            core.add_request(rid, list(p), sp)
        reqs = [core._requests[rid] for rid in rids]
        while any(len(r.output_token_ids) == 0 for r in reqs):
            core.step()
        for _ in range(2):
            core.step()
        spans: dict[str, list[float]] = {t: [] for t in sets or {"current": None}}
        for _ in range(args.rounds):
            for tag in spans:
                if elapsed() > args.deadline_s - 2 or any(r.finished for r in reqs):
                    break
                use(tag)
                core.step()  # the first step after a switch is not timed
                sync()
                t0 = time.perf_counter()
                for _ in range(args.span_steps):
                    core.step()
                sync()
                spans[tag].append((time.perf_counter() - t0) / args.span_steps * 1e3)
        use("current")
        res["mean_context"] = (
            sum(len(p) for p in prompts) / rows + sum(len(r.output_token_ids) for r in reqs) / rows
        )
        for rid in rids:
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()
        res["spans_ms"] = spans
        med = {t: statistics.median(v) for t, v in spans.items() if v}
        for t, m in med.items():
            res[f"{t}_step_ms"] = m
        if "current" in med and name in med and name != "current":
            cur_v, var_v = spans["current"], spans[name]
            res["variant_over_current"] = med[name] / med["current"]
            res["paired_faster_rounds"] = [sum(b < a for a, b in zip(cur_v, var_v)), len(var_v)]
        print(f"   steps (ms, median of spans): {med} (at {elapsed():.1f} s)", flush=True)
        # greedy tokens of the 32 prompts, current then the variant (the second run finds
        # the prompts' pages in the prefix cache: the same K/V, only decode differs)
        ids: dict[str, list] = {}
        params = SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True)
        for tag in sets if len(sets) > 1 else ():
            if elapsed() > args.deadline_s - 5:
                res["errors"][f"greedy {tag}"] = "skipped: deadline"
                break
            use(tag)
            outs = llm.generate(prompts, params)
            ids[tag] = [list(o.outputs[0].token_ids) for o in outs]
            print(f"   greedy {tag} done (at {elapsed():.1f} s)", flush=True)
        use("current")
        if len(ids) == 2:
            a, b = ids.values()
            res["greedy_same_rows"] = [sum(ra == rb for ra, rb in zip(a, b)), len(a)]
            res["greedy_same_tokens"] = [
                sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)),
                sum(len(r) for r in a),
            ]
            first = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra))
                     for ra, rb in zip(a, b)]  # fmt: skip
            res["greedy_first_diff_median"] = statistics.median(first)
            print(f"   greedy: {res['greedy_same_rows']} rows, {res['greedy_same_tokens']} "
                  f"tokens identical", flush=True)  # fmt: skip
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
    ap.add_argument("--shapes", default="32x4096,8x4096")
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
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtype", default="fp8_e4m3", help="engine: --kv-cache-dtype")
    ap.add_argument("--quantization", default="fp8", help="engine: --quantization (none: bf16)")
    ap.add_argument("--span-steps", type=int, default=8, help="engine: steps a timed span")
    ap.add_argument("--rounds", type=int, default=5, help="engine: interleaved rounds")
    ap.add_argument("--span-tokens", type=int, default=128, help="engine: tokens a span request")
    ap.add_argument("--greedy-tokens", type=int, default=8)
    ap.add_argument("--confirm-rounds", type=int, default=3, help="sweep: rounds of the top 3")
    ap.add_argument("--set", default="round1", choices=sorted(VARIANT_SETS), help="sweep: variants")
    ap.add_argument("--sweep-json", default="", help="engine: the sweep's JSON to read")
    ap.add_argument("--wait-s", type=float, default=90.0, help="engine: wait for the sweep")
    ap.add_argument(
        "--engine-need-s",
        type=float,
        default=25.0,
        help="engine: seconds its A/B needs; it stops waiting for the sweep this long before "
        "--deadline-s",
    )
    ap.add_argument(
        "--force-fields",
        default="",
        help="engine: JSON fields instead of the sweep's; toggle-even: DecodeConfig.even "
        "flipped from the engine's own",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.mode == "sweep":
        sweep(args, dev)
    else:
        engine(args, dev)


if __name__ == "__main__":
    sys.exit(main())
