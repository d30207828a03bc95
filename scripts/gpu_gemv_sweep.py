"""GEMV sweep (issue 10): the Triton GEMV's configurations against cuBLAS (``F.linear``) for the
linear shapes of Llama-3.1-8B at the decode graphs' row counts (buckets 1, 2, 4, 8, 16, 32, 48,
64), bf16, fp32 accumulation, on the GPU.

Each (shape, M, configuration) is timed as a CUDA graph of back-to-back launches over copies
of the weight that together exceed 256 MB (the H200's L2 is 50 MB, so every launch reads its
weight from HBM as the decode graph's layers do), median of 5 replays; cuBLAS the same way.
A configuration counts only if its result is within twice cuBLAS's error of the fp32
reference. A configuration wins a (shape, M) when it is >= 3 % faster than cuBLAS there.

Run on the GPU machine from the repo root:
``python3 scripts/gpu_gemv_sweep.py [--ms 32,48,64] [--shapes qkv,o_proj] [--merge OLD.json]
[--jobs 12] [--write]``. ``--ms``/``--shapes`` measure a subset; ``--merge`` keeps an earlier
sweep's results for the (shape, M) pairs not measured now, and the table is built from all of
them; ``--jobs`` compiles the kernels in that many processes first (Triton's disk cache).
Prints the table, writes ``$OUT/gemv_sweep.json`` (every timing) and ``$OUT/gemv_table.py``;
with ``--write`` also ``pdserve/model/gemv_table.py`` (then ``ruff format`` it: ``make lint``
checks the format).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import time

import torch
import torch.nn.functional as F
import triton

from pdserve.model import triton_gemv

SHAPES = {  # name: (N, K) of Llama-3.1-8B at TP 1
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
MS = (1, 2, 4, 8, 16, 32, 48, 64)
ROWS = [  # (BLOCK_N, BLOCK_K, num_warps): 4-8 16-byte loads a thread per iteration
    ("rows", bn, bk, w, 1)
    for bn, bk, w in (
        (2, 2048, 4),
        (4, 1024, 4),
        (4, 2048, 8),
        (8, 512, 4),
        (8, 1024, 4),
        (8, 1024, 8),
        (16, 512, 4),
        (16, 1024, 8),
    )
]
DOTS = [  # M = 2..16 (BLOCK_M 16)
    ("dot", bn, bk, w, st)
    for bn, bk, w, st in (
        (16, 128, 4, 6),
        (16, 256, 4, 4),
        (16, 512, 4, 3),
        (32, 256, 4, 4),
        (64, 128, 4, 4),
        (64, 256, 4, 3),
        (128, 128, 4, 4),
    )
]
# M = 17..64 (BLOCK_M 32 or 64): x is re-read from L2 by every program, BLOCK_M * K per
# BLOCK_N * K of weight, so wide BLOCK_N pays at 64 rows; split-K gives those wide tiles
# enough programs for 132 SMs. Shared memory: num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 B.
WIDE = [
    (kind, bn, bk, w, st)
    for kind, bn, bk, w, st in (
        ("dot", 16, 256, 4, 4),
        ("dot", 32, 128, 4, 5),
        ("dot", 64, 64, 4, 6),
        ("dot", 64, 128, 4, 4),
        ("dot", 128, 64, 4, 5),
        ("dot", 128, 128, 8, 3),
        ("dot", 256, 64, 8, 4),
        ("splitk2", 64, 128, 4, 4),
        ("splitk2", 128, 64, 4, 5),
        ("splitk2", 128, 128, 8, 3),
        ("splitk4", 64, 128, 4, 4),
        ("splitk4", 128, 64, 4, 5),
        ("splitk8", 128, 64, 4, 4),
    )
]
DEVICE = "cuda"
MARGIN = 0.97
L2_DEFEAT = 256 << 20
REPS = 8


def configs_for(m: int) -> list[tuple]:
    """The configurations tried at ``m`` rows."""
    if m == 1:
        return ROWS + DOTS
    return DOTS if m <= 16 else WIDE


def time_us(launch, n_copies: int) -> float:
    """Median µs per launch of ``launch(i)`` (i = weight copy) replayed in a CUDA graph."""
    for i in range(n_copies):
        launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            for i in range(n_copies):
                launch(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (REPS * n_copies))
    del g
    return statistics.median(times)


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def _compile(job: tuple[list[tuple[int, int, int]], list[tuple]]) -> int:
    """Run each configuration once at each (M, N, K): fills Triton's disk cache (a worker)."""
    pairs, cfgs = job
    n = 0
    for m, N, K in pairs:
        x = torch.randn(m, K, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16)
        for cfg in cfgs:
            try:
                triton_gemv.gemv(x, w, None, cfg)
                n += 1
            except Exception:  # noqa: BLE001 (reported by the timing pass)
                pass
    torch.cuda.synchronize()
    return n


