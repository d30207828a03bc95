"""Issue 26, session 8 (branch fp8g): the FP8 weight GEMV at one row (and the 64-row tiles),
kernel variants timed per shape alone, then the winners in the engine.

Usage: ``python scripts/gpu_s8_fp8g.py [--budget S] [--sweep-budget S] -- BENCH-OFFLINE-FLAGS``
(the flags after ``--`` are ``pdserve bench offline``'s; ``--json`` is set here). Steps:

0. ``--precompile-procs P`` processes (``--precompile i/P``) compile every variant's kernels
   into Triton's disk cache (small N, the real K and M: the same compiled kernels) while the
   engine loads, so the sweep below does not spend its seconds compiling;
1. bench offline's rows with the engine's paths as they are (``bench_default``);
2. the sweep, on the engine's GPU, for Llama-3.1-8B's four FP8 linears ``(N, K)``: per
   shape ``copies`` random e4m3 weights (at least ``--rotate-mb`` MB together, so L2 does
   not hold them), each variant timed in a CUDA graph of calls cycling over the copies
   (``fp8.time_us``), GB/s = weight bytes / time, beside a torch copy of the same bytes
   timed the same way (GB/s counted once, and read + write); each variant's output on one x
   against the current path's (bit-equal, max |diff| / max |current|) and against the
   dequantized fp32 product. One row: the current path (the table's), gemv tiles of the
   current kernel, the ``gemvk`` tiles (``scripts/s8_gemvk.py``: 16-byte vectors summed in
   thread, the next tile read ahead, K split 1 / 2 / 4), w8a8 with K split; 64 rows: the
   current w8a8 tile, other w8a8 tiles, ``_scaled_mm``. A w8a8 variant is timed twice: the
   kernel on rows quantized before (what the engine runs where the quantization is inside
   the add + RMSNorm before it: qkv, gate_up) and with ``quantize_rows`` (o, down); its
   ``eff_us`` is the one the engine would run;
3. winners: per shape and row count the fastest variant by ``eff_us`` when it beats the
   current path by more than ``--margin`` and its error against the dequantized product is
   under ``fp8.CHOICE_MAX_ERROR``;
4. in the engine, ``fp8.PATHS`` swapped between the current paths (``off``) and the
   winners (``on``), the decode graphs captured again each time: the 1x200 step (and 64x200
   when a 64-row winner exists) profiled off, on, off, on; greedy tokens of one prompt and of
   64 prompts (32 tokens each) on vs off;
5. bench offline's rows again with the winners (``bench_on``);
6. ``quantize_rows`` on the GPU against its torch reference at the shapes of the CPU test
   (which codes differ: the test's four failures on CUDA).

Everything goes to ``$OUT/fp8g.json``, written after each item; progress lines on stdout.
``--device cpu`` with ``random:tiny`` checks the script (``TRITON_INTERPRET=1``, tiny
shapes, no graphs). Variants stop being timed once ``--sweep-budget`` seconds have passed
since the start, the engine A/B once ``--budget`` has.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from pdserve.model import fp8, triton_w8a8

# Llama-3.1-8B's fused FP8 linears (N, K): qkv, o, gate_up, down
SHAPES = ((6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096))  # the order timed
NAMES = {(6144, 4096): "qkv", (4096, 4096): "o", (28672, 4096): "gate_up", (4096, 14336): "down"}
AFTER_NORM = {(6144, 4096), (28672, 4096)}  # their w8a8 rows are quantized inside add + RMSNorm
# --device cpu: tiny shapes with the same roles (interpreter)
CPU_SHAPES = ((128, 64), (64, 64), (64, 128), (256, 64))  # random:tiny's

# gemvk tiles (BLOCK_N, BLOCK_K, num_warps, num_stages, AHEAD); each at K split 1 and 2
GEMVK_TILES = (
    (8, 512, 4, 1, True),
    (8, 1024, 4, 1, True),
    (4, 1024, 4, 1, True),
    (16, 512, 4, 1, True),
    (8, 1024, 4, 1, False),
    (16, 1024, 8, 1, True),
    (4, 2048, 4, 1, True),
    (2, 2048, 4, 1, True),
    (8, 2048, 8, 1, True),
    (4, 512, 2, 1, True),
    (8, 1024, 4, 2, False),
)
GEMVK_SPLIT4 = ((8, 1024, 4, 1, True), (4, 1024, 4, 1, True))  # also at K split 4
GEMV_EXTRA = (("gemv", 8, 1024, 4, 2), ("gemv", 4, 1024, 4, 1), ("gemv", 16, 512, 4, 1))
W8A8_ONE = (  # (BLOCK_N, BLOCK_K, SPLIT) of swapped 16-row tiles at one row
    (64, 256, 2),
    (64, 256, 4),
    (64, 128, 2),
    (64, 128, 4),
    (128, 128, 2),
    (128, 128, 4),
)
W8A8_64 = (  # (BLOCK_N, BLOCK_K, SPLIT, stages) of swapped 64-row tiles at 64 rows
    (64, 256, 1, 4),
    (64, 256, 2, 4),
    (64, 128, 1, 4),
    (64, 128, 2, 4),
    (128, 128, 1, 4),
    (128, 256, 1, 3),
)


def variants(m: int, n: int, k: int, cpu: bool) -> list[tuple[str, tuple]]:
    """``(name, path)`` of the candidates at ``m`` rows of ``[n, k]`` (current path first,
    added by the caller). Paths are ``fp8.run_path``'s, plus kind ``w8a8q`` (the w8a8
    kernel on rows quantized before the timing)."""
    out: list[tuple[str, tuple]] = []
    if m == 1:
        tiles = GEMVK_TILES
        extra = GEMV_EXTRA
        w1 = W8A8_ONE
        if cpu:  # small tiles for the tiny shapes, few of them
            tiles = ((8, 64, 4, 1, True), (4, 128, 4, 1, False))
            extra = (("gemv", 8, 64, 4, 1),)
            w1 = ((16, 64, 2),)
        for bn, bk, warps, stages, ahead in tiles:
            splits = (1, 2, 4) if (bn, bk, warps, stages, ahead) in GEMVK_SPLIT4 else (1, 2)
            for s in splits:
                if k % bk == 0 and k // bk >= s:
                    cfg = ("gemvk", bn, bk, s, warps, stages, ahead)
                    name = f"gemvk_{bn}x{bk}_s{s}_w{warps}_st{stages}" + ("_ah" if ahead else "")
                    out.append((name, ("gemvk", cfg)))
        for cfg in extra:
            out.append((f"gemv_{cfg[1]}x{cfg[2]}_w{cfg[3]}_st{cfg[4]}", ("gemv", cfg)))
        for bn, bk, s in w1:
            cfg = ("w8a8", 16, bn, bk, s, True, 4, 4)
            out.append((f"w8a8_16x{bn}x{bk}_s{s}", ("w8a8q", cfg)))
    else:
        tiles64 = W8A8_64 if not cpu else ((16, 64, 1, 2),)
        for bn, bk, s, stages in tiles64:
            cfg = ("w8a8", 64, bn, bk, s, True, 4, stages)
            out.append((f"w8a8_64x{bn}x{bk}_s{s}_st{stages}", ("w8a8q", cfg)))
        if not cpu:
            out.append(("scaled_mm", ("scaled_mm", None)))
    return out


def run_variant(path: tuple, x: torch.Tensor, xq, w: fp8.Fp8Weight, quant: bool):
    """The output of ``path`` on x (``w8a8q``: on the pre-quantized ``xq = (q, s)`` unless
    ``quant``, then quantized in the call as ``fp8.run_path`` does)."""
    kind, cfg = path
    if kind == "gemvk":  # not an engine path: the kernel lives beside this script
        import s8_gemvk

        return s8_gemvk.gemvk(x, w.weight, w.scale, None, cfg)
    if kind == "w8a8q":
        if quant:
            return fp8.run_path(("w8a8", cfg), x, w, None)
        return triton_w8a8.w8a8(xq[0], xq[1], w.weight, w.scale, None, x.dtype, cfg)
    return fp8.run_path(path, x, w, None)


def time_fns(fns, cpu: bool) -> float:
    if cpu:
        t = time.perf_counter()
        for f in fns:
            f()
        return 1e6 * (time.perf_counter() - t) / len(fns)
    return fp8.time_us(fns, reps=max(24, 2 * len(fns)))


def make_weights(n: int, k: int, copies: int, device) -> list[fp8.Fp8Weight]:
    out = []
    g = torch.Generator(device=device).manual_seed(n + k)
    for _ in range(copies):
        w = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02
        q, s = fp8.quantize_per_channel(w)
        del w
        out.append(fp8.Fp8Weight(q, s, k))
    return out


def sweep_shape(n, k, rows, base_paths, device, cpu, copies, deadline, log):
    """One shape's results ``{m: {...}}`` (see the module doc)."""
    ws = make_weights(n, k, copies, device)
    nbytes = n * k
    res: dict = {"bytes": nbytes, "copies": copies}
    # a torch copy of the same bytes, the same rotation
    srcs = [w.weight.view(torch.uint8) for w in ws]
    dsts = [torch.empty_like(srcs[0]) for _ in range(2)]
    fns = [lambda i=i, d=dsts: d[i % 2].copy_(srcs[i]) for i in range(len(srcs))]
    cus = time_fns(fns, cpu)
    res["copy_us"] = cus
    res["copy_GBps_once"] = nbytes / cus / 1e3
    res["copy_GBps_rw"] = 2 * nbytes / cus / 1e3
    fns = dsts = []
    log(
        f"SHAPE {NAMES.get((n, k), '')} {n}x{k}: {nbytes / 1e6:.1f} MB x {copies}, copy {cus:.2f} us = {res['copy_GBps_once']:.0f} GB/s once, {res['copy_GBps_rw']:.0f} r+w"
    )
    g = torch.Generator(device=device).manual_seed(1)
    for m in rows:
        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
        xq = fp8.quantize_rows(x)
        ref = x.float() @ ws[0].dequantize(torch.float32).T
        cur = fp8.path_for(m, n, k) if (n, k) in base_paths else fp8.default_path(m, n, k)
        cur_kind, cur_cfg = cur
        cur_path = ("w8a8q", cur_cfg) if cur_kind == "w8a8" else cur
        base_out = run_variant(cur_path, x, xq, ws[0], quant=(n, k) not in AFTER_NORM)
        rm: dict = {"current": str(cur), "variants": {}}
        res[str(m)] = rm
        cands = [("current", cur_path)] + variants(m, n, k, cpu)
        for name, path in cands:
            if time.time() > deadline:
                rm.setdefault("skipped", []).append(name)
                continue
            r: dict = {"path": str(path if path[0] != "w8a8q" else ("w8a8", path[1]))}
            try:
                out = run_variant(path, x, xq, ws[0], quant=False)
                r["bit_equal_current"] = bool(torch.equal(out, base_out))
                r["err_vs_current"] = fp8.relative_error(out, base_out)
                r["err_vs_ref"] = fp8.relative_error(out, ref)
                us = time_fns(
                    [
                        lambda w=w, p=path, x=x, xq=xq: run_variant(p, x, xq, w, quant=False)
                        for w in ws
                    ],
                    cpu,
                )
                r["us"] = us
                r["GBps"] = nbytes / us / 1e3
                r["frac_of_copy_rw"] = r["GBps"] / res["copy_GBps_rw"]
                eff = us
                if path[0] == "w8a8q" and (n, k) not in AFTER_NORM:
                    uq = time_fns(
                        [
                            lambda w=w, p=path, x=x, xq=xq: run_variant(p, x, xq, w, quant=True)
                            for w in ws
                        ],
                        cpu,
                    )
                    r["us_with_quant"] = eff = uq
                r["eff_us"] = eff
            except Exception as exc:  # noqa: BLE001 a variant that fails is recorded
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                if not cpu:
                    torch.cuda.synchronize()
            rm["variants"][name] = r
            log(
                f"  m={m:3d} {name:34s} "
                + (
                    f"{r['eff_us']:8.2f} us {r['GBps']:6.0f} GB/s {r['frac_of_copy_rw']:.2f} of copy"
                    f" eq={int(r['bit_equal_current'])} dcur={r['err_vs_current']:.1e} dref={r['err_vs_ref']:.1e}"
                    if "eff_us" in r
                    else r.get("error", "")
                )
            )
    del ws
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    return res


