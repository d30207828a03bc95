"""Issue 26, second kernel round, on one GPU (run by ``scripts/gpu_fp8_kernels2.sh``): the
FP8 linears of ``model/triton_w8a8.py`` at Llama-3.1-8B's four shapes.

For each shape (N, K) and each row count of ``fp8.PROBE_ROWS`` (1..1,024), over weight copies
that do not fit in L2 (random bf16 weights x 0.02, quantized per channel):

1. correctness before any timing: every candidate path of ``fp8.candidate_paths`` (what
   ``fp8.choose_paths`` times when the engine loads) and ``_scaled_mm`` against the
   dequantized reference in fp32: ``err`` = max |out - ref| / max |ref|, with ``ref`` =
   x @ real(w).T for the bf16-activation paths (gemv, w8a16s, w8a16) and
   real(xq) @ real(w).T for the quantized-activation ones (w8a8, scaled_mm); plus
   ``quantize_rows`` (the one-launch kernel) against its torch reference, bit for bit;
2. timings (``fp8.time_us``: a CUDA graph of 24 calls cycling the copies, the engine's
   timer): bf16 ``F.linear``, each candidate path, ``_scaled_mm`` with the old torch
   activation quantization (``scaled_mm_torchq``: issue 26's first measurement), and the
   quantization alone (``quant_us``, ``quant_torch_us``);
3. ``engine``: the fastest candidate that passed 1 (``fp8.choose_paths`` takes the fastest
   of the same candidates with the same timer, after its own looser check), and the
   four-linears x 32-layers table in ms: bf16, the best of each kind, the engine's choice;
   ``paths_table``: ``fp8.PATHS`` as this run's picks would fill it.

Writes ``$OUT/fp8_kernels2.json`` after each row count (a cut run keeps what it measured),
at the end ``$OUT/fp8_paths_table.py`` (``pdserve/model/fp8_paths_table.py`` filled with
this run's picks: copy it there, then ``ruff format`` it, for the same paths in every process
on that card) and a compact table. ``--rows M,M,...``: only those row counts (prefill chunks
past the table's 1,024, say), their picks printed and kept in the JSON, no table written. ``--smoke``: tiny shapes, 1-4 rows (a check of the
script itself; needs CUDA too).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from pdserve.model import fp8, triton_w8a8

OUT = os.environ.get("OUT", "gpu_fp8_kernels2")
SHAPES = {  # Llama-3.1-8B: (N, K)
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
TABLE_ROWS = (1, 4, 16, 32, 64, 128, 256, 1024)
T0 = time.perf_counter()
# No row count is started past this many seconds (``--budget-s S``; the .sh gives the
# script 120 s; a row of all four shapes takes a few seconds once the kernels are compiled)
BUDGET_S = 100.0
# largest |error| / largest |ref| a path may show (the bf16 output's rounding is ~0.004)
ERR_MAX = {kind: 0.01 for kind in fp8.PATH_KINDS}


def _dump(res: dict) -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "fp8_kernels2.json"), "w") as f:
        json.dump(res, f, indent=1)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _name(path: fp8.Path) -> str:
    kind, cfg = path
    return kind if cfg is None else f"{kind}{list(cfg[1:])}"


def weights(n: int, k: int, copies: int) -> tuple[list, list, torch.Tensor]:
    """``copies`` random bf16 weights ``[n, k]`` (x 0.02), their per-channel e4m3 forms and
    the first one's dequantized fp32 weight."""
    dev = torch.device("cuda")
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    qw = [fp8.Fp8Weight(*fp8.quantize_per_channel(w), k) for w in w16]
    return w16, qw, qw[0].dequantize(torch.float32)


