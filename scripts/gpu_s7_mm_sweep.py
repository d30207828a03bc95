"""The persistent TMA matmul (``scripts/s7_triton_mm.py``) against ``F.linear`` (cuBLAS) at
Llama-3.1-8B's four linear shapes and decode batches of 64-256 rows, no model (64 rows: for
the record only, those are ``gemv_table``'s; ``table_entries`` skips them).

For each row count M (``--ms``, in that order) and shape ``N x K`` (qkv 6,144 x 4,096, o
4,096 x 4,096, gate_up 28,672 x 4,096, down 4,096 x 14,336), bf16: ``F.linear`` timed, then
every configuration of ``CONFIGS`` (checked against ``F.linear`` first: a configuration that
fails to build, run or agree is recorded with its error and skipped), then ``F.linear``
again; times are ``triton.testing.do_bench`` medians (L2 flushed before each run, as a
decode step reads each weight from HBM), in microseconds; ``torch_us`` is the lower of the
two ``F.linear`` timings. The JSON (``$OUT/mm_sweep.json``) is written after every item;
``--budget-s`` stops starting new items past that many seconds.

:func:`table_entries` reads such a JSON: per shape and M the fastest configuration where it
beat ``torch_us`` by >= 3 % (``MIN_GAIN``), else None (cuBLAS). The H200 run
(docs/figures/h200_s7/mm_sweep.json) found none, so the engine has no such table.

``--device cpu`` (under ``TRITON_INTERPRET=1``, toy shapes ``--toy``) checks the script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

# gate_up first: the largest share of the 256-row step (and the first item pays the compiles)
SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "o": (4096, 4096)}
TOY_SHAPES = {"qkv": (96, 64), "down": (64, 160)}
CONFIGS = [
    ("mm128", 256, 64, 8, 3),
    ("mm128", 128, 64, 4, 4),
    ("mm128", 128, 64, 8, 4),
    ("mm128", 128, 128, 8, 3),
    ("mm256", 64, 64, 4, 4),
    ("mm64", 256, 64, 4, 4),
    ("mm64", 128, 64, 4, 5),
    ("mm256", 128, 64, 8, 3),
    ("mm128_ws", 256, 64, 8, 3),
    ("mm128_ws", 128, 64, 8, 4),
    ("mm256_ws", 128, 64, 8, 3),
]
TOY_CONFIGS = [("mm64", 32, 32, 4, 2), ("mm128_ws", 16, 32, 4, 2)]
MIN_GAIN = 1.03  # torch_us / best_us at or above which the table takes the kernel
MIN_ROWS = 65  # fewer rows are the GEMV's (gemv_table: M <= 64)


def _bench(fn, cuda: bool) -> float:
    """Median microseconds of ``fn()``."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")) * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def sweep(args) -> dict:
    import s7_triton_mm as triton_mm

    cuda = args.device == "cuda"
    shapes = TOY_SHAPES if args.toy else SHAPES
    configs = TOY_CONFIGS if args.toy else CONFIGS
    out = os.environ.get("OUT", ".")
    path = os.path.join(out, args.json)
    res: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "min_gain": MIN_GAIN,
        "configs": [list(c) for c in configs],
        "rows": [],
        "complete": False,
    }
    t_start = time.perf_counter()
    gen = torch.Generator(device=args.device).manual_seed(0)
    for m in [int(v) for v in args.ms.split(",")]:
        for name, (n, k) in shapes.items():
            if time.perf_counter() - t_start > args.budget_s:
                print(f"budget of {args.budget_s} s spent: stopped before M={m} {name}")
                res["stopped_at"] = [m, name]
                return res
            dt = torch.bfloat16 if cuda else torch.float32
            x = torch.randn(m, k, generator=gen, device=args.device).to(dt)
            w = (torch.randn(n, k, generator=gen, device=args.device) * 0.02).to(dt)
            ref = F.linear(x, w)
            t_first = _bench(lambda x=x, w=w: F.linear(x, w), cuda)
            row: dict = {"shape": name, "M": m, "N": n, "K": k, "configs_us": {}, "errors": {}}
            row["t_start"] = time.time()  # wall clock: compared with the engine load's
            for cfg in configs:
                key = str(tuple(cfg))
                try:
                    got = triton_mm.mm(x, w, None, cfg)
                    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    if not err < (2e-2 if cuda else 1e-4):
                        raise RuntimeError(f"disagrees with F.linear: max rel err {err:.3g}")
                    row["configs_us"][key] = _bench(
                        lambda c=cfg, x=x, w=w: triton_mm.mm(x, w, None, c), cuda
                    )
                except Exception as exc:  # noqa: BLE001 (a config that fails to build/run must not stop the rest)
                    row["errors"][key] = f"{type(exc).__name__}: {str(exc)[:200]}"
            t_second = _bench(lambda x=x, w=w: F.linear(x, w), cuda)
            row["t_end"] = time.time()
            row["torch_us_runs"] = [t_first, t_second]
            row["torch_us"] = min(t_first, t_second)
            if row["configs_us"]:
                best = min(row["configs_us"], key=row["configs_us"].get)
                row["best"] = best
                row["best_us"] = row["configs_us"][best]
                row["speedup"] = row["torch_us"] / row["best_us"]
            flop = 2.0 * m * n * k
            row["torch_tflops"] = flop / row["torch_us"] / 1e6
            row["best_tflops"] = flop / row["best_us"] / 1e6 if "best_us" in row else None
            res["rows"].append(row)
            print(
                f"M={m:4d} {name:8s} torch {row['torch_us']:8.1f} us ({row['torch_tflops']:.0f} "
                f"TFLOP/s)  best {row.get('best_us', float('nan')):8.1f} us {row.get('best', '-')}"
                f"  x{row.get('speedup', float('nan')):.3f}  errors {len(row['errors'])}",
                flush=True,
            )
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    res["complete"] = True
    return res


def table_entries(res: dict) -> dict:
    """``{(dtype, N, K): ((m, config or None), ...)}`` from a sweep's JSON: the fastest
    configuration of each shape and M where it beat ``torch_us`` by ``MIN_GAIN``."""
    table: dict = {}
    for row in res["rows"]:
        if row["M"] < MIN_ROWS:
            continue  # the GEMV's rows (gemv_table)
        cfg = None
        if row.get("speedup", 0) >= MIN_GAIN:
            kind, bn, bk, w, s = eval(row["best"])  # a tuple literal written by sweep()
            cfg = (kind, bn, bk, w, s)
        table.setdefault(("bfloat16", row["N"], row["K"]), []).append((row["M"], cfg))
    return {key: tuple(sorted(v)) for key, v in table.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ms", default="256,128,192,64,96")
    ap.add_argument("--toy", action="store_true", help="toy shapes and configs (CPU check)")
    ap.add_argument("--budget-s", type=float, default=45.0)
    ap.add_argument("--json", default="mm_sweep.json", help="file name under $OUT")
    args = ap.parse_args()
    res = sweep(args)
    with open(os.path.join(os.environ.get("OUT", "."), args.json), "w") as f:
        json.dump(res, f, indent=1)
    print("complete" if res["complete"] else "incomplete", file=sys.stderr)


if __name__ == "__main__":
    main()
