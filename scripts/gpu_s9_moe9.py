"""MoE decode, session 9 (issue 27): the sparse layer's new kernel variants alone, then the
engine's steps with the picks against the committed path (one engine, variants swapped in
process).

With ``gpu_s8_moe8``'s functions (its part A's layer timing and checks, its part B's
greedy comparison, recapture and step profile):

A. One sparse layer alone (H 2048, I 768, 128 experts, top 8, bf16; 4 weight copies;
   CUDA graphs; every output checked against ``moe.experts_loop`` and compared with the
   committed path's bits):
   - 1 token (the few-token path): the committed tiles; the top-k sum inside the down
     kernel (``down_kind="assign_sum"``: the last of a token's k programs of a column block
     sums the k rows, in a fixed order: the same bits) at down tiles 64 and 32; gate/up
     tiles of 16 columns (twice the programs: 384 for 132 SMs instead of 192), 2 warps,
     other chunks and stages;
   - 64 tokens (uniform: ~125 experts; pool: 24 experts, as the random preset routes):
     the committed path; the alignment in one program per expert
     (``RouteAlignConfig.align_kind="experts"``, 4 / 2 / 8 warps) instead of one program;
     row blocks of 32 (an expert with 17-32 tokens read once, not twice), alone and with
     the per-expert alignment.
   Picks: a few-token config only if < 0.99 x the committed one; a route_align config / a
   grouped plan at 64 tokens if < 0.97 x the committed summed over both regimes.
B. One engine (``bench offline``'s flags, routing counters off): greedy tokens (1 prompt x
   32, 64 prompts x 8) and the kernel profile of a 1 x 200 and a 64 x 200 step with the
   committed path, then with the picks (graphs captured again; greedy compared), then the
   1 x 200 profile with the picks and PDL off (each kernel's own time); then, if seconds
   remain, ``bench offline --num-prompts 1,64`` with the picks.

``$OUT/moe9.json``, written after every item; each item only while ``BUDGET_S`` seconds
leave room. ``python3 scripts/gpu_s9_moe9.py --write-table JSON``: part A's picks into
``pdserve/model/moe_table.py``. CPU dry run: ``SMOKE=1 DEVICE=cpu
MODEL=random:tiny-qwen3-moe TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_s8_moe8 as m
import torch

from pdserve.model import pdl
from pdserve.model import triton_moe as tm

G = tm.GemvConfig
RA = tm.RouteAlignConfig
MC = tm.MoEConfig
m.OUT_DIR = os.environ.get("OUT", "gpu_s9_moe9")
if m.SMOKE:
    GEMV_BASE = G(16, 32, 4, 16, 16, 4, "dot", 2, "assign", 2)
    GEMVS = [
        GEMV_BASE._replace(down_kind="assign_sum"),
        GEMV_BASE._replace(down_kind="assign_sum", down_n=32),
        GEMV_BASE._replace(up_n=32, up_warps=2),
    ]
    RA_ALTS = [RA("split", 1, True, 1, 4, "experts"), RA("split", 1, True, 1, 2, "experts")]
    BM32 = tm.MoEPlan(MC(32, 16, 32, 4, 2), MC(32, 16, 16, 4, 2), None, True)
else:
    GEMV_BASE = G(*m.moe_table.GEMV) if m.moe_table.GEMV else G()
    GEMVS = [
        GEMV_BASE._replace(down_kind="assign_sum"),
        GEMV_BASE._replace(down_kind="assign_sum", down_n=32),
        GEMV_BASE._replace(up_n=16),
        GEMV_BASE._replace(up_n=16, down_kind="assign_sum"),
        GEMV_BASE._replace(up_n=16, up_warps=2),
        GEMV_BASE._replace(up_n=16, up_k=128, up_stages=4),
        GEMV_BASE._replace(up_n=16, up_k=512, up_stages=2),
        GEMV_BASE._replace(up_warps=2),
        GEMV_BASE._replace(up_k=128, up_stages=5),
        GEMV_BASE._replace(up_n=16, down_n=32, down_kind="assign_sum"),
        GEMV_BASE._replace(up_n=16, up_k=128, up_stages=4, down_kind="assign_sum"),
    ]
    RA_ALTS = [
        RA("split", 1, True, 1, 4, "experts"),
        RA("split", 1, True, 1, 2, "experts"),
        RA("split", 1, True, 1, 8, "experts"),
    ]
    BM32 = tm.MoEPlan(MC(32, 128, 64, 4, 3), MC(32, 128, 64, 4, 3), None, True)
m.TOKENS = [(1, "uniform"), (m.BIG, "uniform"), (m.BIG, "pool")]
_ra_name = m.ra_name


def ra_name(c: tm.RouteAlignConfig | None) -> str:
    """``gpu_s8_moe8.ra_name`` with the alignment's kind."""
    return _ra_name(c) + (" experts" if c is not None and c.align_kind == "experts" else "")


