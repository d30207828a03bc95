"""MoE decode, session 11 (issue 27): the persistent grouped GEMMs (``MoEPlan.persist``,
``moe_table.PERSISTENT``, off by default) against the committed grid kernels, the layer
alone, then one engine's 64-row all-decoding step.

Why (docs/benchmarks.md S10-MOE10, S9-MOE92): at 64 tokens routed to ~24 experts the gate/up
and down kernels take 43.1 + 38.2 us a layer against ~54 us for the routed experts' bytes
(24 x 9.44 MB at ~4.2 TB/s). Their grid is sized for the worst routing (152 row blocks of 16
at 512 assignments over 128 experts; a CUDA graph fixes it): ~48 are used, so ~1,250 of
gate/up's 1,824 programs and ~3,300 of down's 4,864 start, read ``used`` and return,
interleaved with the working ones; and each expert's ~21 rows take two 16-row blocks, two
programs reading the same weight tile. The persistent kernels launch a few programs per SM
that walk only the used tiles; with 32-row blocks an expert of <= 32 rows is one tile (its
weights read by one program), and a block whose second half is padding is multiplied as 16
rows (``half``), so experts of a few rows (uniform routing) cost the MMAs of today's tiles.
Every output element is the same sum in the same order (the same bits).

A. One sparse layer alone (H 2048, I 768, 128 experts, top 8, bf16; 4 weight copies so no
   replay finds its experts in L2; CUDA graphs; PDL as ``moe_table.PDL``): 1 token (the
   committed few-token path: reference only, these kernels are not on it) and 64 tokens
   routed uniformly (~125 experts) and from a pool of 24 / 15 experts (the random preset's
   concentrated routing: 24 in sessions 6-9's layer rows, ~15 a layer in bench offline's
   64-prompt steps by their bytes, so ~21 / ~34 rows an expert): the
   committed plan (``route_align`` + grid kernels + top-k sum) against the persistent plans
   of ``PLANS`` and the grid kernels with 32-row blocks (S9-MOE92's best at 24 experts).
   Each: us, the fraction of the routed experts' bytes over the copy bandwidth, the
   relative error against ``moe.experts_loop`` (> 0.02: WRONG) and ``same_bits`` against
   the committed output. The compiled kernels' shared memory and registers where Triton
   says (the programs per SM a plan asks for must fit: else its second programs wait).
   Order for part B: the persistent plans by their time summed over the pooled regimes,
   those not slower by > 1 % uniform first; ``pick_ok``: also < 0.97 x the committed summed
   over the pooled regimes and the same bits in every regime.
B. One engine (``bench offline``'s flags for ``random:qwen3-30b-a3b``, bf16,
   ``PDSERVE_MOE_ROUTING_STATS=1``): the 64-row bucket's graphs captured again into a pool
   of their own with each of part A's first ``ENGINE_PLANS`` plans (``moe_table.PERSISTENT``
   set for the bucket's DECODE row while capturing) and swapped in; greedy tokens of the
   bench's 64 prompts x 12 against today's; the all-decoding step of the 64 prompts
   interleaved span by span with today's (``ROUNDS`` x ``SPAN`` steps, paired differences,
   median); the step's kernel profile with the best (gate/up and down us a layer); ``bench
   offline --num-prompts 64`` with it and then with today's graphs, as seconds are left.

``$OUT/moegemm.json`` after every item, within ``BUDGET_S``. CPU dry run (toy layer under
the interpreter; no graphs: the engine's variants set the table and run eagerly):
``SMOKE=1 DEVICE=cpu MODEL=random:tiny-qwen3-moe TRITON_INTERPRET=1 TOKENS=8``. A kept
pick goes into ``moe_table.PERSISTENT`` by hand: ``(512, up, down, up_per_sm,
down_per_sm, half)`` from the JSON's ``plans``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from pdserve.model import moe, moe_table
from pdserve.model import triton_moe as tm

T0 = time.time()
SMOKE = os.environ.get("SMOKE") == "1"
H, INTER, E, K = (64, 48, 16, 4) if SMOKE else (2048, 768, 128, 8)
DT = torch.float16 if SMOKE else torch.bfloat16  # (the interpreter's bf16 dots are wrong)
COPIES = 1 if SMOKE else 4
BIG = 8 if SMOKE else 64
BUDGET_S = float(os.environ.get("BUDGET_S", "110"))
A_S = float(os.environ.get("A_S", "24"))  # part A ends by then (compiles included)
JOBS = int(os.environ.get("JOBS", "0" if SMOKE else "14"))
OUT_DIR = os.environ.get("OUT", "gpu_s11_moegemm")
MODEL = os.environ.get("MODEL", "random:qwen3-30b-a3b")
DEVICE = os.environ.get("DEVICE", "cpu" if SMOKE else "cuda")
TOKENS = os.environ.get("TOKENS", "128")
ROUNDS = int(os.environ.get("ROUNDS", "6"))
SPAN = int(os.environ.get("SPAN", "8"))
ENGINE_PLANS = int(os.environ.get("ENGINE_PLANS", "2"))
# Part B's plans by name (comma-separated), in place of part A's order (session 13: p16, the
# committed tiles persistent, which uniform routing should not slow, beside session 12's
# engine pick p64, which uniform routing did)
ENGINE_NAMES = [n for n in os.environ.get("ENGINE_NAMES", "").split(",") if n]
MC = tm.MoEConfig

# name -> (up tiles, down tiles, (gate/up, down) programs per SM or None: the grid kernels,
# half, dynamic: the tiles handed out by a device counter). Programs per SM from the sm_90 builds (scripts/sm90_moe_build_check.py --s11, Triton
# 3.6 and 3.9 alike): shared memory 73,728 / 81,920 / 61,440 / 98,304 B (gate/up) and
# 40,960 / 49,152 / 36,864 B (down) against the SM's 233,472 (1 KB reserved a program).
if SMOKE:
    PLANS: dict[str, tuple] = {  # the committed K chunks (the interpreter's sums follow them)
        "p16": (MC(16, 16, 256, 4, 2), MC(16, 16, 128, 4, 2), (2, 2), True, False),
        "p32": (MC(32, 16, 256, 4, 2), MC(32, 32, 128, 4, 2), (1, 3), True, False),
        "p32-dyn": (MC(32, 16, 256, 4, 2), MC(32, 32, 128, 4, 2), (2, 2), True, True),
        "p64": (MC(64, 16, 256, 4, 2), MC(64, 32, 128, 4, 2), (1, 2), True, False),
        "grid32": (MC(32, 16, 256, 4, 2), MC(32, 32, 128, 4, 2), None, True, False),
    }
else:
    PLANS = {
        "p32": (MC(32, 32, 128, 4, 4), MC(32, 64, 128, 4, 3), (3, 4), True, False),
        "p32-dyn": (MC(32, 32, 128, 4, 4), MC(32, 64, 128, 4, 3), (3, 4), True, True),
        "p16": (MC(16, 64, 128, 4, 3), MC(16, 64, 128, 4, 3), (3, 5), True, False),
        "p32-64": (MC(32, 64, 64, 4, 4), MC(32, 64, 64, 4, 4), (3, 6), True, False),
        "p32-k256": (MC(32, 16, 256, 4, 4), MC(32, 32, 128, 4, 4), (2, 4), True, False),
        "p32-k256-dyn": (MC(32, 16, 256, 4, 4), MC(32, 32, 128, 4, 4), (2, 4), True, True),
        "p32-nohalf": (MC(32, 32, 128, 4, 4), MC(32, 64, 128, 4, 3), (3, 4), False, False),
        "p32-few": (MC(32, 32, 128, 4, 4), MC(32, 64, 128, 4, 3), (1, 2), True, False),
        # 64-row blocks (an expert of ~34 rows one tile; wgmma on full tiles, the 32-row
        # half on HMMA: the bits may differ)
        "p64": (MC(64, 32, 64, 4, 4), MC(64, 32, 64, 4, 4), (3, 4), True, False),
        "grid32": (MC(32, 64, 64, 4, 4), MC(32, 64, 128, 4, 3), None, True, False),
    }
# "poolP": each token's top k from the same P experts (the random preset's concentrated
# routing: 24 in the layer rows of sessions 6-9; ~15 a layer in bench offline's 64-prompt
# steps by its step bytes, S10-MOE10: 10.55 GB against 6.10 at one prompt)
TOKENS_A = [(1, "uniform"), (BIG, "uniform")]
TOKENS_A += [(BIG, "pool6"), (BIG, "pool5")] if SMOKE else [(BIG, "pool24"), (BIG, "pool15")]


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def plan_of(name: str, n_assign: int) -> tm.MoEPlan:
    """Part A's plan ``name`` (``committed``: ``pick_plan``'s) at ``n_assign`` assignments:
    the committed DECODE row's top-k sum with the listed tiles."""
    base = tm.pick_plan(n_assign, E)
    if name == "committed":
        return base
    up, down, persist, half, dynamic = PLANS[name]
    return tm.MoEPlan(up, down, None, base.triton_sum, False, persist, half, dynamic)


