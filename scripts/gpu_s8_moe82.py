"""MoE decode, session 8, second H200 round (issue 27): the figures the first round's lost
JSON held, and each kernel's own time.

The first round (``scripts/gpu_s8_moe8.py``, its echoed summary in
docs/figures/h200_s8/moe8_output.txt) picked PDL on the grouped path's kernels and the
few-token path at 1 token (routing fused into the gate/up launch, the down projection per
assignment then the top-k sum: ``GemvConfig(32, 256, 4, 64, 128, 4, "dot", 3, "assign",
3)``). This round, with ``gpu_s8_moe8``'s functions:

A. the layer alone (CUDA graphs, 4 weight copies, outputs checked as there) at 1 token:
   the committed path, PDL, the picked few-token tiles and five neighbours (reduction
   chunk, warps, stages, down tile); at 64 tokens (uniform, pool): committed, PDL, PDL +
   route_align's alignment in 16 warps;
B. one engine (routing counters off, no bench): the kernel profile (every kernel: launches
   per layer, microseconds each) of a 1 x 200 and a 64 x 200 step with the committed path,
   with the first round's picks, then with the picks and PDL off in every Triton kernel
   (``PDSERVE_TRITON_PDL=0`` read again: with PDL a kernel's profiled time includes its
   wait for the one before, so only this profile gives each kernel's own time).

``$OUT/moe82.json``; each item only while ``BUDGET_S`` seconds leave room.
CPU dry run: ``SMOKE=1 DEVICE=cpu MODEL=random:tiny-qwen3-moe TRITON_INTERPRET=1``.
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

ROUND1 = {"PDL": True, "GEMV_MAX_TOKENS": 1,
          "GEMV": [32, 256, 4, 64, 128, 4, "dot", 3, "assign", 3],
          "route_align_64": None, "decode": []}  # fmt: skip
G = tm.GemvConfig
if not m.SMOKE:
    m.GEMVS = [
        G(*ROUND1["GEMV"]),
        G(32, 512, 4, 64, 128, 4, "dot", 3, "assign", 3),
        G(32, 256, 8, 64, 128, 4, "dot", 3, "assign", 3),
        G(32, 256, 4, 64, 256, 4, "dot", 3, "assign", 3),
        G(32, 256, 4, 64, 128, 4, "dot", 4, "assign", 4),
        G(32, 256, 4, 128, 128, 8, "dot", 3, "assign", 3),
    ]
    m.RA_ALTS = [tm.RouteAlignConfig("split", 1, True, 1, 16)]
m.UP_ALTS = []
m.OUT_DIR = os.environ.get("OUT", "gpu_s8_moe82")
# the baseline is the path before session 8's picks, whatever moe_table holds now
m.COMMITTED.update({"PDL": False, "GEMV_MAX_TOKENS": 0, "GEMV": None})


def _warm2(chunk: list) -> int:
    """``gpu_s8_moe8._warm`` with this module's candidate lists (a worker imports this
    module, which sets them)."""
    return m._warm(chunk)


def warm_up2() -> None:
    work = [(T, i) for T in sorted({t for t, _ in m.TOKENS}) for i in range(len(m.candidates(T)))]
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


def part_b2(result: dict, save) -> None:
    from pdserve.bench import offline
    from pdserve.engine.llm import LLM

    top = __import__("argparse").ArgumentParser()
    offline.add_parser(top.add_subparsers(dest="cmd"))
    dt = "float32" if m.DEVICE == "cpu" else "bfloat16"
    args = top.parse_args(["offline", "--model", m.MODEL, "--device", m.DEVICE, "--dtype", dt,
                           "--num-prompts", "1,64", "--ours-only"])  # fmt: skip
    m.apply(None)
    t0 = time.time()
    llm = LLM(max_running_requests=64, **offline.llm_fields(args, [1, 64]))
    result["engine_start_s"] = time.time() - t0
    m.log(f"engine up in {result['engine_start_s']:.0f} s")
    b = result["engine"] = {"recapture_s": [], "profile": {}}
    layers = list(llm.engine.executor.rank0.runner.model.decoder_layers())
    try:
        for label in ("committed", "picks", "picks_pdl_off"):
            if m.left() < 8:
                b["profile"][label] = {"skipped": f"{m.left():.0f} s left"}
                continue
            if label == "picks":
                m.apply(ROUND1)
                b["recapture_s"].append(m.recapture(llm))
            elif label == "picks_pdl_off":
                os.environ["PDSERVE_TRITON_PDL"] = "0"
                pdl._options.cache_clear()
                b["recapture_s"].append(m.recapture(llm))
            b["profile"][label] = {}
            for rows in (1, 64):
                if m.left() < 6:
                    b["profile"][label][str(rows)] = {"skipped": f"{m.left():.0f} s left"}
                    continue
                b["profile"][label][str(rows)] = m.step_profile(llm, rows, 200, len(layers))
                save()
    finally:
        llm.shutdown()


def main() -> None:
    os.makedirs(m.OUT_DIR, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if m.DEVICE.startswith("cuda") else "cpu",
                    "time": time.time(), "shape": [m.H, m.INTER, m.E, m.K], "copies": m.COPIES,
                    "budget_s": m.BUDGET_S, "round1_table": ROUND1, "layers": [], "table": None}  # fmt: skip

    def save() -> None:
        result["elapsed_s"] = time.time() - m.T0
        with open(os.path.join(m.OUT_DIR, "moe82.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        m.part_a(result, save)
    except Exception as exc:  # noqa: BLE001 (part B still runs)
        m.log(f"part A failed: {type(exc).__name__}: {exc}")
        result["part_a_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    save()
    try:
        part_b2(result, save)
    except Exception as exc:  # noqa: BLE001
        m.log(f"part B failed: {type(exc).__name__}: {exc}")
        result["part_b_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    save()
    m.log("done")


if __name__ == "__main__":
    main()