m.ra_name = ra_name


def candidates(T: int) -> list:
    C = m.Cand
    if T <= 2:
        out = [C("gemv", gemv=GEMV_BASE, label="committed")]
        return out + [C("gemv", gemv=g, label="gemv") for g in GEMVS]
    base = tm.pick_plan(T * m.K, m.E)
    out = [C("grouped", base, None, True, label="committed")]
    out += [C("grouped", base, ra, True, label="route_align") for ra in RA_ALTS]
    out.append(C("grouped", BM32, None, True, label="tiles"))
    out.append(C("grouped", BM32, RA_ALTS[0], True, label="combo"))
    return out


m.candidates = candidates
m.UP_ALTS = []


def _warm2(chunk: list) -> int:
    """``gpu_s8_moe8._warm`` with this module's candidates (a worker imports this module)."""
    return m._warm(chunk)


def warm_up2() -> None:
    work = [(T, i) for T in sorted({t for t, _ in m.TOKENS}) for i in range(len(candidates(T)))]
    if m.JOBS <= 1:
        return
    t0 = time.time()
    try:
        ctx = multiprocessing.get_context("spawn")
        jobs = min(m.JOBS, len(work))
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            n = sum(pool.map(_warm2, [work[i::jobs] for i in range(jobs)]))
    except Exception as exc:  # noqa: BLE001 (then the main process compiles as it times)
        m.log(f"warm-up failed: {type(exc).__name__}: {str(exc)[:200]}")
        return
    m.log(f"compiled {n}/{len(work)} candidates in {jobs} processes: {time.time() - t0:.0f} s")


m.warm_up = warm_up2


def picks(result: dict) -> dict:
    """Part A's picks (see the module doc) as ``gpu_s8_moe8.apply`` takes them."""
    t = {"PDL": True, "GEMV_MAX_TOKENS": m.COMMITTED["GEMV_MAX_TOKENS"],
         "GEMV": m.COMMITTED["GEMV"], "route_align_64": None, "decode": []}  # fmt: skip
    rows = result["layers"]
    one = next((r for r in rows if r["tokens"] == 1), None)
    if one:
        ok = m._ok(one)
        base = next((v for v in ok.values() if v["label"] == "committed"), None)
        gem = [v for v in ok.values() if v["label"] == "gemv"]
        if base and gem:
            best = min(gem, key=lambda v: v["us"])
            if best["us"] < 0.99 * base["us"]:
                t["GEMV"] = best["gemv"]
    big = [r for r in rows if r["tokens"] == m.BIG]
    score: dict[str, float] = {}
    info: dict[str, dict] = {}
    for r in big:
        for n, v in m._ok(r).items():
            score[n] = score.get(n, 0.0) + v["us"]
            info[n] = v
    full = [n for n in score if all(n in m._ok(r) for r in big)]
    base_n = next((n for n in full if info[n]["label"] == "committed"), None)
    if base_n:
        bar = 0.97 * score[base_n]
        ras = [n for n in full if info[n]["label"] == "route_align" and score[n] < bar]
        if ras:
            t["route_align_64"] = info[min(ras, key=lambda n: score[n])]["route_align"]
        tiles = [n for n in full if info[n]["label"] == "tiles" and score[n] < bar]
        if tiles:
            plan = info[min(tiles, key=lambda n: score[n])]["plan"]
            t["decode"].append([m.BIG * m.K, plan])
    return t


m.picks = picks


