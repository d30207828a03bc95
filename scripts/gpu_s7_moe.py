"""MoE decode kernels, session 7 (issue 27): route_align's variants against the committed
plans, one Qwen3-30B-A3B sparse layer (H 2048, I 768, 128 experts, 8 per token, bf16)
on one H200, CUDA graphs, 4 weight copies (no step finds its experts in L2).

1. ``route_align`` alone (48 launches a graph, as 48 layers) at 1, 8, 16 and 64 tokens:
   one program (``RouteAlignConfig("one", warps, rank_dot)``) against the split launches
   (routing in programs of a few tokens, then the alignment: ``"split"``), each checked
   equal to ``moe.route`` + ``triton_moe.align`` (ids, order, blocks, used rows);
2. the layer (``route_align`` + ``grouped_experts``) at 1, 16 and 64 tokens, uniform and
   concentrated (``pool``: each token's 8 experts from 24, as the random preset routes)
   routing: the committed plan (``pick_plan``) against 32-row tiles, all with the
   committed route_align; then the best plan with the best route_align. Each checked
   against ``moe.experts_loop`` (relative max error > 0.02 = WRONG, never picked).

Kernels compile first in ``JOBS`` processes; candidates past ``BUDGET_S`` seconds of timing
(route_align's past half of it) are skipped and listed.
Writes ``$OUT/moe_s7.json`` after each item, with ``table``: the ``moe_table`` rows the
measurements pick (``ROUTE_ALIGN`` per token bound; ``DECODE`` rows of 16 and 64 tokens
where another plan beat the committed one summed over the regimes).

``python3 scripts/gpu_s7_moe.py --write-table JSON`` (no GPU) writes them into
``pdserve/model/moe_table.py``. ``SMOKE=1``: toy shapes on CPU under ``TRITON_INTERPRET=1``.

The H200 call of 2026-12-03 (docs/figures/h200_s7/moe_s7.json) also timed the gate/up
reduction split over 2, 4 or 8 programs (fp32 partial sums, then their ordered sum + silu *
up: commit de9063c): slower at 1, 16 and 64 tokens in both regimes (e.g. 64 tokens, 24
experts: 142.4 / 146.5 / 157.0 us against 140.5), so the kernels were dropped.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import re
import sys
import time

import torch

from pdserve.model import moe
from pdserve.model import triton_moe as tm

SMOKE = os.environ.get("SMOKE") == "1"
H, INTER, E, K = (64, 48, 16, 4) if SMOKE else (2048, 768, 128, 8)
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter's bf16 dots are wrong
COPIES = 1 if SMOKE else 4
LAYERS = 2 if SMOKE else 48  # route_align launches per timed graph
POOL = 6 if SMOKE else 24
BUDGET_S = float(os.environ.get("BUDGET_S", "40"))  # of timing, after the compile warm-up
JOBS = int(os.environ.get("JOBS", "0" if SMOKE else "14"))
OUT_DIR = os.environ.get("OUT", "gpu_s7_moe")
T0 = time.time()  # reset when the warm-up ends

RA_TOKENS = [1, 8, 16, 64]
RA = (
    [tm.RouteAlignConfig("one", w, False) for w in (1, 2, 4, 8)]
    + [tm.RouteAlignConfig("one", w, True) for w in (1, 4, 8)]
    + [
        tm.RouteAlignConfig("split", rw, d, tpp, aw)
        for d in (False, True)
        for tpp, rw in ((1, 1), (4, 1), (16, 4))
        for aw in (4, 8)
    ]
)
LAYER_TOKENS = [64, 16, 1]
ALT_32 = (tm.MoEConfig(32, 128, 64, 4, 3), tm.MoEConfig(32, 128, 64, 4, 3))  # s6's pool best
if SMOKE:
    RA = RA[:1] + RA[4:5] + RA[8:9] + RA[-1:]
    RA_TOKENS, LAYER_TOKENS = [1, 8], [8, 1]
    ALT_32 = (tm.MoEConfig(32, 16, 16, 4, 2), tm.MoEConfig(32, 16, 16, 4, 2))


def ra_name(c: tm.RouteAlignConfig) -> str:
    if c.kind == "one":
        return f"one w{c.num_warps}" + (" dot" if c.rank_dot else "")
    return f"split tpp{c.tokens_per_program} w{c.num_warps} aw{c.align_warps}" + (
        " dot" if c.rank_dot else ""
    )


def plan_name(p: tm.MoEPlan) -> str:
    s = f"up{tuple(p.up)} down{tuple(p.down)}"
    if p.down_sum:
        s += f" down_sum{tuple(p.down_sum)}"
    if p.triton_sum:
        s += " triton_sum"
    return s


def make_logits(T: int, regime: str, gen: torch.Generator, dev) -> torch.Tensor:
    """Router logits ``[T, E]`` (fp32): random, or each token's K experts drawn from POOL."""
    logits = torch.randn(T, E, device=dev, generator=gen)
    if regime == "pool":
        pool = torch.randperm(E, device=dev, generator=gen)[:POOL]
        logits = logits * 0.1 - 8.0
        for t in range(T):
            pick = pool[torch.randperm(POOL, device=dev, generator=gen)[:K]]
            logits[t, pick] = 2.0 + 0.5 * torch.randn(K, device=dev, generator=gen)
    return logits


