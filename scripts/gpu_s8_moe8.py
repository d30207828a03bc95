"""MoE decode, session 8 (issue 27): where a Qwen3-30B-A3B decode step's time goes, the
MoE block's kernel variants alone, then the step with the winners on vs off in one engine.

A. One sparse layer alone (H 2048, I 768, 128 experts, top 8, bf16; 4 weight copies so no
   step finds its experts in L2; CUDA graphs), at 1 and 2 tokens (uniform routing) and 64
   tokens (uniform, and ``pool``: each token's 8 experts from 24, as the random preset
   routes): the committed path (``route_align`` + grouped GEMMs + top-k sum, as
   ``SparseMoeBlock`` runs it) against
   - the same with PDL on its four kernels (``moe_table.PDL``);
   - other gate/up / down tiles of the grouped kernels (with PDL);
   - 64 tokens: ``route_align``'s alignment program with 16 warps (one program or split);
   - 1-2 tokens: the few-token path (routing fused into the gate/up launch, no sort):
     its down projection per assignment then the top-k sum (``down_kind="assign"``, three
     launches) or the one-launch down + sum (two launches).
   Every output is checked against ``moe.experts_loop`` (relative max error > 0.02: WRONG,
   never picked) and compared with the committed path's (``same_bits``). Picks (``table``):
   PDL when it is faster summed over the rows; the few-token path at the token counts where
   its best tiles beat the best grouped plan by > 3 %; the grouped plan and route_align
   config at 1 and 64 tokens where one beats the committed by > 3 %.
B. One engine (``bench offline``'s flags, ``PDSERVE_MOE_ROUTING_STATS=1``), built with the
   committed picks: greedy tokens (1 prompt x 32, 64 prompts x 8); the routing counters off
   and the kernel profile of a 1 x 200 and a 64 x 200 step (every kernel: launches per
   layer, microseconds each); then the picks applied (the graphs of the 1- and 64-row
   buckets captured again at each switch), the same greedy tokens (``greedy_same``) and
   profiles; then the counters on again and ``bench offline --num-prompts 1,64`` with the
   picks (its rows: tok/s, the all-decoding step, the roofline over the experts routed to).

Each part runs only while ``BUDGET_S`` seconds (from the start) leave room; ``$OUT/moe8.json``
is written after every item. ``python3 scripts/gpu_s8_moe8.py --write-table JSON`` (no
GPU) writes part A's picks into ``pdserve/model/moe_table.py``. ``SMOKE=1``: toy shapes on
CPU under ``TRITON_INTERPRET=1`` with ``MODEL=random:tiny-qwen3-moe DEVICE=cpu``
(``SKIP_A=1`` / ``SKIP_B=1`` leave a part out; ``FORCE_TABLE=JSON``: part B with those picks).
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import json
import multiprocessing
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pdserve.model import moe, moe_table
from pdserve.model import triton_moe as tm

SMOKE = os.environ.get("SMOKE") == "1"
H, INTER, E, K = (64, 48, 16, 4) if SMOKE else (2048, 768, 128, 8)
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter's bf16 dots are wrong
COPIES = 1 if SMOKE else 4
POOL = 6 if SMOKE else 24
BUDGET_S = float(os.environ.get("BUDGET_S", "140"))  # the whole script, from its start
A_S = float(os.environ.get("A_S", "24"))  # part A ends by then (compile included)
JOBS = int(os.environ.get("JOBS", "0" if SMOKE else "14"))
OUT_DIR = os.environ.get("OUT", "gpu_s8_moe8")
MODEL = os.environ.get("MODEL", "random:qwen3-30b-a3b")
DEVICE = os.environ.get("DEVICE", "cpu" if SMOKE else "cuda")
T0 = time.time()
COMMITTED = {"PDL": moe_table.PDL, "GEMV_MAX_TOKENS": moe_table.GEMV_MAX_TOKENS,
             "GEMV": moe_table.GEMV, "ROUTE_ALIGN": moe_table.ROUTE_ALIGN,
             "DECODE": moe_table.DECODE}  # fmt: skip


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


# ------------------------------------------------------------------ A. the layer alone
def G(*f) -> tm.GemvConfig:
    return tm.GemvConfig(*f)


if SMOKE:
    GEMVS = [
        G(16, 32, 4, 16, 16, 4, "dot", 2, "assign", 2),
        G(16, 32, 4, 4, 16, 4, "dot", 2, "rows", 2),
    ]
    UP_ALTS = [(tm.MoEConfig(16, 16, 32, 4, 2), tm.MoEConfig(16, 16, 16, 4, 2))]
    RA_ALTS = [tm.RouteAlignConfig("one", 4, True)]
    TOKENS = [(1, "uniform"), (2, "uniform"), (8, "uniform"), (8, "pool")]
    BIG = 8
else:
    # the few-token path: up (n, k, warps), down (n, k, warps), kinds and stages; up_k 256
    # and down_k 128 are the committed grouped tiles' reduction chunks (same sums)
    GEMVS = [
        G(32, 256, 4, 64, 128, 4, "dot", 3, "assign", 3),
        G(16, 256, 4, 64, 128, 4, "dot", 3, "assign", 3),
        G(32, 256, 4, 32, 128, 4, "dot", 3, "assign", 3),
        G(64, 256, 4, 64, 256, 4, "dot", 3, "assign", 2),
        G(32, 128, 4, 4, 256, 8, "dot", 4, "rows", 3),  # session 6's best few-token tiles
    ]
    UP_ALTS = [  # (gate/up, down) of the grouped kernels, block_m 16 (the alignment's)
        (tm.MoEConfig(16, 16, 256, 4, 3), tm.MoEConfig(16, 64, 128, 4, 3)),
        (tm.MoEConfig(16, 32, 256, 4, 3), tm.MoEConfig(16, 32, 128, 4, 3)),
        (tm.MoEConfig(16, 128, 128, 8, 3), tm.MoEConfig(16, 128, 128, 8, 3)),
    ]
    RA_ALTS = [
        tm.RouteAlignConfig("one", 16, True),
        tm.RouteAlignConfig("split", 1, True, 1, 16),
        tm.RouteAlignConfig("split", 1, True, 4, 16),
    ]
    TOKENS = [(1, "uniform"), (64, "uniform"), (64, "pool")]
    BIG = 64


def plan_name(p: tm.MoEPlan) -> str:
    return f"up{tuple(p.up)} down{tuple(p.down)}" + (" tsum" if p.triton_sum else "")


def ra_name(c: tm.RouteAlignConfig | None) -> str:
    if c is None:
        return "ra table"
    if c.kind == "one":
        return f"ra one w{c.num_warps}" + (" dot" if c.rank_dot else "")
    return f"ra split tpp{c.tokens_per_program} w{c.num_warps} aw{c.align_warps}" + (
        " dot" if c.rank_dot else ""
    )


class Cand:
    """One way to run the layer: ``grouped`` (plan, route_align config, PDL) or ``gemv``."""

    def __init__(self, kind, plan=None, ra=None, pdl=False, gemv=None, label=""):
        self.kind, self.plan, self.ra, self.pdl, self.gemv = kind, plan, ra, pdl, gemv
        self.label = label

    @property
    def name(self) -> str:
        if self.kind == "gemv":
            g = self.gemv
            return (f"gemv up {g.up_kind}({g.up_n},{g.up_k},{g.up_warps},s{g.up_stages}) down "
                    f"{g.down_kind}({g.down_n},{g.down_k},{g.down_warps},s{g.down_stages})")  # fmt: skip
        return f"{plan_name(self.plan)} | {ra_name(self.ra)} | pdl {int(self.pdl)}"

    def run(self, x, logits, w13, w2):
        if self.kind == "gemv":
            return tm.route_experts_gemv(logits, x, w13, w2, K, True, self.gemv)[0]
        moe_table.PDL = self.pdl
        try:
            w, ids, al = tm.route_align(logits, K, True, self.plan.up.block_m, config=self.ra)
            return tm.grouped_experts(x, w13, w2, w, al, self.plan, ids=ids)
        finally:
            moe_table.PDL = COMMITTED["PDL"]


def candidates(T: int) -> list[Cand]:
    base = tm.pick_plan(T * K, E)
    out = [Cand("grouped", base, None, False, label="committed"),
           Cand("grouped", base, None, True, label="pdl")]  # fmt: skip
    for up, dn in UP_ALTS:
        out.append(Cand("grouped", tm.MoEPlan(up, dn, None, True), None, True, label="tiles"))
    if T >= BIG:
        for ra in RA_ALTS:
            out.append(Cand("grouped", base, ra, True, label="route_align"))
    if T <= 2:
        out += [Cand("gemv", gemv=g, label="gemv") for g in GEMVS]
    return out


def make_logits(T: int, regime: str, gen: torch.Generator, dev) -> torch.Tensor:
    logits = torch.randn(T, E, device=dev, generator=gen)
    if regime == "pool":
        pool = torch.randperm(E, device=dev, generator=gen)[:POOL]
        logits = logits * 0.1 - 8.0
        for t in range(T):
            pick = pool[torch.randperm(POOL, device=dev, generator=gen)[:K]]
            logits[t, pick] = 2.0 + 0.5 * torch.randn(K, device=dev, generator=gen)
    return logits


def graph_time(fn, iters: int = 20) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph (median of 5 spans)."""
    if SMOKE or DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / iters)
    del g
    return sorted(times)[2]