def part_b(result: dict, save) -> None:
    from pdserve.bench import offline
    from pdserve.engine.llm import LLM

    top = __import__("argparse").ArgumentParser()
    offline.add_parser(top.add_subparsers(dest="cmd"))
    dt = "float32" if m.DEVICE == "cpu" else "bfloat16"
    bench_json = os.path.join(m.OUT_DIR, "bench.json")
    args = top.parse_args(["offline", "--model", m.MODEL, "--device", m.DEVICE, "--dtype", dt,
                           "--num-prompts", "1,64", "--max-tokens", os.environ.get("TOKENS", "128"),
                           "--repeats", "1", "--ours-only", "--json", bench_json])  # fmt: skip
    counts = [1, 64]
    m.apply(None)
    t0 = time.time()
    llm = LLM(max_running_requests=64, **offline.llm_fields(args, counts))
    result["engine_start_s"] = time.time() - t0
    m.log(f"engine up in {result['engine_start_s']:.0f} s")
    b = result["engine"] = {"recapture_s": [], "profile": {}}
    layers = list(llm.engine.executor.rank0.runner.model.decoder_layers())
    sparse = [la for la in layers if la.moe is not None]
    stats = [la.moe.routing_stats for la in sparse]

    def counters(on: bool) -> None:
        for la, st in zip(sparse, stats):
            la.moe.routing_stats = st if on else None
            if st is not None:
                st.zero_()

    def profile(label: str, sizes=(1, 64)) -> None:
        b["profile"].setdefault(label, {})
        for rows_ in sizes:
            if m.left() < 5:
                b["profile"][label][str(rows_)] = {"skipped": f"{m.left():.0f} s left"}
                continue
            b["profile"][label][str(rows_)] = m.step_profile(llm, rows_, 200, len(layers))
            save()

    try:
        counters(False)
        b["recapture_s"].append(m.recapture(llm))
        prompts = offline.workload_prompts(llm, 64, None, None)
        off = m.greedy(llm, prompts)
        m.log("greedy (committed) done")
        profile("committed")
        if result["table"] != result["committed_table"] and m.left() > 12:
            m.apply(result["table"])
            b["recapture_s"].append(m.recapture(llm))
            on = m.greedy(llm, prompts)
            b["greedy_same"] = {str(n): sum(a == c for a, c in zip(off[n], on[n])) for n in off}
            b["greedy_of"] = {str(n): len(off[n]) for n in off}
            m.log(f"greedy with the picks: identical {b['greedy_same']} of {b['greedy_of']}")
            save()
            profile("picks")
        if m.left() > 10:
            os.environ["PDSERVE_TRITON_PDL"] = "0"
            pdl._options.cache_clear()
            b["recapture_s"].append(m.recapture(llm))
            profile("picks_pdl_off", (1,))
            os.environ.pop("PDSERVE_TRITON_PDL")
            pdl._options.cache_clear()
        if m.left() > 18:
            counters(True)
            b["recapture_s"].append(m.recapture(llm))
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
            m.log("bench done")
        else:
            b["bench"] = {"skipped": f"{m.left():.0f} s left"}
        save()
    finally:
        llm.shutdown()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-table":
        with open(sys.argv[2]) as f:
            result = json.load(f)
        print(f"wrote {m.write_table(result)}: {result['table']} (run ruff format on it)")
        return
    os.makedirs(m.OUT_DIR, exist_ok=True)
    committed = {"PDL": m.COMMITTED["PDL"], "GEMV_MAX_TOKENS": m.COMMITTED["GEMV_MAX_TOKENS"],
                 "GEMV": m.COMMITTED["GEMV"], "route_align_64": None, "decode": []}  # fmt: skip
    result: dict = {"device": torch.cuda.get_device_name() if m.DEVICE.startswith("cuda") else "cpu",
                    "time": time.time(), "shape": [m.H, m.INTER, m.E, m.K], "copies": m.COPIES,
                    "budget_s": m.BUDGET_S, "committed_table": committed, "layers": [],
                    "table": None}  # fmt: skip

    def save() -> None:
        result["elapsed_s"] = time.time() - m.T0
        with open(os.path.join(m.OUT_DIR, "moe9.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        if os.environ.get("SKIP_A") != "1":
            m.part_a(result, save)
    except Exception as exc:  # noqa: BLE001 (part B still runs with the committed path)
        m.log(f"part A failed: {type(exc).__name__}: {exc}")
        result["part_a_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if result["table"] is None:
        result["table"] = dict(committed)
    if os.environ.get("FORCE_TABLE"):  # (a CPU check of part B's switch)
        result["table"] = json.loads(os.environ["FORCE_TABLE"])
    save()
    if os.environ.get("SKIP_B") != "1":
        try:
            part_b(result, save)
        except Exception as exc:  # noqa: BLE001
            m.log(f"part B failed: {type(exc).__name__}: {exc}")
            result["part_b_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    save()
    m.log("done")


if __name__ == "__main__":
    main()
