"""Issue 24, session 9 (bf16 ``random:llama-3.1-8b``, 64 prompts >= 10,000 tok/s): the
decode attention's 64-row configuration, the skinny GEMM's 64-row entries one by one, and
where the first token of the 64 prompts goes. Two modes, run by ``scripts/gpu_s9_bf16row.sh``.

``sweep`` (no model; beside the engine's load): the split-KV decode attention of one step
(32 layers in one CUDA graph) over a page-major pool laid out as the engine lays it
(``KVCacheLayout``, 128-token pages, each row's pages in order, the KV stored already:
``TritonBackend.forward(..., kv_stored=True)``), at 64 rows x 130 / 200 / 256 / 512 / 1,024
tokens of context and 48 x 200 (the 48-row bucket takes the same table entry: ``B * Hkv``
<= 512), for the configurations of :data:`VARIANTS` (``DecodeConfig`` fields: splits,
block_n, num_warps, num_stages). Every (variant, shape) graph is captured once, then timed
in ``--rounds`` interleaved rounds (the variant order reversed every other round), so a
drift (e.g. the engine loading beside it) hits all alike; per variant and shape: µs a
layer per round and the median, the KV bytes read per second, and the output's largest
error against an fp32 attention of the same KV (last layer) over the largest |output|.
The pick rule (:func:`attn_pick`): the variant with the least summed median over the
64-row contexts of the 64-prompt run (130 / 200 / 256), if at most 0.97 of ``current``'s
sum and at most 1.03 of ``current`` at 512 and 1,024 (the same graph runs them) and its
error at most 2 x ``current``'s + 1e-3. -> ``$OUT/<--json>``, after every round.

``engine`` (one ``random:llama-3.1-8b`` load: 256 running requests, graphs to 256 rows,
24 GiB of KV, a 4,096-token step budget, as bench offline's 64 / 256 rows run). Variants
are decode-graph sets of the 64-row bucket (its graphs captured again into a pool of
their own; swapping a set between steps only changes which graph the next step
replays):

- ``base``: the engine as it is (``skinny_table`` with the four 64-row entries; the
  attention's ``SHORT`` entry of the 512 bound);
- ``attn``: the sweep's fastest configuration by the sum over 130 / 200 / 256 (even when the
  pick rule does not take it: the engine A/B is the check), in the 512 bound's entry;
- ``no_qkv``, ``no_o``, ``no_down``: that one skinny entry switched back (to cuBLAS or the
  Triton GEMV of ``gemv_table``, as the engine runs without it).

Parts, while ``--deadline-s`` allows (the JSON written after each):

1. ``attn_ab`` / ``skinny_ab``: the 64-row all-decoding step (64 prompts of 130 tokens,
   greedy), the variants interleaved span by span in one decode session (``--span`` steps a
   span, the order reversed every other round): ms a step per span and the median;
2. ``runs64``: bench offline's 64-prompt run (GSM8K chat prompts, 128 greedy tokens) per
   variant: tok/s and the greedy outputs against ``base``'s (identical rows, identical
   second tokens (the first decode step's), the position of each row's first difference);
3. ``prefill``: the first token of the 64 prompts (``_time_ours(.., 1)``: the two prefill
   chunks of 4,096 + 3,921 tokens) ``--first-repeats`` times with every engine step's start
   and duration, then once under ``torch.profiler``: GPU kernel time by class (cuBLAS GEMM,
   attention, other), the union of the kernels' busy time, the host's share;
4. ``picks``: the set the measurements support (:func:`choose`: ``attn`` if its step beat
   ``base``'s by > ``--min-gain`` of a step, each skinny entry dropped if its removal did),
   captured, then ``base`` and ``picks`` interleaved: the 64-row step again, and bench
   offline's 64-prompt procedure (a warm-up run of 128 and of 1 token, then ``--repeats`` x
   (128 tokens, 1 token)): tok/s, first token, decode ms a step;
5. ``runs256``: the 256-prompt run (base) twice, every engine step's start, duration, rows
   running and waiting (why the whole run's decode step moves +-8 % between runs);
6. ``profile64``: the 64x200 step profile (``gpu_step_profile``) with the picks.

``--device cpu --model random:tiny --toy`` (under ``TRITON_INTERPRET=1``) checks the flow:
no graphs there, so the variants are the same engine and the times mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.perf_counter()
HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 128, 32
# name -> (splits, block_n, num_warps, num_stages); "current" = the engine's pick now
VARIANTS: dict[str, tuple[int, int, int, int] | None] = {
    "current": None,
    "n32 w2 s3": (1, 32, 2, 3),
    "n32 w2 s4": (1, 32, 2, 4),
    "n32 w2 s2": (1, 32, 2, 2),
    "n64 w2 s3": (1, 64, 2, 3),
    "n32 w4 s3": (1, 32, 4, 3),
    "n16 w2 s3": (1, 16, 2, 3),
    "n32 w1 s3": (1, 32, 1, 3),
}
SHAPES = [(64, 130), (64, 200), (64, 256), (64, 512), (64, 1024), (48, 200)]
TOY_SHAPES = [(4, 20), (4, 40), (3, 20)]
RUN_CTX = (130, 200, 256)  # the 64-prompt run's contexts (125-token prompts + 128 out)
LONG_CTX = (512, 1024)  # the same graph (bound 1,024) runs these

QKV = ("linear", "bfloat16", 6144, 4096)
O = ("linear", "bfloat16", 4096, 4096)
DOWN = ("linear", "bfloat16", 4096, 14336)


def elapsed() -> float:
    return time.perf_counter() - T0


def _save(path: str, res: dict) -> None:
    res["elapsed_s"] = round(elapsed(), 2)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- sweep


def _pool(rows: int, ctx: int, layers: int, dev: torch.device, dtype: torch.dtype):
    """A page-major pool of ``rows`` sequences of room for ``ctx`` + 1 tokens (pages in
    order), random values; its per-layer views and each row's pages."""
    from pdserve.engine.kv.layout import KVCacheLayout

    per_row = -(-(ctx + 1) // PAGE)
    num_pages = rows * per_row
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    lay = KVCacheLayout("page_major", layers, HKV, D, PAGE, num_pages, dtype)
    kv = torch.empty(lay.shape, dtype=dtype, device=dev)
    step = max(1, num_pages // 8)
    torch.manual_seed(9)
    for p0 in range(0, num_pages, step):  # in pieces: the fp32 temporaries stay small
        kv[p0 : p0 + step].normal_()
    return kv, lay.layer_views(kv), tables


def _reference(q: torch.Tensor, k_cache, v_cache, tables, rows: int, ctx: int) -> torch.Tensor:
    """fp32 attention of ``q`` ``[rows, HQ, D]`` over the first ``ctx`` tokens of each row's
    pages (GQA: query head h reads KV head h // G) -> ``[rows, HQ, D]``."""
    idx = torch.tensor([t for t in tables[:rows]], device=q.device)
    k = k_cache[idx].reshape(rows, -1, HKV, D)[:, :ctx].float()  # [R, T, Hkv, D]
    v = v_cache[idx].reshape(rows, -1, HKV, D)[:, :ctx].float()
    qg = q.float().view(rows, HKV, HQ // HKV, D)
    s = torch.einsum("rhgd,rthd->rhgt", qg, k) * D**-0.5
    o = torch.einsum("rhgt,rthd->rhgd", torch.softmax(s, dim=-1), v)
    return o.reshape(rows, HQ, D)


def sweep(args) -> None:
    from pdserve.model import triton_backend as tb
    from pdserve.model.attention import build_attention_metadata

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    layers = 2 if args.toy else LAYERS
    shapes = TOY_SHAPES if args.toy else SHAPES
    names = list(VARIANTS)[:3] if args.toy else list(VARIANTS)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "layers": layers,
        "variants": {n: VARIANTS[n] for n in names},
        "shapes": {},
        "errors": {},
        "rounds_done": 0,
    }
    max_rows = max(r for r, _ in shapes)
    max_ctx = max(c for _, c in shapes)
    # bf16 as the engine; fp32 on the CPU (the interpreter computes bf16 dots wrongly)
    dtype = torch.bfloat16 if cuda else torch.float32
    kv, views, tables = _pool(max_rows, max_ctx, layers, dev, dtype)
    print(f"[{elapsed():5.1f} s] pool {tuple(kv.shape)} built", flush=True)
    torch.manual_seed(3)
    q_all = (torch.randn(max_rows, HQ, D, device=dev) * 0.5).to(dtype)
    picks = tb.device_picks(dev, HQ // HKV, D)
    cases: dict[tuple[int, int], dict[str, Any]] = {}
    for rows, ctx in shapes:
        md = build_attention_metadata([1] * rows, [ctx] * rows, tables[:rows], PAGE, dev)
        q = q_all[:rows].contiguous()
        cur = tb.decode_config(rows, HKV, PAGE, tb.ONE_SPLIT_MAX_CONTEXT, None, picks)
        ref = _reference(q, views[-1][0], views[-1][1], tables, rows, ctx)
        key = f"{rows}x{ctx}"
        cases[(rows, ctx)] = dict(md=md, q=q, cur=cur, ref=ref, key=key, graphs={})
        res["shapes"][key] = {
            "rows": rows,
            "context": ctx,
            "current_config": str(cur),
            "kv_bytes_per_step": rows * ctx * HKV * D * 2 * kv.element_size() * layers,
            "variants": {},
        }

    def config_of(name: str, case: dict) -> Any:
        fields = VARIANTS[name]
        if fields is None:
            return case["cur"]
        s, bn, w, st = fields
        return tb.DecodeConfig(s, bn, w, st)

    def build(name: str, case: dict) -> None:
        """Compile and capture the 32 layers of ``name`` at this shape; record the error."""
        backend = tb.TritonBackend()
        md, q = case["md"], case["q"]
        kv_new = q[:, :HKV]  # not read (kv_stored); its shape gives Hkv
        plan = backend.plan_for_capture(md, PAGE, None)
        plan.config = config_of(name, case)
        out: list[torch.Tensor] = []

        def step() -> None:
            o = None
            for kc, vc in views:
                o = backend.forward(q, kv_new, kv_new, kc, vc, md, plan, D**-0.5, kv_stored=True)
            out[:] = [o]

        step()
        _sync(dev)
        o = out[0].float().view(q.shape[0], HQ, D)
        err = float((o - case["ref"]).abs().max() / case["ref"].abs().max().clamp_min(1e-30))
        entry = res["shapes"][case["key"]]["variants"].setdefault(name, {})
        entry.update(config=str(plan.config), err=err, us_layer=[])
        if not cuda:
            case["graphs"][name] = step
            return
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            step()
        g.replay()
        _sync(dev)
        case["graphs"][name] = g

    def timed(name: str, case: dict) -> float:
        fn = case["graphs"][name]
        if not cuda:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6 / layers
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        fn.replay()  # warm (its KV not in L2 anyway: > 1 GB a replay at 64 x 200)
        a.record()
        for _ in range(args.reps):
            fn.replay()
        b.record()
        b.synchronize()
        return float(a.elapsed_time(b)) * 1e3 / args.reps / layers

    # compile + capture every (variant, shape), variants in order (a deadline cuts the tail)
    built: list[str] = []
    for name in names:
        if elapsed() > args.build_deadline_s:
            res["errors"][name] = "skipped: build deadline"
            continue
        try:
            for case in cases.values():
                build(name, case)
            built.append(name)
            print(f"[{elapsed():5.1f} s] built {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 (a failed variant must not end the sweep)
            res["errors"][name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            print(f"   {name} failed: {res['errors'][name][:150]}", flush=True)
            for case in cases.values():
                case["graphs"].pop(name, None)
        _save(out_path, res)
    for rnd in range(args.rounds):
        if elapsed() > args.deadline_s:
            res["errors"]["rounds"] = f"stopped after {rnd} rounds: deadline"
            break
        order = built if rnd % 2 == 0 else built[::-1]
        for name in order:
            for case in cases.values():
                us = timed(name, case)
                res["shapes"][case["key"]]["variants"][name]["us_layer"].append(us)
        res["rounds_done"] = rnd + 1
        summarize(res)
        line = "  ".join(
            f"{k} {v['variants']['current']['median_us']:.1f}/{v.get('best', '?')} {v.get('best_us', 0):.1f}"
            for k, v in res["shapes"].items()
            if "median_us" in v["variants"].get("current", {})
        )
        print(f"[{elapsed():5.1f} s] round {rnd + 1}: {line}", flush=True)
        _save(out_path, res)
    res["pick"] = attn_pick(res)
    print(f"[{elapsed():5.1f} s] pick: {res['pick']}", flush=True)
    _save(out_path, res)
    del cases
    if cuda:
        torch.cuda.empty_cache()


def summarize(res: dict) -> None:
    """Per shape and variant: the median µs a layer over the rounds, KV GB/s; the fastest."""
    for r in res["shapes"].values():
        best = None
        for name, v in r["variants"].items():
            if not v.get("us_layer"):
                continue
            v["median_us"] = statistics.median(v["us_layer"])
            v["kv_gb_s"] = r["kv_bytes_per_step"] / res["layers"] / v["median_us"] / 1e3
            if best is None or v["median_us"] < r["variants"][best]["median_us"]:
                best = name
        if best is not None:
            r["best"], r["best_us"] = best, r["variants"][best]["median_us"]


def attn_pick(res: dict, run_ctx=RUN_CTX, long_ctx=LONG_CTX, rows: int = 64) -> dict:
    """The rule of the module doc over ``res`` (a sweep's JSON): ``{"fastest": name (least
    sum over the run's contexts, any), "pick": name or None (the rule holds), "fields",
    "sums", "why"}``."""
    shapes = {(r["rows"], r["context"]): r for r in res["shapes"].values()}
    run = [shapes.get((rows, c)) for c in run_ctx]
    if not run or any(r is None for r in run):
        run = [r for (rw, _), r in sorted(shapes.items()) if rw == max(k[0] for k in shapes)][:3]
    sums: dict[str, float] = {}
    for name in res["variants"]:
        meds = [r["variants"].get(name, {}).get("median_us") for r in run]
        if all(m is not None for m in meds):
            sums[name] = sum(meds)
    out: dict[str, Any] = {"sums": sums, "pick": None, "fastest": None, "fields": None}
    if "current" not in sums or len(sums) < 2:
        out["why"] = "current or every variant missing"
        return out
    fastest = min((n for n in sums if n != "current"), key=sums.__getitem__)
    out["fastest"], out["fields"] = fastest, res["variants"][fastest]
    why = [f"{fastest}: {sums[fastest]:.2f} vs current {sums['current']:.2f} us"]
    ok = sums[fastest] <= 0.97 * sums["current"]
    for c in long_ctx:
        r = shapes.get((rows, c))
        if r is None:
            continue
        a = r["variants"].get(fastest, {}).get("median_us")
        b = r["variants"].get("current", {}).get("median_us")
        if a is None or b is None:
            continue
        why.append(f"{rows}x{c}: {a:.2f} vs {b:.2f}")
        ok = ok and a <= 1.03 * b
    for r in run:
        e, e0 = r["variants"][fastest].get("err", 1.0), r["variants"]["current"].get("err", 0.0)
        ok = ok and e <= 2 * e0 + 1e-3
    out["pick"] = fastest if ok else None
    out["why"] = "; ".join(why)
    return out


# ---------------------------------------------------------------------------- engine


class StepClock:
    """Every ``core.step()`` while active: (start ms from the first, duration ms, rows
    running, rows waiting after it)."""

    def __init__(self, core) -> None:
        self.core = core
        self.rows: list[tuple[float, float, int, int]] = []

    def __enter__(self) -> StepClock:
        orig = type(self.core).step
        core = self.core
        t0 = time.perf_counter()

        def step():
            t = time.perf_counter()
            out = orig(core)
            s = core.scheduler
            self.rows.append(
                (
                    round((t - t0) * 1e3, 3),
                    round((time.perf_counter() - t) * 1e3, 3),
                    len(s.running),
                    len(getattr(s, "waiting", ())),
                )
            )
            return out

        core.step = step
        return self

    def __exit__(self, *exc) -> None:
        del self.core.step  # the class's method again


def _kernel_class(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("nvjet", "gemm", "cutlass", "xmma", "cublas", "splitkreduce")):
        return "gemm"
    if "extend" in n or "decode_split" in n or "decode_merge" in n or "flash" in n:
        return "attention"
    return "other"


def engine(args) -> None:
    from gpu_step_profile import _prompts, profile_shapes

    from pdserve.bench.offline import _time_ours, workload_prompts
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.model import decode_attn_table, skinny_table
    from pdserve.model import triton_backend as tb

    toy = args.toy
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {"parts_done": [], "skipped": {}, "errors": {}, "notes": []}
    n64 = 4 if toy else 64
    n256 = 8 if toy else 256
    t = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_running_requests=n256, kv_cache_memory=2 if toy else 24,
              max_num_batched_tokens=64 if toy else 4096)  # fmt: skip
    res["engine_start_s"] = round(time.perf_counter() - t, 1)
    core = llm.engine
    cuda = core.device.type == "cuda"
    res["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"[{elapsed():5.1f} s] engine up in {res['engine_start_s']:.0f} s", flush=True)
    _save(out_path, res)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # --- the sweep's result (it runs beside the load: nothing here is timed before it ends)
    t = time.perf_counter()
    while args.done and not os.path.exists(args.done):
        if time.perf_counter() - t > args.sweep_wait_s or elapsed() > args.deadline_s - 40:
            res["notes"].append("stopped waiting for the sweep")
            break
        time.sleep(0.25)
    res["sweep_wait_s"] = round(time.perf_counter() - t, 1)
    pick: dict[str, Any] = {}
    try:
        with open(args.sweep_json) as f:
            pick = attn_pick(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        res["notes"].append(f"no sweep result: {type(exc).__name__}: {exc}")
    res["sweep_pick"] = pick
    attn_fields = pick.get("fields") or (1, 32, 2, 3)  # S8-ATTN's candidate when no sweep
    res["attn_fields"] = list(attn_fields)
    print(f"[{elapsed():5.1f} s] sweep waited {res['sweep_wait_s']} s; attention variant "
          f"{attn_fields} (rule pick {pick.get('pick')})", flush=True)  # fmt: skip

    # --- decode-graph sets of the 64-row bucket
    g = core.executor.rank0.runner.graphs
    dev_name = res["device"]
    attn_key = (dev_name, HQ // HKV, D)
    short0 = decode_attn_table.SHORT
    table0 = dict(skinny_table.TABLE)
    bucket = g.bucket(n64) if g is not None else None
    keys = [k for k in g.keys() if k[0] == bucket] if g is not None else []  # noqa: SIM118 (a method)
    sets: dict[str, dict] = {}
    if g is not None:
        sets["base"] = {k: (g._graphs[k], g._logits[k], g._greedy[k]) for k in keys}
    variants_made: list[str] = ["base"]

    def install(name: str) -> None:
        if g is None:
            return
        for k, (gr, lo, gd) in sets[name].items():
            g._graphs[k], g._logits[k], g._greedy[k] = gr, lo, gd

    def with_attn(fields) -> dict:
        if attn_key not in short0:  # a device the table does not list (the CPU check)
            return short0
        least, entries = short0[attn_key]
        bound = HKV * bucket if bucket else 512
        new = tuple((n, tuple(fields) + (0, 0, False) if n == bound else c) for n, c in entries)
        return {**short0, attn_key: (least, new)}

    @torch.inference_mode()
    def capture(name: str, table: dict, short: dict) -> float:
        """The 64-row bucket's graphs with ``table`` / ``short`` in force, into a pool of
        their own; the module tables restored after."""
        t = time.perf_counter()
        if g is None:
            return 0.0
        skinny_table.TABLE = table
        decode_attn_table.SHORT = short
        tb._cuda_picks.cache_clear()
        pool = g._pool
        try:
            sync()
            g._rows.zero_()  # padded rows only: nothing written to the KV pool
            g._rows[2].fill_(-1)
            g._table.zero_()
            g._pool = None
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            made = {}
            for k in keys:
                g._run(k)  # warm-up: compiles
                sync()
                gr = g._capture(k, stream)
                sync()
                made[k] = (gr, g._logits[k], g._greedy[k])
            sets[name] = made
            variants_made.append(name)
        finally:
            g._pool = pool
            skinny_table.TABLE = table0
            decode_attn_table.SHORT = short0
            tb._cuda_picks.cache_clear()
            install("base")
        return time.perf_counter() - t

    def left() -> float:
        return args.deadline_s - elapsed()

    def part(name: str, need: float, fn) -> None:
        if left() < need:
            res["skipped"][name] = f"{left():.0f} s left, needs ~{need:.0f}"
            print(f"== {name}: skipped ({left():.0f} s left)", flush=True)
            _save(out_path, res)
            return
        print(f"== {name} (at {elapsed():.1f} s, {left():.0f} s left)", flush=True)
        try:
            fn()
            res["parts_done"].append(name)
        except Exception as exc:  # noqa: BLE001 (a failed part must not lose the others)
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"
            try:  # a part cut mid-way must not leave its requests to the next
                for rid in list(core._requests):
                    core.abort_request(rid)
                while core.has_unfinished_requests():
                    core.step()
            except Exception as exc2:  # noqa: BLE001
                res["errors"][name + " cleanup"] = f"{type(exc2).__name__}: {str(exc2)[:200]}"
        finally:
            install("base")
        _save(out_path, res)

    def ab_steps(names: list[str], rounds: int, span: int, ctx: int, salt: int) -> dict:
        """The all-decoding step of ``n64`` rows, ``names`` interleaved span by span."""
        names = [n for n in names if n in sets or g is None]
        total = rounds * len(names) * span + 2 * len(names) + 4
        params = SamplingParams(temperature=0, max_tokens=total + 8, ignore_eos=True)
        llm.reset_prefix_cache()
        ids = [f"ab{salt}-{i}" for i in range(n64)]
        for rid, p in zip(ids, _prompts(n64, ctx, salt)):
            core.add_request(rid, p, params)
        reqs = [core._requests[r] for r in ids]
        while any(len(r.output_token_ids) == 0 for r in reqs):
            core.step()
        for n in names:  # warm each set
            install(n)
            core.step()
            core.step()
        sync()
        spans: dict[str, list[float]] = {n: [] for n in names}
        for rnd in range(rounds):
            for n in names if rnd % 2 == 0 else names[::-1]:
                install(n)
                t = time.perf_counter()
                for _ in range(span):
                    core.step()
                sync()
                spans[n].append((time.perf_counter() - t) / span * 1e3)
        ctx_end = statistics.mean(len(r.prompt_token_ids) + len(r.output_token_ids) for r in reqs)
        for rid in ids:
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()
        install("base")
        out = {n: {"median_ms": statistics.median(v), "mean_ms": statistics.mean(v),
                   "spans_ms": [round(x, 4) for x in v]} for n, v in spans.items()}  # fmt: skip
        b = out.get("base", {}).get("median_ms")
        for n, v in out.items():
            v["vs_base_ms"] = v["median_ms"] - b if b else None
            # the paired differences (each round's span minus base's of the same round)
            if b and n != "base":
                d = [x - y for x, y in zip(spans[n], spans["base"])]
                v["paired_diff_median_ms"] = statistics.median(d)
        print("   " + "  ".join(f"{n} {v['median_ms']:.4f}" for n, v in out.items())
              + f"  (context {ctx} -> {ctx_end:.0f})", flush=True)  # fmt: skip
        return {"rows": n64, "context_start": ctx, "context_end": ctx_end, "span": span,
                "rounds": rounds, "variants": out}  # fmt: skip

    prompts64 = workload_prompts(llm, n64, None, None)
    base_ids: list[list[int]] = []

    def compare(ids: list[list[int]]) -> dict:
        firsts = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            for a, b in zip(ids, base_ids)
        ]
        diffs = [d for d in firsts if d is not None]
        return {
            "same_outputs": sum(d is None for d in firsts),
            "same_token2": sum(len(a) > 1 and a[:2] == b[:2] for a, b in zip(ids, base_ids)),
            "first_diff_positions": firsts,
            "first_diff_median": statistics.median(diffs) if diffs else None,
        }

    # --- the parts
    def p_capture() -> None:
        res["capture_s"] = {}
        specs = [("attn", table0, with_attn(attn_fields) if g is not None else short0)]
        specs += [
            (f"no_{tag}", {k: v for k, v in table0.items() if k != key}, short0)
            for tag, key in (("qkv", QKV), ("o", O), ("down", DOWN))
        ]
        for name, table, short in specs:
            try:
                res["capture_s"][name] = round(capture(name, table, short), 2)
            except Exception as exc:  # noqa: BLE001
                res["errors"][f"capture {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"   captured {name} ({res['capture_s'].get(name)} s)", flush=True)
        res["variants_made"] = list(variants_made)

    def p_attn_ab() -> None:
        res["attn_ab"] = ab_steps(
            ["base", "attn"], 4 if toy else 6, 3 if toy else 10, 20 if toy else 130, 1
        )

    def p_skinny_ab() -> None:
        res["skinny_ab"] = ab_steps(["base", "no_qkv", "no_o", "no_down"], 2 if toy else 4,
                                    3 if toy else 8, 20 if toy else 130, 2)  # fmt: skip

    def p_runs64() -> None:
        out: dict[str, Any] = {}
        res["runs64"] = out
        _time_ours(llm, prompts64, args.max_tokens)  # bench offline's warm-up run
        for name in ["base", "attn", "no_qkv", "no_o", "no_down"]:
            if name not in variants_made or left() < 3:
                continue
            install(name)
            _time_ours(llm, prompts64, 4)  # this set's 64-row graph replayed once
            secs, ids = _time_ours(llm, prompts64, args.max_tokens)
            v: dict[str, Any] = {"tok_s": n64 * args.max_tokens / secs, "s": secs}
            if name == "base":
                base_ids[:] = ids
            else:
                v |= compare(ids)
            out[name] = v
            print(f"   {name}: {v['tok_s']:.0f} tok/s, same {v.get('same_outputs')}, token2 "
                  f"{v.get('same_token2')}, first diff median {v.get('first_diff_median')}", flush=True)  # fmt: skip
            _save(out_path, res)

    def p_prefill() -> None:
        out: dict[str, Any] = {"num_prompts": n64,
                               "prompt_tokens": sum(len(p) for p in prompts64)}  # fmt: skip
        res["prefill"] = out
        _time_ours(llm, prompts64, 1)
        firsts, clocks = [], []
        for _ in range(args.first_repeats):
            with StepClock(core) as c:
                firsts.append(_time_ours(llm, prompts64, 1)[0])
            clocks.append(c.rows)
        out["first_token_s"] = firsts
        out["steps"] = clocks
        print(f"   first token: {[round(x * 1e3, 1) for x in firsts]} ms; steps "
              f"{[[r[1] for r in c] for c in clocks]}", flush=True)  # fmt: skip
        with StepClock(core) as c:
            full, _ = _time_ours(llm, prompts64, args.max_tokens)
        out["full_run_s"] = full
        out["full_run_steps_head"] = c.rows[:8]
        out["full_run_step_count"] = len(c.rows)
        _save(out_path, res)
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            _time_ours(llm, prompts64, 1)
            sync()
            wall = time.perf_counter() - t
        kern = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        per: collections.Counter = collections.Counter()
        cnt: collections.Counter = collections.Counter()
        cls: collections.Counter = collections.Counter()
        spans = []
        for e in kern:
            us = e.time_range.end - e.time_range.start
            per[e.name[:100]] += us
            cnt[e.name[:100]] += 1
            cls[_kernel_class(e.name)] += us
            spans.append((e.time_range.start, e.time_range.end))
        spans.sort()
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        out["profiled"] = {
            "wall_ms": wall * 1e3,
            "kernel_sum_ms": sum(per.values()) / 1e3,
            "gpu_busy_ms": busy / 1e3,
            "first_kernel_to_last_ms": (spans[-1][1] - spans[0][0]) / 1e3 if spans else None,
            "by_class_ms": {k: v / 1e3 for k, v in cls.items()},
            "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in per.most_common(16)},
            "top_kernel_counts": {k: cnt[k] for k, _ in per.most_common(16)},
            "kernels": len(kern),
        }
        p = out["profiled"]
        print(f"   profiled: wall {p['wall_ms']:.1f} ms, GPU busy {p['gpu_busy_ms']:.1f}, kernels "
              f"{p['kernel_sum_ms']:.1f} {({k: round(v, 1) for k, v in p['by_class_ms'].items()})}", flush=True)  # fmt: skip

    def choose() -> dict:
        """The set the step A/Bs support: attn if its step beat base's by > min_gain of a
        step; each skinny entry dropped if the step without it did."""
        table = dict(table0)
        short = short0
        why = []
        ab = (res.get("attn_ab") or {}).get("variants", {})
        base = ab.get("base", {}).get("median_ms")
        a = ab.get("attn", {})
        if base and a and a.get("paired_diff_median_ms", 0) < -args.min_gain * base:
            short = with_attn(attn_fields)
            why.append(f"attn {attn_fields}: {a['paired_diff_median_ms']:+.4f} ms")
        sk = (res.get("skinny_ab") or {}).get("variants", {})
        base = sk.get("base", {}).get("median_ms")
        for tag, key in (("qkv", QKV), ("o", O), ("down", DOWN)):
            v = sk.get(f"no_{tag}", {})
            if base and v and v.get("paired_diff_median_ms", 0) < -args.min_gain * base:
                table.pop(key, None)
                why.append(f"no_{tag}: {v['paired_diff_median_ms']:+.4f} ms")
        return {"table": table, "short": short, "why": why,
                "changed": table != table0 or short is not short0}  # fmt: skip

    def p_picks() -> None:
        c = choose()
        res["picks"] = {"why": c["why"], "changed": c["changed"],
                        "skinny_keys": [list(k) for k in c["table"]],
                        "attn_512": c["short"].get(attn_key, (0, ()))[1] if g is not None else None}  # fmt: skip
        print(f"   picks: {c['why'] or 'none'}", flush=True)
        names = ["base"]
        if c["changed"] or toy:
            res["picks"]["capture_s"] = capture("picks", c["table"], c["short"])
            names.append("picks")
            res["picks"]["ab"] = ab_steps(
                names, 2 if toy else 4, 3 if toy else 10, 20 if toy else 130, 3
            )
        _save(out_path, res)
        runs: dict[str, dict] = {n: {"runs": [], "first": []} for n in names}
        res["picks"]["offline"] = runs
        for n in names:  # bench offline's warm-up: a full run and a 1-token run
            install(n)
            _time_ours(llm, prompts64, args.max_tokens)
            _time_ours(llm, prompts64, 1)
        for rep in range(args.repeats):
            for n in names if rep % 2 == 0 else names[::-1]:
                if left() < 2.5:
                    break
                install(n)
                secs, _ = _time_ours(llm, prompts64, args.max_tokens)
                runs[n]["runs"].append(n64 * args.max_tokens / secs)
                runs[n]["first"].append(_time_ours(llm, prompts64, 1)[0])
            _save(out_path, res)
        for n, r in runs.items():
            if r["runs"]:
                tok = statistics.median(r["runs"])
                first = statistics.median(r["first"])
                r["tok_s"] = tok
                r["first_token_s"] = first
                r["decode_ms_per_step"] = (
                    (n64 * args.max_tokens / tok - first) / (args.max_tokens - 1) * 1e3
                )
                print(f"   {n}: {tok:.0f} tok/s (runs {[round(x) for x in r['runs']]}), first "
                      f"{first * 1e3:.1f} ms, decode {r['decode_ms_per_step']:.3f} ms/step", flush=True)  # fmt: skip
        install("base")

    def p_runs256() -> None:
        prompts = workload_prompts(llm, n256, None, None)
        out: dict[str, Any] = {"runs": []}
        res["runs256"] = out
        _time_ours(llm, prompts, 1)
        for i in range(2):
            if i and left() < 5:
                break
            with StepClock(core) as c:
                secs, _ = _time_ours(llm, prompts, args.max_tokens)
            rows = c.rows
            tail = [r[1] for r in rows[-(args.max_tokens * 3 // 4) :]]  # decode steps only
            out["runs"].append({"tok_s": n256 * args.max_tokens / secs, "s": secs, "steps": rows,
                                "tail_step_ms_median": statistics.median(tail),
                                "tail_step_ms_mean": statistics.mean(tail)})  # fmt: skip
            print(f"   256 run {i}: {n256 * args.max_tokens / secs:.0f} tok/s, {len(rows)} steps, "
                  f"last {len(tail)} steps median {statistics.median(tail):.3f} mean "
                  f"{statistics.mean(tail):.3f} ms", flush=True)  # fmt: skip
            _save(out_path, res)

    def p_profile64() -> None:
        name = "picks" if "picks" in variants_made else "base"
        install(name)
        r = profile_shapes(llm, ["4x20" if toy else "64x200"], 4 if toy else 16, 12)
        res["profile64"] = {"set": name} | {
            s: {k: x[k] for k in ("step_ms", "step_ms_spans", "kernel_ms", "kernels_per_step")}
            | {"top_kernels_ms": x["top_kernels_ms"]}
            for s, x in r.items()
        }

    try:
        part("capture", 6, p_capture)
        part("attn_ab", 3, p_attn_ab)
        part("skinny_ab", 4, p_skinny_ab)
        part("runs64", 6, p_runs64)
        part("prefill", 5, p_prefill)
        part("picks", 8, p_picks)
        part("runs256", 7, p_runs256)
        part("profile64", 4, p_profile64)
    finally:
        _save(out_path, res)
        summary = {
            "parts": res["parts_done"], "skipped": res["skipped"], "errors": res["errors"],
            "capture_s": res.get("capture_s"), "sweep_pick": res.get("sweep_pick", {}).get("why"),
            "attn_ab": {n: round(v["median_ms"], 4) for n, v in (res.get("attn_ab") or {}).get("variants", {}).items()},
            "skinny_ab": {n: round(v["median_ms"], 4) for n, v in (res.get("skinny_ab") or {}).get("variants", {}).items()},
            "runs64": {n: round(v["tok_s"]) for n, v in (res.get("runs64") or {}).items()},
            "first_ms": [round(x * 1e3, 1) for x in (res.get("prefill") or {}).get("first_token_s", [])],
            "picks": (res.get("picks") or {}).get("why"),
            "offline": {n: round(v.get("tok_s", 0)) for n, v in ((res.get("picks") or {}).get("offline") or {}).items()},
        }  # fmt: skip
        print("SUMMARY_JSON " + json.dumps(summary, separators=(",", ":")), flush=True)
        llm.shutdown()
    print(f"== done at {elapsed():.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["sweep", "engine"])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--toy", action="store_true", help="small shapes and counts (CPU check)")
    ap.add_argument("--json", default="")
    ap.add_argument("--deadline-s", type=float, default=60.0, help="skip parts / rounds after")
    ap.add_argument("--build-deadline-s", type=float, default=45.0, help="sweep: compile until")
    ap.add_argument("--rounds", type=int, default=5, help="sweep: interleaved timing rounds")
    ap.add_argument("--reps", type=int, default=20, help="sweep: graph replays timed a round")
    ap.add_argument("--done", default="", help="sweep: touched when done; engine: waited for")
    ap.add_argument("--sweep-json", default="", help="engine: the sweep's JSON")
    ap.add_argument("--sweep-wait-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--first-repeats", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="engine: bench-offline repeats")
    ap.add_argument("--min-gain", type=float, default=0.003, help="engine: of a step, to pick")
    args = ap.parse_args()
    args.json = args.json or ("attn_sweep.json" if args.mode == "sweep" else "bf16row.json")
    if args.mode == "sweep":
        try:
            sweep(args)
        finally:
            if args.done:
                with open(args.done, "a") as f:
                    f.write("sweep done\n")
    else:
        engine(args)


if __name__ == "__main__":
    main()