def pick_winners(sweep: dict, margin: float) -> dict:
    """``{"N,K": {m: (name, path)}}``: per shape and row count the fastest variant by
    ``eff_us`` beating the current path by more than ``margin`` (a fraction), its error
    against the dequantized product under fp8.CHOICE_MAX_ERROR."""
    out: dict = {}
    for shape, res in sweep.items():
        for key, rm in res.items():
            if not key.isdigit():
                continue
            vs = rm["variants"]
            cur = vs.get("current", {}).get("eff_us")
            if cur is None:
                continue
            ok = [
                (r["eff_us"], name)
                for name, r in vs.items()
                if name != "current"
                and "eff_us" in r
                and r["err_vs_ref"] < fp8.CHOICE_MAX_ERROR
                and r["eff_us"] < cur * (1 - margin)
            ]
            if ok:
                us, name = min(ok)
                out.setdefault(shape, {})[int(key)] = (name, vs[name]["path"], us, cur)
    return out


def _parse_path(text: str) -> tuple:
    import ast

    return tuple(ast.literal_eval(text))


def paths_with(base: dict, winners: dict) -> dict:
    """``base`` (fp8.PATHS) with the winners' entries in place of the row counts they won."""
    new = dict(base)
    for shape, by_m in winners.items():
        n, k = (int(v) for v in shape.split(","))
        # (a shape without entries, --device cpu: the winners, then w8a16 for any rows)
        entries = list(base.get((n, k), ())) or [(m, None) for m in sorted(by_m)] + [
            (1 << 30, ("w8a16", None))
        ]
        for m, (_, path, _, _) in by_m.items():
            p = _parse_path(path)
            for i, (m_max, _old) in enumerate(entries):
                if m_max == m:
                    entries[i] = (m_max, p)
        new[(n, k)] = tuple(entries)
    return new