def _warm(chunk: list) -> int:
    """Compile a chunk of (T, candidate index) (a worker process; zero weights, real shapes)."""
    dev = torch.device(DEVICE)
    w13 = torch.zeros(E, 2 * INTER, H, device=dev, dtype=DT)
    w2 = torch.zeros(E, H, INTER, device=dev, dtype=DT)
    done = 0
    for T, i in chunk:
        try:
            c = candidates(T)[i]
            c.run(torch.zeros(T, H, device=dev, dtype=DT), torch.randn(T, E, device=dev), w13, w2)
            done += 1
        except Exception:  # noqa: BLE001 (reported when the main process times it)
            pass
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return done


def warm_up() -> None:
    work = [(T, i) for T in sorted({t for t, _ in TOKENS}) for i in range(len(candidates(T)))]
    if JOBS <= 1:
        return
    t0 = time.time()
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(JOBS, mp_context=ctx) as pool:
            n = sum(pool.map(_warm, [work[i::JOBS] for i in range(JOBS)]))
    except Exception as exc:  # noqa: BLE001 (then the main process compiles as it times)
        log(f"warm-up failed: {type(exc).__name__}: {str(exc)[:200]}")
        return
    log(f"compiled {n}/{len(work)} candidates in {JOBS} processes: {time.time() - t0:.0f} s")


