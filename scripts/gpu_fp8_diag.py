"""FP8 linear on CUDA against the dequantized weight, row counts 1..256, Llama-3.1-8B shapes.

Prints, per (shape, rows, path), the largest |error| relative to the output's largest
|value|: the production path (``fp8.linear``), the Triton kernel's default configuration,
and ``_scaled_mm``. Run on the GPU machine: ``python scripts/gpu_fp8_diag.py``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pdserve.model import fp8, triton_fp8


def main() -> None:
    out = []
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda") * 0.02
        q, s = fp8.quantize_per_channel(w)
        fw = fp8.Fp8Weight(q, s, k)
        real = fw.dequantize(torch.float32)
        for m in (1, 2, 3, 4, 8, 16, 17, 31, 32, 64, 128, 256):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ real.T
            scale = ref.abs().max().item()
            row = {"n": n, "k": k, "m": m}
            for name, fn in (
                ("linear", lambda x=x, fw=fw: fp8.linear(x, fw, None)),
                (
                    "triton_default",
                    lambda x=x, fw=fw: triton_fp8.fp8_matmul(x, fw.weight, fw.scale, fw.group),
                ),
                ("scaled_mm", lambda x=x, fw=fw: fp8.scaled_mm(x, fw, None)),
            ):
                try:
                    got = fn().float()
                    row[name] = round((got - ref).abs().max().item() / scale, 5)
                except Exception as exc:  # noqa: BLE001
                    row[name] = f"error {type(exc).__name__}: {exc}"[:120]
            print(row, flush=True)
            out.append(row)
    path = os.path.join(os.environ.get("OUT", "."), "fp8_diag.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