def run_layer(name: str, x, logits, w13, w2) -> torch.Tensor:
    T = x.shape[0]
    if name == "gemv":
        return tm.route_experts_gemv(logits, x, w13, w2, K, True)[0]
    plan = plan_of(name, T * K)
    w, ids, al = tm.route_align(logits, K, True, plan.up.block_m)
    out = tm.grouped_experts(x, w13, w2, w, al, plan, ids=ids)
    assert isinstance(out, torch.Tensor)
    return out


def names_for(T: int) -> list[str]:
    return ["gemv"] if T == 1 else ["committed", *PLANS]


def make_logits(T: int, regime: str, gen: torch.Generator, dev) -> torch.Tensor:
    """Router logits: ``uniform`` (random), or ``poolP``: each token's top k from the same
    ``P`` experts (the random preset's concentrated routing)."""
    logits = torch.randn(T, E, device=dev, generator=gen)
    if regime.startswith("pool"):
        n = int(regime[4:])
        assert n >= K, f"a pool of {n} experts for top {K}"
        pool = torch.randperm(E, device=dev, generator=gen)[:n]
        logits = logits * 0.1 - 8.0
        for t in range(T):
            pick = pool[torch.randperm(n, device=dev, generator=gen)[:K]]
            logits[t, pick] = 2.0 + 0.5 * torch.randn(K, device=dev, generator=gen)
    return logits


