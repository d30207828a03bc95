"""Where the decode step's host gap goes at long contexts (issue 24/26, session 7).

At 32 rows x 4,096 tokens the step profile (``gpu_step_profile.py``) shows ~1.5 ms a step
in which no kernel runs (``gap_ms``), against ~0.05 ms at 64 x 200. This script loads one
engine (bf16 ``random:llama-3.1-8b``, graphs on), profiles the shapes as
``gpu_step_profile.py`` does, then runs ``--steps`` more all-decoding steps of each shape
under ``cProfile`` and records the host functions by own time and by cumulative time (a
device read such as ``.tolist()`` or ``synchronize`` with a large own time is the host
waiting for the GPU; a Python function with a large own time is host work), and the wall
time of each ``EngineCore.step`` call. Writes ``$OUT/hostgap.json``.
Run on the GPU machine: ``python3 scripts/gpu_s7_hostgap.py [SHAPES...]``; ``--device cpu
--model random:tiny --dtype float32 8x300`` checks the script without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_step_profile import _prompts, profile_shapes

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def _host_profile(llm: LLM, rows: int, ctx: int, steps: int, cuda: bool) -> dict:
    import torch

    core = llm.engine
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=3 * steps + 8, ignore_eos=True)
    for i, p in enumerate(_prompts(rows, ctx, 7)):
        core.add_request(f"host-{i}", p, params)
    while any(len(r.output_token_ids) == 0 for r in core._requests.values()):
        core.step()
    for _ in range(3):
        core.step()
    if cuda:
        torch.cuda.synchronize()
    walls = []
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        walls.append((time.perf_counter() - t) * 1e3)
    pr.disable()
    if cuda:
        torch.cuda.synchronize()
    total_ms = (time.perf_counter() - t0) * 1e3
    for rid in list(core._requests):
        core.abort_request(rid)
    while core.has_unfinished_requests():
        core.step()
    st = pstats.Stats(pr)
    rows_out = []
    for (fn, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows_out.append(
            {
                "function": f"{os.path.relpath(fn) if fn.startswith('/') else fn}:{line}({name})",
                "calls_per_step": nc / steps,
                "own_ms_per_step": tt * 1e3 / steps,
                "cum_ms_per_step": ct * 1e3 / steps,
            }
        )
    by_own = sorted(rows_out, key=lambda r: -r["own_ms_per_step"])[:30]
    by_cum = sorted(rows_out, key=lambda r: -r["cum_ms_per_step"])[:40]
    return {
        "rows": rows,
        "context": ctx,
        "ms_per_step_under_cprofile": total_ms / steps,
        "step_call_ms_median": statistics.median(walls),
        "step_call_ms": walls,
        "by_own_time": by_own,
        "by_cumulative_time": by_cum,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=["32x4096", "64x200"])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", type=float, default=24)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    out = os.environ.get("OUT", ".")
    t0 = time.time()
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=256 if args.device != "cpu" else 64,
        kv_cache_memory=args.kv_cache_memory,
    )
    print(f"engine up in {time.time() - t0:.0f} s", flush=True)
    cuda = llm.engine.device.type == "cuda"
    res: dict = {"profile": {}, "host": {}}
    path = os.path.join(out, "hostgap.json")
    try:
        res["profile"] = profile_shapes(llm, args.shapes, args.steps, 8)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        for shape in args.shapes:
            rows, ctx = (int(x) for x in shape.split("x"))
            h = _host_profile(llm, rows, ctx, args.steps, cuda)
            res["host"][shape] = h
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
            print(
                f"== host {shape}: {h['ms_per_step_under_cprofile']:.3f} ms/step under cProfile, "
                f"step() call median {h['step_call_ms_median']:.3f} ms",
                flush=True,
            )
            for r in h["by_own_time"][:12]:
                print(
                    f"   own {r['own_ms_per_step']:7.3f} cum {r['cum_ms_per_step']:7.3f} "
                    f"x{r['calls_per_step']:6.1f} {r['function'][:90]}",
                    flush=True,
                )
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