def measure_row(m: int, n: int, k: int, w16: list, qw: list, deq: torch.Tensor) -> dict:
    """One row count of one shape: the checks, then the timings (see the module doc)."""
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    row: dict = {"paths": {}, "failed": {}}
    xq, xs = triton_w8a8.quantize_rows(x)
    rq, rs = fp8.quantize_rows_torch(x)
    row["quant_same_bits"] = bool(
        torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(xs, rs)
    )
    ref_x = x.float() @ deq.T
    ref_q = (xq.float() * xs) @ deq.T
    row["act_quant_err"] = _err(ref_q, ref_x)  # what per-token e4m3 activations cost
    row["quant_us"] = fp8.time_us([lambda x=x: triton_w8a8.quantize_rows(x)])
    row["quant_torch_us"] = fp8.time_us([lambda x=x: fp8.quantize_rows_torch(x)])
    row["bf16_us"] = fp8.time_us([lambda w=w, x=x: F.linear(x, w) for w in w16])
    cands = fp8.candidate_paths(m, n, k)
    if ("scaled_mm", None) not in cands and n % 16 == 0 and k % 16 == 0:
        cands.append(("scaled_mm", None))
    for path in cands:
        pname = _name(path)
        try:
            out = fp8.run_path(path, x, qw[0], None)
            torch.cuda.synchronize()
            err = _err(out, ref_q if path[0] in ("w8a8", "scaled_mm") else ref_x)
            if not err < ERR_MAX[path[0]]:
                row["failed"][pname] = f"err {err:.3g}"
                continue
            us = fp8.time_us([lambda w=w, p=path, x=x: fp8.run_path(p, x, w, None) for w in qw])
            row["paths"][pname] = {
                "us": us,
                "err": err,
                "kind": path[0],
                "path": [path[0], None if path[1] is None else list(path[1])],
            }
        except Exception as exc:  # noqa: BLE001 a tile Triton cannot build, cuBLAS refuses
            row["failed"][pname] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
    if n % 16 == 0 and k % 16 == 0:

        def old(w, x=x):
            q, s = fp8.quantize_rows_torch(x)
            return torch._scaled_mm(
                q, w.weight.t(), scale_a=s, scale_b=w.scale_row(), out_dtype=x.dtype
            )

        row["scaled_mm_torchq_us"] = fp8.time_us([lambda w=w: old(w) for w in qw])
    best_kind: dict = {}
    for name, p in row["paths"].items():
        if p["kind"] not in best_kind or p["us"] < best_kind[p["kind"]][1]:
            best_kind[p["kind"]] = (name, p["us"])
    row["best_by_kind"] = best_kind
    if row["paths"]:
        eng = min(row["paths"].items(), key=lambda kv: kv[1]["us"])
        row["engine"], row["engine_us"] = eng[0], eng[1]["us"]
        row["engine_path"] = eng[1]["path"]
        row["engine_gbps"] = n * k / (eng[1]["us"] * 1e3)
    row["seconds"] = time.perf_counter() - t0
    print(
        f"  M={m:4d} bf16 {row['bf16_us']:7.1f}  engine {row.get('engine_us', float('nan')):7.1f}"
        f" {row.get('engine', '-')}  quant {row['quant_us']:.1f}/{row['quant_torch_us']:.1f}"
        f" bits={row['quant_same_bits']} failed={len(row['failed'])} ({row['seconds']:.1f}s)",
        flush=True,
    )
    return row