def part_a(result: dict, save) -> None:
    dev = torch.device(DEVICE)
    from pdserve.bench.roofline import copy_bandwidth

    bw = copy_bandwidth(dev, 1 << 20 if SMOKE else None)
    result["copy_bandwidth"] = bw
    warm_up()
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(COPIES):
        w13 = (torch.randn(E, 2 * INTER, H, device=dev, generator=gen) * 0.02).to(DT)
        w2 = (torch.randn(E, H, INTER, device=dev, generator=gen) * 0.02).to(DT)
        layers.append((w13, w2))
    order = sorted(TOKENS, key=lambda r: (r[0] != 1, r[0] != BIG))  # 1 token, then 64, then 2
    for T, regime in order:
        x = torch.randn(T, H, device=dev, generator=gen).to(DT)
        logits = make_logits(T, regime, gen, dev)
        w0, ids0 = moe.route(logits, K, True)
        routed = int(torch.unique(ids0).numel())
        ref = moe.experts_loop(x, *layers[0], w0, ids0).float()
        floor = (routed * 3 * INTER * H * 2 + 2 * T * H * 2) / bw
        row = {"tokens": T, "regime": regime, "routed_experts": routed,
               "roofline_us": floor * 1e6, "candidates": {}}  # fmt: skip
        result["layers"].append(row)
        committed_out = None
        for c in candidates(T):
            if time.time() - T0 > A_S:
                row["candidates"][c.name] = {"skipped": "time budget", "label": c.label}
                continue
            try:
                out = c.run(x, logits, *layers[0])
                if committed_out is None:
                    committed_out = out.clone()
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                same = bool(torch.equal(out, committed_out))
                dt = graph_time(lambda: [c.run(x, logits, *wl) for wl in layers]) / len(layers)  # noqa: B023
            except Exception as exc:  # noqa: BLE001 (a tile that does not build)
                row["candidates"][c.name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}",
                                             "label": c.label}  # fmt: skip
                log(f"  {c.name}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            ok = err <= 0.02
            row["candidates"][c.name] = {
                "us": dt * 1e6, "fraction": floor / dt, "rel_err": err, "ok": ok,
                "same_bits": same, "label": c.label, "kind": c.kind, "pdl": c.pdl,
                "plan": [list(c.plan.up), list(c.plan.down), None, c.plan.triton_sum]
                if c.plan else None,
                "route_align": list(c.ra) if c.ra else None,
                "gemv": list(c.gemv) if c.gemv else None,
            }  # fmt: skip
            print(f"T {T:>3} {regime:<7} {routed:>3} exp floor {floor * 1e6:6.1f} us | "
                  f"{c.name:<84} {dt * 1e6:7.1f} us ({floor / dt:4.0%}) err {err:.1e}"
                  + (" same" if same else " diff") + ("" if ok else "  WRONG"), flush=True)  # fmt: skip
        save()
    result["table"] = picks(result)
    log(f"A done; picks {result['table']}")
    save()


def _ok(row: dict) -> dict:
    return {n: v for n, v in row["candidates"].items() if v.get("ok") and "us" in v}


def picks(result: dict) -> dict:
    """Part A's picks (see the module doc), as moe_table values."""
    rows = result["layers"]
    t = {"PDL": COMMITTED["PDL"], "GEMV_MAX_TOKENS": COMMITTED["GEMV_MAX_TOKENS"],
         "GEMV": COMMITTED["GEMV"], "route_align_64": None, "decode": []}  # fmt: skip
    # PDL: the committed plan with PDL against without, summed over the rows
    on = off = 0.0
    worst = 1.0
    for r in rows:
        ok = _ok(r)
        a = next((v["us"] for v in ok.values() if v["label"] == "committed"), None)
        b = next((v["us"] for v in ok.values() if v["label"] == "pdl"), None)
        if a and b:
            off, on, worst = off + a, on + b, max(worst, b / a)
    if on and on < 0.99 * off and worst < 1.03:
        t["PDL"] = True
    pdl = t["PDL"]
    # the few-token path: the gemv config fastest summed over the rows of <= 2 tokens;
    # taken up to the largest token count (from 1 on) where it beats the best grouped by > 3 %
    small = sorted((r for r in rows if r["tokens"] <= 2), key=lambda r: r["tokens"])
    gsum: dict[str, float] = collections.defaultdict(float)
    gseen: dict[str, int] = collections.Counter()
    for r in small:
        for n, v in _ok(r).items():
            if v["kind"] == "gemv":
                gsum[n] += v["us"]
                gseen[n] += 1
    full = [n for n in gsum if gseen[n] == len(small)]
    bound = 0
    if full:
        best = min(full, key=lambda n: gsum[n])
        for r in small:
            ok = _ok(r)
            grouped = [v["us"] for v in ok.values() if v["kind"] == "grouped" and v["pdl"] == pdl]
            if (
                grouped
                and best in ok
                and ok[best]["us"] < 0.97 * min(grouped)
                and bound == r["tokens"] - 1
            ):
                bound = r["tokens"]
        if bound:
            t["GEMV_MAX_TOKENS"], t["GEMV"] = bound, small[0]["candidates"][best]["gemv"]
    # grouped tiles (PDL as picked) at 1 token (row 8) and 64 (row 512), summed over regimes
    for T in sorted({r["tokens"] for r in rows}):
        if T == 2:
            continue
        regs = [r for r in rows if r["tokens"] == T]
        score: dict[str, float] = collections.defaultdict(float)
        seen: dict[str, int] = collections.Counter()
        info = {}
        for r in regs:
            for n, v in _ok(r).items():
                if v["kind"] == "grouped" and v["pdl"] == pdl:
                    score[n] += v["us"]
                    seen[n] += 1
                    info[n] = v
        common = [n for n in score if seen[n] == len(regs)]
        base = next(
            (n for n in common if info[n]["label"] == ("pdl" if pdl else "committed")), None
        )
        if not base:
            continue
        tiles = [n for n in common if info[n]["label"] in ("tiles", "pdl", "committed")]
        best = min(tiles, key=lambda n: score[n])
        if best != base and score[best] < 0.97 * score[base]:
            t["decode"].append([T * K, info[best]["plan"]])
        ras = [n for n in common if info[n]["label"] == "route_align"]
        if T == BIG and ras:
            rb = min(ras, key=lambda n: score[n])
            if score[rb] < 0.97 * score[base]:
                t["route_align_64"] = info[rb]["route_align"]
    return t


def apply(table: dict | None) -> None:
    """Set moe_table's attributes to ``table``'s picks (None: the committed values)."""
    for k in ("PDL", "GEMV_MAX_TOKENS", "GEMV", "ROUTE_ALIGN", "DECODE"):
        setattr(moe_table, k, COMMITTED[k])
    if table is None:
        return
    moe_table.PDL = bool(table["PDL"])
    moe_table.GEMV_MAX_TOKENS = int(table["GEMV_MAX_TOKENS"])
    moe_table.GEMV = tuple(table["GEMV"]) if table["GEMV"] else None
    if table["route_align_64"]:
        ra = [r for r in COMMITTED["ROUTE_ALIGN"] if r[0] != BIG]
        moe_table.ROUTE_ALIGN = tuple(sorted(ra + [(BIG, tuple(table["route_align_64"]))]))
    dec = [list(r) for r in COMMITTED["DECODE"]]
    for n_assign, plan in table["decode"]:
        for r in dec:
            if r[0] == n_assign:
                r[1], r[2] = tuple(plan[0]), tuple(plan[1])
    moe_table.DECODE = tuple(tuple(r) for r in dec)


# ------------------------------------------------------------------ B. the engine
def recapture(llm, sizes=(1, 64)) -> float:
    """The CUDA graphs of the ``sizes`` buckets captured again (after a pick changed);
    returns the seconds it took."""
    runner = llm.engine.executor.rank0.runner
    g = runner.graphs
    t0 = time.time()
    if g is None:
        return 0.0
    stream = torch.cuda.Stream()
    with torch.inference_mode():
        for key in g.keys():  # noqa: SIM118 (a method of the graph runner)
            if key[0] not in sizes:
                continue
            g._graphs.pop(key, None)
            g._run(key)
            torch.cuda.synchronize()
            g._graphs[key] = g._capture(key, stream)
            torch.cuda.synchronize()
    gc.collect()
    return time.time() - t0


def greedy(llm, prompts) -> dict:
    from pdserve.engine.sampling_params import SamplingParams

    out = {}
    for n, toks in ((1, 32), (64, 8)):
        llm.reset_prefix_cache()
        p = SamplingParams(temperature=0, max_tokens=toks, ignore_eos=True)
        out[n] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:n], p)]
    return out


