"""Build the TMA GEMV kernels (``pdserve/model/triton_gemv_tma.py``) for Hopper (sm_90) on a
machine without a GPU, and count what their machine code uses.

Triton compiles ahead of time for a named target (``triton.compile`` with
``GPUTarget("cuda", 90, 32)``) through its bundled ``ptxas``; ``cuobjdump -sass`` (bundled
too) lists the instructions. Each kernel is specialised as a launch would specialise it
(integer arguments and pointers divisible by 16 marked so, as Triton's JIT does at run time).
Counted per kernel: ``HGMMA`` (Hopper's warpgroup MMA, wgmma), ``UTMALDG`` (bulk tensor
copies, TMA), ``SYNCS`` (mbarrier operations), ``STG.E.128`` / ``STG.E.U16`` (16-byte and
2-byte global stores), ``LDL``/``STL`` (local memory: spills), the shared memory and the warps
(warp specialization adds warps). This says the kernel builds and which instructions it
uses, with this machine's Triton (3.9 in the CPU venv; the H200 image has 3.6): not its
speed, nor its results (the CPU tests run it under the interpreter; the sweep on the GPU).
The H200's own build: ``pip install --no-deps --target /tmp/triton36 triton==3.6.0`` and
``PYTHONPATH=/tmp/triton36:.`` (the decode kernel's registers and shared memory then equal
those the H200 reported, docs/figures/h200_s10/fp8kv.json).

``python3 scripts/sm90_build_check.py --decode --configs "(1, 64, 4, 3)" "(1, 32, 4, 1, 0,
0, True)"``: the split-KV decode kernel instead (shared memory, registers, programs an SM
holds by each, cp.async vs register loads). ``python3 scripts/sm90_build_check.py
[--configs "('tma', 128, 128, 4, 3)" ...] [--ms 32,64] [--json]``: default every ``tma*`` configuration of ``scripts/gpu_gemv_sweep.py`` at the
Llama-3.1-8B o_proj shape (N = K = 4096), bf16. ``--pdl`` instead builds every kernel that
takes a ``PDL`` constexpr (``model/pdl.py``) with it on and off and says whether the PTX has
``griddepcontrol.wait`` / ``.launch_dependents``. ``--serve``: many such calls in one process
(one a line of stdin, as a JSON list of arguments; the tests' way: torch and Triton are
imported once). Run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.model import triton_gemv, triton_gemv_tma

TARGET = GPUTarget("cuda", 90, 32)
OPS = (
    "HGMMA",
    "HMMA",
    "UTMALDG",
    "SYNCS",
    "STG.E.128",
    "STG.E.U16",
    "LDL",
    "STL",
    "LDGSTS",
    "LDG",
    "LDG.E.128",
    "F2FP",
    "F2F",
    "HADD2.F32",
    "LDS",
    "LDSM",
)


def build(fn, args: dict, constexprs: dict, warps: int, stages: int):
    """``fn`` compiled for sm_90 with ``args`` (name -> value) specialised as a launch would."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        ty, attr = native_specialize_impl(BaseBackend, args[name], False, True, True)[:2]
        sig[name] = ty
        if isinstance(attr, str) and "D" in attr:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))


def sass_counts(kernel) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    words = collections.Counter(re.findall(r"\b([A-Z][A-Z0-9]*(?:\.[A-Z0-9]+)*)\b", sass))
    return {op: sum(n for w, n in words.items() if w == op or w.startswith(op + ".")) for op in OPS}


