"""Issue 26, session 10: FP8 weights + e4m3 KV at 512-1,024 rows (the best-batch target,
>= 27,000 output tok/s at <= 1,024 prompts), one engine load. Two picks are judged:

- ``attn``: ``decode_attn_table.FP8_ONE`` (an e4m3 cache's one-split decode tiles of 16
  tokens, 1 warp, 3 stages from 4,096 rows x KV heads on, i.e. 512 rows of Llama-3.1-8B);
  off: the table emptied (the rule's 32-token, 2-warp tiles);
- ``silu``: ``fp8.FUSE_SILU_QUANT`` (the down projection's e4m3 rows and scales written by the
  SwiGLU kernel, ``fused_ops.silu_mul_quant``, instead of silu_mul then quantize_rows).

Two modes:

``micro`` (no model; run beside the engine's load, the GPU idle meanwhile):

- the e4m3 decode attention of a B x 200 step (8 layers of a page-major pool laid out as the
  engine's, ``scripts/gpu_s8_attn.py``'s harness) at B = 1,024 / 512 / 384 / 256 / 128: the
  rule's tiles (``rule``, what runs with FP8_ONE empty) and variants of 16 / 32 tokens: µs a
  layer (where the FP8_ONE bound belongs);
- SwiGLU + quantization of ``[T, 2 x 14,336]`` bf16 at T = 16 / 64 / 256 / 512 / 1,024 /
  16,384: ``silu_mul`` then ``quantize_rows`` against ``silu_mul_quant`` (µs, one CUDA graph
  of a few calls; the bits compared);
-> ``$OUT/<--micro-json>`` after each item, then ``<json>.done``.

``engine`` (``random:llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8_e4m3``, 1,024
running requests, step budget 16,384 = bench offline's at 1,024 prompts; fewer graph buckets
than the engine's, the rows timed here exact buckets; the heap frozen after start-up as
``bench offline`` does):

1. ``steady``: 1,024 GSM8K prompts (bench offline's workload) prefilled, ``silu`` on and off
   in turn chunk by chunk (eager: no capture) -> paired chunk times; then all decoding at
   1,024 rows: the four combinations of the picks (graphs of the bucket captured again for
   each), rounds of ``--steps`` steps in turn; the kernels of the step with both on
   (``torch.profiler``); then requests aborted down to 512 (four combinations), 256 and 64
   rows (``silu`` on / off).
2. ``rows``: bench offline's row procedure at 1,024 prompts (the first-token run, then the
   full run of 128 tokens, each from an empty prefix cache) with both picks on, then both
   off, again while time is left; the greedy tokens of every run compared with the first's
   (``same_outputs`` of 1,024; the picks change no bits but the attention's summation order).
-> ``$OUT/<--json>`` (``fp8big.json``, the micro JSON merged in) after each measurement.

``--device cpu --toy`` (``random:tiny``, TRITON_INTERPRET=1) checks the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.perf_counter()
INTER = 14336
# e4m3 decode variants at one split: (block_n, num_warps, num_stages)
ATTN_TILES: dict[str, tuple[int, int, int]] = {
    "n16 w1 s3": (16, 1, 3),
    "n16 w1 s2": (16, 1, 2),
    "n16 w2 s3": (16, 2, 3),
    "n32 w1 s3": (32, 1, 3),
}
COMBOS = {
    "off": (False, False),
    "attn": (True, False),
    "silu": (False, True),
    "both": (True, True),
}


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f} s] {msg}", flush=True)


def save(path: str, res: dict) -> None:
    res["elapsed_s"] = elapsed()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ micro
def micro(args) -> None:
    import gpu_s8_attn as A

    from pdserve.model import fp8, fused_ops
    from pdserve.model import triton_backend as tb

    dev = torch.device(args.device)
    out_path = os.path.join(os.environ.get("OUT", "."), args.micro_json)
    res: dict[str, Any] = {"attn": {}, "silu": [], "errors": {}}
    toy = args.toy
    layers = 2 if toy else 8
    # 1. SwiGLU + quantization (first: short, the attention may be cut by its deadline)
    inter = 256 if toy else INTER
    for t in [4, 16] if toy else [16, 64, 256, 512, 1024, 16384]:
        if elapsed() > args.deadline_s:
            res["errors"][f"silu {t}"] = "skipped: deadline"
            break
        try:
            x = (torch.randn(t, 2 * inter, device=dev) * 2).to(torch.bfloat16)
            q0, s0 = fp8.quantize_rows(fused_ops.silu_mul(x))
            q1, s1 = fused_ops.silu_mul_quant(x)
            same = torch.equal(s0, s1) and torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
            r = {"T": t, "same_bits": same}
            if dev.type == "cuda":
                r["two_kernels_us"] = fp8.time_us(
                    [lambda x=x: fp8.quantize_rows(fused_ops.silu_mul(x))], 12
                )
                r["silu_mul_us"] = fp8.time_us([lambda x=x: fused_ops.silu_mul(x)], 12)
                r["fused_us"] = fp8.time_us([lambda x=x: fused_ops.silu_mul_quant(x)], 12)
            res["silu"].append(r)
            log(f"   silu T={t}: {r}")
            del q0, s0, q1, s1
        except Exception as exc:  # noqa: BLE001 noted, the rest runs
            res["errors"][f"silu {t}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        save(out_path, res)
    # 2. attention
    shapes = ["4x40"] if toy else ["1024x200", "512x200", "384x200", "256x200", "128x200"]
    for shape in shapes:
        if elapsed() > args.attn_deadline_s:
            res["errors"][shape] = "skipped: deadline"
            break
        rows, ctx = (int(x) for x in shape.split("x"))
        try:
            case = A.build_pool(rows, ctx, ["fp8"], layers, dev)
        except Exception as exc:  # noqa: BLE001 noted, the rest runs
            res["errors"][shape] = f"pool: {type(exc).__name__}: {str(exc)[:300]}"
            continue
        # the rule's configuration (what runs with FP8_ONE empty)
        bound = tb.ONE_SPLIT_MAX_CONTEXT
        picks = tb.device_picks(dev, A.HQ // A.HKV, A.D)
        rule = tb.fp8_decode_config(tb.decode_config(rows, A.HKV, A.PAGE, bound, None, picks))
        r: dict[str, Any] = {"rule_config": str(rule), "us": {}, "diff": {}}
        res["attn"][shape] = r
        ref = None
        names = ["rule", *ATTN_TILES][: 3 if toy else None]
        for name in names:
            if elapsed() > args.attn_deadline_s:
                break
            cfg = rule
            if name != "rule":
                bn, w, st = ATTN_TILES[name]
                cfg = A.variant_config(rule, {"block_n": bn, "num_warps": w, "num_stages": st})
            try:
                s, o = A.run_variant(case, "fp8", cfg, False, dev, 20)
            except Exception as exc:  # noqa: BLE001 noted
                res["errors"][f"{shape} {name}"] = " ".join(str(exc).split())[:300]
                continue
            ref = o if ref is None else ref
            r["us"][name] = s * 1e6 / layers
            r["diff"][name] = float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            log(
                f"   attn {shape} {name:<10} {s * 1e6 / layers:8.1f} us/layer diff {r['diff'][name]:.1e}"
            )
        save(out_path, res)
        del case
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save(out_path, res)
    log("micro done")


# ------------------------------------------------------------------------------ engine
class GcPauses:
    """Collections per generation and their milliseconds since the last :meth:`take`."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.secs = [0.0, 0.0, 0.0]
        self._t = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info.get("generation", 0)
            self.count[g] += 1
            self.secs[g] += time.perf_counter() - self._t

    def take(self) -> dict:
        out = {"count": self.count, "ms": [round(1e3 * s, 2) for s in self.secs]}
        self.count, self.secs = [0, 0, 0], [0.0, 0.0, 0.0]
        return out