def graph_time(fn, iters: int = 20) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph (median of 5 spans); on CPU one
    eager call."""
    if DEVICE == "cpu":
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
    """Compile a chunk of (T, name) in a worker process (zero weights, real shapes): the
    kernels land in Triton's cache for the main process."""
    dev = torch.device(DEVICE)
    w13 = torch.zeros(E, 2 * INTER, H, device=dev, dtype=DT)
    w2 = torch.zeros(E, H, INTER, device=dev, dtype=DT)
    done = 0
    for T, name in chunk:
        try:
            x = torch.zeros(T, H, device=dev, dtype=DT)
            run_layer(name, x, torch.randn(T, E, device=dev), w13, w2)
            done += 1
        except Exception:  # noqa: BLE001 (reported when the main process times it)
            pass
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return done


def warm_up() -> None:
    work = [(T, n) for T in sorted({t for t, _ in TOKENS_A}) for n in names_for(T)]
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
    log(f"compiled {n}/{len(work)} in {JOBS} processes: {time.time() - t0:.0f} s")


def kernel_facts() -> dict:
    """Shared memory, registers and warps of every compiled persistent / grid kernel, as far
    as this Triton's JIT cache says (best effort: {} when its layout is another)."""
    out: dict[str, list] = {}
    for fn in (tm._gate_up_persist_kernel, tm._down_persist_kernel, tm._gate_up_kernel,
               tm._down_kernel):  # fmt: skip
        rows = []
        try:
            for cache in fn.device_caches.values():
                for key, kern in cache[0].items():
                    md = kern.metadata
                    rows.append({"shared": md.shared, "regs": getattr(kern, "n_regs", None),
                                 "spills": getattr(kern, "n_spills", None),
                                 "warps": md.num_warps, "stages": md.num_stages,
                                 "key": str(key)[-160:]})  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            rows.append({"error": f"{type(exc).__name__}: {str(exc)[:100]}"})
        out[fn.__name__ if hasattr(fn, "__name__") else str(fn)] = rows
    return out


