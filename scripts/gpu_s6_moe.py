"""MoE expert-kernel sweep at decode sizes (issue 27, session 6): one Qwen3-30B-A3B sparse
layer (H 2048, I 768, 128 experts, 8 per token, bf16) at 1, 2, 4, 8, 16 and 64 tokens on one
H200, every candidate replayed in a CUDA graph over 4 copies of the layer's weights (so, as
in the 48-layer model, no step finds its experts in L2), against the experts' roofline
(bytes of the distinct experts routed to + x + out, over the copy bandwidth of this run).

What a candidate runs: the routing and the experts, from router logits computed outside the
graph (the engine computes them inside add + RMSNorm), i.e. ``route_align`` + the plan's
kernels (``grouped_experts``), or ``route_experts_gemv`` (the few-token path). Per token
count and routing regime, a coordinate descent over ``triton_moe.MoEPlan``:

A. the same tiles for both kernels (main's ``(16, 64, 128, 4, 3)`` first; 32/64-row blocks
   at 64 tokens);
B. the gate/up tiles, the down tiles of A's best kept;
C. the down tiles, B's gate/up kept, then the top-k sum in Triton; D. (<= 16 tokens) the down projection + routing
   weights + top-k sum in one launch (``down_sum``: elementwise or tensor cores), B's
   gate/up kept;
E. (<= 16 tokens) route_align's warps (1, 2, 4) with the best plan;
F. (<= 4 tokens) the few-token path (``route_experts_gemv``, elementwise and tensor-core
   gate/up and down).

Routing regimes: ``uniform`` (random router logits: at 64 tokens ~127 experts routed) and
``pool24`` (each token's 8 experts drawn from 24: the concentrated routing of the
``random:qwen3-30b-a3b`` preset, whose 64-prompt steps route ~17-27 experts a layer, as its
step bytes in docs/figures/h200_s5/moe_decode_default.json show) at 16 and 64 tokens.
Each candidate's output is checked against ``moe.experts_loop`` (bf16, relative max error
> 0.02 = WRONG, never picked). Then the fused kernels against the per-expert loop
(``experts_loop``), both eager (the loop syncs with the host), at 1, 64 and 2,048 tokens.

Kernels compile first in ``JOBS`` processes (Triton's disk cache), then the main process
times; candidates past ``BUDGET_S`` (default 110) are skipped and listed. Prints a table,
the picks, and a ``moe_table.DECODE`` proposal; writes ``$OUT/moe_s6_sweep.json`` after each
row. ``python3 scripts/gpu_s6_moe.py --write-table SWEEP.json`` (no GPU) writes
``pdserve/model/moe_table.py`` from such a JSON: per token count the grouped plan with the
least sum over its routing regimes of (time / the regime's best). Usage (repository root, GPU machine): ``python3 scripts/gpu_s6_moe.py``; ``SMOKE=1``
checks the script on CPU under ``TRITON_INTERPRET=1`` at toy shapes (timings meaningless).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

import torch

from pdserve.model import moe
from pdserve.model import triton_moe as tm

SMOKE = os.environ.get("SMOKE") == "1"
H, INTER, E, K = (64, 48, 16, 4) if SMOKE else (2048, 768, 128, 8)
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter's bf16 dots are wrong
COPIES = 1 if SMOKE else 4
TOKENS = [1, 64, 8, 16, 2, 4]  # most important first (the time budget)
POOL = 6 if SMOKE else 24
BUDGET_S = float(os.environ.get("BUDGET_S", "110"))
JOBS = int(os.environ.get("JOBS", "0" if SMOKE else "10"))
OUT_DIR = os.environ.get("OUT", "gpu_s6_moe")
T0 = time.time()

MAIN = (16, 64, 128, 4, 3)
# (block_n, block_k, num_warps, num_stages); smem-filtered per block_m below
UP_TILES = [(64, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3),
            (64, 256, 4, 3), (32, 128, 4, 5), (128, 128, 8, 3), (64, 64, 4, 4)]  # fmt: skip
DOWN_TILES = [(64, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (128, 128, 8, 3),
              (64, 256, 4, 3), (16, 256, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4)]  # fmt: skip
SAME_FEW = [MAIN, (16, 32, 128, 4, 3), (16, 32, 256, 4, 3)]
SAME_64 = [MAIN, (32, 64, 128, 4, 3), (32, 64, 64, 4, 3), (64, 64, 64, 4, 3),
           (64, 128, 64, 8, 3), (32, 128, 64, 4, 3)]  # fmt: skip
DSUM = [("rows", 4, 256, 8, 1), ("rows", 8, 256, 8, 1), ("rows", 2, 512, 8, 1),
        ("rows", 4, 512, 8, 1), ("dot", 16, 128, 4, 4), ("dot", 16, 256, 4, 4),
        ("dot", 16, 128, 4, 6), ("dot", 32, 128, 4, 4)]  # fmt: skip
GEMVS = [
    tm.GemvConfig(),
    tm.GemvConfig(32, 256, 8, 8, 128, 8),
    tm.GemvConfig(16, 256, 4, 4, 256, 8, "dot", 4),
    tm.GemvConfig(32, 128, 4, 4, 256, 8, "dot", 4),
    tm.GemvConfig(16, 512, 4, 4, 256, 8, "dot", 3),
    tm.GemvConfig(32, 256, 4, 8, 256, 8, "dot", 3),
    tm.GemvConfig(16, 256, 4, 16, 256, 4, "dot", 4, "dot", 4),
    tm.GemvConfig(32, 128, 4, 16, 128, 4, "dot", 4, "dot", 6),
]
if SMOKE:
    UP_TILES, DOWN_TILES = UP_TILES[:2], DOWN_TILES[:2]
    SAME_FEW, SAME_64, DSUM, GEMVS = SAME_FEW[:2], SAME_64[:2], DSUM[:5:4], GEMVS[6:7]


def smem_ok(bm: int, t: tuple, up: bool) -> bool:
    """Whether a tile's pipelined shared memory fits (~200 KB of the H200's 227)."""
    bn, bk, _, st = t
    return st * (bm * bk + (2 if up else 1) * bk * bn) * 2 <= 200_000


def cfg(bm: int, t: tuple) -> tm.MoEConfig:
    return tm.MoEConfig(bm, *t)


def regimes(T: int) -> list[str]:
    return ["uniform", "pool"] if T >= 16 else ["uniform"]


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


def make_step(kind: str, c, x, logits, layers, warps=None):
    """The graph body of one candidate over every weight copy in ``layers``."""
    if kind == "grouped":

        def step():
            out = None
            for w13, w2 in layers:
                w, ids, al = tm.route_align(logits, K, True, c.up.block_m, num_warps=warps)
                out = tm.grouped_experts(x, w13, w2, w, al, c, ids=ids)
            return out
    else:

        def step():
            out = None
            for w13, w2 in layers:
                out = tm.route_experts_gemv(logits, x, w13, w2, K, True, c)[0]
            return out

    return step


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


def plan_name(kind: str, c, warps=None) -> str:
    if kind == "gemv":
        return "gemv " + ",".join(map(str, c))
    name = f"grouped up{tuple(c.up)} down{tuple(c.down)}"
    if c.down_sum:
        name = f"grouped up{tuple(c.up)} down_sum{tuple(c.down_sum)}"
    elif c.triton_sum:
        name += " triton_sum"
    return name + (f" ra_warps {warps}" if warps else "")


def plan_dict(kind: str, c, warps=None) -> dict:
    """A candidate as JSON (what --write-table reads back)."""
    if kind == "gemv":
        return {"kind": "gemv", "gemv": list(c)}
    return {"kind": "grouped", "up": list(c.up), "down": list(c.down),
            "down_sum": list(c.down_sum) if c.down_sum else None,
            "triton_sum": c.triton_sum, "route_align_warps": warps}  # fmt: skip


def pick_for_table(rows: list[dict]) -> dict | None:
    """The grouped plan of one token count: over its rows (routing regimes), the candidate
    timed correct in all of them with the least sum of (its time / the row's best grouped
    time), the top-k sum and route_align's warps left aside; then ``triton_sum`` where the
    Triton sum beat torch's in every pair timed. None when no plan was timed in every row."""
    best: dict[str, float] = {}
    scores: dict[str, float] = {}
    plans: dict[str, dict] = {}
    for row in rows:
        ok = {n: v for n, v in row["candidates"].items()
              if v.get("ok") and v.get("plan", {}).get("kind") == "grouped"
              and not v["plan"]["triton_sum"] and not v["plan"]["route_align_warps"]}  # fmt: skip
        if not ok:
            return None
        low = min(v["us"] for v in ok.values())
        for n, v in ok.items():
            scores[n] = scores.get(n, 0.0) + v["us"] / low
            best[n] = best.get(n, 0) + 1
            plans[n] = v["plan"]
    common = [n for n in scores if best[n] == len(rows)]
    if not common:
        return None
    plan = dict(plans[min(common, key=lambda n: scores[n])])
    # the top-k sum in Triton where it beat torch's in every (row, plan) pair timed
    pairs = [(v["us"], row["candidates"][n + " triton_sum"].get("us"))
             for row in rows for n, v in row["candidates"].items()
             if v.get("ok") and n + " triton_sum" in row["candidates"]]  # fmt: skip
    plan["triton_sum"] = bool(pairs) and all(t is not None and t < u for u, t in pairs)
    return plan


