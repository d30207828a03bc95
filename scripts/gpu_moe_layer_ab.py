"""One Qwen3-30B-A3B sparse layer (H 2048, I 768, 128 experts, 8 per token, bf16) at decode
sizes on the GPU, each variant replayed in a CUDA graph: the router GEMM plus

- ``grouped``: ``route_align`` + ``grouped_experts`` (sort by expert, two grouped GEMMs, the
  top-k sum: 5 launches with the router; what main runs for up to 64 tokens), at
  :func:`triton_moe.pick_config`'s tiles and a few others at 64 tokens;
- ``gemv``: ``route_experts_gemv`` (routing inside the gate/up GEMV, weights and top-k sum
  inside the down GEMV, no sort: 3 launches with the router), at a few tile choices;

against the layer's roofline (bytes of the distinct experts routed to + router + x, over
the copy bandwidth of the same run). Prints a table and which path/tiles won per token
count (what ``PDSERVE_MOE_GEMV_MAX_TOKENS`` and ``GemvConfig``'s defaults should be);
writes ``$OUT/moe_layer_ab.json``. ~30-60 s (Triton compiles) on one H200.

Usage (repository root, GPU machine): ``python3 scripts/gpu_moe_layer_ab.py``;
``SMOKE=1 TRITON_INTERPRET=1`` checks the script on CPU at toy shapes (timings meaningless).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from pdserve.bench.roofline import copy_bandwidth
from pdserve.model import triton_moe as tm

SMOKE = os.environ.get("SMOKE") == "1"
H, INTER, E, K = (64, 48, 16, 4) if SMOKE else (2048, 768, 128, 8)
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter's bf16 dots are wrong
GEMV_TOKENS = [1, 2, 4, 8, 16]
GROUPED_TOKENS = [1, 2, 4, 8, 16, 64]
GEMV_CONFIGS = [
    tm.GemvConfig(),
    tm.GemvConfig(32, 256, 8, 8, 128, 8),
    tm.GemvConfig(8, 1024, 8, 2, 512, 8),
][: 1 if SMOKE else None]
# at 64 tokens: more columns per program, then bigger row blocks (an expert with more tokens
# than a block re-reads its weights once per block; padding rows cost compute, not bytes)
GROUPED_64 = [
    tm.MoEConfig(16, 32, 128, 4, 3),
    tm.MoEConfig(32, 64, 64, 4, 3),
    tm.MoEConfig(64, 64, 64, 4, 3),
]


def graph_time(fn, iters: int = 20) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph (best of 3 spans)."""
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
    dev = torch.device("cpu" if SMOKE else "cuda")
    t_start = time.time()
    bw = copy_bandwidth(dev, 1 << 20 if SMOKE else None)
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.empty(E, 2 * INTER, H, device=dev, dtype=DT)
    w2 = torch.empty(E, H, INTER, device=dev, dtype=DT)
    for e in range(E):
        w13[e] = torch.randn(2 * INTER, H, device=dev, generator=gen) * 0.02
        w2[e] = torch.randn(H, INTER, device=dev, generator=gen) * 0.02
    router = (torch.randn(E, H, device=dev, generator=gen) * 0.02).to(DT)
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; one expert {per_expert / 1e6:.2f} MB", flush=True)
    rows = []
    for T in sorted(set(GEMV_TOKENS) | set(GROUPED_TOKENS)):
        x = torch.randn(T, H, device=dev, generator=gen).to(DT)
        logits0 = F.linear(x, router)
        _, ids0 = torch.topk(torch.softmax(logits0.float(), -1), K, -1)
        routed = int(torch.unique(ids0).numel())
        nbytes = routed * per_expert + router.numel() * 2 + 2 * T * H * 2
        floor = nbytes / bw
        row: dict = {"tokens": T, "routed_experts": routed, "roofline_us": floor * 1e6}
        variants: list[tuple[str, object]] = []
        if T in GROUPED_TOKENS:
            cfgs = [tm.pick_config(T * K, E)] + (GROUPED_64 if T == 64 else [])
            variants += [("grouped", c) for c in cfgs]
        if T in GEMV_TOKENS:
            variants += [("gemv", c) for c in GEMV_CONFIGS]
        ref = None
        for kind, cfg in variants:
            name = f"{kind} {tuple(cfg)}"

            if kind == "grouped":

                def step(cfg=cfg, x=x):
                    logits = F.linear(x, router)
                    w, _, al = tm.route_align(logits, K, True, cfg.block_m)
                    return tm.grouped_experts(x, w13, w2, w, al, cfg)
            else:

                def step(cfg=cfg, x=x):
                    return tm.route_experts_gemv(F.linear(x, router), x, w13, w2, K, True, cfg)[0]

            try:
                out = step().float()
                if ref is None:
                    ref = out
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                dt = graph_time(step)
            except Exception as exc:  # noqa: BLE001 (a tile choice that does not build)
                print(f"T {T} {name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            row[name] = {"us": dt * 1e6, "fraction": floor / dt, "rel_err_vs_first": err}
            print(
                f"T {T:>3} {routed:>3} experts roofline {floor * 1e6:6.1f} us | {name:<40} "
                f"{dt * 1e6:7.1f} us ({floor / dt:4.0%}) err {err:.1e}"
                + ("  WRONG" if err > 0.02 else ""),
                flush=True,
            )
        timed = [(v["us"], k) for k, v in row.items() if isinstance(v, dict)]
        if timed:
            row["best"] = min(timed)[1]
            print(f"T {T:>3}: best {row['best']}", flush=True)
        rows.append(row)
        out_dir = os.environ.get("OUT", "gpu_moe")
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "moe_layer_ab.json"), "w") as f:  # after each row
            json.dump({"copy_bandwidth": bw, "shape": [H, INTER, E, K], "rows": rows}, f, indent=1)
    # the router GEMM inside add + RMSNorm (fused_ops.add_rms_norm_router) vs the two launches
    from pdserve.model import fused_ops

    norm_w = torch.ones(H, device=dev, dtype=DT)
    router_rows = []
    for T in (1, 64):
        h = torch.randn(T, H, device=dev, generator=gen).to(DT)
        d = torch.randn(T, H, device=dev, generator=gen).to(DT)

        def two(h=h, d=d):
            _, y = fused_ops.add_rms_norm(h, d, norm_w, 1e-6)
            return F.linear(y, router)

        def one(h=h, d=d):
            return fused_ops.add_rms_norm_router(h, d, norm_w, 1e-6, router)[2]

        err = ((one().float() - two().float()).abs().max() / two().float().abs().max()).item()
        t2, t1 = graph_time(two), graph_time(one)
        router_rows.append({"tokens": T, "two_us": t2 * 1e6, "fused_us": t1 * 1e6, "rel_err": err})
        print(
            f"T {T:>3} add+RMSNorm then router GEMM {t2 * 1e6:6.1f} us | in one kernel "
            f"{t1 * 1e6:6.1f} us (rel err {err:.1e})",
            flush=True,
        )
        with open(os.path.join(out_dir, "moe_layer_ab.json"), "w") as f:
            json.dump(
                {"copy_bandwidth": bw, "shape": [H, INTER, E, K], "rows": rows,
                 "router_in_norm": router_rows},
                f,
                indent=1,
            )  # fmt: skip
    print(f"layer A/B done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
