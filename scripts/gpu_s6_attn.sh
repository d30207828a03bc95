#!/usr/bin/env bash
# Session 6, decode attention at many rows x short contexts and the greedy pick (issue 24):
# kernel sweeps only, no model load; about 1.5 minutes, 2 at worst (the step's timeout).
# Run from the repository root on the GPU machine with the wheels in ${WHEELS:-.whl} (as
# gpu_check.sh). Writes $OUT/attn_sweep.json (rewritten after every case: a timeout keeps
# what was measured) and $OUT/attn_sweep.txt, and prints the summary.
#   scripts/gpu_s6_attn_sweep.py: 32 layers' decode attention in one CUDA graph at 64/128/256
#   rows x 200/512/1,024 tokens under ~20 split/tile/warp/stage configurations, plus 32 x
#   4,096 and 1 x 4,096 under the current choice (the long context kept honest); us a
#   layer, GB/s, fraction of the copy bandwidth measured in the same run; then the greedy
#   pick: torch argmax + log_softmax + gather against the one-pass Triton kernel at 64, 256
#   and 1 rows x 128,256 fp32 logits (first), and the lm_head's bf16 GEMM + fp32 cast
#   against one GEMM writing fp32 at 64 and 256 rows (second).
# DRY_RUN=1: the same on CPU under Triton's interpreter at toy shapes (a check of the script).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s6_attn}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}  # pdserve from this tree
. scripts/gpu_setup.sh
if [ "${DRY_RUN:-0}" = 1 ]; then
    export TRITON_INTERPRET=1
    DEV=(--device cpu)
else
    DEV=()
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
fi
# the kernel sweep stops starting cases after 95 s; the timeout ends it at 115 s at worst
timeout 115 $PY scripts/gpu_s6_attn_sweep.py "${DEV[@]}" --budget 95 2>&1 | tee "$OUT/attn_sweep.txt"
echo "attn sweep rc=${PIPESTATUS[0]}"
ls -la "$OUT"