def table_source(result: dict) -> str:
    """pdserve/model/moe_table.py from a sweep's JSON: DECODE per token count (bound T x k),
    ROUTE_ALIGN_WARPS from the route_align step of each count up to 16 tokens."""
    _, _, n_experts, k = result["shape"]
    decode, warps = [], []
    for T in sorted({r["tokens"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["tokens"] == T]
        p = pick_for_table(rows)
        if p is None:
            continue
        ds = tuple(p["down_sum"]) if p["down_sum"] else None
        decode.append((T * k, tuple(p["up"]), tuple(p["down"]), ds, p["triton_sum"]))
        w = next(
            (r["best_plan"].get("route_align_warps") for r in rows if r.get("best_plan")), None
        )
        if w and T <= 16:
            warps.append((T * n_experts, w))
    from pdserve.model import moe_table

    head = (moe_table.__doc__ or "").split("Written by")[0]
    date = time.strftime("%Y-%m-%d", time.gmtime(result.get("time", time.time())))
    return (
        f'"""{head}Written by ``scripts/gpu_s6_moe.py --write-table SWEEP.json`` from an H200 sweep\n'
        f"({result.get('device', 'GPU')}, {date}; the timings: {result.get('source', 'SWEEP.json')}).\n"
        '"""\n\nfrom __future__ import annotations\n\n'
        "Tiles = tuple[int, int, int, int, int]\nDownSum = tuple[str, int, int, int, int]\n\n"
        "DECODE: tuple[tuple[int, Tiles, Tiles, DownSum | None, bool], ...] = (\n"
        + "".join(f"    {row!r},\n" for row in decode)
        + ")\nROUTE_ALIGN_WARPS: tuple[tuple[int, int], ...] = ("
        + "".join(f"{w!r}, " for w in warps).rstrip(" ")
        + ")\n"
    )


def all_candidates() -> list[tuple[int, str, object, int | None]]:
    """Every (tokens, kind, plan, warps) a descent may time, for the compile warm-up: each
    kernel tile once per block_m (the descents pair them differently; the kernels compile
    per tile, not per pair)."""
    out = []
    for T in TOKENS:
        bms = [16] if T <= 16 else [16, 32, 64]
        for bm in bms:
            ups = [t for t in UP_TILES if smem_ok(bm, t, True)]
            dns = [t for t in DOWN_TILES if smem_ok(bm, t, False)]
            for i in range(max(len(ups), len(dns))):
                p = tm.MoEPlan(cfg(bm, ups[i % len(ups)]), cfg(bm, dns[i % len(dns)]))
                out.append((T, "grouped", p, None))
        for same in SAME_FEW if T <= 16 else SAME_64:
            out.append(
                (T, "grouped", tm.MoEPlan(cfg(same[0], same[1:]), cfg(same[0], same[1:])), None)
            )
        if T <= 16:
            for d in DSUM:
                out.append(
                    (T, "grouped", tm.MoEPlan(cfg(16, MAIN[1:]), cfg(16, MAIN[1:]), d), None)
                )
            out.append(
                (T, "grouped", tm.MoEPlan(cfg(16, MAIN[1:]), cfg(16, MAIN[1:]), None, True), None)
            )
            for w in (1, 2, 4):
                out.append((T, "grouped", tm.MoEPlan(cfg(16, MAIN[1:]), cfg(16, MAIN[1:])), w))
        if T <= 4:
            out += [(T, "gemv", g, None) for g in GEMVS]
    return out


def _warm(chunk: list) -> int:
    """Compile a chunk of candidates (a worker process; garbage weights, real shapes)."""
    dev = torch.device("cpu" if SMOKE else "cuda")
    w13 = torch.zeros(E, 2 * INTER, H, device=dev, dtype=DT)
    w2 = torch.zeros(E, H, INTER, device=dev, dtype=DT)
    done = 0
    for T, kind, c, warps in chunk:
        x = torch.zeros(T, H, device=dev, dtype=DT)
        logits = torch.randn(T, E, device=dev)
        try:
            make_step(kind, c, x, logits, [(w13, w2)], warps)()
            done += 1
        except Exception:  # noqa: BLE001 (reported when the main process times it)
            pass
    if not SMOKE:
        torch.cuda.synchronize()
    return done


def warm_up() -> None:
    cands = all_candidates()
    if JOBS <= 1:
        return
    chunks = [cands[i::JOBS] for i in range(JOBS)]
    ctx = multiprocessing.get_context("spawn")
    t0 = time.time()
    try:
        with concurrent.futures.ProcessPoolExecutor(JOBS, mp_context=ctx) as pool:
            n = sum(pool.map(_warm, chunks))
    except Exception as exc:  # noqa: BLE001 (then the main process compiles as it times)
        print(f"warm-up failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return
    print(
        f"compiled {n}/{len(cands)} candidates in {JOBS} processes: {time.time() - t0:.0f} s",
        flush=True,
    )


class Row:
    """One (tokens, regime) row: its problem, its roofline, the candidates timed."""

    def __init__(self, T, regime, dev, gen, layers, per_expert, bw):
        self.T, self.regime = T, regime
        self.layers = layers
        self.x = (torch.randn(T, H, device=dev, generator=gen)).to(DT)
        self.logits = make_logits(T, regime, gen, dev)
        w0, ids0 = moe.route(self.logits, K, True)
        self.routed = int(torch.unique(ids0).numel())
        w13, w2 = layers[0]
        self.ref = moe.experts_loop(self.x, w13, w2, w0, ids0).float()
        nbytes = self.routed * per_expert + 2 * T * H * 2
        self.floor = nbytes / bw
        self.data = {"tokens": T, "regime": regime, "routed_experts": self.routed,
                     "roofline_us": self.floor * 1e6, "candidates": {}}  # fmt: skip

    def time(self, kind, c, warps=None):
        """Seconds per layer of a candidate (None: failed, wrong or out of time)."""
        name = plan_name(kind, c, warps)
        if name in self.data["candidates"]:
            seen = self.data["candidates"][name]
            return seen["us"] / 1e6 if seen.get("ok") else None
        if time.time() - T0 > BUDGET_S:
            self.data["candidates"][name] = {"skipped": "time budget"}
            return None
        try:
            step = make_step(kind, c, self.x, self.logits, self.layers[:1], warps)
            out = step().float()
            err = ((out - self.ref).abs().max() / self.ref.abs().max()).item()
            dt = graph_time(make_step(kind, c, self.x, self.logits, self.layers, warps)) / len(
                self.layers
            )
        except Exception as exc:  # noqa: BLE001 (a tile that does not build)
            self.data["candidates"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            return None
        ok = err <= 0.02
        self.data["candidates"][name] = {"us": dt * 1e6, "fraction": self.floor / dt,
                                         "rel_err": err, "ok": ok,
                                         "plan": plan_dict(kind, c, warps)}  # fmt: skip
        print(f"T {self.T:>3} {self.regime:<7} {self.routed:>3} exp floor {self.floor * 1e6:6.1f} us | "
              f"{name:<66} {dt * 1e6:7.1f} us ({self.floor / dt:4.0%}) err {err:.1e}"
              + ("" if ok else "  WRONG"), flush=True)  # fmt: skip
        return dt if ok else None

    def best(self, items):
        """The fastest of ``items`` [(kind, plan, warps)] (timing those not yet timed)."""
        timed = [(self.time(*it), it) for it in items]
        timed = [(t, it) for t, it in timed if t is not None]
        return min(timed, key=lambda p: p[0]) if timed else (None, items[0])


def descend(row: Row) -> dict:
    T = row.T
    same = SAME_FEW if T <= 16 else SAME_64
    base = [("grouped", tm.MoEPlan(cfg(s[0], s[1:]), cfg(s[0], s[1:])), None) for s in same]
    _, (_, pa, _) = row.best(base)
    bm = pa.up.block_m
    ups = [
        ("grouped", tm.MoEPlan(cfg(bm, t), pa.down), None) for t in UP_TILES if smem_ok(bm, t, True)
    ]
    _, (_, pb, _) = row.best([("grouped", pa, None)] + ups)
    dns = [
        ("grouped", tm.MoEPlan(pb.up, cfg(bm, t)), None)
        for t in DOWN_TILES
        if smem_ok(bm, t, False)
    ]
    cands = [("grouped", pb, None)] + dns
    if T <= 16 and bm == 16:
        cands += [("grouped", tm.MoEPlan(pb.up, pb.down, d), None) for d in DSUM]
    _, (_, pc, _) = row.best(cands)
    if pc.down_sum is None:  # the top-k sum in Triton instead of torch
        _, (_, pc, _) = row.best(
            [("grouped", pc, None), ("grouped", pc._replace(triton_sum=True), None)]
        )
    warps = None
    if T <= 16:
        tw, (_, _, warps) = row.best([("grouped", pc, w) for w in (1, 2, 4)])
    gemv = None
    if T <= 4:
        tg, (_, gemv, _) = row.best([("gemv", g, None) for g in GEMVS])
    best_name = None
    timed = [(v["us"], k) for k, v in row.data["candidates"].items() if v.get("ok")]
    if timed:
        best_name = min(timed)[1]
    main_name = plan_name("grouped", tm.MoEPlan(cfg(16, MAIN[1:]), cfg(16, MAIN[1:])))
    main_us = row.data["candidates"].get(main_name, {}).get("us")
    row.data["best"] = best_name
    row.data["best_plan"] = {"up": list(pc.up), "down": list(pc.down),
                             "down_sum": list(pc.down_sum) if pc.down_sum else None,
                             "triton_sum": pc.triton_sum,
                             "route_align_warps": warps,
                             "best_gemv": list(gemv) if gemv else None}  # fmt: skip
    if best_name:
        b = row.data["candidates"][best_name]
        print(f"T {T:>3} {row.regime}: best {best_name} {b['us']:.1f} us ({b['fraction']:.0%}); "
              f"main's tiles {main_us and round(main_us, 1)} us", flush=True)  # fmt: skip
    return row.data


def eager_time(fn, reps: int) -> float:
    fn()
    if not SMOKE:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if not SMOKE:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-table":
        with open(sys.argv[2]) as f:
            result = json.load(f)
        result["source"] = sys.argv[2]
        path = os.path.join(os.path.dirname(tm.__file__), "moe_table.py")
        source = table_source(result)
        with open(path, "w") as f:
            f.write(source)
        print(f"wrote {path} (run ruff format on it)")
        return
    dev = torch.device("cpu" if SMOKE else "cuda")
    os.makedirs(OUT_DIR, exist_ok=True)
    from pdserve.bench.roofline import copy_bandwidth

    bw = copy_bandwidth(dev, 1 << 20 if SMOKE else None)
    warm_up()
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(COPIES):
        w13 = (torch.randn(E, 2 * INTER, H, device=dev, generator=gen) * 0.02).to(DT)
        w2 = (torch.randn(E, H, INTER, device=dev, generator=gen) * 0.02).to(DT)
        layers.append((w13, w2))
    per_expert = 3 * INTER * H * 2
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; one expert {per_expert / 1e6:.2f} MB; "
          f"{time.time() - T0:.0f} s", flush=True)  # fmt: skip
    device = "cpu" if SMOKE else torch.cuda.get_device_name()
    result = {"device": device, "time": time.time(), "copy_bandwidth": bw,
              "shape": [H, INTER, E, K], "copies": COPIES,
              "rows": [], "loop_vs_fused": []}  # fmt: skip

    def save():
        with open(os.path.join(OUT_DIR, "moe_s6_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)

    for T in TOKENS:
        for regime in regimes(T):
            row = Row(T, regime, dev, gen, layers, per_expert, bw)
            result["rows"].append(descend(row))
            save()
    # the fused kernels against the per-expert loop, eager (the loop syncs with the host)
    w13, w2 = layers[0]
    for T in [1, 64, 2048] if not SMOKE else [1, 8]:
        if time.time() - T0 > BUDGET_S + 20:
            break
        x = torch.randn(T, H, device=dev, generator=gen).to(DT)
        w, ids = moe.route(torch.randn(T, E, device=dev, generator=gen), K, True)
        reps = 3 if T > 64 else 10
        t_loop = eager_time(lambda x=x, w=w, ids=ids: moe.experts_loop(x, w13, w2, w, ids), reps)
        t_fused = eager_time(lambda x=x, w=w, ids=ids: tm.fused_experts(x, w13, w2, w, ids), reps)
        err = (
            (
                tm.fused_experts(x, w13, w2, w, ids).float()
                - moe.experts_loop(x, w13, w2, w, ids).float()
            )
            .abs()
            .max()
        ).item()
        result["loop_vs_fused"].append({"tokens": T, "loop_us": t_loop * 1e6, "fused_us": t_fused * 1e6,
                                        "speedup": t_loop / t_fused, "max_abs_diff": err})  # fmt: skip
        print(f"T {T:>5} eager: per-expert loop {t_loop * 1e6:8.1f} us, fused {t_fused * 1e6:8.1f} us "
              f"({t_loop / t_fused:.1f}x), max |diff| {err:.1e}", flush=True)  # fmt: skip
        save()
    # a moe_table.DECODE proposal: per bucket the best grouped plan (pool regime at 64)
    proposal = []
    for T in sorted(TOKENS):
        rows = [r for r in result["rows"] if r["tokens"] == T]
        pick = next((r for r in rows if r["regime"] == "pool"), rows[0] if rows else None)
        if pick and pick.get("best_plan"):
            p = pick["best_plan"]
            proposal.append((T * K, tuple(p["up"]), tuple(p["down"]),
                             tuple(p["down_sum"]) if p["down_sum"] else None, p["triton_sum"]))  # fmt: skip
    result["decode_table_proposal"] = proposal
    save()
    print("DECODE proposal:", proposal)
    print(f"sweep done in {time.time() - T0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
