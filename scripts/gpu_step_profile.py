"""Where a decode step's time goes at issue 24's shapes: GPU kernels or the host.

For each shape ``ROWSxCONTEXT`` (default ``1x200 64x200 256x200 32x4096``) one engine
(``random:llama-3.1-8b`` bf16 on CUDA, graphs up to 256 rows, 24 GiB of KV; ``--model``,
``--quantization fp8``, ``--kv-cache-dtype fp8_e4m3`` as the engine takes them) decodes greedy
tokens for ROWS prompts of CONTEXT tokens and reports:

- ``step_ms``: the wall time of one engine step once every request decodes (the prompts
  are prefilled first, outside the timing; new to the prefix cache: it is reset first), the
  median over three spans of ``--steps`` steps;
- ``kernel_ms``: the GPU time of one such step's kernels, from ``torch.profiler`` over
  ``--steps`` more steps, per kernel name;
- ``gap_ms`` = step_ms - kernel_ms: time the GPU waits on the host (launches, scheduling,
  sampling's host side, the plan), so a step with a large gap is host-bound;
- the 12 (``--top``) kernels that take most of a step with their launches per step, the
  kernels per step in all (``kernels_per_step``; per name: ``kernel_counts_per_step``),
  and the count of graph launches per step (``cudaGraphLaunch`` from the CPU activity; 0
  means the step ran eager).

Run on the GPU machine from the repository root (``scripts/gpu_setup.sh`` sourced first for
the carried wheels): ``python3 scripts/gpu_step_profile.py [SHAPES...]``; writes
``$OUT/step_profile.json`` (``--json``). ``--device cpu`` (with ``random:tiny`` and toy shapes) checks
the script itself without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
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


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _decode_steps(llm: LLM, rows: int, ctx: int, steps: int, salt: int, cuda: bool):
    """Seconds per step over three spans of ``steps`` engine steps in which all ``rows``
    requests decode (the prompts prefilled first, outside the timing), and the per-kernel GPU microseconds and
    graph launches of ``steps`` more such steps under ``torch.profiler``."""
    core = llm.engine
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=5 * steps + 8, ignore_eos=True)
    for i, p in enumerate(_prompts(rows, ctx, salt)):
        core.add_request(f"prof-{salt}-{i}", p, params)
    while any(len(r.output_token_ids) == 0 for r in core._requests.values()):
        core.step()  # prefill (and maybe a few decode rows) until every request decodes
    core.step()
    _sync(cuda)
    times = []
    for _ in range(3):  # three spans of ``steps`` steps, unsynchronized inside (overlap on)
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        _sync(cuda)
        times.append((time.perf_counter() - t0) / steps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            core.step()
        _sync(cuda)
    for rid in list(core._requests):
        core.abort_request(rid)
    while core.has_unfinished_requests():
        core.step()
    per: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    launches = 0
    for a in prof.key_averages():
        if a.key in ("cudaGraphLaunch", "cuGraphLaunch"):
            launches += a.count
        # kernels only (a CPU op's device time is its kernels' again)
        if cuda and a.device_type == DeviceType.CUDA:
            per[a.key] += a.device_time_total
            count[a.key] += a.count
    return times, per, launches, count


def profile_shapes(llm: LLM, shapes: list[str], steps: int = 24, top_n: int = 12) -> dict:
    """The profile of each shape ``"ROWSxCONTEXT"`` on ``llm``'s engine (see the module
    doc), printed as it goes; returns ``{shape: result}``. Also called by other scripts
    with the engine they built (``scripts/gpu_fp8_offline.py``: after bench offline's rows,
    one model load for both)."""
    cuda = llm.engine.device.type == "cuda"
    res = {}
    n = steps
    for shape in shapes:
        rows, ctx = (int(x) for x in shape.split("x"))
        _decode_steps(llm, rows, ctx, 4, 0, cuda)  # warm: this shape's buckets, the allocator
        times, per, launches, count = _decode_steps(llm, rows, ctx, n, 1, cuda)
        step_ms = statistics.median(times) * 1e3
        kernel_ms = sum(per.values()) / n / 1e3
        top = sorted(per.items(), key=lambda kv: -kv[1])[:top_n]
        r = {
            "model": llm.engine.config.model.model,
            "quantization": llm.engine.config.model.quantization,
            "kv_dtype": str(llm.engine.executor.rank0.storage.kv.dtype),
            "rows": rows,
            "context": ctx,
            "step_ms": step_ms,
            "step_ms_spans": [t * 1e3 for t in times],
            "kernel_ms": kernel_ms,
            "gap_ms": step_ms - kernel_ms,
            "graph_launches_per_step": launches / n,
            "top_kernels_ms": {k[:120]: v / n / 1e3 for k, v in top},
            "kernels_per_step": sum(count.values()) / n,
            "kernel_counts_per_step": {k[:120]: c / n for k, c in count.most_common()},
        }
        res[shape] = r
        print(
            f"== {shape}: step {step_ms:.3f} ms, kernels "
            f"{kernel_ms:.3f} ms, gap {step_ms - kernel_ms:.3f} ms, graph launches/step "
            f"{r['graph_launches_per_step']:.2f}, kernels/step {r['kernels_per_step']:.0f}",
            flush=True,
        )
        for k, v in top:
            print(f"   {v / n / 1e3:8.3f} ms {count[k] / n:6.1f}x  {k[:100]}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=["1x200", "64x200", "256x200", "32x4096"])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--quantization", default=None, help="fp8 / fp8_block (the engine's flag); unset: none"
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8_e4m3")
    ap.add_argument("--kv-cache-memory", type=float, default=24)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed, then profiled")
    ap.add_argument("--top", type=int, default=12, help="kernels listed, by GPU time")
    ap.add_argument("--json", default="step_profile.json", help="file name under $OUT")
    args = ap.parse_args()
    out = os.environ.get("OUT", ".")
    t0 = time.time()
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        kv_cache_memory=args.kv_cache_memory,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    print(
        f"engine up in {time.time() - t0:.0f} s ({args.model}, quantization "
        f"{args.quantization or '-'}, KV {llm.engine.executor.rank0.storage.kv.dtype})",
        flush=True,
    )
    try:
        res = profile_shapes(llm, args.shapes, args.steps, args.top)
    finally:
        llm.shutdown()
    with open(os.path.join(out, args.json), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