def precompile(shapes: dict, ms: list[int], jobs: int) -> None:
    """Compile every (configuration, row tile) in ``jobs`` processes at once."""
    by_tile: dict[tuple, list[tuple[int, int, int]]] = {}
    for m in ms:
        for N, K in shapes.values():
            for cfg in configs_for(m):
                # the compiled kernel depends on the row tile and K/N divisibility only
                key = (cfg, m == 1, triton_gemv.block_m(m) if m > 1 else 1)
                by_tile.setdefault(key, [(m, N, K)])
    job_list = [(pairs, [cfg]) for (cfg, _, _), pairs in by_tile.items()]
    ctx = multiprocessing.get_context("spawn")
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        done = sum(pool.map(_compile, job_list))
    print(f"precompiled {done} of {len(job_list)} in {time.time() - t0:.0f} s", flush=True)


def build_table(results: list[dict]) -> dict[tuple[str, int, int], list[tuple[int, tuple | None]]]:
    """``(dtype, N, K) -> [(m, config or None), ...]`` from the timings: the fastest correct
    configuration where it beats cuBLAS by >= 3 %, else None; trailing Nones dropped."""
    table: dict[tuple[str, int, int], list[tuple[int, tuple | None]]] = {}
    for name, (N, K) in SHAPES.items():
        rows: list[tuple[int, tuple | None]] = []
        for m in sorted({r["M"] for r in results if r["shape"] == name}):
            here = [r for r in results if r["shape"] == name and r["M"] == m]
            cub = [r["us"] for r in here if r["config"] == "cublas"]
            ours = [r for r in here if r["config"] != "cublas" and r["ok"]]
            if not cub:
                continue
            best = min(ours, key=lambda r: r["us"], default=None)
            win = best is not None and best["us"] < MARGIN * cub[0]
            rows.append((m, tuple(best["config"]) if win and best else None))
        while rows and rows[-1][1] is None:
            rows.pop()
        if rows:
            table[("bfloat16", N, K)] = rows
    return table