def part_a(res: dict, save) -> None:
    from pdserve.bench.roofline import copy_bandwidth

    dev = torch.device(DEVICE)
    bw = copy_bandwidth(dev, 1 << 20 if SMOKE else None)
    res["copy_bandwidth"] = bw
    warm_up()
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(COPIES):
        w13 = (torch.randn(E, 2 * INTER, H, device=dev, generator=gen) * 0.02).to(DT)
        w2 = (torch.randn(E, H, INTER, device=dev, generator=gen) * 0.02).to(DT)
        layers.append((w13, w2))
    for T, regime in sorted(TOKENS_A, key=lambda r: (r[0] == 1, r[1] == "uniform")):
        x = torch.randn(T, H, device=dev, generator=gen).to(DT)
        logits = make_logits(T, regime, gen, dev)
        w0, ids0 = moe.route(logits, K, True)
        routed = int(torch.unique(ids0).numel())
        ref = moe.experts_loop(x, *layers[0], w0, ids0).float()
        floor = (routed * 3 * INTER * H * 2 + 2 * T * H * 2) / bw
        row: dict[str, Any] = {"tokens": T, "regime": regime, "routed_experts": routed,
                               "roofline_us": floor * 1e6, "candidates": {}}  # fmt: skip
        res["layers"].append(row)
        first = None
        for name in names_for(T):
            if time.time() - T0 > A_S:
                row["candidates"][name] = {"skipped": "time budget"}
                continue
            try:
                out = run_layer(name, x, logits, *layers[0])
                first = out.clone() if first is None else first
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                same = bool(torch.equal(out, first))
                dt = graph_time(
                    lambda n=name, x=x, lg=logits: [run_layer(n, x, lg, *wl) for wl in layers]
                ) / len(layers)
            except Exception as exc:  # noqa: BLE001 (a plan that does not build or run)
                row["candidates"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                log(f"  T {T} {regime} {name}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            row["candidates"][name] = {"us": dt * 1e6, "fraction": floor / dt, "rel_err": err,
                                       "ok": err <= 0.02, "same_bits": same}  # fmt: skip
            print(f"T {T:>3} {regime:<7} {routed:>3} exp floor {floor * 1e6:6.1f} us | "
                  f"{name:<11} {dt * 1e6:7.1f} us ({floor / dt:4.0%}) err {err:.1e} "
                  f"{'same' if same else 'diff'}{'' if err <= 0.02 else '  WRONG'}", flush=True)  # fmt: skip
        save()
    res["kernels"] = kernel_facts()
    res["order"], res["pick_ok"] = order(res)
    log(f"A done; order {res['order']}, pick_ok {res['pick_ok']}")
    save()


def order(res: dict) -> tuple[list[str], list[str]]:
    """The persistent plans for part B: by their time summed over the pooled regimes, those
    within 1 % of the committed uniform time first; and those that would be kept on part A
    alone (< 0.97 x the committed summed over the pooled regimes, <= 1.01 x uniform, the
    same bits in every regime)."""
    rows = {r["regime"]: r["candidates"] for r in res["layers"] if r["tokens"] == BIG}
    uni = rows.get("uniform", {})
    pools = [c for reg, c in rows.items() if reg != "uniform"]
    if any("us" not in c.get("committed", {}) for c in [uni, *pools]):
        return [], []
    cu = uni["committed"]["us"]
    names = [n for n in PLANS if PLANS[n][2] is not None
             and all(c.get(n, {}).get("ok") for c in [uni, *pools])]  # fmt: skip
    fine = {n: uni[n]["us"] <= 1.01 * cu for n in names}

    def pooled(n: str) -> float:
        return sum(c[n]["us"] for c in pools)

    names.sort(key=lambda n: (not fine[n], pooled(n)))
    ok = [n for n in names if fine[n] and pooled(n) < 0.97 * pooled("committed")
          and all(c[n]["same_bits"] for c in [uni, *pools])]  # fmt: skip
    return names, ok


# ------------------------------------------------------------------ B. the engine
def part_b(res: dict, save) -> None:
    from pdserve.bench import offline
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    top = __import__("argparse").ArgumentParser()
    offline.add_parser(top.add_subparsers(dest="cmd"))
    dt = "float32" if DEVICE == "cpu" else "bfloat16"
    bench_json = os.path.join(OUT_DIR, "bench.json")
    args = top.parse_args(["offline", "--model", MODEL, "--device", DEVICE, "--dtype", dt,
                           "--num-prompts", "1,64", "--max-tokens", TOKENS, "--repeats", "1",
                           "--ours-only", "--json", bench_json])  # fmt: skip
    t = time.time()
    llm = LLM(max_running_requests=64, **offline.llm_fields(args, [1, 64]))
    res["engine_start_s"] = round(time.time() - t, 1)
    log(f"engine up in {res['engine_start_s']:.0f} s")
    core = llm.engine
    cuda = core.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runner = core.executor.rank0.runner
    model = runner.model
    s = model.shapes
    layers = list(model.decoder_layers())
    stats = [la.moe.routing_stats for la in layers if la.moe is not None]
    res["counters_on"] = all(st is not None for st in stats)
    n_assign = 64 * s.top_k
    bound = next((r[0] for r in moe_table.DECODE if r[0] >= n_assign), moe_table.DECODE[-1][0])
    res["decode_row"] = bound
    g = runner.graphs
    keys = []
    if g is not None:
        keys = [k for k in g.keys() if k[0] == g.bucket(64)]  # noqa: SIM118 (a method)
        keys = [k for k in keys if k[1] is not None] or keys  # the bounded ones, if any
    res["keys"] = keys
    sets: dict[str, Any] = {"base": {k: (g._graphs[k], g._logits[k], g._greedy[k]) for k in keys}}
    tables: dict[str, tuple] = {"base": ()}
    engine_plans = (
        ENGINE_NAMES or (res.get("order") or [n for n in PLANS if PLANS[n][2]])[:ENGINE_PLANS]
    )
    for name in engine_plans:
        up, down, persist, half, dynamic = PLANS[name]
        tables[name] = ((bound, tuple(up), tuple(down), persist[0], persist[1], half, dynamic),)
    res["tables"] = tables
    save()

    def install(name: str) -> None:
        """Variant ``name``'s graphs swapped in; without graphs (CPU), its table."""
        moe_table.PERSISTENT = tables[name] if g is None else ()
        for k, (gr, lo, gd) in sets.get(name, {}).items():
            g._graphs[k], g._logits[k], g._greedy[k] = gr, lo, gd

    @torch.inference_mode()
    def capture(name: str) -> None:
        """The 64-row bucket's graphs with ``name``'s table in force, into a pool of their own."""
        pool = g._pool
        t = time.time()
        try:
            moe_table.PERSISTENT = tables[name]
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
                made[k] = (g._capture(k, stream), g._logits[k], g._greedy[k])
                sync()
            sets[name] = made
        finally:
            g._pool = pool
            moe_table.PERSISTENT = ()
            install("base")
        res.setdefault("capture_s", {})[name] = round(time.time() - t, 2)
        log(f"captured {name} in {time.time() - t:.1f} s")

    def drain() -> None:
        for rid in list(core._requests):
            core.abort_request(rid)
        while core.has_unfinished_requests():
            core.step()

    def part(name: str, need: float, fn) -> None:
        if left() < need:
            res["skipped"][name] = f"{left():.0f} s left, needs ~{need:.0f}"
            log(f"{name}: skipped ({left():.0f} s left)")
            save()
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 (a failed part must not lose the others)
            import traceback

            traceback.print_exc()
            res["errors"][name] = f"{type(exc).__name__}: {str(exc)[:400]}"
            try:
                drain()
            except Exception as exc2:  # noqa: BLE001
                res["errors"][name + " cleanup"] = f"{type(exc2).__name__}: {str(exc2)[:200]}"
        finally:
            install("base")
        save()

    prompts = offline.workload_prompts(llm, 64, None, None)

    def greedy() -> list[list[int]]:
        llm.reset_prefix_cache()
        p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, p)]

    base_ids: list[list[int]] = []
    res["greedy"] = {}
    for name in engine_plans:

        def p_variant(name: str = name) -> None:
            if not base_ids:
                install("base")
                base_ids.extend(greedy())
            if g is not None:
                capture(name)
            install(name)
            ids = greedy()
            same = sum(a == b for a, b in zip(ids, base_ids))
            res["greedy"][name] = {"same": same == len(ids), "same_outputs": same,
                                   "of": len(ids)}  # fmt: skip
            log(f"{name}: greedy outputs the same as today's: {same} of {len(ids)}")

        part(name, 24, p_variant)

    def ab_steps() -> None:
        """The all-decoding step of the 64 prompts, today's and each variant interleaved
        span by span (order reversed every other round), in one decode session."""
        names = ["base"] + [n for n in res["greedy"] if n in tables]
        total = ROUNDS * len(names) * SPAN + 2 * len(names) + 4
        params = SamplingParams(temperature=0, max_tokens=total + 8, ignore_eos=True)
        llm.reset_prefix_cache()
        ids = [f"ab-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
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
        for rnd in range(ROUNDS):
            for n in names if rnd % 2 == 0 else names[::-1]:
                install(n)
                t = time.perf_counter()
                for _ in range(SPAN):
                    core.step()
                sync()
                spans[n].append((time.perf_counter() - t) / SPAN * 1e3)
        ctx_end = statistics.mean(len(r.prompt_token_ids) + len(r.output_token_ids) for r in reqs)
        drain()
        out: dict[str, Any] = {}
        for n, v in spans.items():
            d = [a - b for a, b in zip(v, spans["base"])]
            out[n] = {"median_ms": statistics.median(v), "paired_diff_median_ms":
                      statistics.median(d), "lower_rounds": sum(x < 0 for x in d),
                      "spans_ms": [round(x, 4) for x in v]}  # fmt: skip
        res["ab"] = {"context_start": statistics.mean(len(p) for p in prompts),
                     "context_end": ctx_end, "rounds": ROUNDS, "span": SPAN, "variants": out}  # fmt: skip
        log("ab 64: " + "  ".join(f"{n} {v['median_ms']:.4f} ({v['paired_diff_median_ms']:+.4f},"
                                  f" {v['lower_rounds']}/{ROUNDS} lower)" for n, v in out.items()))  # fmt: skip

    if res["greedy"]:
        part("ab", 16, ab_steps)

    def best() -> str:
        ab = (res.get("ab") or {}).get("variants") or {}
        ok = [n for n in ab if n != "base" and res["greedy"].get(n, {}).get("same")
              and ab[n]["paired_diff_median_ms"] < 0]  # fmt: skip
        return min(ok, key=lambda n: ab[n]["paired_diff_median_ms"]) if ok else "base"

    def profile(label: str, steps: int = 8) -> None:
        """The 64 prompts' all-decoding step: step time and every kernel (us a layer)."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        params = SamplingParams(temperature=0, max_tokens=3 * steps + 16, ignore_eos=True)
        llm.reset_prefix_cache()
        ids = [f"prof-{label}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            core.add_request(rid, p, params)
        reqs = [core._requests[r] for r in ids]
        while any(len(r.output_token_ids) == 0 for r in reqs):
            core.step()
        core.step()
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync()
        step_ms = (time.perf_counter() - t) / steps * 1e3
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=acts) as prof:
            for _ in range(steps):
                core.step()
            sync()
        drain()
        per: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for a in prof.key_averages():
            if cuda and a.device_type == DeviceType.CUDA:
                per[a.key] += a.device_time_total
                count[a.key] += a.count
        n_l = len(layers)
        kernels = {k[:110]: {"us_per_step": round(per[k] / steps, 1),
                             "per_layer": round(count[k] / steps / n_l, 2),
                             "us_each": round(per[k] / max(count[k], 1), 2)}
                   for k in sorted(per, key=lambda k: -per[k])}  # fmt: skip
        res.setdefault("profile", {})[label] = {
            "step_ms": step_ms, "kernel_ms": sum(per.values()) / steps / 1e3,
            "kernels_per_step": sum(count.values()) / steps, "kernels": kernels,
        }  # fmt: skip
        log(
            f"profile {label}: step {step_ms:.3f} ms, {sum(count.values()) / steps:.0f} kernels/step"
        )
        for k, v in list(kernels.items())[:12]:
            print(f"    {v['us_per_step']:8.1f} us/step {v['per_layer']:5.2f}/layer "
                  f"{v['us_each']:7.2f} us  {k[:70]}", flush=True)  # fmt: skip

    def bench(label: str, variant: str) -> None:
        install(variant)
        for st in stats:
            if st is not None:
                st.zero_()
        offline._run(args, llm, [(64, "gsm8k")], [prompts], None, res["engine_start_s"])
        with open(bench_json) as f:
            bj = json.load(f)
        out = {k: bj.get(k) for k in ("model", "copy_bandwidth_bytes_per_s")}
        out["variant"] = variant
        out["results"] = [{k: r.get(k) for k in (
            "num_prompts", "ours_tok_s", "ours_decode_ms_per_step", "ours_step_ms_all_decoding",
            "steady_roofline_ms", "roofline_fraction", "run_roofline_fraction", "step_bytes")}
            for r in bj["results"]]  # fmt: skip
        res.setdefault("bench", {})[label] = out
        for r in out["results"]:
            log(f"bench {label} ({variant}): {r}")

    pick = best()
    res["pick"] = pick
    log(f"pick: {pick}")
    show = pick if pick != "base" else next(iter(res["greedy"]), "base")
    part("profile", 6, lambda: (install(show), profile(show)))
    if pick != "base":
        part("bench pick", 9, lambda: bench("pick", pick))
    part("bench base", 9, lambda: bench("base", "base"))
    save()
    llm.shutdown()


def main() -> None:
    os.makedirs(OUT_DIR, exist_ok=True)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEVICE.startswith("cuda") else "cpu",
        "time": time.time(), "budget_s": BUDGET_S, "shape": [H, INTER, E, K], "copies": COPIES,
        "plans": {n: [list(p[0]), list(p[1]), *p[2:]] for n, p in PLANS.items()},
        "committed_decode": [list(map(str, r)) for r in moe_table.DECODE], "layers": [],
        "errors": {}, "skipped": {},
    }  # fmt: skip
    path = os.path.join(OUT_DIR, "moegemm.json")

    def save() -> None:
        res["elapsed_s"] = round(time.time() - T0, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    if os.environ.get("SKIP_A") != "1":
        try:
            part_a(res, save)
        except Exception as exc:  # noqa: BLE001 (part B still runs, with PLANS' order)
            import traceback

            traceback.print_exc()
            res["errors"]["A"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    save()
    if os.environ.get("SKIP_B") != "1":
        try:
            part_b(res, save)
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            res["errors"]["B"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    save()
    log("done")


if __name__ == "__main__":
    main()