def precompile(shard: int, procs: int, cpu: bool) -> None:
    """Compile shard ``shard`` of the variants' kernels (small N, the real K and rows)."""
    device = "cpu" if cpu else "cuda"
    jobs = []
    shapes = CPU_SHAPES if cpu else SHAPES
    seen = set()
    for n, k in shapes:
        for m in (1, 64) if not cpu else (1, 16):
            for _name, path in variants(m, n, k, cpu):
                key = (str(path), k, m)
                if key not in seen:
                    seen.add(key)
                    jobs.append((k, m, path))
    mine = jobs[shard::procs]
    t = time.time()
    ws: dict = {}
    for k, m, path in mine:
        if k not in ws:
            ws[k] = make_weights(256, k, 1, device)[0]
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        xq = fp8.quantize_rows(x)
        try:
            run_variant(path, x, xq, ws[k], quant=path[0] == "w8a8q")
        except Exception as exc:  # noqa: BLE001 the sweep records it
            print(f"precompile {path}: {exc}", flush=True)
    if not cpu:
        torch.cuda.synchronize()
    print(f"PRECOMPILE {shard}/{procs}: {len(mine)} jobs in {time.time() - t:.1f} s", flush=True)


def greedy_tokens(llm, prompts: int, n: int = 32) -> list[list[int]]:
    from pdserve.engine.sampling_params import SamplingParams

    ps = [[1 + (j * 37 + i * 101) % 3000 for j in range(120)] for i in range(prompts)]
    llm.reset_prefix_cache()
    out = llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in out]


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first = []
    for x, y in zip(a, b, strict=True):
        d = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        first.append(d)
    return {
        "identical_outputs": same,
        "outputs": len(a),
        "mean_first_divergence": sum(first) / len(first),
    }