def main() -> int:
    global BUDGET_S
    smoke = "--smoke" in sys.argv
    if "--budget-s" in sys.argv:
        BUDGET_S = float(sys.argv[sys.argv.index("--budget-s") + 1])
    shapes = {"tiny": (256, 512)} if smoke else SHAPES
    rows = (1, 2, 4) if smoke else tuple(sorted(set(fp8.PROBE_ROWS) | set(TABLE_ROWS)))
    # --rows M,M,...: only these row counts (e.g. prefill chunks past the table's 1,024),
    # their picks printed and in the JSON; no table is written from a partial run
    custom = "--rows" in sys.argv
    if custom:
        rows = tuple(int(x) for x in sys.argv[sys.argv.index("--rows") + 1].split(","))

    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "note": "µs per call: fp8.time_us (CUDA graph of 24 calls over weight copies > 256 MiB "
        "in all); err = max |out - ref| / max |ref| vs the dequantized reference",
        "shapes": {},
    }
    import triton

    res["triton"] = triton.__version__
    state = {}
    for name, (n, k) in shapes.items():
        copies = min(16, max(2, -(-(256 << 20) // (n * k))))
        state[name] = weights(n, k, copies)
        res["shapes"][name] = {"n": n, "k": k, "copies": copies, "rows": {}}
    # rows outer, shapes inner: a run cut by the budget keeps whole rows of the table
    for m in rows:
        if time.perf_counter() - T0 > BUDGET_S:
            print(f"budget of {BUDGET_S} s spent: rows from {m} on not measured", flush=True)
            res["cut_at_rows"] = m
            break
        for name, (n, k) in shapes.items():
            print(f"{name} ({n}, {k})", flush=True)
            res["shapes"][name]["rows"][str(m)] = measure_row(m, n, k, *state[name])
            _dump(res)
    if smoke:
        return 0
    if custom:
        for m in rows:
            picks = {
                s: (r.get("engine"), r.get("engine_us"), r.get("bf16_us"))
                for s in shapes
                if (r := res["shapes"][s]["rows"].get(str(m)))
            }
            print(f"picks M={m} (path, us, bf16 us): {picks}")
        return 0
    done = [m for m in TABLE_ROWS if all(str(m) in res["shapes"][s]["rows"] for s in SHAPES)]
    totals: dict = {}
    for m in done:
        t: dict = {}
        for name in SHAPES:
            r = res["shapes"][name]["rows"][str(m)]
            parts = {
                "bf16": r["bf16_us"],
                "engine": r.get("engine_us"),
                "scaled_mm_torchq": r.get("scaled_mm_torchq_us"),
            }
            for kind in fp8.PATH_KINDS:
                parts[kind] = r["best_by_kind"].get(kind, (None, None))[1]
            for key, v in parts.items():
                t[key] = None if v is None or t.get(key, 0.0) is None else t.get(key, 0.0) + v
        totals[str(m)] = {key: None if v is None else 32 * v / 1e3 for key, v in t.items()}
    res["four_linears_x32_ms"] = totals
    # fp8.PATHS as this run would fill it (fp8.choose_paths picks the same way, per process):
    # (N, K) -> ((rows, (kind, config)), ...), for a measured table seeding PATHS
    res["paths_table"] = {
        f"{n},{k}": [
            [int(m), r["engine_path"]]
            for m, r in sorted(res["shapes"][s]["rows"].items(), key=lambda kv: int(kv[0]))
            if "engine_path" in r
        ]
        for s, (n, k) in SHAPES.items()
    }
    _dump(res)
    table = {
        (res["device"], n, k): tuple(
            (m, (path[0], None if path[1] is None else tuple(path[1])))
            for m, path in res["paths_table"][f"{n},{k}"]
        )
        for n, k in SHAPES.values()
    }
    with open(os.path.join(OUT, "fp8_paths_table.py"), "w") as f:
        f.write(
            f'''"""FP8 linear paths measured on a GPU: ``(device name, N, K) -> ((largest M, (kind,
config)), ...)`` ascending in M, the form of :data:`pdserve.model.fp8.PATHS`. A shape listed
here for the card the model loads on is not timed at start (:func:`pdserve.model.fp8.choose_paths`
copies the entry), so every process on that kind of card takes the same paths (a prefill and a
decode worker compute the same numbers as a mixed one); a shape not listed is timed.

Written by ``scripts/gpu_fp8_kernels2.py`` on {res["device"]} (torch {res["torch"]}, Triton
{res["triton"]}; every timing in its ``fp8_kernels2.json``); do not edit by hand.
"""

from __future__ import annotations

from typing import Any

TABLE: dict[tuple[str, int, int], tuple[tuple[int, tuple[str, Any]], ...]] = {table!r}
'''
        )
    cols = ["bf16", "engine", "gemv", "w8a8", "w8a16s", "scaled_mm", "w8a16", "scaled_mm_torchq"]
    print("four linears x 32 layers, ms (engine = fastest correct candidate per shape)")
    print("rows " + " ".join(f"{c:>9s}" for c in cols))
    for m in done:
        t = totals[str(m)]
        print(f"{m:4d} " + " ".join(f"{'-' if t[c] is None else f'{t[c]:.2f}':>9s}" for c in cols))
    for m in done:
        picks = {s: res["shapes"][s]["rows"][str(m)].get("engine") for s in SHAPES}
        print(f"picks M={m}: {picks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
