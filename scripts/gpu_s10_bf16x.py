"""Issue 24, session 10 (bf16 ``random:llama-3.1-8b``, 64 prompts x 128 >= 10,000 tok/s):
where the first token's host time and the 64-row decode step's time go, and three cheap
candidates measured in one engine. Two modes, run by ``scripts/gpu_s10_bf16x.sh``.

``sweep`` (no model; beside the engine's load): the extend (prefill) attention kernel at
the 64-prompt run's prefill shapes (32 and 64 prompts of ~125 tokens: one 4,096-token chunk
and the whole 8,017-token prompt set; page-major pool, K/V stored, 32 layers each launch on
its own layer) for the tile configurations of :data:`EXTEND_VARIANTS`
(``BLOCK_M, BLOCK_N, num_warps, num_stages``; ``BLOCK_N`` kept at 64: the online softmax's
blocks, so the bits stay), interleaved rounds, µs a layer, median; per variant whether its
output equals ``current``'s bit for bit and its error against an fp32 attention.

``engine`` (one load: 256 running requests, graphs to 256 rows, 24 GiB of KV, a 4,096-token
budget: bench offline's engine for ``--num-prompts 1,64,256``; the start-up heap frozen as
bench offline freezes it). Parts, while ``--deadline-s`` allows (the JSON written after
each):

1. ``first``: bench offline's warm-up (128 tokens, then 1), the first token of the 64
   prompts 3 times (every engine step's start and length), then once under
   ``torch.profiler`` (CPU + CUDA): the GPU's idle gaps (the kernels' busy union against
   the run's wall), each gap of >= 20 µs with the kernels either side and the CPU ops
   overlapping it (what the host was doing while the GPU waited), the lead (call -> first
   kernel) and tail (last kernel -> return);
2. ``extend_ab``: the sweep's fastest bit-identical extend tiles (up to 2) against
   ``current`` in the engine's first token of the 64 prompts, interleaved rounds, paired
   medians; the fastest's 64 x 128 greedy outputs against ``current``'s;
3. ``budget_ab``: the step's token budget 4,096 (base) against 8,192 (the 8,017 prompt
   tokens in one prefill step) by bench offline's procedure (warm-ups, then 128-token and
   1-token runs interleaved): tok/s, first token, decode ms a step, greedy outputs;
4. ``decode64``: the 64 x 200 all-decoding step (graphs, PDL as the engine runs it) under the
   profiler: per kernel its *incremental* time (its end minus the previous kernel's end, in
   stream order: under PDL a kernel starts early and waits, so its own duration overstates
   it), summed per name and per step, and one whole step's sequence; wall ms a step;
5. ``picks``: what 2 and 3 support (a gain > ``--min-gain-ms``, outputs identical) against
   base by bench offline's procedure interleaved (``--repeats``);
6. ``pdl``: the 64-row bucket captured again with PDL off, the all-decoding step A/B
   (paired span medians) and its incremental profile (each kernel's own time).

``--device cpu --model random:tiny --toy`` (under ``TRITON_INTERPRET=1``) checks the flow.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_s9_bf16row import StepClock, _kernel_class, _save, _sync

T0 = time.perf_counter()
HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 128, 32
# name -> (BLOCK_M, BLOCK_N, num_warps, num_stages); "current": the engine's own launch
EXTEND_VARIANTS: dict[str, tuple[int, int, int, int] | None] = {
    "current": None,
    "m128 w8 s2": (128, 64, 8, 2),
    "m128 w8 s3": (128, 64, 8, 3),
    "m128 w4 s2": (128, 64, 4, 2),
    "m64 w8 s3": (64, 64, 8, 3),
    "m64 w4 s2": (64, 64, 4, 2),
    "m32 w4 s3": (32, 64, 4, 3),
    "m32 w2 s3": (32, 64, 2, 3),
}
SWEEP_SHAPES = [32, 64]  # prompts of ~125 tokens
TOY_SHAPES = [3, 4]


def elapsed() -> float:
    return time.perf_counter() - T0


class _TiledLaunch:
    """``extend_kernel`` with ``num_warps`` / ``num_stages`` added to every launch (the
    backend launches ``extend_kernel[grid](...)`` with Triton's defaults, 4 and 3)."""

    def __init__(self, kernel, warps: int, stages: int) -> None:
        self.kernel, self.warps, self.stages = kernel, warps, stages

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            return launch(*args, num_warps=self.warps, num_stages=self.stages, **kwargs)

        return run


@contextlib.contextmanager
def extend_tiles(fields: tuple[int, int, int, int] | None):
    """The backend's extend launches use ``fields`` while inside (``None``: as it is)."""
    from pdserve.model import triton_backend as tb

    saved = (tb._EXTEND_BLOCK_M, tb._EXTEND_BLOCK_N, tb.extend_kernel)
    if fields is not None:
        bm, bn, w, s = fields
        tb._EXTEND_BLOCK_M, tb._EXTEND_BLOCK_N = bm, bn
        tb.extend_kernel = _TiledLaunch(saved[2], w, s)
    try:
        yield
    finally:
        tb._EXTEND_BLOCK_M, tb._EXTEND_BLOCK_N, tb.extend_kernel = saved


def _lengths(n: int, toy: bool) -> list[int]:
    g = torch.Generator().manual_seed(24 + n)
    lo, hi = (5, 12) if toy else (100, 151)  # the GSM8K chat prompts: ~125 tokens
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def sweep(args) -> None:
    from pdserve.engine.kv.layout import KVCacheLayout
    from pdserve.model import triton_backend as tb
    from pdserve.model.attention import build_attention_metadata

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    layers = 2 if args.toy else LAYERS
    shapes = TOY_SHAPES if args.toy else SWEEP_SHAPES
    names = list(EXTEND_VARIANTS)[:3] if args.toy else list(EXTEND_VARIANTS)
    dtype = torch.bfloat16 if cuda else torch.float32
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "layers": layers,
        "variants": {n: EXTEND_VARIANTS[n] for n in names},
        "shapes": {},
        "errors": {},
        "rounds_done": 0,
    }
    hq, hkv, d = (4, 2, 16) if args.toy else (HQ, HKV, D)
    page = 16 if args.toy else PAGE
    cases = {}
    for n in shapes:
        lens = _lengths(n, args.toy)
        per = [-(-x // page) for x in lens]
        starts = [sum(per[:i]) for i in range(n)]
        tables = [list(range(s, s + p)) for s, p in zip(starts, per)]
        pages = sum(per)
        lay = KVCacheLayout("page_major", layers, hkv, d, page, pages, dtype)
        torch.manual_seed(5)
        kv = torch.randn(lay.shape, dtype=dtype, device=dev)
        views = lay.layer_views(kv)
        T = sum(lens)
        q = (torch.randn(T, hq, d, device=dev) * 0.5).to(dtype)
        md = build_attention_metadata(lens, lens, tables, page, dev)
        key = f"{n}x~{round(sum(lens) / n)}"
        cases[n] = dict(lens=lens, tables=tables, views=views, q=q, md=md, key=key, outs={})
        res["shapes"][key] = {"prompts": n, "tokens": T, "variants": {}}
    backend = tb.TritonBackend()

    def run(case) -> torch.Tensor:
        q, md = case["q"], case["md"]
        plan = backend.plan(md, page)
        o = None
        kvn = q[:, :hkv]
        for kc, vc in case["views"]:
            o = backend.forward(q, kvn, kvn, kc, vc, md, plan, d**-0.5, kv_stored=True)
        return o

    def reference(case) -> torch.Tensor:
        """fp32 causal attention of the last layer, per prompt (GQA)."""
        kc, vc = case["views"][-1]
        outs, t = [], 0
        for n, tab in zip(case["lens"], case["tables"]):
            k = kc[tab].reshape(-1, hkv, d)[:n].float()
            v = vc[tab].reshape(-1, hkv, d)[:n].float()
            qq = case["q"][t : t + n].float().view(n, hkv, hq // hkv, d)
            s = torch.einsum("qhgd,khd->hgqk", qq, k) * d**-0.5
            mask = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~mask, float("-inf"))
            o = torch.einsum("hgqk,khd->qhgd", torch.softmax(s, -1), v)
            outs.append(o.reshape(n, hq * d))
            t += n
        return torch.cat(outs)

    def timed(name, case) -> float:
        with extend_tiles(EXTEND_VARIANTS[name]):
            if not cuda:
                t = time.perf_counter()
                run(case)
                return (time.perf_counter() - t) * 1e6 / layers
            a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            run(case)
            a.record()
            for _ in range(args.reps):
                run(case)
            b.record()
            b.synchronize()
            return float(a.elapsed_time(b)) * 1e3 / args.reps / layers

    built: list[str] = []
    for name in names:
        if elapsed() > args.build_deadline_s:
            res["errors"][name] = "skipped: build deadline"
            continue
        try:
            for case in cases.values():
                with extend_tiles(EXTEND_VARIANTS[name]):
                    o = run(case)
                _sync(dev)
                ref = reference(case)
                err = float((o.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                case["outs"][name] = o
                same = (
                    torch.equal(o, case["outs"]["current"]) if "current" in case["outs"] else None
                )
                res["shapes"][case["key"]]["variants"][name] = {
                    "err": err, "same_bits": same, "us_layer": []
                }  # fmt: skip
            built.append(name)
            print(f"[{elapsed():5.1f} s] built {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 (a failed variant must not end the sweep)
            res["errors"][name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            print(f"   {name} failed: {res['errors'][name][:150]}", flush=True)
        _save(out_path, res)
    for case in cases.values():
        case["outs"].clear()
    for rnd in range(args.rounds):
        if elapsed() > args.deadline_s:
            res["errors"]["rounds"] = f"stopped after {rnd} rounds: deadline"
            break
        for name in built if rnd % 2 == 0 else built[::-1]:
            for case in cases.values():
                res["shapes"][case["key"]]["variants"][name]["us_layer"].append(timed(name, case))
        res["rounds_done"] = rnd + 1
        for s in res["shapes"].values():
            for v in s["variants"].values():
                if v["us_layer"]:
                    v["median_us"] = statistics.median(v["us_layer"])
        print(f"[{elapsed():5.1f} s] round {rnd + 1}: " + "  ".join(
            f"{k}: " + ", ".join(f"{n} {v.get('median_us', 0):.1f}" for n, v in s["variants"].items())
            for k, s in res["shapes"].items()), flush=True)  # fmt: skip
        _save(out_path, res)
    res["ranked"] = extend_rank(res)
    print(f"[{elapsed():5.1f} s] ranked: {res['ranked']}", flush=True)
    _save(out_path, res)


def extend_rank(res: dict) -> list[list]:
    """Variants other than ``current`` whose output is ``current``'s bit for bit at every
    shape, by summed median µs over the shapes, fastest first: ``[[name, sum, current's]]``
    (only those faster than ``current``)."""
    shapes = list(res.get("shapes", {}).values())
    sums: dict[str, float] = {}
    for name in res.get("variants", {}):
        vs = [s["variants"].get(name, {}) for s in shapes]
        timed = bool(shapes) and all("median_us" in v for v in vs)
        if timed and (name == "current" or all(v.get("same_bits") for v in vs)):
            sums[name] = sum(v["median_us"] for v in vs)
    cur = sums.get("current")
    if cur is None:
        return []
    return [[n, round(s, 2), round(cur, 2)] for n, s in sorted(sums.items(), key=lambda t: t[1])
            if n != "current" and s < cur]  # fmt: skip


# ---------------------------------------------------------------------------- engine


def _busy_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def timeline(prof, region: str, min_gap_us: float = 20.0, top: int = 24) -> dict:
    """The GPU's idle time inside the ``record_function(region)`` span of ``prof``: lead
    (span start -> first kernel), tail (last kernel end -> span end), the gaps between the
    kernels' busy union, each of >= ``min_gap_us`` with the kernels either side and the CPU
    ops that overlap it by >= 30 % (name and overlap µs, the longest 6), the longest ``top``
    gaps; and the kernels' time by class."""
    from torch.autograd import DeviceType

    evs = list(prof.events())
    reg = [e for e in evs if e.name == region and e.device_type == DeviceType.CPU]
    if not reg:
        return {"error": f"no {region} span"}
    r0, r1 = reg[0].time_range.start, reg[0].time_range.end
    kern = sorted(
        (
            e
            for e in evs
            if e.device_type == DeviceType.CUDA
            and e.name != region
            and r0 <= e.time_range.start <= r1
        ),
        key=lambda e: e.time_range.start,
    )
    if not kern:
        return {"error": "no kernels", "wall_ms": (r1 - r0) / 1e3}
    cpu = [e for e in evs if e.device_type == DeviceType.CPU and e.name != region]
    busy = _busy_union([(e.time_range.start, e.time_range.end) for e in kern])
    gaps = []
    ki = 0
    for (_s0, e0), (s1, _e1) in zip(busy, busy[1:]):
        g = s1 - e0
        if g < min_gap_us:
            continue
        while ki < len(kern) and kern[ki].time_range.start < s1:
            ki += 1
        before = max((k for k in kern[:ki] if k.time_range.end <= e0 + 0.5),
                     key=lambda k: k.time_range.end, default=None)  # fmt: skip
        after = kern[ki] if ki < len(kern) else None
        gaps.append({
            "at_ms": round((e0 - r0) / 1e3, 3), "us": round(g, 1), "_span": (e0, s1),
            "before": before.name[:60] if before else None, "after": after.name[:60] if after else None,
        })  # fmt: skip
    longest = sorted(gaps, key=lambda g: -g["us"])[:top]
    for g in longest:  # what the host did meanwhile (the longest gaps only: CPU events are many)
        e0, s1 = g["_span"]
        ops: collections.Counter = collections.Counter()
        for c in cpu:
            ov = min(c.time_range.end, s1) - max(c.time_range.start, e0)
            if ov >= 0.3 * (s1 - e0):
                ops[c.name[:60]] += ov
        g["cpu_ops"] = {k: round(v, 1) for k, v in ops.most_common(6)}
    for g in gaps:
        g.pop("_span")
    cls: collections.Counter = collections.Counter()
    for e in kern:
        cls[_kernel_class(e.name)] += e.time_range.end - e.time_range.start
    busy_us = sum(e - s for s, e in busy)
    inner = sum(s1 - e0 for (_s0, e0), (s1, _e1) in zip(busy, busy[1:]))
    return {
        "wall_ms": (r1 - r0) / 1e3,
        "gpu_busy_ms": busy_us / 1e3,
        "lead_ms": (busy[0][0] - r0) / 1e3,
        "tail_ms": (r1 - busy[-1][1]) / 1e3,
        "inner_idle_ms": inner / 1e3,
        "gaps_over_min_ms": sum(g["us"] for g in gaps) / 1e3,
        "gaps_over_min": len(gaps),
        "min_gap_us": min_gap_us,
        "kernels": len(kern),
        "by_class_ms": {k: round(v / 1e3, 3) for k, v in cls.items()},
        "longest_gaps": longest,
        "gaps_in_order": [[g["at_ms"], g["us"]] for g in gaps][:200],
    }


def incremental(prof, steps: int) -> dict:
    """Kernels of ``steps`` graph steps in stream order: per name the summed incremental
    time (end minus the previous kernel's end, never below 0) a step, its own duration a
    step and launches a step; one whole step's sequence (name, incremental µs, duration µs)
    from the first kernel after the longest idle gap."""
    from torch.autograd import DeviceType

    kern = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                  key=lambda e: e.time_range.start)  # fmt: skip
    if not kern:
        return {"error": "no kernels"}
    inc: collections.Counter = collections.Counter()
    dur: collections.Counter = collections.Counter()
    cnt: collections.Counter = collections.Counter()
    seq = []
    prev_end = kern[0].time_range.start
    for e in kern:
        s, t = e.time_range.start, e.time_range.end
        x = max(0.0, t - prev_end)  # its end minus the previous kernel's end
        name = e.name[:70]
        inc[name] += x
        dur[name] += t - s
        cnt[name] += 1
        seq.append((name, round(x, 2), round(t - s, 2), round(s - prev_end, 2)))
        prev_end = max(prev_end, t)
    per = len(kern) / steps
    # one step: from the kernel after the first wide gap (a step boundary) on
    start = 0
    gaps = [(seq[i][3], i) for i in range(1, min(len(seq), int(2 * per) + 2))]
    if gaps:
        start = max(gaps)[1]
    span = kern[-1].time_range.end - kern[0].time_range.start
    return {
        "kernels_per_step": per,
        "first_to_last_ms_per_step": span / steps / 1e3,
        "incremental_ms_per_step": {k: round(v / steps / 1e3, 4) for k, v in inc.most_common()},
        "duration_ms_per_step": {k: round(dur[k] / steps / 1e3, 4) for k, _ in inc.most_common()},
        "launches_per_step": {k: cnt[k] / steps for k, _ in inc.most_common()},
        "one_step": seq[start : start + int(round(per))],
    }


def engine(args) -> None:
    from gpu_step_profile import _prompts
    from torch.profiler import ProfilerActivity, profile, record_function

    from pdserve import gc_watch
    from pdserve.bench.offline import _time_ours, workload_prompts
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    toy = args.toy
    out_path = os.path.join(os.environ.get("OUT", "."), args.json)
    res: dict[str, Any] = {"parts_done": [], "skipped": {}, "errors": {}, "notes": []}
    n64 = 4 if toy else 64
    budget0 = 64 if toy else 4096
    t = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_running_requests=8 if toy else 256, kv_cache_memory=2 if toy else 24,
              max_num_batched_tokens=budget0)  # fmt: skip
    res["engine_start_s"] = round(time.perf_counter() - t, 1)
    core = llm.engine
    cuda = core.device.type == "cuda"
    res["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    gc_watch.freeze_heap()
    print(f"[{elapsed():5.1f} s] engine up in {res['engine_start_s']:.0f} s", flush=True)
    _save(out_path, res)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prompts64 = workload_prompts(llm, n64, None, None)
    res["prompt_tokens"] = sum(len(p) for p in prompts64)
    sched_cfg0 = core.scheduler.config
    M = args.max_tokens

    def set_budget(n: int) -> None:
        import dataclasses

        core.scheduler.config = dataclasses.replace(sched_cfg0, max_num_batched_tokens=n)

    # the sweep's result (it ran beside the load)
    t = time.perf_counter()
    while args.done and not os.path.exists(args.done):
        if time.perf_counter() - t > args.sweep_wait_s or elapsed() > args.deadline_s - 40:
            res["notes"].append("stopped waiting for the sweep")
            break
        time.sleep(0.25)
    ranked: list = []
    res["sweep_rounds"] = 0
    try:
        with open(args.sweep_json) as f:
            sw = json.load(f)
        ranked = extend_rank(sw)
        res["sweep_rounds"] = sw.get("rounds_done", 0)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        res["notes"].append(f"no sweep result: {type(exc).__name__}: {exc}")
    res["sweep_ranked"] = ranked
    ext_names = [r[0] for r in ranked[:2]]
    if not ranked and not res["sweep_rounds"]:  # no sweep figures: the likeliest tile
        ext_names = ["m128 w4 s2"] if toy else ["m128 w8 s2"]
    res["extend_tried"] = ext_names
    print(f"[{elapsed():5.1f} s] sweep ranked {ranked}; extend variants {ext_names}", flush=True)

    def left() -> float:
        return args.deadline_s - elapsed()

    def drain() -> None:
        for rid in list(core._requests):
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()

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
            try:
                drain()
            except Exception as exc2:  # noqa: BLE001
                res["errors"][name + " cleanup"] = f"{type(exc2).__name__}: {str(exc2)[:200]}"
        finally:
            set_budget(sched_cfg0.max_num_batched_tokens)
        _save(out_path, res)

    def compare(ids: list[list[int]], base: list[list[int]]) -> dict:
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(ids, base)]  # fmt: skip
        diffs = [d for d in firsts if d is not None]
        return {"same_outputs": sum(d is None for d in firsts), "rows": len(firsts),
                "first_diff_median": statistics.median(diffs) if diffs else None}  # fmt: skip

    def offline(variants: dict[str, Any], repeats: int) -> dict:
        """bench offline's row procedure per variant (a context manager factory / setup
        callable per name), interleaved: warm-ups (M, 1), then ``repeats`` x (M, 1)."""
        runs: dict[str, dict] = {n: {"runs": [], "first": []} for n in variants}
        ids: dict[str, list] = {}
        for ctx in variants.values():
            with ctx():
                _time_ours(llm, prompts64, M)
                _time_ours(llm, prompts64, 1)
        for rep in range(repeats):
            for n in list(variants) if rep % 2 == 0 else list(variants)[::-1]:
                if left() < 2.5:
                    break
                with variants[n]():
                    secs, ids[n] = _time_ours(llm, prompts64, M)
                    runs[n]["runs"].append(n64 * M / secs)
                    runs[n]["first"].append(_time_ours(llm, prompts64, 1)[0])
        base = next(iter(variants))
        for n, r in runs.items():
            if r["runs"]:
                tok, first = statistics.median(r["runs"]), statistics.median(r["first"])
                r |= {"tok_s": tok, "first_token_s": first,
                      "decode_ms_per_step": (n64 * M / tok - first) / (M - 1) * 1e3}  # fmt: skip
                if n != base and base in ids and n in ids:
                    r |= compare(ids[n], ids[base])
                print(f"   {n}: {tok:.0f} tok/s (runs {[round(x) for x in r['runs']]}), first "
                      f"{first * 1e3:.1f} ms, decode {r['decode_ms_per_step']:.3f} ms/step, "
                      f"same {r.get('same_outputs')}", flush=True)  # fmt: skip
        return runs

    # --- the parts
    def p_first() -> None:
        out: dict[str, Any] = {}
        res["first"] = out
        _time_ours(llm, prompts64, M)  # bench offline's warm-ups
        _time_ours(llm, prompts64, 1)
        firsts, clocks = [], []
        for _ in range(3):
            with StepClock(core) as c:
                firsts.append(_time_ours(llm, prompts64, 1)[0])
            clocks.append(c.rows)
        out["first_token_s"] = firsts
        out["steps"] = clocks
        print(f"   first token {[round(x * 1e3, 1) for x in firsts]} ms; steps "
              f"{[[r[1] for r in c] for c in clocks]}", flush=True)  # fmt: skip
        with profile(activities=acts) as prof, record_function("first_token"):
            _time_ours(llm, prompts64, 1)
            sync()
        out["timeline"] = tl = timeline(prof, "first_token")
        print(f"   profiled: wall {tl.get('wall_ms', 0):.1f} ms, busy {tl.get('gpu_busy_ms', 0):.1f}, "
              f"lead {tl.get('lead_ms', 0):.2f}, tail {tl.get('tail_ms', 0):.2f}, inner idle "
              f"{tl.get('inner_idle_ms', 0):.2f} ({tl.get('gaps_over_min')} gaps >= 20 us: "
              f"{tl.get('gaps_over_min_ms', 0):.2f} ms)", flush=True)  # fmt: skip
        for g in tl.get("longest_gaps", [])[:8]:
            print(f"     gap {g['us']:7.1f} us at {g['at_ms']:7.2f} ms: {g['before']} -> "
                  f"{g['after']}; cpu {list(g['cpu_ops'])[:3]}", flush=True)  # fmt: skip

    def p_extend_ab() -> None:
        if not ext_names:
            res["extend_ab"] = {"note": "the sweep found no faster bit-identical tile"}
            return
        names = ["current", *ext_names]
        out: dict[str, Any] = {"names": names, "ms": {n: [] for n in names}}
        res["extend_ab"] = out
        for n in names:  # warm: each tile's compile
            with extend_tiles(EXTEND_VARIANTS.get(n)):
                _time_ours(llm, prompts64, 1)
        rounds = 3 if toy else 6
        for rnd in range(rounds):
            if left() < 3:
                break
            for n in names if rnd % 2 == 0 else names[::-1]:
                with extend_tiles(EXTEND_VARIANTS.get(n)):
                    out["ms"][n].append(_time_ours(llm, prompts64, 1)[0] * 1e3)
        base = out["ms"]["current"]
        for n in names:
            v = out["ms"][n]
            if not v:
                continue
            out[n] = {"median_ms": statistics.median(v)}
            if n != "current":
                out[n]["paired_diff_median_ms"] = statistics.median(
                    [x - y for x, y in zip(v, base)]
                )
        best = min(ext_names, key=lambda n: out.get(n, {}).get("paired_diff_median_ms", 1e9))
        out["best"] = best
        _, base_ids = _time_ours(llm, prompts64, M)
        with extend_tiles(EXTEND_VARIANTS.get(best)):
            _, ids = _time_ours(llm, prompts64, M)
        out["best_outputs"] = compare(ids, base_ids)
        print("   first token ms: " + "  ".join(
            f"{n} {out[n]['median_ms']:.2f} ({out[n].get('paired_diff_median_ms', 0):+.2f})"
            for n in names if n in out) + f"; {best}'s outputs: {out['best_outputs']}", flush=True)  # fmt: skip

    def p_budget_ab() -> None:
        b2 = 128 if toy else 8192

        def mk(n):
            @contextlib.contextmanager
            def ctx():
                set_budget(n)
                try:
                    yield
                finally:
                    set_budget(budget0)

            return ctx

        res["budget_ab"] = offline({f"b{budget0}": mk(budget0), f"b{b2}": mk(b2)}, 2 if toy else 3)

    def decode_steps(rows: int, ctx: int, salt: int, warm: int, steps: int):
        params = SamplingParams(temperature=0, max_tokens=warm + 8 * steps + 8, ignore_eos=True)
        llm.reset_prefix_cache()
        ids = [f"d{salt}-{i}" for i in range(rows)]
        for rid, p in zip(ids, _prompts(rows, ctx, salt)):
            core.add_request(rid, p, params)
        reqs = [core._requests[r] for r in ids]
        while any(len(r.output_token_ids) == 0 for r in reqs):
            core.step()
        for _ in range(warm):
            core.step()
        sync()
        return ids

    def span(steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync()
        return (time.perf_counter() - t) / steps * 1e3

    def p_decode64() -> None:
        steps = 4 if toy else 12
        decode_steps(n64, 20 if toy else 200, 3, 4, steps)
        walls = [span(steps) for _ in range(3)]
        with profile(activities=acts) as prof:
            for _ in range(steps):
                core.step()
            sync()
        drain()
        res["decode64"] = {"step_ms_spans": walls, "step_ms": statistics.median(walls)}
        res["decode64"] |= incremental(prof, steps) if cuda else {}
        d = res["decode64"]
        print(f"   64x200 step {d['step_ms']:.3f} ms; first-to-last "
              f"{d.get('first_to_last_ms_per_step', 0):.3f} ms a step", flush=True)  # fmt: skip
        for k, v in list(d.get("incremental_ms_per_step", {}).items())[:12]:
            print(f"     {v:7.4f} ms (own {d['duration_ms_per_step'][k]:7.4f}, "
                  f"{d['launches_per_step'][k]:5.1f}x) {k}", flush=True)  # fmt: skip

    def p_picks() -> None:
        why = []
        ext = None
        ea = res.get("extend_ab") or {}
        best = ea.get("best")
        gain = ea.get(best, {}).get("paired_diff_median_ms", 0) if best else 0
        if gain < -args.min_gain_ms and ea.get("best_outputs", {}).get("same_outputs") == n64:
            ext = EXTEND_VARIANTS.get(best)
            why.append(f"extend {best}: {gain:+.2f} ms")
        bud = budget0
        ba = res.get("budget_ab") or {}
        b_base, b_new = (
            ba.get(f"b{budget0}", {}),
            next((v for k, v in ba.items() if k != f"b{budget0}"), {}),
        )
        if b_base.get("tok_s") and b_new.get("tok_s"):
            gain_ms = (n64 * M / b_base["tok_s"] - n64 * M / b_new["tok_s"]) * 1e3
            if gain_ms > args.min_gain_ms and b_new.get("same_outputs") == n64:
                bud = 128 if toy else 8192
                why.append(f"budget {bud}: {gain_ms:+.2f} ms a run")
        res["picks"] = {"why": why, "extend": ext, "budget": bud}
        print(f"   picks: {why or 'none'}", flush=True)
        if not why and not toy:
            return

        @contextlib.contextmanager
        def picked():
            set_budget(bud)
            try:
                with extend_tiles(ext):
                    yield
            finally:
                set_budget(budget0)

        res["picks"]["offline"] = offline(
            {"base": contextlib.nullcontext, "picks": picked}, 2 if toy else args.repeats
        )

    def p_pdl() -> None:
        from pdserve.model import pdl

        g = core.executor.rank0.runner.graphs
        out: dict[str, Any] = {}
        res["pdl"] = out
        if g is None:
            out["note"] = "no graphs"
            return
        bucket = g.bucket(n64)
        keys = [k for k in g.keys() if k[0] == bucket]  # noqa: SIM118 (a method)
        base = {k: (g._graphs[k], g._logits[k], g._greedy[k]) for k in keys}
        t = time.perf_counter()
        options = pdl._options
        pdl._options = lambda index: pdl._OFF  # every launch without PDL while capturing
        pool = g._pool
        made = {}
        try:
            with torch.inference_mode():
                sync()
                g._rows.zero_()
                g._rows[2].fill_(-1)
                g._table.zero_()
                g._pool = None
                stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                for k in keys:
                    g._run(k)
                    sync()
                    made[k] = (g._capture(k, stream), g._logits[k], g._greedy[k])
                    sync()
        finally:
            g._pool = pool
            pdl._options = options
            for k, v in base.items():
                g._graphs[k], g._logits[k], g._greedy[k] = v
        out["capture_s"] = round(time.perf_counter() - t, 2)
        sets = {"pdl": base, "no_pdl": made}

        def install(name):
            for k, (gr, lo, gd) in sets[name].items():
                g._graphs[k], g._logits[k], g._greedy[k] = gr, lo, gd

        steps = 8
        decode_steps(n64, 130, 5, 0, 50)
        for n in sets:
            install(n)
            span(2)
        spans: dict[str, list[float]] = {n: [] for n in sets}
        try:
            for rnd in range(5):
                for n in list(sets) if rnd % 2 == 0 else list(sets)[::-1]:
                    install(n)
                    spans[n].append(span(steps))
            install("no_pdl")
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    core.step()
                sync()
        finally:
            install("pdl")
            drain()
        out["spans_ms"] = spans
        out["median_ms"] = {n: statistics.median(v) for n, v in spans.items()}
        out["paired_diff_median_ms"] = statistics.median(
            [x - y for x, y in zip(spans["no_pdl"], spans["pdl"])]
        )
        out["no_pdl_profile"] = incremental(prof, steps)
        print(f"   64-row step pdl {out['median_ms']['pdl']:.3f} / no pdl "
              f"{out['median_ms']['no_pdl']:.3f} ms (paired {out['paired_diff_median_ms']:+.4f}); "
              f"capture {out['capture_s']} s", flush=True)  # fmt: skip
        for k, v in list(out["no_pdl_profile"].get("duration_ms_per_step", {}).items())[:10]:
            print(f"     {v:7.4f} ms own  {k}", flush=True)

    try:
        part("first", 6, p_first)
        part("extend_ab", 6, p_extend_ab)
        part("decode64", 4, p_decode64)
        part("budget_ab", 10, p_budget_ab)
        part("picks", 8, p_picks)
        if cuda:
            part("pdl", 12, p_pdl)
    finally:
        _save(out_path, res)
        summary = {
            "parts": res["parts_done"], "skipped": res["skipped"], "errors": res["errors"],
            "first_ms": [round(x * 1e3, 1) for x in (res.get("first") or {}).get("first_token_s", [])],
            "extend": {n: v for n, v in (res.get("extend_ab") or {}).items() if isinstance(v, dict) and "median_ms" in v},
            "budget": {n: round(v.get("tok_s", 0)) for n, v in (res.get("budget_ab") or {}).items()},
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
    ap.add_argument("--build-deadline-s", type=float, default=40.0, help="sweep: compile until")
    ap.add_argument("--rounds", type=int, default=5, help="sweep: interleaved timing rounds")
    ap.add_argument("--reps", type=int, default=5, help="sweep: 32-layer passes timed a round")
    ap.add_argument("--done", default="", help="sweep: touched when done; engine: waited for")
    ap.add_argument("--sweep-json", default="", help="engine: the sweep's JSON")
    ap.add_argument("--sweep-wait-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="engine: bench-offline repeats")
    ap.add_argument("--min-gain-ms", type=float, default=0.5, help="engine: a run's ms, to pick")
    args = ap.parse_args()
    args.json = args.json or ("extend_sweep.json" if args.mode == "sweep" else "bf16x.json")
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