def step_profile(llm, rows: int, ctx: int, n_layers: int, steps: int = 8) -> dict:
    """One step shape's time and every kernel (launches per step and per layer, us each)."""
    from gpu_step_profile import _decode_steps

    cuda = DEVICE.startswith("cuda")
    times, per, launches, count = _decode_steps(llm, rows, ctx, steps, 1, cuda)
    kernels = {
        k[:120]: {"per_step": count[k] / steps, "per_layer": count[k] / steps / n_layers,
                  "us_each": per[k] / max(count[k], 1), "us_per_step": per[k] / steps}
        for k in sorted(count, key=lambda k: -per[k])
    }  # fmt: skip
    r = {"rows": rows, "context": ctx, "step_ms": statistics.median(times) * 1e3,
         "step_ms_spans": [t * 1e3 for t in times], "kernel_ms": sum(per.values()) / steps / 1e3,
         "kernels_per_step": sum(count.values()) / steps,
         "graph_launches_per_step": launches / steps, "kernels": kernels}  # fmt: skip
    log(f"profile {rows}x{ctx}: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms, "
        f"{r['kernels_per_step']:.0f} kernels/step")  # fmt: skip
    for k, v in list(kernels.items())[:16]:
        print(f"    {v['us_per_step']:8.1f} us/step {v['per_layer']:5.2f}/layer "
              f"{v['us_each']:7.2f} us each  {k[:80]}", flush=True)  # fmt: skip
    return r