def check(cfg: tuple, m: int, n: int = 4096, k: int = 4096) -> dict:
    """Build ``cfg``'s kernel for ``m`` rows of bf16 ``[m, k] @ [n, k].T`` and count its SASS."""
    kind, block_n, block_k, warps, stages = cfg
    parsed = triton_gemv_tma.parse_kind(kind)
    if parsed is None:
        raise SystemExit(f"{kind!r} is not a tma kind")
    split, stream, ws = parsed
    bm = triton_gemv.block_m(m)
    w = torch.empty(n, k, dtype=torch.bfloat16)
    x = torch.empty(m, k, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    common = dict(
        x_desc=TensorDescriptor(x, [m, k], [k, 1], [bm, block_k]),
        w_desc=TensorDescriptor(w, [n, k], [k, 1], [block_n, block_k]),
        x_ptr=x,
        b_ptr=w,
        o_ptr=out,
        M=m,
        N=n,
        K=k,
        s_xm=k,
        s_om=n,
        NUM_PROGRAMS=132,
    )
    consts = dict(
        HAS_BIAS=False,
        SILU=False,
        X_DESC=True,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        WARP_SPEC=ws,
        FLATTEN=not ws,
        IEEE=False,
    )
    if stream:
        fn = triton_gemv_tma._gemv_tma_stream_kernel
        args = dict(common, p_ptr=torch.empty(1, dtype=torch.float32))
    else:
        fn = triton_gemv_tma._gemv_tma_kernel
        args = dict(common, K_TILES=triton.cdiv(k // block_k, split), s_os=m * n)
        consts["SPLIT_K"] = split
    kernel = build(fn, args, consts, warps, stages)
    return dict(
        config=list(cfg),
        M=m,
        shared=kernel.metadata.shared,
        warps=kernel.metadata.num_warps,
        sass=sass_counts(kernel),
    )


# The kernels that take a ``PDL`` constexpr (model/pdl.py), with the other constexprs of a
# Llama-3.1-8B bf16 launch and the dtypes of their non-bf16 pointers.
_I32, _I64, _F32 = torch.int32, torch.int64, torch.float32
PDL_KERNELS = {
    "fused_ops._rope_kernel": (
        dict(H=40, HALF=64, BLOCK_H=64, BLOCK_D=64, STORE=True, HQ=32, HKV=8, D=128,
             PAGE_SIZE=128, BLOCK_KV=8, BLOCK_DV=128, FP8=False),
        dict(pos_ptr=_I64, slot_ptr=_I64), 4),
    "fused_ops._silu_mul_kernel": (dict(BLOCK=1024), {}, 4),
    "fused_ops._add_rms_norm_kernel": (dict(HAS_RES=True, BLOCK=4096), {}, 8),
    "triton_kernels.store_kv_kernel": (
        dict(HKV=8, D=128, PAGE_SIZE=128, BLOCK_H=8, BLOCK_D=128), dict(slot_ptr=_I64), 4),
    "triton_kernels.decode_split_kernel": (
        dict(G=4, D=128, PAGE_SIZE=128, NUM_SPLITS=2, MIN_SPLIT=256, BALANCE_PROGRAMS=264,
             BLOCK_B=64, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, TILE_IN_PAGE=True, IEEE=False,
             F16_DOT=False, PREFETCH=False, ALIGNED=False, WIDEN=0, FMA=False, UNROLL=1,
             EVICT=False, EVEN=False),
        dict(table_ptr=_I32, seq_lens_ptr=_I64, mid_o_ptr=_F32, mid_lse_ptr=_F32), 4),
    "triton_kernels.decode_merge_kernel": (
        dict(D=128, NUM_SPLITS=2, BLOCK_S=2, BLOCK_D=128), dict(mid_o_ptr=_F32, mid_lse_ptr=_F32), 4),
    "triton_kernels.extend_kernel": (
        dict(G=4, D=128, PAGE_SIZE=128, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, IEEE=False),
        dict(table_ptr=_I32, qsl_ptr=_I32, seq_lens_ptr=_I64), 4),
    "triton_gemv._gemv_rows_kernel": (
        dict(HAS_BIAS=False, SILU=False, BLOCK_N=16, BLOCK_K=1024), {}, 8),
    "triton_gemv._gemv_dot_kernel": (
        dict(HAS_BIAS=False, SILU=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2,
             IEEE=False), dict(o_ptr=_F32), 4),
    "triton_gemv._splitk_reduce_kernel": (
        dict(HAS_BIAS=False, SPLIT_K=2, BLOCK=1024), dict(p_ptr=_F32), 4),
}  # fmt: skip


def registers(kernel) -> int:
    """Registers a thread of ``kernel`` uses (``cuobjdump -res-usage``)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return int(re.findall(r"REG:(\d+)", out)[0])


def check_decode(
    cfg: tuple, kv: str = "bf16", f16_dot: bool = False, aligned: bool = False
) -> dict:
    """The split-KV decode kernel (``triton_kernels.decode_split_kernel``) at Llama-3.1-8B's
    heads (G 4, head_dim 128, 128-token pages, bf16) for ``cfg`` = DecodeConfig's fields
    ``(splits, block_n, num_warps, num_stages[, min_split, balance, prefetch, widen, fma,
    unroll, evict, even, vmul])``: shared
    memory, registers a thread, programs an SM can hold by each (228 KB, 64K registers) and
    its SASS counts (``LDGSTS``: cp.async into shared memory, Triton's pipeline; ``LDG``:
    loads into registers; ``F2FP``/``F2F``/``HADD2.F32``: conversions). ``kv="fp8"``: an
    e4m3 cache, ``f16_dot``: the kernel's ``F16_DOT`` (its tiles converted to fp16, not
    bf16); ``aligned``: its ``ALIGNED`` (16-byte K/V loads: ``LDG.E.128``). ``loops``: each
    loop's body (a backward branch's range) in SASS instructions, one warp's, and the
    opcodes it issues most (the tile loop is the longest; with ``even`` its whole tiles'
    loop), ``LDS.U8``: byte loads from shared memory in the whole kernel."""
    from pdserve.model import triton_kernels

    splits, block_n, warps, stages, *rest = cfg
    defaults = (0, 0, False, 0, False, 1, False, False, False)
    min_split, balance, prefetch, widen, fma, unroll, evict, even, vmul = (
        *rest,
        *defaults[len(rest) :],
    )
    consts = dict(
        G=4, D=128, PAGE_SIZE=128, NUM_SPLITS=splits, MIN_SPLIT=min_split,
        BALANCE_PROGRAMS=balance, BLOCK_B=64 if balance else 1, BLOCK_H=4 if fma else 16,
        BLOCK_N=block_n, BLOCK_D=128, TILE_IN_PAGE=128 % block_n == 0, IEEE=False, PDL=False,
        PREFETCH=bool(prefetch), F16_DOT=f16_dot, ALIGNED=aligned,
        WIDEN=widen if kv == "fp8" else 0, FMA=bool(fma), UNROLL=unroll, EVICT=bool(evict),
        EVEN=bool(even), VMUL=bool(vmul) and kv == "fp8",
    )  # fmt: skip
    dtypes = dict(table_ptr=_I32, seq_lens_ptr=_I64, mid_o_ptr=_F32, mid_lse_ptr=_F32)
    if kv == "fp8":
        dtypes.update(k_cache_ptr=torch.float8_e4m3fn, v_cache_ptr=torch.float8_e4m3fn)
    args: dict = {}
    for arg in triton_kernels.decode_split_kernel.arg_names:
        if arg in consts:
            continue
        if arg.endswith("_ptr"):
            args[arg] = torch.empty(64, dtype=dtypes.get(arg, torch.bfloat16))
        else:
            args[arg] = {"scale": 0.5, "v_mul": 1.0}.get(arg, 4096)
    kernel = build(triton_kernels.decode_split_kernel, args, consts, warps, stages)
    regs = registers(kernel)
    shared = kernel.metadata.shared
    return dict(
        config=list(cfg),
        kv=kv,
        f16_dot=f16_dot,
        aligned=aligned,
        shared=shared,
        registers=regs,
        programs_per_sm_by_shared=(228 * 1024) // max(1, shared + 1024),
        programs_per_sm_by_registers=65536 // (regs * 32 * warps),
        sass=sass_counts(kernel),
        loops=loop_counts(kernel),
        lds_u8=sass_text(kernel).count("LDS.U8"),
    )


def sass_text(kernel) -> str:
    """``kernel``'s SASS (``cuobjdump -sass``)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def loop_counts(kernel) -> list[dict]:
    """Each loop of ``kernel``'s SASS (the instructions from a backward branch's target to
    the branch): its instruction count and its 8 most frequent opcodes (without
    modifiers), longest loop first."""
    ins = []
    for line in sass_text(kernel).splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    out = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            ops = collections.Counter(o.split(".")[0] for o in body)
            out.append({"instructions": len(body), "top": dict(ops.most_common(8))})
    return sorted(out, key=lambda r: -r["instructions"])


def check_pdl(name: str, pdl: bool) -> dict:
    """Build kernel ``name`` (``module.kernel`` of pdserve.model) for sm_90 with ``PDL``
    set or not; say whether its PTX waits on the previous grid and lets the next launch."""
    import importlib

    module, attr = name.split(".")
    fn = getattr(importlib.import_module(f"pdserve.model.{module}"), attr)
    consts, dtypes, warps = PDL_KERNELS[name]
    consts = dict(consts, PDL=pdl)
    args: dict = {}
    for arg in fn.arg_names:
        if arg in consts:
            continue
        if arg.endswith("_ptr"):
            args[arg] = torch.empty(64, dtype=dtypes.get(arg, torch.bfloat16))
        else:
            args[arg] = 0.5 if arg in ("scale", "eps", "v_mul") else 4096
    ptx = build(fn, args, consts, warps, 2).asm["ptx"]
    return dict(
        kernel=name,
        pdl=pdl,
        wait="griddepcontrol.wait" in ptx,
        launch_dependents="griddepcontrol.launch_dependents" in ptx,
    )


# ``--serve``: the line printed after each request's rows (the tests' ``sm90_build`` fixture,
# tests/model/conftest.py, reads up to it).
SERVE_END = "-- sm90_build_check: done --"


def serve() -> None:
    """Build on request, torch and Triton imported once: each line of stdin is one call's
    arguments (a JSON list, as on the command line); its rows are printed, then
    :data:`SERVE_END`. A call whose arguments fail to parse prints its usage error instead
    (on stderr) and the marker all the same."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            main(json.loads(line))
        except SystemExit:
            pass
        print(SERVE_END, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=None, help="config tuples (Python syntax)")
    ap.add_argument("--ms", default="32,64", help="row counts")
    ap.add_argument("--json", action="store_true", help="one json line a (config, M)")
    ap.add_argument(
        "--pdl", action="store_true", help="build the PDL kernels with and without PDL instead"
    )
    ap.add_argument(
        "--decode",
        action="store_true",
        help="build the split-KV decode kernel for each --configs tuple (DecodeConfig's "
        "fields) instead",
    )
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"), help="--decode's cache")
    ap.add_argument("--f16-dot", action="store_true", help="--decode with F16_DOT")
    ap.add_argument("--aligned", action="store_true", help="--decode with ALIGNED")
    ap.add_argument(
        "--serve",
        action="store_true",
        help="read calls from stdin, one a line (a JSON list of these arguments), each "
        f"answered by its rows and a line {SERVE_END!r}: one process for many calls",
    )
    args = ap.parse_args(argv)
    if args.serve:
        serve()
        return
    if args.decode:
        for c in args.configs or ["(1, 64, 4, 3)"]:
            cfg = tuple(ast.literal_eval(c))
            try:
                row = check_decode(cfg, args.kv, args.f16_dot, args.aligned)
            except Exception as exc:  # noqa: BLE001 (reported: a configuration that does not build)
                row = dict(config=list(cfg), error=" ".join(str(exc).split())[:300])
            print(json.dumps(row) if args.json else row, flush=True)
        return
    if args.pdl:
        for name in PDL_KERNELS:
            for pdl in (True, False):
                try:
                    row = check_pdl(name, pdl)
                except Exception as exc:  # noqa: BLE001 (reported: a kernel that does not build)
                    row = dict(kernel=name, pdl=pdl, error=" ".join(str(exc).split())[:300])
                print(json.dumps(row) if args.json else row, flush=True)
        return
    if args.configs:
        cfgs = [tuple(ast.literal_eval(c)) for c in args.configs]
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_gemv_sweep

        cfgs = gpu_gemv_sweep.TMA
    for cfg in cfgs:
        for m in (int(s) for s in args.ms.split(",")):
            try:
                row = check(cfg, m)
            except Exception as exc:  # noqa: BLE001 (reported: a configuration that does not build)
                row = dict(config=list(cfg), M=m, error=" ".join(str(exc).split())[:300])
            print(json.dumps(row) if args.json else row, flush=True)


if __name__ == "__main__":
    main()
