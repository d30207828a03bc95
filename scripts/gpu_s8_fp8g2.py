"""Issue 26, session 8, second call (branch fp8g): the sweep of ``gpu_s8_fp8g.py`` again
without an engine (its JSON did not come back from the first call), and the candidates in
a chain of Llama-3.1-8B's 32 layers x 4 FP8 linears under one CUDA graph.

Usage: ``python scripts/gpu_s8_fp8g2.py [--limit S]``; writes ``$OUT/fp8g2.json``. Steps:

1. ``gpu_s8_fp8g.py --precompile i/P`` processes compile the variants' kernels into
   Triton's disk cache (waited for);
2. ``fp8.PATHS`` set from ``fp8_paths_table`` for this card (what the engine runs), then
   ``gpu_s8_fp8g.sweep_shape`` per shape at 1 and 64 rows: every variant timed alone
   (GB/s, fraction of a torch copy of the same bytes, output vs the current path and the
   dequantized product); a ``SUM`` line per shape and row count: the current path and the
   four fastest variants (eff µs, GB/s), the failures counted;
3. the chain: 32 layers of distinct random e4m3 weights of the four shapes, one row (and
   64), qkv -> o -> gate_up -> down per layer in one CUDA graph (PDL as in the engine; a
   w8a8 path on qkv / gate_up takes rows quantized before, as inside add + RMSNorm, on o /
   down quantizes in the call), timed for the current paths, every shape's fastest variant
   together (``best_all``), each alone (``best_<shape>``), the fastest gemvk of every shape
   together (``gemvk_all``), the current paths again; µs per chain and the fraction of a
   torch copy of the chain's bytes;
4. ``quantize_rows`` against its torch reference (gpu_s8_fp8g.quant_diag).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_s8_fp8g as s8
import torch

from pdserve.model import fp8, fp8_paths_table


def summarize(res: dict, shape: str, log) -> None:
    for key, rm in res.items():
        if not key.isdigit():
            continue
        vs = rm["variants"]
        ok = sorted((r["eff_us"], n) for n, r in vs.items() if "eff_us" in r and n != "current")
        bad = [n for n, r in vs.items() if "error" in r]
        cur = vs.get("current", {})
        line = f"SUM {s8.NAMES.get(tuple(int(v) for v in shape.split(',')), shape)} m={key}"
        if "eff_us" in cur:
            line += f" cur {cur['eff_us']:.2f}us {cur['GBps']:.0f}GB/s {cur['frac_of_copy_rw']:.2f}"
        for us, n in ok[:4]:
            r = vs[n]
            line += f" | {n} {us:.2f} {r['GBps']:.0f} eq{int(r['bit_equal_current'])} d{r['err_vs_current']:.0e}"
        if bad:
            line += f" | {len(bad)} failed, e.g. {bad[0]}: {vs[bad[0]]['error'][:90]}"
        if rm.get("skipped"):
            line += f" | {len(rm['skipped'])} skipped"
        log(line)


def chain_weights(device, layers: int) -> dict:
    """``{(n, k): [Fp8Weight] * layers}``: random e4m3 codes, one scale per row."""
    out = {}
    g = torch.Generator(device=device).manual_seed(3)
    for n, k in s8.SHAPES:
        ws = []
        for _ in range(layers):
            q = (torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 8).to(
                fp8.FP8
            )
            ws.append(fp8.Fp8Weight(q, torch.full((n, 1), 0.002, device=device), k))
        out[(n, k)] = ws
    return out


def time_chain(paths: dict, ws: dict, m: int, device, cpu: bool) -> float:
    """µs of one pass over the layers: per layer qkv, o, gate_up, down by ``paths``."""
    xs = {}
    g = torch.Generator(device=device).manual_seed(4)
    for n, k in s8.SHAPES:
        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
        xs[(n, k)] = (x, fp8.quantize_rows(x))
    layers = len(ws[s8.SHAPES[0]])

    def one() -> None:
        for i in range(layers):
            for shape in s8.SHAPES:
                x, xq = xs[shape]
                s8.run_variant(paths[shape], x, xq, ws[shape][i], quant=shape not in s8.AFTER_NORM)

    return s8.time_fns([one], cpu) if cpu else fp8.time_us([one], reps=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=float, default=90.0, help="s from start to end by")
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rotate-mb", type=float, default=240.0)
    ap.add_argument("--json", default="fp8g2.json")
    ap.add_argument("--cpu", action="store_true", help="check the script: tiny shapes, interpreter")
    own = ap.parse_args()
    if own.cpu:  # random:tiny's shapes in the roles of the four
        big = s8.SHAPES
        s8.SHAPES = s8.CPU_SHAPES
        s8.NAMES = {c: s8.NAMES[b] for c, b in zip(s8.CPU_SHAPES, big, strict=True)}
        s8.AFTER_NORM = {c for c, b in zip(s8.CPU_SHAPES, big, strict=True) if b in s8.AFTER_NORM}
    rows = (1, 16) if own.cpu else (1, 64)
    t0 = time.time()
    out = os.environ.get("OUT", ".")
    path = os.path.join(out, own.json)
    res: dict = {"sweep": {}, "chain": {}}

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:5.1f}s] {msg}", flush=True)

    me = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_s8_fp8g.py")
    procs = [
        subprocess.Popen(
            [sys.executable, me, "--precompile", f"{i}/{own.procs}"]
            + (["--cpu"] if own.cpu else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(own.procs)
    ]
    device = torch.device("cpu") if own.cpu else torch.device("cuda", 0)
    card = "cpu" if own.cpu else torch.cuda.get_device_name(device)
    res["card"] = card
    for n, k in s8.SHAPES:
        entry = fp8_paths_table.TABLE.get((card, n, k))
        if entry is not None:
            fp8.PATHS[(n, k)] = entry
    base = dict(fp8.PATHS)
    res["base_paths"] = {f"{n},{k}": [(m, str(p)) for m, p in e] for (n, k), e in base.items()}
    pre = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=max(1.0, 40 - (time.time() - t0)))
            lines = (o or "").strip().splitlines()
            pre.append(lines[-1] if lines else "")
            pre += [ln for ln in lines if ln.startswith("precompile ")][:3]
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pre.append("killed")
    res["precompile"] = pre
    log(f"PRE {pre}")
    deadline = t0 + own.limit - 30
    for n, k in s8.SHAPES:
        copies = max(2, min(16, -(-int(own.rotate_mb * 1e6) // (n * k))))
        try:
            r = s8.sweep_shape(n, k, rows, base, device, own.cpu, copies, deadline, lambda s: None)
            res["sweep"][f"{n},{k}"] = r
            log(
                f"SHAPE {s8.NAMES[(n, k)]} {n}x{k} {n * k / 1e6:.1f}MB x{copies}: copy "
                f"{r['copy_us']:.2f}us {r['copy_GBps_rw']:.0f}GB/s r+w"
            )
            summarize(r, f"{n},{k}", log)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            res["sweep"][f"{n},{k}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        save()
    # the chain
    try:
        ws = chain_weights(device, own.layers)
        nbytes = sum(n * k for n, k in s8.SHAPES) * own.layers
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_us = s8.time_fns(
            [lambda s=src, d=dst: d.copy_(s)] * 4, own.cpu
        )  # half the bytes each way
        del src, dst
        res["chain"]["bytes"] = nbytes
        res["chain"]["copy_us_rw"] = copy_us  # moving nbytes (read + write) once
        log(f"CHAIN {own.layers} layers {nbytes / 1e9:.2f} GB: a copy moving them {copy_us:.1f} us")
        for m in rows:
            cur = {s: fp8.path_for(m, *s) for s in s8.SHAPES}
            cur = {s: (("w8a8q", p[1]) if p[0] == "w8a8" else p) for s, p in cur.items()}
            best, gemvk = {}, {}
            for s in s8.SHAPES:
                vs = res["sweep"].get(f"{s[0]},{s[1]}", {}).get(str(m), {}).get("variants", {})
                ok = sorted((r["eff_us"], n) for n, r in vs.items() if "eff_us" in r)
                ok = [
                    (us, n)
                    for us, n in ok
                    if n == "current" or vs[n]["err_vs_ref"] < fp8.CHOICE_MAX_ERROR
                ]
                if ok and ok[0][1] != "current":
                    best[s] = ok[0][1]
                gk = [n for _, n in ok if n.startswith("gemvk")]
                if gk:
                    gemvk[s] = gk[0]

            def path_of(s, name, m=m):
                vs = res["sweep"][f"{s[0]},{s[1]}"][str(m)]["variants"]
                p = ast.literal_eval(vs[name]["path"])
                return ("w8a8q", p[1]) if p[0] == "w8a8" else tuple(p)

            plans = [("current", {})]
            if best:
                plans.append(("best_all", best))
                if len(best) > 1:
                    plans += [(f"best_{s8.NAMES[s]}", {s: best[s]}) for s in best]
            if gemvk and m == 1:
                plans.append(("gemvk_all", gemvk))
            plans.append(("current_again", {}))
            rm: dict = {}
            res["chain"][str(m)] = rm
            for label, swap in plans:
                if time.time() - t0 > own.limit - 12:
                    rm.setdefault("skipped", []).append(label)
                    continue
                paths = dict(cur)
                paths.update({s: path_of(s, name) for s, name in swap.items()})
                try:
                    us = time_chain(paths, ws, m, device, own.cpu)
                    rm[label] = {
                        "us": us,
                        "frac_of_copy": copy_us / us,
                        "swap": {s8.NAMES[s]: name for s, name in swap.items()},
                    }
                    log(
                        f"CHAIN m={m} {label}: {us:.1f} us = {copy_us / us:.2f} of a copy "
                        + " ".join(f"{s8.NAMES[s]}={name}" for s, name in swap.items())
                    )
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    rm[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                save()
        del ws
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        res["chain"]["error"] = f"{type(exc).__name__}: {exc}"[:300]
    save()
    if not own.cpu and time.time() - t0 < own.limit - 6:
        try:
            res["quantize_rows_diag"] = s8.quant_diag(device)
            log(f"QUANT {json.dumps(res['quantize_rows_diag'])[:400]}")
        except Exception as exc:  # noqa: BLE001
            res["quantize_rows_diag"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    res["total_s"] = round(time.time() - t0, 1)
    save()
    log("END")
    return 0


if __name__ == "__main__":
    sys.exit(main())