def part_b(result: dict, save) -> None:
    from pdserve.bench import offline
    from pdserve.engine.llm import LLM

    top = __import__("argparse").ArgumentParser()
    offline.add_parser(top.add_subparsers(dest="cmd"))
    dt = "float32" if DEVICE == "cpu" else "bfloat16"
    bench_json = os.path.join(OUT_DIR, "bench.json")
    args = top.parse_args(["offline", "--model", MODEL, "--device", DEVICE, "--dtype", dt,
                           "--num-prompts", "1,64", "--max-tokens", os.environ.get("TOKENS", "128"),
                           "--repeats", "1", "--ours-only", "--json", bench_json])  # fmt: skip
    counts = [1, 64]
    apply(None)
    t0 = time.time()
    llm = LLM(max_running_requests=64, **offline.llm_fields(args, counts))
    result["engine_start_s"] = time.time() - t0
    log(f"engine up in {result['engine_start_s']:.0f} s")
    b = result["engine"] = {"recapture_s": [], "profile": {}}
    layers = list(llm.engine.executor.rank0.runner.model.decoder_layers())
    stats = [layer.moe.routing_stats for layer in layers if layer.moe is not None]

    def counters(on: bool) -> None:
        for layer, t in zip((la for la in layers if la.moe is not None), stats):
            layer.moe.routing_stats = t if on else None
            if t is not None:
                t.zero_()

    def profiles(label: str) -> None:
        b["profile"][label] = {}
        for rows_ in (1, 64):
            if left() < 22:  # ~3 s a profile; the bench keeps its ~12 s
                b["profile"][label][str(rows_)] = {"skipped": f"{left():.0f} s left"}
                continue
            b["profile"][label][str(rows_)] = step_profile(llm, rows_, 200, len(layers))
            save()

    try:
        prompts = offline.workload_prompts(llm, 64, None, None)
        off = greedy(llm, prompts)
        log("greedy (committed) done")
        changed = result["table"] != result["committed_table"]
        counters(False)  # the counters' kernels would count as the layer's
        b["recapture_s"].append(recapture(llm))
        profiles("committed")
        if changed:
            apply(result["table"])
            b["recapture_s"].append(recapture(llm))
            on = greedy(llm, prompts)
            b["greedy_same"] = {str(n): sum(a == c for a, c in zip(off[n], on[n])) for n in off}
            b["greedy_of"] = {str(n): len(off[n]) for n in off}
            log(f"greedy with the picks: identical {b['greedy_same']} of {b['greedy_of']}")
            save()
            profiles("picks")
        if left() > 14:
            counters(True)
            b["recapture_s"].append(recapture(llm))
            rows = [(n, "gsm8k") for n in counts]
            prompt_sets = [offline.workload_prompts(llm, n, None, None) for n in counts]
            offline._run(args, llm, rows, prompt_sets, None, result["engine_start_s"])
            with open(bench_json) as f:
                bj = json.load(f)
            b["bench"] = {k: bj.get(k) for k in ("model", "copy_bandwidth_bytes_per_s", "kv_pages")}
            b["bench"]["results"] = [{k: r.get(k) for k in (
                "num_prompts", "ours_tok_s", "ours_decode_ms_per_step", "ours_step_ms_all_decoding",
                "steady_roofline_ms", "roofline_fraction", "run_roofline_fraction", "step_bytes")}
                for r in bj["results"]]  # fmt: skip
            log("bench done")
        else:
            b["bench"] = {"skipped": f"{left():.0f} s left"}
            log(f"bench skipped: {left():.0f} s left")
        save()
    finally:
        llm.shutdown()


