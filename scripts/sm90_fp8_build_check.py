"""Build the FP8 kernels of ``pdserve/model/triton_w8a8.py`` for Hopper (sm_90) on a machine
without a GPU (``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` through Triton's bundled
``ptxas``, as ``scripts/sm90_build_check.py`` does for the TMA GEMV) and count what their
machine code uses: every constexpr set that ``fp8.choose_paths`` tries at Llama-3.1-8B's
shapes (each w8a8 tile on e4m3 and on bf16 activations, with and without split-K), the gemv
tiles and the activation quantization. Per kernel: ``QGMMA`` / ``HGMMA`` (wgmma on e4m3 /
16-bit operands), ``HMMA`` (mma.sync),
``LDL``/``STL`` (spills), shared memory. This says that they build and which instructions
they use with this machine's Triton (3.9 in the CPU venv; the H200 image has 3.6): not their
speed nor their results.

``python3 scripts/sm90_fp8_build_check.py [--json PATH]``. Run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import torch

sys.path.insert(0, os.path.dirname(__file__))
import sm90_build_check
from sm90_build_check import build, sass_counts

from pdserve.model import fp8, triton_w8a8

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
# QGMMA: Hopper's wgmma on e4m3 operands (HGMMA: 16-bit ones); HMMA: mma.sync
OPS = ("QGMMA", "HGMMA", "HMMA", "LDL", "STL")
sm90_build_check.OPS = OPS


def _row(kernel) -> dict:
    c = sass_counts(kernel)
    return {**{op: c.get(op, 0) for op in OPS}, "shared": kernel.metadata.shared}


def w8a8_builds() -> dict:
    cfgs: set[tuple[bool, tuple]] = set()
    for m in fp8.PROBE_ROWS:
        for n, k in SHAPES:
            for path in fp8.candidate_paths(m, n, k):
                if path[0] in ("w8a8", "w8a16s"):
                    cfgs.add((path[0] == "w8a8", path[1]))
    out = {}
    for a8, cfg in sorted(cfgs, key=str):
        _, bm, bn, bk, split, swap, warps, stages = cfg
        xdt = torch.float8_e4m3fn if a8 else torch.bfloat16
        args = dict(
            x_ptr=torch.empty(64, 64, dtype=xdt),
            xs_ptr=torch.empty(64, dtype=torch.float32),
            w_ptr=torch.empty(64, 64, dtype=torch.float8_e4m3fn),
            ws_ptr=torch.empty(64, dtype=torch.float32),
            b_ptr=torch.empty(64, dtype=torch.float32),
            o_ptr=torch.empty(64, dtype=torch.float32 if split > 1 else torch.bfloat16),
            M=64,
            N=4096,
            K=4096,
            K_SPLIT=1024,
            s_xm=4096,
            s_wn=4096,
            s_om=4096,
            s_os=4096 * 64,
        )
        const = dict(
            HAS_BIAS=False,
            A8=a8,
            PARTIAL=split > 1,
            SWAP=swap,
            EVEN_K=True,
            EMULATE=False,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            PDL=False,
        )
        name = f"{'w8a8' if a8 else 'w8a16s'}{list(cfg[1:])}"
        try:
            out[name] = _row(build(triton_w8a8._w8a8_kernel, args, const, warps, stages))
        except Exception as exc:  # noqa: BLE001 report, go on
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        print(name, out[name], flush=True)
    return out


def other_builds() -> dict:
    out = {}
    for cfg in triton_w8a8.GEMV_CANDIDATES:
        _, bn, bk, warps, stages = cfg
        args = dict(
            x_ptr=torch.empty(64, dtype=torch.bfloat16),
            w_ptr=torch.empty(64, 64, dtype=torch.float8_e4m3fn),
            s_ptr=torch.empty(64, dtype=torch.float32),
            b_ptr=torch.empty(64, dtype=torch.float32),
            o_ptr=torch.empty(64, dtype=torch.bfloat16),
            N=4096,
            K=4096,
            s_wn=4096,
        )
        const = dict(HAS_BIAS=False, EVEN_K=True, BLOCK_N=bn, BLOCK_K=bk, SILU=False, PDL=False)
        name = f"gemv{list(cfg[1:])}"
        try:
            out[name] = _row(build(triton_w8a8._gemv_kernel, args, const, warps, stages))
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        print(name, out[name], flush=True)
    for block, one in ((4096, True), (8192, False)):
        args = dict(
            x_ptr=torch.empty(64, dtype=torch.bfloat16),
            q_ptr=torch.empty(64, dtype=torch.float8_e4m3fn),
            s_ptr=torch.empty(64, dtype=torch.float32),
            K=4096,
            s_xm=4096,
            s_qm=4096,
        )
        const = dict(BLOCK_K=block, ONE_TILE=one, PDL=False)
        name = f"quant[{block}, {one}]"
        try:
            out[name] = _row(build(triton_w8a8._quant_rows_kernel, args, const, 8, 3))
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        print(name, out[name], flush=True)
    return out


def main() -> int:
    res = {"w8a8": w8a8_builds(), "other": other_builds()}
    bad = [k for part in res.values() for k, v in part.items() if "error" in v]
    print(f"{sum(len(p) for p in res.values())} kernels, {len(bad)} failed to build: {bad}")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(res, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