def recapture(llm) -> None:
    g = llm.engine.executor.rank0.runner.graphs
    if g is None:
        return
    g._graphs.clear(), g._logits.clear(), g._greedy.clear()
    g._pool = None
    gc.collect()
    g.capture()


def quant_diag(device) -> dict:
    """quantize_rows (Triton) against quantize_rows_torch at the CPU test's shapes."""
    out = {}
    for m, k in ((3, 160), (2, 8200)):
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator().manual_seed(2)
            x = (torch.randn(m, k, generator=g) * 3).to(dtype)
            x[0, :3] = torch.tensor([-0.0, 1e-30, -1e-30])
            if m > 2:
                x[2] = 0.0
            x[1, :6] = torch.tensor([448.0, 84.0, -12.5, 124.3, 447.0, 0.0068359375])
            x = x.to(device)
            q, s = triton_w8a8.quantize_rows(x)
            rq, rs = fp8.quantize_rows_torch(x)
            qb, rb = q.view(torch.uint8).cpu(), rq.view(torch.uint8).cpu()
            diff = (qb != rb).nonzero().tolist()
            out[f"{m}x{k}_{str(dtype)[6:]}"] = {
                "scale_equal": bool(torch.equal(s.cpu(), rs.cpu())),
                "codes_differing": len(diff),
                "first": [(i, j, int(qb[i, j]), int(rb[i, j])) for i, j in diff[:6]],
                "only_zero_signs": all({int(qb[i, j]), int(rb[i, j])} == {0, 128} for i, j in diff),
            }
    return out