def write_table(result: dict) -> str:
    """pdserve/model/moe_table.py with part A's picks (in place)."""
    path = moe_table.__file__
    with open(path) as f:
        src = f.read()
    t = result["table"]
    src = re.sub(r"\nPDL: bool = .*\n", f"\nPDL: bool = {bool(t['PDL'])}\n", src)
    src = re.sub(r"\nGEMV_MAX_TOKENS: int = .*\n",
                 f"\nGEMV_MAX_TOKENS: int = {int(t['GEMV_MAX_TOKENS'])}\n", src)  # fmt: skip
    gemv = tuple(t["GEMV"]) if t["GEMV"] else None
    src = re.sub(r"\nGEMV: (.*) = .*\n", lambda m: f"\nGEMV: {m.group(1)} = {gemv!r}\n", src)
    if t["route_align_64"]:
        src, _ = re.subn(r"\n    \(64, \(\"split\".*\)\),\n",
                         f"\n    (64, {tuple(t['route_align_64'])!r}),\n", src, count=1)  # fmt: skip
    for n_assign, plan in t["decode"]:
        for r in moe_table.DECODE:
            if r[0] == n_assign:
                row = (n_assign, tuple(plan[0]), tuple(plan[1]), r[3], r[4])
                src, _ = re.subn(rf"\n    \({n_assign}, .*\),\n", f"\n    {row!r},\n", src, count=1)
    with open(path, "w") as f:
        f.write(src)
    return path


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-table":
        with open(sys.argv[2]) as f:
            result = json.load(f)
        print(f"wrote {write_table(result)}: {result['table']} (run ruff format on it)")
        return
    os.makedirs(OUT_DIR, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if DEVICE.startswith("cuda") else "cpu",
                    "time": time.time(), "shape": [H, INTER, E, K], "copies": COPIES,
                    "budget_s": BUDGET_S, "committed": {k: v for k, v in COMMITTED.items()
                                                       if k != "DECODE"},
                    "layers": [], "table": None}  # fmt: skip

    def save() -> None:
        result["elapsed_s"] = time.time() - T0
        with open(os.path.join(OUT_DIR, "moe8.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        if os.environ.get("SKIP_A") != "1":
            part_a(result, save)
    except Exception as exc:  # noqa: BLE001 (part B still runs with the committed path)
        log(f"part A failed: {type(exc).__name__}: {exc}")
        result["part_a_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    result["committed_table"] = {"PDL": COMMITTED["PDL"], "GEMV_MAX_TOKENS": COMMITTED["GEMV_MAX_TOKENS"],
                                 "GEMV": COMMITTED["GEMV"], "route_align_64": None, "decode": []}  # fmt: skip
    if result["table"] is None:
        result["table"] = dict(result["committed_table"])
    if os.environ.get("FORCE_TABLE"):  # (a CPU check of part B's switch)
        result["table"] = json.loads(os.environ["FORCE_TABLE"])
    save()
    if os.environ.get("SKIP_B") != "1":
        try:
            part_b(result, save)
        except Exception as exc:  # noqa: BLE001
            log(f"part B failed: {type(exc).__name__}: {exc}")
            result["part_b_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    save()
    log("done")


if __name__ == "__main__":
    main()
