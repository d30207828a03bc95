"""GEMV sweep (issue 10): the Triton GEMV's configurations against cuBLAS (``F.linear``) for the
linear shapes of Llama-3.1-8B (and the attention linears of Qwen3-30B-A3B: ``moe_qkv``,
``moe_o_proj``) at the decode graphs' row counts (buckets 1, 2, 4, 8, 16, 32, 48,
64), bf16, fp32 accumulation, on the GPU.

Each (shape, M, configuration) is timed as a CUDA graph of back-to-back launches over copies
of the weight that together exceed 256 MB (the H200's L2 is 50 MB, so every launch reads its
weight from HBM as the decode graph's layers do), median of 5 replays; cuBLAS the same way.
A configuration counts only if its result is within twice cuBLAS's error of the fp32
reference. A configuration wins a (shape, M) when it is >= 3 % faster than cuBLAS there.

Configurations: ``rows`` (M = 1), ``dot`` (M <= 16), ``dot``/``splitkS`` and the TMA-fed
``tma*`` kinds (M = 17..64; ``model/triton_gemv_tma.py``). Before timing, each configuration
runs in a process of its own (``--probe-jobs`` at once, 8 by default): one that fails to
compile on this machine (a Triton version without warp specialization on Hopper, a tile past
shared memory), crashes, hangs past ``PROBE_TIMEOUT`` or computes wrong is skipped with its
reason printed and listed under ``skipped`` in the json, instead of aborting the sweep.

Run on the GPU machine from the repo root:
``python3 scripts/gpu_gemv_sweep.py [--ms 32,48,64] [--shapes qkv,o_proj] [--merge OLD.json]
[--jobs 12] [--probe-jobs 8] [--write]``. ``--ms``/``--shapes`` measure a subset;
``--merge`` keeps an earlier sweep's results for the (shape, M) pairs not measured now, and
the table is built from all of them; ``--jobs`` compiles the kernels in that many processes
first (Triton's disk cache).
The TMA kinds' first measurement (issue 10; ~31 configurations at 4 shapes x 3 row counts):
``timeout 580 python3 scripts/gpu_gemv_sweep.py --ms 32,48,64 --shapes qkv,o_proj,down,gate_up
--merge docs/figures/h200_gemv_sweep.json --write``, then copy ``$OUT/gemv_sweep.json`` over
``docs/figures/h200_gemv_sweep.json`` and ``ruff format`` the table.
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
import subprocess
import sys
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
    # the attention linears of Qwen3-30B-A3B (hidden 2048, 32 query and 4 KV heads of 128)
    "moe_qkv": (5120, 2048),
    "moe_o_proj": (2048, 4096),
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
# M = 17..64, the TMA-fed kinds (model/triton_gemv_tma.py): the weight in [BLOCK_N, BLOCK_K]
# boxes, x in [BLOCK_M, BLOCK_K] boxes, num_stages of both in shared memory (bf16, BLOCK_M
# 64: 96-197 KB of the H200's 227 KB, as built for sm_90 by scripts/sm90_build_check.py);
# the persistent grid is min(132, work). "tma": a tile a unit (qkv 48 tiles of 128,
# o_proj/down 32, gate_up 224); "tma_sk4": o_proj/down 128 units; "tma_stream": equal weight
# bytes a program whatever the tile count; "_ws": warp-specialized (64-wide tiles: the ones
# Triton 3.9's Hopper pass splits).
TMA = [
    ("tma", 128, 128, 4, 3),
    ("tma", 64, 128, 4, 4),
    ("tma", 128, 64, 4, 5),
    ("tma", 256, 64, 8, 4),
    ("tma_stream", 128, 128, 4, 3),
    ("tma_stream", 128, 64, 4, 5),
    ("tma_stream", 64, 128, 4, 4),
    ("tma_stream", 256, 64, 8, 3),
    ("tma_stream", 128, 128, 8, 4),
    ("tma_stream", 64, 64, 4, 6),  # 64-wide tiles: smaller partial slots, more x from L2
    ("tma_stream", 64, 256, 4, 3),
    ("tma_sk2", 128, 128, 4, 3),
    ("tma_sk4", 128, 64, 4, 5),
    ("tma_sk4", 64, 128, 4, 4),
    ("tma_ws", 64, 128, 4, 4),
    ("tma_ws", 64, 64, 4, 6),
    ("tma_ws_sk2", 64, 128, 4, 4),
    ("tma_ws_sk4", 64, 64, 4, 6),
]
DEVICE = "cuda"
MARGIN = 0.97
L2_DEFEAT = 256 << 20
REPS = 8
PROBE_TIMEOUT = 150  # s for one configuration's probe process (its compiles and runs)


def configs_for(m: int) -> list[tuple]:
    """The configurations tried at ``m`` rows."""
    if m == 1:
        return ROWS + DOTS
    return DOTS if m <= 16 else WIDE + TMA


def parse_shape(name: str) -> tuple[int, int]:
    """``(N, K)`` of a ``SHAPES`` name or of ``NxK`` (e.g. ``4096x14336``)."""
    if name in SHAPES:
        return SHAPES[name]
    n, sep, k = name.partition("x")
    if not (sep and n.isdigit() and k.isdigit()):
        raise SystemExit(f"unknown shape {name!r}: one of {', '.join(SHAPES)} or NxK")
    return int(n), int(k)


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


def precompile(shapes: dict, ms: list[int], jobs: int, skip: dict[tuple, str]) -> None:
    """Compile every (configuration not in ``skip``, row tile) in ``jobs`` processes at once."""
    by_tile: dict[tuple, list[tuple[int, int, int]]] = {}
    for m in ms:
        for N, K in shapes.values():
            for cfg in configs_for(m):
                if cfg in skip:
                    continue
                # the compiled kernel depends on the row tile and K/N divisibility only
                key = (cfg, m == 1, triton_gemv.block_m(m) if m > 1 else 1)
                by_tile.setdefault(key, [(m, N, K)])
    job_list = [(pairs, [cfg]) for (cfg, _, _), pairs in by_tile.items()]
    ctx = multiprocessing.get_context("spawn")
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        done = sum(pool.map(_compile, job_list))
    print(f"precompiled {done} of {len(job_list)} in {time.time() - t0:.0f} s", flush=True)


def probe_one(cfg: tuple, shapes: dict, ms: list[int]) -> None:
    """In a probe process: run ``cfg`` once at every (shape, M) and check it as
    :func:`measure` does; prints ``PROBE OK``, or ``PROBE FAILED: <where>: <why>`` and exits 1
    (a crash or a hang ends the process: the parent reports it)."""
    torch.manual_seed(0)
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter: fp32
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=DEVICE, dtype=dt) * 0.02
        for M in ms:
            where = f"{name} M={M}"
            x = torch.randn(M, K, device=DEVICE, dtype=dt)
            ref = x.double() @ w.double().T
            cub_err = (F.linear(x, w).double() - ref).abs().max().item()
            try:
                got = triton_gemv.gemv(x, w, None, cfg)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 (the reason is the probe's answer)
                first = " ".join(str(exc).split())[:300]
                print(f"PROBE FAILED: {where}: {type(exc).__name__}: {first}", flush=True)
                raise SystemExit(1) from None
            err = (got.double() - ref).abs().max().item()
            if not err <= 2 * cub_err + 1e-3:
                print(f"PROBE FAILED: {where}: max error {err:.3g} (cuBLAS {cub_err:.3g})")
                raise SystemExit(1)
    print("PROBE OK", flush=True)


def probe(
    shapes: dict, ms: list[int], jobs: int, cfgs: list[tuple] | None = None
) -> dict[tuple, str]:
    """Each configuration (``cfgs``, default every one this sweep tries) run in its own
    process at the row counts that try it (``jobs`` at once, each at most ``PROBE_TIMEOUT``
    s): ``{config: reason}`` of those that did not compile, crashed (an illegal address would
    poison this process's CUDA context), hung or computed wrong; the sweep skips them. Their
    compiles land in Triton's disk cache for the timing pass."""
    if cfgs is None:
        cfgs = list(dict.fromkeys(cfg for m in ms for cfg in configs_for(m)))
    base = [sys.executable, os.path.abspath(__file__), "--device", DEVICE]
    base += ["--shapes", ",".join(f"{N}x{K}" for N, K in shapes.values())]

    def run(cfg: tuple) -> tuple[tuple, str | None]:
        rows = [m for m in ms if cfg in configs_for(m)] or ms
        try:
            done = subprocess.run(
                [*base, "--ms", ",".join(map(str, rows)), "--probe", json.dumps(cfg)],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return cfg, f"no answer within {PROBE_TIMEOUT} s (killed)"
        if done.returncode == 0 and "PROBE OK" in done.stdout:
            return cfg, None
        lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
        why = next((ln for ln in lines if ln.startswith("PROBE FAILED")), None)
        return cfg, f"exit {done.returncode}: {why or (lines[-1][:300] if lines else 'no output')}"

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        answers = list(pool.map(run, cfgs))
    failed = {cfg: why for cfg, why in answers if why is not None}
    for cfg, why in failed.items():
        print(f"  skipped {cfg}: {why}", flush=True)
    print(
        f"probed {len(cfgs)} configurations in {time.time() - t0:.0f} s: {len(failed)} skipped",
        flush=True,
    )
    return failed


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


def measure(shapes: dict, ms: list[int], skip: dict[tuple, str] | None = None) -> list[dict]:
    """Time cuBLAS and every configuration not in ``skip`` at each (shape, M)."""
    skip = skip or {}
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
                if cfg in skip:
                    continue
                try:
                    got = triton_gemv.gemv(x, ws[0], None, cfg)
                    err = (got.double() - ref).abs().max().item()
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
    ap.add_argument(
        "--probe-jobs",
        type=int,
        default=8,
        help="first run each configuration in its own process, this many at once, and skip "
        "those that fail to compile, crash, hang or compute wrong (0: no probe)",
    )
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # a probe process's config
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for --probe (the tests)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    ms = [int(m) for m in args.ms.split(",")]
    shapes = {s: parse_shape(s) for s in args.shapes.split(",")}
    if args.probe is not None:
        probe_one(tuple(json.loads(args.probe)), shapes, ms)
        return
    if any(s not in SHAPES for s in shapes):
        raise SystemExit("NxK shapes are for --probe; the sweep measures named shapes")
    skip = probe(shapes, ms, args.probe_jobs) if args.probe_jobs > 0 else {}
    if args.jobs > 1:
        precompile(shapes, ms, args.jobs, skip)
    results = measure(shapes, ms, skip)
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
                skipped=[dict(config=cfg, reason=why) for cfg, why in skip.items()],
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
