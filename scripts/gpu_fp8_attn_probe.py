"""Issue 26: what one layer's attention block costs with an FP8 (e4m3) KV cache against a
bf16 one, on one GPU, without loading a model (Llama-3.1-8B's attention shapes: 32 query
heads, 8 KV heads of 128, 128-token pages).

For each shape ``ROWSxCONTEXT`` (default ``1x200 64x200 32x4096``: every row decodes one
token over CONTEXT tokens of cache), timed as the engine's decode graph runs it (the
triton backend's capture plan for that bucket and context bound; ``fp8.time_us``: a CUDA
graph of 24 calls cycling ``--copies`` layers' caches so that L2 does not hold them):

- ``attn_us``: the decode attention alone (``TritonBackend.forward`` with the KV stored
  already: the split kernel and its merge), bf16 and e4m3 caches, and the KV bytes it reads
  per microsecond (``gb_s``); ``fp8_over_bf16``: the ratio of the two;
- ``block_us``: RoPE + KV store + attention as a decode step runs them: ``bf16`` (the RoPE
  kernel stores K/V), ``fp8_unfused`` (RoPE alone, then the backend quantizes K and V in
  torch ops and its store kernel writes them: the engine before the fused FP8 store) and
  ``fp8_fused`` (the RoPE kernel quantizes and stores: ``fused_ops.rope_store_kv`` with an
  e4m3 cache); x 32 layers in ``block_ms_per_step``;
- ``variants_us`` (at ``--variant-shapes``): the decode attention under other tiles / warps /
  stages (``--variants``) than the bucket's own ``config``, both caches: does the e4m3
  cache, with half the bytes a tile, want more tokens a tile?
- ``silu_gemv`` (once): a one-row step's SwiGLU + FP8 down projection, two launches against
  the gemv that computes the activation itself (``fp8.FUSE_SILU_GEMV``'s question);
- ``max_rel_err``: the e4m3 cache's attention output against the bf16 cache's over the same
  values (largest |difference| / largest |output|).

Writes ``$OUT/fp8_attn_probe.json`` and prints a compact table. ``--device cpu`` (under
``TRITON_INTERPRET=1``, toy shapes such as ``2x40``) checks the script itself: the times
mean nothing there.

``--kernel-variants NAME,...`` (``all``: every one of ``KERNEL_VARIANTS``) times instead the
decode attention alone at each shape under each named variant of the decode kernel
(``apply_variant``: the backend's load / conversion switches, the e4m3 cache's tile, warps,
prefetch, pieces), with its output's largest difference from the bf16 cache's
(``err_vs_bf16``) and from the e4m3 default's (``diff_vs_fp8``), over the largest output;
``best_fp8``: the fastest e4m3 variant at that shape.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch

from pdserve.model import fp8, triton_backend
from pdserve.model.attention import build_attention_metadata, quantize_kv
from pdserve.model.fused_ops import rope_inplace, rope_store_kv
from pdserve.model.triton_backend import ONE_SPLIT_MAX_CONTEXT, TritonBackend

HQ, HKV, D, PAGE = 32, 8, 128, 128
LAYERS = 32


def _timer(cuda: bool):
    if cuda:
        return fp8.time_us

    def cpu_us(fns, reps: int = 2) -> float:
        t0 = time.perf_counter()
        for i in range(reps):
            fns[i % len(fns)]()
        return 1e6 * (time.perf_counter() - t0) / reps

    return cpu_us


_AL = {"FP8_KV_ALIGNED_LOADS": True}
_F16 = {"FP8_KV_F16_DOTS": True}
_S6 = {"FP8_KV_ALIGNED_LOADS": False, "FP8_KV_F16_DOTS": False}
# name -> (cache, the backend's switches set (``FP8_KV_F16_DOTS``: every rule or none; a
# switch not named keeps the backend's default), DecodeConfig fields replaced in the e4m3
# cache's configuration: tokens a tile, warps, the next tile's prefetch, the pieces the
# long-context rule cuts the batch's KV into). "fp8": the backend's e4m3 defaults; "fp8
# s6": the e4m3 kernel as session 6 left it (4 warps everywhere: the bf16 tiles).
KERNEL_VARIANTS: dict[str, tuple[str, dict[str, bool], dict[str, int | bool]]] = {
    "bf16": ("bf16", {}, {}),
    "bf16 aligned": ("bf16", {"KV16_ALIGNED_LOADS": True}, {}),
    "fp8": ("fp8", {}, {}),
    "fp8 s6": ("fp8", _S6, {"num_warps": 4}),
    "fp8 f16dot": ("fp8", _F16, {}),
    "fp8 aligned": ("fp8", _AL, {}),
    "fp8 aligned f16dot": ("fp8", _AL | _F16, {}),
    "fp8 aligned f16dot prefetch": ("fp8", _AL | _F16, {"prefetch": True}),
    "fp8 aligned f16dot n128": ("fp8", _AL | _F16, {"block_n": 128}),
    "fp8 aligned f16dot n128 w8": ("fp8", _AL | _F16, {"block_n": 128, "num_warps": 8}),
    "fp8 aligned f16dot n32": ("fp8", _AL | _F16, {"block_n": 32}),
    "fp8 aligned f16dot w8": ("fp8", _AL | _F16, {"num_warps": 8}),
    "fp8 aligned f16dot w4": ("fp8", _AL | _F16, {"num_warps": 4}),
    "fp8 aligned f16dot w2": ("fp8", _AL | _F16, {"num_warps": 2}),
    "fp8 aligned f16dot balance2048": ("fp8", _AL | _F16, {"balance": 2048}),
}
_DEFAULTS = {
    sw: getattr(triton_backend, sw)
    for sw in ("FP8_KV_ALIGNED_LOADS", "KV16_ALIGNED_LOADS", "FP8_KV_F16_DOTS")
}
_RULES = frozenset({"split", "one", "long"})
_FP8_CONFIG = triton_backend.fp8_decode_config


def apply_variant(name: str) -> str:
    """Set :mod:`pdserve.model.triton_backend` up for the decode-kernel variant ``name`` (of
    :data:`KERNEL_VARIANTS`) in this process, before any launch or graph capture: its
    switches set (the others at the backend's defaults) and its fields replaced in every
    e4m3 configuration (``balance`` only in the long-context rule's; ``min_split`` rounded
    up to the tile). Returns the cache it is for (``"bf16"`` / ``"fp8"``)."""
    kind, switches, fields = KERNEL_VARIANTS[name]
    for sw, default in _DEFAULTS.items():
        on = switches.get(sw)
        if sw == "FP8_KV_F16_DOTS" and on is not None:
            setattr(triton_backend, sw, _RULES if on else frozenset())
        else:
            setattr(triton_backend, sw, default if on is None else on)

    def fp8_config(cfg):
        cfg = _FP8_CONFIG(cfg)
        f = {k: v for k, v in fields.items() if k != "balance" or cfg.balance}
        bn = int(f.get("block_n", cfg.block_n))
        f["min_split"] = -(-cfg.min_split // bn) * bn if cfg.min_split else 0
        return replace(cfg, **f)

    triton_backend.fp8_decode_config = fp8_config if fields else _FP8_CONFIG  # type: ignore[assignment]
    return kind


def _case(rows: int, ctx: int, copies: int, dev: torch.device) -> dict:
    """One shape's inputs: ``rows`` decode rows over ``ctx`` tokens, ``copies`` layers'
    caches of each kind (random bf16 and its e4m3), the metadata, q/k/v and a backend."""
    gen = torch.Generator().manual_seed(rows * 7 + ctx)
    pages_per_row = -(-(ctx + 1) // PAGE)
    num_pages = rows * pages_per_row
    tables = [list(range(r * pages_per_row, (r + 1) * pages_per_row)) for r in range(rows)]
    md = build_attention_metadata([1] * rows, [ctx] * rows, tables, PAGE, dev)
    qkv = (torch.randn(rows, HQ + 2 * HKV, D, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    caches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"bf16": [], "fp8": []}
    torch.manual_seed(rows * 7 + ctx)
    for _ in range(copies):
        kv = torch.randn(2, num_pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
        caches["bf16"].append((kv[0], kv[1]))
        caches["fp8"].append((quantize_kv(kv[0], 1.0), quantize_kv(kv[1], 1.0)))
    bound = ONE_SPLIT_MAX_CONTEXT if ctx <= ONE_SPLIT_MAX_CONTEXT else None
    return dict(md=md, qkv=qkv, caches=caches, bound=bound, backend=TritonBackend())


def probe_kernels(
    rows: int, ctx: int, copies: int, dev: torch.device, names: list[str], save=None
) -> dict:
    """The decode attention alone at one shape under each variant of ``names`` (see the
    module doc), as the engine's decode graph for that bucket runs it; ``save(res)`` (if
    given) after each variant, so that a run cut short keeps what it measured."""
    c = _case(rows, ctx, copies, dev)
    timer = _timer(dev.type == "cuda")
    backend, md, qkv = c["backend"], c["md"], c["qkv"]
    q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
    kv_bytes = {"bf16": rows * ctx * HKV * D * 2 * 2, "fp8": rows * ctx * HKV * D * 2}
    res: dict = {"rows": rows, "context": ctx, "graph_context_bound": c["bound"]}
    for key in ("kernels_us", "gb_s", "err_vs_bf16", "diff_vs_fp8", "configs"):
        res[key] = {}
    outs: dict[str, torch.Tensor] = {}
    for name in names:
        try:
            kind = apply_variant(name)
            p = backend.plan_for_capture(md, PAGE, c["bound"])

            def attn(i: int, p=p, kind=kind) -> torch.Tensor:
                kc, vc = c["caches"][kind][i]
                return backend.forward(q, k, v, kc, vc, md, p, D**-0.5, kv_stored=True)

            out = attn(0).float()
            cfg = p.config if kind == "bf16" else triton_backend.fp8_decode_config(p.config)
            res["configs"][name] = str(cfg)
            us = timer([lambda i=i: attn(i) for i in range(copies)])
            res["kernels_us"][name] = us
            res["gb_s"][name] = kv_bytes[kind] / us / 1e3
            outs[name] = out
            for ref, key in (("bf16", "err_vs_bf16"), ("fp8", "diff_vs_fp8")):
                if ref in outs:
                    d = (out - outs[ref]).abs().max() / outs[ref].abs().max()
                    res[key][name] = float(d)
        except Exception as exc:  # noqa: BLE001 a variant that fails to build or run: noted
            res["kernels_us"][name] = f"failed: {' '.join(str(exc).split())[:160]}"
        finally:
            apply_variant("bf16")
        timed = {n: t for n, t in res["kernels_us"].items() if isinstance(t, float)}
        fp8 = {n: t for n, t in timed.items() if KERNEL_VARIANTS[n][0] == "fp8"}
        if fp8:
            res["best_fp8"] = min(fp8, key=fp8.__getitem__)
        if save is not None:
            save(res)
    return res


def probe(
    rows: int, ctx: int, copies: int, dev: torch.device, variants: list[tuple[int, int, int]]
) -> dict:
    """The figures of one shape (see the module doc); ``variants``: the decode
    configurations ``(block_n, num_warps, num_stages)`` also timed over both caches."""
    cuda = dev.type == "cuda"
    gen = torch.Generator().manual_seed(rows * 7 + ctx)
    pages_per_row = -(-(ctx + 1) // PAGE)
    num_pages = rows * pages_per_row
    tables = [list(range(r * pages_per_row, (r + 1) * pages_per_row)) for r in range(rows)]
    md = build_attention_metadata([1] * rows, [ctx] * rows, tables, PAGE, dev)
    positions = torch.full((rows,), ctx - 1, dtype=torch.int64, device=dev)
    backend = TritonBackend()
    bound = ONE_SPLIT_MAX_CONTEXT if ctx <= ONE_SPLIT_MAX_CONTEXT else None
    qkv = (torch.randn(rows, HQ + 2 * HKV, D, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    table = torch.randn(max(ctx, 1) + 1, D, generator=gen).to(torch.bfloat16).to(dev)
    caches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"bf16": [], "fp8": []}
    torch.manual_seed(rows * 7 + ctx)
    for _ in range(copies):  # drawn on the device (32 x 4,096: 4 x 277 M values)
        kv = torch.randn(2, num_pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
        caches["bf16"].append((kv[0], kv[1]))
        caches["fp8"].append((quantize_kv(kv[0], 1.0), quantize_kv(kv[1], 1.0)))
    timer = _timer(cuda)
    scale = D**-0.5

    def plan():
        return backend.plan_for_capture(md, PAGE, bound)

    def attn(kind: str, i: int, p) -> torch.Tensor:
        kc, vc = caches[kind][i]
        q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
        return backend.forward(q, k, v, kc, vc, md, p, scale, kv_stored=True)

    def block(kind: str, fused: bool, i: int, p) -> torch.Tensor:
        kc, vc = caches[kind][i]
        x = qkv.clone() if not cuda else qkv  # in place is fine for timing
        qk, v = x[:, : HQ + HKV], x[:, HQ + HKV :]
        if fused:
            rope_store_kv(qk, v, table, positions, kc, vc, md.slot_mapping)
            stored = True
        else:
            rope_inplace(qk, table, positions)
            stored = False
        return backend.forward(qk[:, :HQ], qk[:, HQ:], v, kc, vc, md, p, scale, kv_stored=stored)

    res: dict = {"rows": rows, "context": ctx, "graph_context_bound": bound}
    kv_bytes = {"bf16": rows * ctx * HKV * D * 2 * 2, "fp8": rows * ctx * HKV * D * 2}
    res["attn_us"], res["gb_s"] = {}, {}
    outs = {}
    for kind in ("bf16", "fp8"):
        p = plan()
        outs[kind] = attn(kind, 0, p).float()
        us = timer([lambda i=i, p=p, kind=kind: attn(kind, i, p) for i in range(copies)])
        res["attn_us"][kind] = us
        res["gb_s"][kind] = kv_bytes[kind] / us / 1e3
    res["fp8_over_bf16"] = res["attn_us"]["fp8"] / res["attn_us"]["bf16"]
    ref = outs["bf16"]
    res["max_rel_err"] = float((outs["fp8"] - ref).abs().max() / ref.abs().max())
    # The e4m3 cache reads half the bytes a tile: variants of the decode configuration
    # the graph's plan picks (more tokens a tile, stages, warps) for that cache, and the
    # same for bf16 as the control. (block_n, num_warps, num_stages); min_split stays a
    # multiple of block_n.
    if variants:
        base = plan()
        attn("fp8", 0, base)  # fixes base.config (the engine's pick for this bucket)
        cfg0 = base.config
        res["config"] = str(cfg0)
        res["variants_us"] = {}
        for bn, warps, stages in variants:
            min_split = -(-cfg0.min_split // bn) * bn if cfg0.min_split else 0
            cfg = replace(cfg0, block_n=bn, num_warps=warps, num_stages=stages, min_split=min_split)
            for kind in ("fp8", "bf16"):
                p = plan()
                p.config = cfg
                try:
                    attn(kind, 0, p)
                    us = timer(
                        [lambda i=i, p=p, kind=kind: attn(kind, i, p) for i in range(copies)]
                    )
                except Exception as exc:  # noqa: BLE001 a tile Triton cannot build: noted
                    us = f"failed: {str(exc)[:120]}"
                res["variants_us"][f"{kind} n{bn} w{warps} s{stages}"] = us
    res["block_us"] = {}
    for name, kind, fused in (
        ("bf16", "bf16", True),
        ("fp8_unfused", "fp8", False),
        ("fp8_fused", "fp8", True),
    ):
        p = plan()
        block(kind, fused, 0, p)
        res["block_us"][name] = timer(
            [
                lambda i=i, p=p, kind=kind, fused=fused: block(kind, fused, i, p)
                for i in range(copies)
            ]
        )
    res["block_ms_per_step"] = {k: v * LAYERS / 1e3 for k, v in res["block_us"].items()}
    return res


def silu_gemv(dev: torch.device, copies: int, n: int = 4096, k: int = 14336) -> dict:
    """One-row SwiGLU + down projection (Llama-3.1-8B's ``[4096, 14336]``, e4m3 per channel)
    by the FP8 gemv with the card's one-row tile (``fp8_paths_table``, else the default):
    ``fused_ops.silu_mul`` then the gemv (two launches, what a one-row FP8 step runs now)
    against the gemv computing the activation itself (``silu_mul=True``, one launch), µs a
    layer; and their largest difference over the largest output."""
    from pdserve.model import fp8_paths_table, triton_w8a8
    from pdserve.model.fused_ops import silu_mul

    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    entry = fp8_paths_table.TABLE.get((card, n, k))
    config = entry[0][1][1] if entry and entry[0][1][0] == "gemv" else triton_w8a8.DEFAULT_GEMV
    torch.manual_seed(11)  # drawn on the device: a CPU draw of 4 x 59 M values takes seconds
    ws = [fp8.quantize_per_channel(torch.randn(n, k, device=dev) * 0.02) for _ in range(copies)]
    x = torch.randn(1, 2 * k, device=dev).to(torch.bfloat16)
    timer = _timer(dev.type == "cuda")

    def two(q, s):
        return triton_w8a8.gemv(silu_mul(x), q, s, None, config)

    def one(q, s):
        return triton_w8a8.gemv(x, q, s, None, config, silu_mul=True)

    a, b = two(*ws[0]).float(), one(*ws[0]).float()
    return {
        "config": list(config),
        "silu_then_gemv_us": timer([lambda q=q, s=s: two(q, s) for q, s in ws]),
        "fused_us": timer([lambda q=q, s=s: one(q, s) for q, s in ws]),
        "max_rel_diff": float((a - b).abs().max() / a.abs().max()),
    }


def kernel_variants(args, dev: torch.device, out: str, res: dict) -> None:
    """``--kernel-variants``: each shape's decode attention under each named variant,
    printed and written to ``$OUT/<--json>`` after each shape."""
    names = (
        list(KERNEL_VARIANTS) if args.kernel_variants == "all" else args.kernel_variants.split(",")
    )
    unknown = [n for n in names if n not in KERNEL_VARIANTS]
    if unknown:
        raise SystemExit(f"--kernel-variants: unknown {unknown}; known: {list(KERNEL_VARIANTS)}")
    for shape in args.shapes:
        rows, ctx = (int(x) for x in shape.split("x"))

        def save(r: dict, shape: str = shape) -> None:
            res[shape] = r
            with open(os.path.join(out, args.json), "w") as f:
                json.dump(res, f, indent=1)

        r = probe_kernels(rows, ctx, args.copies, dev, names, save)
        print(f"{shape}: fastest e4m3 variant: {r.get('best_fp8')}", flush=True)
        for n, t in r["kernels_us"].items():
            if not isinstance(t, float):
                print(f"  {n:<32} {t}", flush=True)
                continue
            line = f"  {n:<32} {t:8.1f} us {r['gb_s'][n]:6.0f} GB/s"
            if n in r["err_vs_bf16"]:
                line += f"  err {r['err_vs_bf16'][n]:.3f}"
            if n in r["diff_vs_fp8"]:
                line += f"  vs fp8 {r['diff_vs_fp8'][n]:.1e}"
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=["1x200", "64x200", "32x4096"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copies", type=int, default=4, help="layers' caches cycled (L2)")
    ap.add_argument("--json", default="fp8_attn_probe.json", help="file name under $OUT")
    ap.add_argument(
        "--variants",
        default="64/4/3,128/4/2,128/8/2,128/4/3",
        help="decode configurations block_n/warps/stages also timed (with the bucket's "
        "splits), comma-separated; '': none",
    )
    ap.add_argument("--no-silu-gemv", action="store_true", help="skip the SwiGLU gemv timing")
    ap.add_argument(
        "--variant-shapes", default="1x200,32x4096", help="the shapes the variants are timed at"
    )
    ap.add_argument(
        "--kernel-variants",
        default="",
        help="time only the decode attention under these KERNEL_VARIANTS (comma-separated "
        "names; 'all': every one) at each shape",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    out = os.environ.get("OUT", ".")
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    if args.kernel_variants:
        kernel_variants(args, dev, out, res)
        return
    print(
        f"{'shape':>9} {'attn bf16 us':>12} {'fp8 us':>8} {'fp8/bf16':>8} {'GB/s bf16':>9} "
        f"{'fp8':>6} {'block bf16':>10} {'fp8 unfused':>11} {'fp8 fused':>9} (us a layer)"
        f" {'err':>7}"
    )
    if not args.no_silu_gemv:
        r = silu_gemv(dev, args.copies)
        res["silu_gemv"] = r
        print(
            f"one-row SwiGLU + FP8 down gemv {r['config']}: silu_mul then gemv "
            f"{r['silu_then_gemv_us']:.1f} us, fused {r['fused_us']:.1f} us "
            f"(x 32 layers: {32 * (r['silu_then_gemv_us'] - r['fused_us']) / 1e3:+.3f} ms saved; "
            f"diff {r['max_rel_diff']:.2g})",
            flush=True,
        )
    for shape in args.shapes:
        rows, ctx = (int(x) for x in shape.split("x"))
        variants = [tuple(int(x) for x in v.split("/")) for v in args.variants.split(",") if v]
        r = probe(
            rows, ctx, args.copies, dev, variants if shape in args.variant_shapes.split(",") else []
        )
        res[shape] = r
        a, b = r["attn_us"], r["block_us"]
        print(
            f"{shape:>9} {a['bf16']:>12.1f} {a['fp8']:>8.1f} {r['fp8_over_bf16']:>8.2f} "
            f"{r['gb_s']['bf16']:>9.0f} {r['gb_s']['fp8']:>6.0f} {b['bf16']:>10.1f} "
            f"{b['fp8_unfused']:>11.1f} {b['fp8_fused']:>9.1f} {r['max_rel_err']:>7.3f}",
            flush=True,
        )
        if "variants_us" in r:
            print(f"          {r['config']}")
            print(
                "          "
                + "  ".join(
                    f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in r["variants_us"].items()
                ),
                flush=True,
            )
        with open(os.path.join(out, args.json), "w") as f:  # after each shape: a cut run keeps it
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