def write_table(json_path: str, keep: str, card: str = "NVIDIA H200") -> None:
    """Rewrite ``pdserve/model/fp8_paths_table.py`` with the winners of ``json_path`` (this
    script's JSON, or gpu_s8_fp8g2.py's: winners by :func:`pick_winners`, margin 0.03) that ``keep`` names (``"N,K:M;N,K:M"``, e.g. the ones the engine A/B
    confirmed; ``all`` for every winner) in place of the table's entries for those rows."""
    from pdserve.model import fp8_paths_table

    with open(json_path) as f:
        doc = json.load(f)
    # gpu_s8_fp8g2.py's JSON has the sweep only: its winners by this script's rule
    winners = doc.get("winners") or {
        s: {str(m): list(v) for m, v in bm.items()}
        for s, bm in pick_winners(doc["sweep"], 0.03).items()
    }
    wanted = None if keep == "all" else {tuple(p.split(":")) for p in keep.split(";") if p}
    table = dict(fp8_paths_table.TABLE)
    changed = []
    for shape, by_m in winners.items():
        n, k = (int(v) for v in shape.split(","))
        entries = list(table[(card, n, k)])
        for m, (name, path, us, cur) in by_m.items():
            if wanted is not None and (shape, m) not in wanted:
                continue
            p = _parse_path(path)
            for i, (m_max, _old) in enumerate(entries):
                if m_max == int(m):
                    entries[i] = (m_max, (p[0], p[1]))
                    changed.append(f"{shape}:{m} {name} {us:.2f} us (was {cur:.2f})")
        table[(card, n, k)] = tuple(entries)
    with open(fp8_paths_table.__file__) as f:
        src = f.read()
    head = src[: src.index("TABLE: dict")]
    body = "TABLE: dict[tuple[str, int, int], tuple[tuple[int, tuple[str, Any]], ...]] = {\n"
    for key, entries in table.items():
        body += f"    {key!r}: (\n"
        for m_max, p in entries:
            body += f"        ({m_max}, {p!r}),\n"
        body += "    ),\n"
    body += "}\n"
    with open(fp8_paths_table.__file__, "w") as f:
        f.write(head + body)
    print(f"wrote {fp8_paths_table.__file__}: " + "; ".join(changed))


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precompile", default="", help="i/P: compile shard i of P and exit")
    ap.add_argument("--precompile-procs", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0, help="s from start: no engine A/B after")
    ap.add_argument("--sweep-budget", type=float, default=0, help="s from start: no sweep after")
    ap.add_argument(
        "--limit",
        type=float,
        default=0,
        help="s from start the process must end by: the sweep gets at least --sweep-min s "
        "after the engine is up within it, the engine A/B and the bench with the winners run "
        "only when they fit",
    )
    ap.add_argument("--sweep-min", type=float, default=18.0)
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--rotate-mb", type=float, default=240.0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default="fp8g.json")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes (with --device cpu)")
    ap.add_argument("--write-table", default="", help="JSON: write its winners to the table")
    ap.add_argument("--keep", default="all", help="with --write-table: N,K:M;... or all")
    own = ap.parse_args(argv[:split])
    if own.write_table:
        write_table(own.write_table, own.keep)
        return 0
    if own.precompile:
        i, p = (int(v) for v in own.precompile.split("/"))
        precompile(i, p, own.cpu)
        return 0
    from pdserve.bench import offline
    from pdserve.cli import build_parser

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_step_profile import profile_shapes

    args = build_parser().parse_args(["bench", "offline", *argv[split + 1 :]])
    out = os.environ.get("OUT", ".")
    path = os.path.join(out, own.json)
    bench_tmp = os.path.join(out, "_bench_fp8g.json")
    args.json = bench_tmp
    t0 = time.time()
    res: dict = {"argv": argv, "sweep": {}, "engine": {}}

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    procs = []
    if own.precompile_procs > 0:
        me = os.path.abspath(__file__)
        for i in range(own.precompile_procs):
            cmd = [sys.executable, me, "--precompile", f"{i}/{own.precompile_procs}"]
            cmd += ["--cpu"] if own.cpu else []
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        log(f"precompile: {len(procs)} processes")

    def take_bench(name: str) -> None:
        if os.path.exists(bench_tmp):
            with open(bench_tmp) as f:
                b = json.load(f)
            os.remove(bench_tmp)
            keep = ("num_prompts", "ours_tok_s", "ours_runs", "ours_decode_ms_per_step")
            keep += ("ours_step_ms_all_decoding", "roofline_fraction", "steady_roofline_ms")
            res[name] = {
                "engine_start_s": b.get("engine_start_s"),
                "copy_bandwidth_bytes_per_s": b.get("copy_bandwidth_bytes_per_s"),
                "rows": [{k: r.get(k) for k in keep} for r in b.get("results", [])],
            }
            save()
            for r in res[name]["rows"]:
                log(
                    f"BENCH {name} {r['num_prompts']} prompts {r['ours_tok_s']:.1f} tok/s step {r['ours_step_ms_all_decoding']}"
                )

    def after(llm) -> None:
        res["engine_up_s"] = round(time.time() - t0, 1)
        take_bench("bench_default")
        cpu = llm.engine.device.type != "cuda"
        device = llm.engine.device
        for p in procs:  # the compiles: wait a little, then go on without them
            try:
                o, _ = p.communicate(timeout=max(1.0, 25 - (time.time() - t0)))
                res.setdefault("precompile", []).append((o or "").strip().splitlines()[-1:])
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                res.setdefault("precompile", []).append("killed: still compiling")
        log(f"precompile done: {res.get('precompile')}")
        base = dict(fp8.PATHS)
        res["base_paths"] = {f"{n},{k}": [(m, str(p)) for m, p in e] for (n, k), e in base.items()}
        deadline = t0 + own.sweep_budget if own.sweep_budget else math.inf
        if own.limit:  # a slow engine start: the sweep first, the A/B and the bench as fit
            deadline = max(deadline, min(time.time() + own.sweep_min, t0 + own.limit - 8))
        res["sweep_deadline_s"] = round(deadline - t0, 1)
        shapes = CPU_SHAPES if cpu else SHAPES
        for n, k in shapes:
            copies = 2 if cpu else max(2, min(16, math.ceil(own.rotate_mb * 1e6 / (n * k))))
            try:
                rows = (1, 16) if cpu else (1, 64)
                res["sweep"][f"{n},{k}"] = sweep_shape(
                    n, k, rows, base, device, cpu, copies, deadline, log
                )
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                res["sweep"][f"{n},{k}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            save()
        winners = pick_winners(res["sweep"], own.margin)
        res["winners"] = {s: {str(m): v for m, v in bm.items()} for s, bm in winners.items()}
        save()
        for s, bm in winners.items():
            for m, (name, _p, us, cur) in bm.items():
                log(f"WINNER {s} m={m}: {name} {us:.2f} us vs current {cur:.2f} us")
        if winners:
            engine_ab(llm, base, winners)
        else:
            log("no winner: engine unchanged")
        if not cpu and not (own.limit and time.time() - t0 > own.limit - 5):
            res["quantize_rows_diag"] = quant_diag(device)
            log(f"QUANT {json.dumps(res['quantize_rows_diag'])}")
            save()

    def engine_ab(llm, base, winners) -> None:
        on = paths_with(base, winners)
        shapes_prof = ["1x200"] + (["64x200"] if any(64 in bm for bm in winners.values()) else [])
        eng = res["engine"]
        toks = {}
        for label in ("off", "on", "off", "on"):
            late = own.limit and time.time() - t0 > own.limit - 14
            if late or (own.budget and time.time() - t0 > own.budget):
                eng.setdefault("skipped", []).append(label)
                continue
            fp8.PATHS.clear()
            fp8.PATHS.update(base if label == "off" else on)
            try:
                recapture(llm)
                prof = profile_shapes(llm, shapes_prof, own.steps, top_n=10)
                for shp, pr in prof.items():
                    e = eng.setdefault(f"{label}_{shp}", [])
                    e.append(
                        {
                            k: pr[k]
                            for k in (
                                "step_ms",
                                "step_ms_spans",
                                "kernel_ms",
                                "kernels_per_step",
                                "top_kernels_ms",
                            )
                        }
                    )
                    log(
                        f"STEP {label} {shp}: {pr['step_ms']:.3f} ms (kernels {pr['kernel_ms']:.3f})"
                    )
                if label not in toks:
                    toks[label] = (greedy_tokens(llm, 1), greedy_tokens(llm, 64))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                eng.setdefault("errors", []).append(f"{label}: {type(exc).__name__}: {exc}"[:300])
            save()
        if "on" in toks and "off" in toks:
            eng["greedy_1"] = token_agreement(toks["off"][0], toks["on"][0])
            eng["greedy_64"] = token_agreement(toks["off"][1], toks["on"][1])
            log(f"GREEDY 1: {eng['greedy_1']} 64: {eng['greedy_64']}")
        save()
        if own.limit and time.time() - t0 > own.limit - 10:
            log("bench with the winners skipped: past --limit - 10 s")
            return
        fp8.PATHS.clear()
        fp8.PATHS.update(on)
        recapture(llm)
        counts = offline._parse_counts(args.num_prompts)
        prompts = [offline.workload_prompts(llm, n, None, None) for n in counts]
        res["bench_on_rc"] = offline._run(args, llm, [(n, "gsm8k") for n in counts], prompts, None)
        take_bench("bench_on")

    rc = offline.run_offline(args, after)
    res["bench_default_rc"] = rc
    res["total_s"] = round(time.time() - t0, 1)
    save()
    log(f"END rc={rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