def graph_time(fn, iters: int = 10) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph (median of 5 spans)."""
    if SMOKE:
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


def table_plan(T: int) -> tm.MoEPlan:
    return tm.pick_plan(T * K, E)


def layer_plans(T: int) -> list[tm.MoEPlan]:
    """The committed plan, then (from 8 tokens) 32-row tiles."""
    base = table_plan(T)
    out = [base]
    if T >= 8:
        alt = tm.MoEPlan(ALT_32[0], ALT_32[1], None, True)
        out += [alt]
    return out


def all_work() -> list[tuple]:
    work: list[tuple] = [("ra", T, c) for T in RA_TOKENS for c in RA]
    work += [("layer", T, p, None) for T in LAYER_TOKENS for p in layer_plans(T)]
    return work


def _warm(chunk: list) -> int:
    """Compile a chunk of candidates (a worker process; garbage weights, real shapes)."""
    dev = torch.device("cpu" if SMOKE else "cuda")
    w13 = torch.zeros(E, 2 * INTER, H, device=dev, dtype=DT)
    w2 = torch.zeros(E, H, INTER, device=dev, dtype=DT)
    done = 0
    for item in chunk:
        try:
            T = item[1]
            logits = torch.randn(T, E, device=dev)
            if item[0] == "ra":
                tm.route_align(logits, K, True, table_plan(T).up.block_m, config=item[2])
            else:
                p = item[2]
                x = torch.zeros(T, H, device=dev, dtype=DT)
                w, ids, al = tm.route_align(logits, K, True, p.up.block_m)
                tm.grouped_experts(x, w13, w2, w, al, p, ids=ids)
            done += 1
        except Exception:  # noqa: BLE001 (reported when the main process times it)
            pass
    if not SMOKE:
        torch.cuda.synchronize()
    return done


def warm_up() -> None:
    work = all_work()
    if JOBS <= 1:
        return
    chunks = [work[i::JOBS] for i in range(JOBS)]
    t0 = time.time()
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(JOBS, mp_context=ctx) as pool:
            n = sum(pool.map(_warm, chunks))
    except Exception as exc:  # noqa: BLE001 (then the main process compiles as it times)
        print(f"warm-up failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return
    print(f"compiled {n}/{len(work)} candidates in {JOBS} processes: {time.time() - t0:.0f} s")


def time_route_align(T: int, logits: torch.Tensor, c: tm.RouteAlignConfig) -> dict:
    """One route_align candidate: equal to the torch pair? microseconds per launch."""
    bm = table_plan(T).up.block_m
    w, ids, al = tm.route_align(logits, K, True, bm, config=c)
    w0, ids0 = moe.route(logits, K, True)
    al0 = tm.align(ids0, E, bm)
    ok = (
        torch.equal(ids, ids0)
        and torch.equal(al.sorted_ids, al0.sorted_ids)
        and torch.equal(al.block_expert, al0.block_expert)
        and int(al.used.item()) == int(al0.used.item())
        and (w - w0).abs().max().item() < 1e-5
    )

    def step():
        for _ in range(LAYERS):
            tm.route_align(logits, K, True, bm, config=c)

    return {"us": graph_time(step) / LAYERS * 1e6, "ok": bool(ok)}


class LayerRow:
    """One (tokens, regime) problem of the layer part, its roofline and reference."""

    def __init__(self, T, regime, dev, gen, layers, bw):
        self.T, self.regime, self.layers = T, regime, layers
        self.x = torch.randn(T, H, device=dev, generator=gen).to(DT)
        self.logits = make_logits(T, regime, gen, dev)
        w0, ids0 = moe.route(self.logits, K, True)
        self.routed = int(torch.unique(ids0).numel())
        self.ref = moe.experts_loop(self.x, *layers[0], w0, ids0).float()
        self.floor = (self.routed * 3 * INTER * H * 2 + 2 * T * H * 2) / bw
        self.data = {"tokens": T, "regime": regime, "routed_experts": self.routed,
                     "roofline_us": self.floor * 1e6, "candidates": {}}  # fmt: skip

    def time(self, p: tm.MoEPlan, ra: tm.RouteAlignConfig | None = None) -> None:
        name = plan_name(p) + (f" | ra {ra_name(ra)}" if ra else "")
        if time.time() - T0 > BUDGET_S:
            self.data["candidates"][name] = {"skipped": "time budget"}
            return

        def step(layers):
            out = None
            for w13, w2 in layers:
                w, ids, al = tm.route_align(self.logits, K, True, p.up.block_m, config=ra)
                out = tm.grouped_experts(self.x, w13, w2, w, al, p, ids=ids)
            return out

        try:
            out = step(self.layers[:1]).float()
            err = ((out - self.ref).abs().max() / self.ref.abs().max()).item()
            dt = graph_time(lambda: step(self.layers)) / len(self.layers)
        except Exception as exc:  # noqa: BLE001 (a tile that does not build)
            self.data["candidates"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            return
        ok = err <= 0.02
        self.data["candidates"][name] = {
            "us": dt * 1e6, "fraction": self.floor / dt, "rel_err": err, "ok": ok,
            "plan": [list(p.up), list(p.down), list(p.down_sum) if p.down_sum else None,
                     p.triton_sum],
            "route_align": list(ra) if ra else None,
        }  # fmt: skip
        print(f"T {self.T:>3} {self.regime:<7} {self.routed:>3} exp floor {self.floor * 1e6:6.1f} us"
              f" | {name:<78} {dt * 1e6:7.1f} us ({self.floor / dt:4.0%}) err {err:.1e}"
              + ("" if ok else "  WRONG"), flush=True)  # fmt: skip


def pick_route_align(result: dict) -> list:
    """Per token bound the fastest correct route_align over its rows, if it beats the
    committed default (``RouteAlignConfig()``) by more than 3 %: [(T, fields), ...]."""
    rows = []
    for T in sorted({r["tokens"] for r in result["route_align"]}):
        cands = [r for r in result["route_align"] if r["tokens"] == T]
        ok = {}
        for r in cands:
            for n, v in r["candidates"].items():
                if v.get("ok") and "us" in v:
                    ok.setdefault(n, []).append(v)
        full = {n: vs for n, vs in ok.items() if len(vs) == len(cands)}
        if not full:
            continue
        best = min(full, key=lambda n: sum(v["us"] for v in full[n]))
        default = cands[0].get("default")
        dflt_us = sum(v["us"] for v in full.get(default, [])) if default in full else None
        b_us = sum(v["us"] for v in full[best])
        if dflt_us is None or b_us < 0.97 * dflt_us:
            rows.append((T, full[best][0]["config"]))
    return rows


def pick_decode(result: dict) -> list:
    """Per layer token count (>= 8) the plan (committed route_align) with the least sum over
    the regimes of time / the regime's best, where it is not the committed plan and beats
    it summed over the regimes by more than 3 %: [(T * K, plan fields), ...]."""
    rows = []
    for T in sorted({r["tokens"] for r in result["layers"]}):
        regs = [r for r in result["layers"] if r["tokens"] == T]
        scores: dict[str, float] = {}
        seen: dict[str, int] = {}
        plans = {}
        for r in regs:
            ok = {n: v for n, v in r["candidates"].items() if v.get("ok") and not v["route_align"]}
            if not ok:
                return rows
            low = min(v["us"] for v in ok.values())
            for n, v in ok.items():
                scores[n] = scores.get(n, 0.0) + v["us"] / low
                seen[n] = seen.get(n, 0) + 1
                plans[n] = v["plan"]
        common = [n for n in scores if seen[n] == len(regs)]
        base = regs[0].get("committed")
        if not common or base not in common:
            continue
        best = min(common, key=lambda n: scores[n])
        if best != base and scores[best] < 0.97 * scores[base]:
            rows.append((T * K, plans[best]))
    return rows


def write_table(result: dict) -> str:
    """pdserve/model/moe_table.py with the rows ``result['table']`` picks (in place)."""
    from pdserve.model import moe_table

    path = moe_table.__file__
    with open(path) as f:
        src = f.read()
    ra = result["table"]["route_align"]
    body = "".join(f"    ({T}, {tuple(f)!r}),\n" for T, f in ra)
    src = re.sub(
        r"ROUTE_ALIGN: tuple\[tuple\[int, tuple\[str, int, bool, int, int\]\], \.\.\.\] = \((.|\n)*?\)\n$",
        "ROUTE_ALIGN: tuple[tuple[int, tuple[str, int, bool, int, int]], ...] = "
        + (f"(\n{body})\n" if body else "()\n"),
        src,
    )
    for n_assign, plan in result["table"]["decode"]:
        up, down, dsum, tsum = plan
        row = (n_assign, tuple(up), tuple(down), tuple(dsum) if dsum else None, tsum)
        src, n = re.subn(rf"\n    \({n_assign}, .*\),\n", f"\n    {row!r},\n", src, count=1)
        if not n:
            raise SystemExit(f"no DECODE row {n_assign} in {path}")
    stamp = (
        "``ROUTE_ALIGN`` written by ``scripts/gpu_s7_moe.py --write-table JSON`` "
        f"({result.get('device')}; the timings: {result.get('source', 'JSON')})"
    )
    if ra or result["table"]["decode"]:
        src = src.replace('"""\n\nfrom __future__', f'\n{stamp}.\n"""\n\nfrom __future__', 1)
    with open(path, "w") as f:
        f.write(src)
    return path


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-table":
        with open(sys.argv[2]) as f:
            result = json.load(f)
        result = result.get("sweep", result)  # the call's moe_s7.json holds the sweep's
        result["source"] = sys.argv[2]
        print(f"wrote {write_table(result)}: {result['table']} (run ruff format on it)")
        return
    dev = torch.device("cpu" if SMOKE else "cuda")
    os.makedirs(OUT_DIR, exist_ok=True)
    from pdserve.bench.roofline import copy_bandwidth

    bw = copy_bandwidth(dev, 1 << 20 if SMOKE else None)
    warm_up()
    global T0
    T0 = time.time()
    gen = torch.Generator(device=dev).manual_seed(0)
    result: dict = {"device": "cpu" if SMOKE else torch.cuda.get_device_name(),
                    "time": time.time(), "copy_bandwidth": bw, "shape": [H, INTER, E, K],
                    "copies": COPIES, "route_align": [], "layers": [],
                    "table": {"route_align": [], "decode": []}}  # fmt: skip

    def save():
        with open(os.path.join(OUT_DIR, "moe_s7.json"), "w") as f:
            json.dump(result, f, indent=1)

    # 1. route_align alone
    for T in RA_TOKENS:
        for regime in ["uniform", "pool"] if T >= 16 else ["uniform"]:
            logits = make_logits(T, regime, gen, dev)
            default = ra_name(
                tm.route_align_config(T, E)._replace(num_warps=tm.route_align_warps(T, E))
            )
            row = {"tokens": T, "regime": regime, "default": default, "candidates": {}}
            result["route_align"].append(row)
            for c in RA:
                if time.time() - T0 > BUDGET_S * 0.5:
                    row["candidates"][ra_name(c)] = {"skipped": "time budget"}
                    continue
                try:
                    v = time_route_align(T, logits, c)
                except Exception as exc:  # noqa: BLE001
                    v = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                v["config"] = list(c)
                row["candidates"][ra_name(c)] = v
            timed = sorted((v["us"], n) for n, v in row["candidates"].items() if v.get("ok"))
            dflt = row["candidates"].get(default, {}).get("us")
            print(f"route_align T {T:>3} {regime:<7}: committed ({default}) "
                  f"{dflt and round(dflt, 2)} us; best " + ", ".join(f"{n} {u:.2f}" for u, n in timed[:3]),
                  flush=True)  # fmt: skip
            bad = [n for n, v in row["candidates"].items() if "ok" in v and not v["ok"]]
            if bad:
                print(f"  WRONG: {bad}")
            save()
    result["table"]["route_align"] = pick_route_align(result)
    save()
    # 2. the layer
    layers = []
    for _ in range(COPIES):
        w13 = (torch.randn(E, 2 * INTER, H, device=dev, generator=gen) * 0.02).to(DT)
        w2 = (torch.randn(E, H, INTER, device=dev, generator=gen) * 0.02).to(DT)
        layers.append((w13, w2))
    rows = []
    for T in LAYER_TOKENS:
        for regime in ["uniform", "pool"] if T >= 16 else ["uniform"]:
            row = LayerRow(T, regime, dev, gen, layers, bw)
            row.data["committed"] = plan_name(table_plan(T))
            result["layers"].append(row.data)
            rows.append(row)
            for p in layer_plans(T):
                row.time(p)
            save()
    result["table"]["decode"] = pick_decode(result)
    # the picks together: the best plan with the picked route_align
    for row in rows:
        T = row.T
        ra = next((f for t, f in result["table"]["route_align"] if t >= T), None)
        if ra is None:
            continue
        plan = next((p for n, p in result["table"]["decode"] if n == T * K), None)
        p = tm.MoEPlan(tm.MoEConfig(*plan[0]), tm.MoEConfig(*plan[1]), None, plan[3]) \
            if plan else table_plan(T)  # fmt: skip
        row.time(p, tm.RouteAlignConfig(*ra))
        save()
    save()
    print(f"table picks: {result['table']}")
    print(f"sweep done in {time.time() - T0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