def measure(shapes: dict, ms: list[int]) -> list[dict]:
    torch.manual_seed(0)
    dt = torch.bfloat16
    t_start = time.time()
    results: list[dict] = []
    for name, (N, K) in shapes.items():
        nbytes = N * K * 2
        copies = max(1, -(-L2_DEFEAT // nbytes))
        ws = [torch.randn(N, K, device=DEVICE, dtype=dt) * 0.02 for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K, device=DEVICE, dtype=dt)
            ref = x.float() @ ws[0].float().T
            cub = F.linear(x, ws[0])
            cub_err = (cub.float() - ref).abs().max().item()
            cub_us = time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]), copies)
            best: tuple[float, tuple | None] = (cub_us, None)
            for cfg in configs_for(M):
                try:
                    got = triton_gemv.gemv(x, ws[0], None, cfg)
                    err = (got.float() - ref).abs().max().item()
                    us = time_us(
                        lambda i, x=x, ws=ws, cfg=cfg: triton_gemv.gemv(x, ws[i], None, cfg),
                        copies,
                    )
                except Exception as exc:  # noqa: BLE001 (a tile that does not compile here: skipped)
                    print(f"  {name} M={M} {cfg}: failed {str(exc)[:80]}", flush=True)
                    continue
                ok = err <= 2 * cub_err + 1e-3
                row = dict(shape=name, N=N, K=K, M=M, config=cfg, us=us, err=err, ok=ok)
                results.append(dict(row, gbps=nbytes / us / 1e3))
                if ok and us < best[0]:
                    best = (us, cfg)
            results.append(
                dict(
                    shape=name,
                    N=N,
                    K=K,
                    M=M,
                    config="cublas",
                    us=cub_us,
                    err=cub_err,
                    ok=True,
                    gbps=nbytes / cub_us / 1e3,
                )
            )
            win = best[1] is not None and best[0] < MARGIN * cub_us
            print(
                f"{name:8s} N={N:6d} K={K:5d} M={M:2d}: cuBLAS {cub_us:7.1f} us "
                f"({nbytes / cub_us / 1e3:5.0f} GB/s)  best triton {best[0]:7.1f} us "
                f"({nbytes / best[0] / 1e3:5.0f} GB/s) {best[1]}  -> "
                f"{'triton' if win else 'cuBLAS'}  [{time.time() - t_start:.0f} s]",
                flush=True,
            )
        ws.clear()
        torch.cuda.empty_cache()
    return results


def table_source(table: dict) -> str:
    body = "".join(
        f"    {key!r}: (\n" + "".join(f"        ({m}, {cfg!r}),\n" for m, cfg in rows) + "    ),\n"
        for key, rows in table.items()
    )
    return (
        '"""Where the Triton GEMV (``triton_gemv``) beat cuBLAS, measured: ``(dtype, N, K) -> '
        "((m, config\nor None), ...)``; config ``(kernel, BLOCK_N, BLOCK_K, num_warps, "
        "num_stages)``, None = cuBLAS.\n\n"
        f"Generated by ``scripts/gpu_gemv_sweep.py --write`` on {device_name()} "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}, torch {torch.__version__},\n"
        f"Triton {triton.__version__}; every timing in docs/figures/h200_gemv_sweep.json); do "
        "not edit by hand.\n"
        '"""\n\nfrom __future__ import annotations\n\n'
        "TABLE: dict[tuple[str, int, int], tuple[tuple[int, tuple[str, int, int, int, int] | "
        "None], ...]] = {\n" + body + "}\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="row counts to measure")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="shapes to measure")
    ap.add_argument("--merge", default=None, help="an earlier gemv_sweep.json to keep")
    ap.add_argument("--jobs", type=int, default=0, help="compile in this many processes first")
    ap.add_argument("--write", action="store_true", help="also write pdserve/model/gemv_table.py")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    if args.jobs > 1:
        precompile(shapes, ms, args.jobs)
    results = measure(shapes, ms)
    if args.merge:
        with open(args.merge) as f:
            old = json.load(f)["results"]
        now = {(r["shape"], r["M"]) for r in results}
        results = [r for r in old if (r["shape"], r["M"]) not in now] + results
        results.sort(key=lambda r: (list(SHAPES).index(r["shape"]), r["M"]))
    table = build_table(results)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "gemv_sweep.json"), "w") as f:
        json.dump(
            dict(
                device=device_name(),
                results=results,
                table={f"{k[0]}:{k[1]}x{k[2]}": v for k, v in table.items()},
            ),
            f,
            indent=1,
        )
    source = table_source(table)
    with open(os.path.join(out_dir, "gemv_table.py"), "w") as f:
        f.write(source)
    if args.write:
        with open(os.path.join(os.path.dirname(triton_gemv.__file__), "gemv_table.py"), "w") as f:
            f.write(source)
    print("TABLE", table)


if __name__ == "__main__":
    main()