def kernel_sums(prof, steps: int) -> dict:
    """Per kernel name: ms a step and launches a step; the total."""
    from torch.autograd import DeviceType

    per: dict[str, float] = {}
    cnt: dict[str, float] = {}
    for a in prof.key_averages():
        if a.device_type == DeviceType.CUDA:
            per[a.key] = per.get(a.key, 0.0) + a.device_time_total
            cnt[a.key] = cnt.get(a.key, 0) + a.count
    top = sorted(per.items(), key=lambda kv: -kv[1])
    return {
        "kernel_ms": sum(per.values()) / steps / 1e3,
        "kernels_ms": {k[:110]: round(v / steps / 1e3, 4) for k, v in top[:25]},
        "kernel_counts": {k[:110]: cnt[k] / steps for k, _ in top[:25]},
    }


def engine(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from pdserve.bench.offline import workload_prompts
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.worker import cuda_graph
    from pdserve.model import decode_attn_table, fp8
    from pdserve.model import triton_backend as tb

    toy = args.toy
    out_dir = os.environ.get("OUT", ".")
    out_path = os.path.join(out_dir, args.json)
    res: dict[str, Any] = {"parts_done": [], "skipped": {}, "errors": {}, "rows": []}
    big, mid = (4, 2) if toy else (1024, 512)
    budget = 64 if toy else 16384
    buckets = [1, 2, 4, 8, 16] if toy else [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256]
    buckets = sorted({*buckets, *([mid, big] if toy else [384, 512, 640, 768, 896, 1024])})
    cuda_graph.graph_batch_sizes = lambda max_batch: [b for b in buckets if b <= max_batch]  # type: ignore[assignment]
    table_on = dict(decode_attn_table.FP8_ONE)
    res["fp8_one_on"] = {str(k): v for k, v in table_on.items()}

    def set_picks(attn: bool, silu: bool) -> None:
        decode_attn_table.FP8_ONE.clear()
        if attn:
            decode_attn_table.FP8_ONE.update(table_on)
        tb._cuda_picks.cache_clear()
        tb.fp8_decode_config.cache_clear()
        fp8.FUSE_SILU_QUANT = silu

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        quantization="fp8",
        kv_cache_dtype="auto" if toy else "fp8_e4m3",
        max_running_requests=big,
        max_num_batched_tokens=budget,
        kv_cache_memory=2 if toy else args.kv_gib,
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
    )
    core = llm.engine
    cuda = core.device.type == "cuda"
    dev = core.device
    res["engine_start_s"] = time.perf_counter() - t0
    g = core.executor.rank0.runner.graphs
    if g is None and args.toy_graphs:  # CPU check: the eager test hook of the graph runner
        rk = core.executor.rank0
        g = cuda_graph.CUDAGraphRunner(
            rk.model, rk.storage.layer_caches, rk.storage.page_size, big,
            cuda_graph.CUDAGraphRunner.max_pages_for(core.max_model_len, rk.storage.page_size),
            eager=True,
        )  # fmt: skip
        rk.runner.graphs = g
    res["buckets"] = g.sizes if g is not None else None
    log(f"engine up in {res['engine_start_s']:.0f} s, buckets {res['buckets']}")
    gc.collect()
    gc.freeze()  # as bench offline and the server's worker do after start-up
    gcp = GcPauses()
    done = os.path.join(out_dir, args.micro_json + ".done")
    t = time.perf_counter()
    while not os.path.exists(done) and time.perf_counter() - t < args.micro_wait_s:
        time.sleep(0.25)
    res["micro_wait_s"] = time.perf_counter() - t
    try:
        with open(os.path.join(out_dir, args.micro_json)) as f:
            res["micro"] = json.load(f)
    except (OSError, ValueError):
        res["micro"] = None
    save(out_path, res)
    prompts_all = workload_prompts(llm, big, None, None)

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
        except Exception as exc:  # noqa: BLE001 a failed part must not lose the others
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"
        finally:
            set_picks(True, True)
        save(out_path, res)

    def span(steps: int) -> dict:
        _sync(dev)
        each = []
        t = time.perf_counter()
        for _ in range(steps):
            s0 = time.perf_counter()
            core.step()
            each.append((time.perf_counter() - s0) * 1e3)
        _sync(dev)
        ms = (time.perf_counter() - t) / steps * 1e3
        return {"step_ms": round(ms, 4), "median_each": round(statistics.median(each), 4)}

    def recapture(rows_list) -> float:
        """The decode graphs of these buckets captured again (after a pick is switched)."""
        if g is None:
            return 0.0
        _sync(dev)
        t = time.perf_counter()
        stream = torch.cuda.Stream() if cuda else None  # type: ignore[no-untyped-call]
        graph_keys = g.keys()
        for key in graph_keys:
            if key[0] in rows_list:
                with torch.inference_mode():
                    # padded rows for the warm-up run, as at start-up: nothing is written to
                    # the KV cache (the next replay fills every row of its bucket again)
                    g._rows[2].fill_(-1)
                    g._rows[3].zero_()
                    g._run(key)
                    _sync(dev)
                    if g.eager:  # the CPU check: nothing to capture
                        continue
                    old = g._graphs.pop(key, None)
                    del old
                    g._graphs[key] = g._capture(key, stream)
                    _sync(dev)
        return time.perf_counter() - t

    steps = 3 if toy else args.steps

    # -------------------------------------------------------------- 1. steady
    def p_steady() -> None:
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=args.steady_max_tokens, ignore_eos=True)
        ids = [f"st-{i}" for i in range(big)]
        for rid, p in zip(ids, prompts_all):
            core.add_request(rid, list(p), params)
        reqs = [core._requests[rid] for rid in ids]
        pre: list[dict] = []
        r: dict[str, Any] = {"prefill_steps": pre}
        res["steady"] = r
        i = 0
        gcp.take()
        while any(len(x.output_token_ids) == 0 for x in reqs):
            silu = i % 2 == 1  # chunk 0 off, 1 on, 2 off, ...: adjacent pairs compared
            set_picks(True, silu)
            before = sum(x.num_computed_tokens for x in reqs)
            _sync(dev)
            t = time.perf_counter()
            core.step()
            _sync(dev)
            ms = (time.perf_counter() - t) * 1e3
            tokens = sum(x.num_computed_tokens for x in reqs) - before
            pre.append({"ms": round(ms, 3), "tokens": tokens, "silu": silu})
            i += 1
        r["prefill_gc"] = gcp.take()
        full = [p for p in pre[2:] if p["tokens"] == budget]  # warm, whole chunks
        for flag in (False, True):
            ms = [p["ms"] for p in full if p["silu"] == flag]
            r[f"prefill_chunk_ms_silu_{'on' if flag else 'off'}"] = ms
        log(
            f"   prefill chunks (ms, tokens, silu): {[(p['ms'], p['tokens'], p['silu']) for p in pre]}"
        )
        save(out_path, res)
        set_picks(True, True)
        for _ in range(2):
            core.step()
        live = list(ids)
        plan = [(big, list(COMBOS)), (mid, list(COMBOS))]
        plan += [] if toy else [(256, ["off", "silu"]), (64, ["off", "silu"])]
        for n, combos in plan:
            if n < len(live):  # abort the rest: n rows keep decoding
                for rid in live[n:]:
                    core.abort_request(rid)
                live = live[:n]
                for _ in range(2):
                    core.step()
            rr: dict[str, Any] = {"rounds": []}
            r[str(n)] = rr
            for rnd in range(args.rounds):
                if left() < (12 if n == big else 4):
                    res["skipped"][f"steady {n} round {rnd}"] = f"{left():.0f} s left"
                    break
                one: dict[str, Any] = {}
                order = combos if rnd % 2 == 0 else combos[::-1]
                for name in order:
                    set_picks(*COMBOS[name])
                    cap = recapture((n,))
                    core.step()  # the new graph's first replay, not timed
                    one[name] = span(steps) | {"capture_s": round(cap, 3)}
                rr["rounds"].append(one)
                log(
                    f"   {n} rows round {rnd}: "
                    + ", ".join(f"{k} {v['step_ms']:.3f}" for k, v in one.items())
                )
                save(out_path, res)
            rounds = rr["rounds"]
            if rounds:
                rr["median_ms"] = {
                    c: statistics.median(x[c]["step_ms"] for x in rounds) for c in combos
                }
                log(f"   {n} rows medians: {rr['median_ms']}")
            if n == big and cuda and left() > 12:
                set_picks(True, True)
                recapture((n,))
                acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                _sync(dev)
                with profile(activities=acts) as prof:
                    for _ in range(3):
                        core.step()
                    _sync(dev)
                rr["profile_both"] = kernel_sums(prof, 3)
                for name, ms in list(rr["profile_both"]["kernels_ms"].items())[:12]:
                    log(
                        f"      {ms:7.3f} ms {rr['profile_both']['kernel_counts'][name]:6.1f}x  {name[:90]}"
                    )
            save(out_path, res)
        for rid in live:
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()
        set_picks(True, True)  # each bench row captures its buckets from 256 rows again

    # -------------------------------------------------------------- 2. bench rows
    each_step: list[float] = []
    real_step = core.step

    def timed_step():  # each engine step's wall ms in the bench runs (host side included)
        t = time.perf_counter()
        out = real_step()
        each_step.append(round((time.perf_counter() - t) * 1e3, 3))
        return out

    def time_run(prompts, max_tokens: int) -> tuple[float, list[list[int]], dict]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        gcp.take()
        each_step.clear()
        core.step = timed_step  # type: ignore[method-assign]
        t = time.perf_counter()
        try:
            outs = llm.generate(prompts, params)
        finally:
            core.step = real_step  # type: ignore[method-assign]
        dt = time.perf_counter() - t
        gcr = gcp.take() | {"steps": len(each_step), "step_ms": list(each_step)}
        return dt, [o.outputs[0].token_ids for o in outs], gcr

    ref_ids: list[list[int]] = []

    def row(label: str, attn: bool, silu: bool) -> None:
        set_picks(attn, silu)
        cap = recapture(tuple(b for b in buckets if b >= 256))
        mt = args.max_tokens
        prompts = prompts_all[:big]
        first, _, gc1 = time_run(prompts, 1)
        full, ids, gc2 = time_run(prompts, mt)
        r: dict[str, Any] = {"label": label, "attn": attn, "silu": silu, "num_prompts": big,
             "max_tokens": mt, "first_token_s": first, "full_s": full, "tok_s": big * mt / full,
             "decode_ms_per_step": (full - first) / (mt - 1) * 1e3, "gc_first": gc1,
             "gc_full": gc2, "capture_s": cap}  # fmt: skip
        if not ref_ids:
            ref_ids.extend(ids)
        else:
            r["same_outputs"] = sum(a == b for a, b in zip(ids, ref_ids))
            firsts = [
                next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                for a, b in zip(ids, ref_ids)
            ]
            diff = [j for j in firsts if j is not None]
            r["first_diff_positions"] = sorted(diff)[:20]
            r["same_tokens"] = sum(
                sum(x == y for x, y in zip(a, b)) for a, b in zip(ids, ref_ids)
            ) / max(1, sum(len(a) for a in ref_ids))
        res["rows"].append(r)
        log(f"   row {label}: {r['tok_s']:.0f} tok/s, first token {first:.3f} s, decode "
            f"{r['decode_ms_per_step']:.2f} ms/step, gc {gc2['count']} {gc2['ms']} ms, steps "
            f"{gc2['steps']} (median {statistics.median(gc2['step_ms'] or [0]):.2f} ms), "
            f"same {r.get('same_outputs')}")  # fmt: skip
        save(out_path, res)

    plan = [
        ("steady", 20, p_steady),
        ("row on", 11, lambda: row("on", True, True)),
        ("row off", 11, lambda: row("off", False, False)),
        ("row on 2", 11, lambda: row("on", True, True)),
        ("row off 2", 11, lambda: row("off", False, False)),
    ]
    try:
        for name, need, fn in plan:
            part(name, 3 if toy else need, fn)
    finally:
        save(out_path, res)
        llm.shutdown()
    log("engine done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["micro", "engine"])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--toy", action="store_true", help="small shapes and counts (CPU check)")
    ap.add_argument("--deadline-s", type=float, default=110.0, help="skip parts after (s)")
    ap.add_argument("--attn-deadline-s", type=float, default=35.0, help="micro: attention")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steady-max-tokens", type=int, default=400)
    ap.add_argument("--steps", type=int, default=6, help="steps of a span")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the combinations")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--micro-json", default="fp8big_micro.json")
    ap.add_argument("--toy-graphs", action="store_true", help="engine on CPU: the eager graph hook")
    ap.add_argument("--attention-backend", default=None, help="the engine's; unset: its default")
    ap.add_argument("--micro-wait-s", type=float, default=5.0)
    ap.add_argument("--json", default="fp8big.json", help="file name under $OUT")
    args = ap.parse_args()
    (micro if args.mode == "micro" else engine)(args)


if __name__ == "__main__":
    main()
