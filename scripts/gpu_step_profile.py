"""Where a decode step's time goes at issue 24's shapes: GPU kernels or the host.

For each shape ``ROWSxCONTEXT`` (default ``1x200 64x200 256x200 32x4096``) one engine
(``random:llama-3.1-8b`` bf16 on CUDA, graphs up to 256 rows, 24 GiB of KV) generates greedy
tokens for ROWS prompts of CONTEXT tokens and reports:

- ``step_ms``: the wall time of one decode step, (time of a run of ``T2`` tokens - time of
  ``T1``) / (T2 - T1), prefill cancelling out (the prompts are new to the prefix cache each
  run: the cache is reset before each);
- ``kernel_ms``: the GPU time of one decode step's kernels, from ``torch.profiler``
  (CUDA activity only) over the same two runs, per kernel name, differenced the same way;
- ``gap_ms`` = step_ms - kernel_ms: time the GPU waits on the host (launches, scheduling,
  sampling's host side, the plan), so a step with a large gap is host-bound;
- the 12 kernels that take most of a step, and the count of graph launches per step
  (``cudaGraphLaunch`` from the CPU activity; 0 means the step ran eager).

Run on the GPU machine from the repository root (``scripts/gpu_setup.sh`` sourced first for
the carried wheels): ``python3 scripts/gpu_step_profile.py [SHAPES...]``; writes
``$OUT/step_profile.json``. ``--device cpu`` (with ``random:tiny`` and toy shapes) checks
the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def _prompts(rows: int, ctx: int, salt: int) -> list[list[int]]:
    """ROWS token-id prompts of CTX tokens, new to the prefix cache for each salt."""
    return [
        [1 + (salt * 7919 + i * 104729 + j * 31) % 30000 for j in range(ctx)] for i in range(rows)
    ]


def _run(llm: LLM, rows: int, ctx: int, tokens: int, salt: int) -> float:
    """Seconds to generate ``tokens`` greedy tokens for each of ``rows`` fresh prompts."""
    llm.reset_prefix_cache()
    p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = _prompts(rows, ctx, salt)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, p)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _kernels(llm: LLM, rows: int, ctx: int, tokens: int, salt: int, cuda: bool):
    """Per-kernel GPU microseconds and the count of graph launches over one run."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _run(llm, rows, ctx, tokens, salt)
    per = collections.Counter()
    launches = 0
    for a in prof.key_averages():
        if a.key in ("cudaGraphLaunch", "cuGraphLaunch"):
            launches += a.count
        # kernels only (a CPU op's device time is its kernels' again)
        if cuda and a.device_type == DeviceType.CUDA:
            per[a.key] += a.device_time_total
    return per, launches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=["1x200", "64x200", "256x200", "32x4096"])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", type=float, default=24)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--t1", type=int, default=16, help="tokens of the short run")
    ap.add_argument("--t2", type=int, default=48, help="tokens of the long run")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    out = os.environ.get("OUT", ".")
    t0 = time.time()
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        kv_cache_memory=args.kv_cache_memory,
    )
    print(f"engine up in {time.time() - t0:.0f} s", flush=True)
    res = {}
    dt = args.t2 - args.t1
    for shape in args.shapes:
        rows, ctx = (int(x) for x in shape.split("x"))
        _run(llm, rows, ctx, 4, 0)  # warm: this shape's buckets, the allocator
        times = {}
        for i, t in enumerate((args.t1, args.t2, args.t1, args.t2)):
            times.setdefault(t, []).append(_run(llm, rows, ctx, t, i + 1))
        step_ms = (min(times[args.t2]) - min(times[args.t1])) / dt * 1e3
        k1, l1 = _kernels(llm, rows, ctx, args.t1, 11, cuda)
        k2, l2 = _kernels(llm, rows, ctx, args.t2, 12, cuda)
        diff = {k: (k2.get(k, 0) - k1.get(k, 0)) / dt / 1e3 for k in set(k1) | set(k2)}
        kernel_ms = sum(diff.values())
        top = sorted(diff.items(), key=lambda kv: -kv[1])[:12]
        r = {
            "rows": rows,
            "context": ctx,
            "step_ms": step_ms,
            "kernel_ms": kernel_ms,
            "gap_ms": step_ms - kernel_ms,
            "graph_launches_per_step": (l2 - l1) / dt,
            "top_kernels_ms": {k[:120]: v for k, v in top},
            "runs_s": times,
        }
        res[shape] = r
        print(
            f"== {shape}: step {step_ms:.3f} ms, kernels {kernel_ms:.3f} ms, gap {step_ms - kernel_ms:.3f} ms, "
            f"graph launches/step {r['graph_launches_per_step']:.2f}",
            flush=True,
        )
        for k, v in top:
            print(f"   {v:8.3f} ms  {k[:110]}", flush=True)
    with open(os.path.join(out, "step_profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
