#!/usr/bin/env bash
# A short H200 call (~4 min): issue 26 with the measured FP8 path table in the engine
# (pdserve/model/fp8_paths_table.py, from scripts/gpu_fp8_kernels2.sh):
#   1. where the fused activation quantization's e4m3 codes differ from torch's on CUDA
#      (test_quantize_rows_same_bits_as_torch failed there; scales were equal)
#   2. bench offline --quantization fp8 --kv-cache-dtype fp8_e4m3, 1 / 64 prompts -> offline_fp8.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_e}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}
. scripts/gpu_setup.sh
echo "== 1. quantize_rows codes vs torch on CUDA ($SECONDS s)"
timeout 60 $PY - <<'PYEOF'
import torch
from pdserve.model import fp8, triton_w8a8
for m, k in [(3, 160), (2, 8200)]:
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(2)
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        x[0, :3] = torch.tensor([-0.0, 1e-30, -1e-30])
        if m > 2:
            x[2] = 0.0
        x[1, :6] = torch.tensor([448.0, 84.0, -12.5, 124.3, 447.0, 0.0068359375])
        x = x.cuda()
        q, s = triton_w8a8.quantize_rows(x)
        rq, rs = fp8.quantize_rows_torch(x)
        a, b = q.view(torch.uint8).int(), rq.view(torch.uint8).int()
        bad = (a != b).nonzero().tolist()
        print(m, k, dtype, "differing codes", len(bad), "of", a.numel(), "first:",
              [(i, j, x[i, j].item(), q[i, j].float().item(), rq[i, j].float().item()) for i, j in bad[:6]])
PYEOF
echo "== 2. bench offline FP8 weights + FP8 KV, 1 / 64 prompts ($SECONDS s)"
timeout ${T_OFFLINE:-200} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --ours-only --quantization fp8 --kv-cache-dtype fp8_e4m3 --num-prompts 1,64 \
    --max-tokens 128 --repeats 1 --json "$OUT/offline_fp8.json" 2>&1 | grep -v "^USDT" | tail -8
echo "== end at $SECONDS s"
