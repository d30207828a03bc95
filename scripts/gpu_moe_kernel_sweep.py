"""Time the fused MoE kernels' tile configurations at one Qwen3-30B-A3B layer (H 2048, I 768,
128 experts, 8 per token, bf16) for several token counts, each call replayed in a CUDA
graph (20 configurations), against the bytes of the experts the batch routes to over the copy bandwidth of the
same run; the per-expert torch loop (eager) beside them. Prints a table and the best
configuration per token count (what ``triton_moe.pick_config`` should return), and writes
``moe_kernel_sweep.json`` under ``$OUT`` (default ``gpu_moe``). ~1 min on one H200.

Usage (repository root, GPU machine): ``python3 scripts/gpu_moe_kernel_sweep.py [T ...]``
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

from pdserve.bench.roofline import copy_bandwidth
from pdserve.model import moe, triton_moe

H, INTER, E, K = 2048, 768, 128, 8
TOKENS = [int(t) for t in sys.argv[1:]] or [1, 8, 64, 256, 2048, 16384]
CONFIGS = [
    triton_moe.MoEConfig(bm, bn, bk, 4, 3)
    for bm, bn, bk in itertools.product((16, 32, 64), (32, 64, 128), (64, 128))
] + [triton_moe.MoEConfig(64, 128, 64, 8, 3), triton_moe.MoEConfig(16, 64, 128, 4, 4)]


def graph_time(fn, iters: int = 20) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph (best of 3 batches)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def main() -> None:
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, device=dev, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, INTER, device=dev, generator=g) * 0.02).bfloat16()
    router = torch.randn(E, H, device=dev, generator=g).bfloat16() * 0.02
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    rows = []
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; one expert {per_expert / 1e6:.2f} MB")
    for T in TOKENS:
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        w, ids = moe.route(x @ router.T, K, True)
        routed = int(torch.unique(ids).numel())
        nbytes = routed * per_expert + 2 * T * H * 2
        floor = nbytes / bw
        results = []
        ref = moe.experts_loop(x, w13, w2, w, ids)
        for cfg in CONFIGS:
            try:
                out = triton_moe.fused_experts(x, w13, w2, w, ids, cfg)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                if err > 0.05:
                    print(f"T {T} {cfg}: wrong (rel err {err:.3f})")
                    continue
                args = (x, w13, w2, w, ids, cfg)
                dt = graph_time(lambda args=args: triton_moe.fused_experts(*args))
            except Exception as exc:  # noqa: BLE001 (a configuration that does not build)
                print(f"T {T} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            results.append((dt, cfg))
        results.sort(key=lambda r: r[0])
        if not results:
            print(f"T {T}: no configuration ran")
            continue
        default = triton_moe.pick_config(T * K, E)
        d_time = next((dt for dt, c in results if c == default), None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            moe.experts_loop(x, w13, w2, w, ids)
        torch.cuda.synchronize()
        loop = (time.perf_counter() - t0) / 3
        best_t, best_cfg = results[0]
        row = {
            "tokens": T,
            "routed_experts": routed,
            "bytes": nbytes,
            "roofline_us": floor * 1e6,
            "best_us": best_t * 1e6,
            "best_config": best_cfg._asdict(),
            "best_fraction": floor / best_t,
            "default_config": default._asdict(),
            "default_us": None if d_time is None else d_time * 1e6,
            "loop_us": loop * 1e6,
            "top5": [(t * 1e6, c._asdict()) for t, c in results[:5]],
        }
        rows.append(row)
        print(
            f"T {T:>6}: {routed:>3} experts, roofline {floor * 1e6:8.1f} us | best {best_t * 1e6:8.1f} us "
            f"({floor / best_t:4.0%}) {tuple(best_cfg)} | default {tuple(default)} "
            f"{'-' if d_time is None else f'{d_time * 1e6:.1f}'} us | loop {loop * 1e6:9.1f} us"
        )
    out_dir = os.environ.get("OUT", "gpu_moe")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "moe_kernel_sweep.json"), "w") as f:
        json.dump({"copy_bandwidth": bw, "shape": [H, INTER, E, K], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
