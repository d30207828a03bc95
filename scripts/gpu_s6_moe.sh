#!/usr/bin/env bash
# Issue 27, session 6: the MoE decode kernels of random:qwen3-30b-a3b on one H200, <= 3 min.
#   1. scripts/gpu_s6_moe.py (<= 115 s; kernels compiled in 10 processes first): one sparse
#      layer (bf16, 4 weight copies so no step hits L2) at 1, 2, 4, 8, 16, 64 tokens, CUDA
#      graphs, candidates against the experts' roofline measured in the same run and checked
#      against moe.experts_loop: tiles of the gate/up and down kernels (coordinate descent),
#      the down + weights + top-k sum in one launch, route_align's warps, the few-token path
#      (elementwise and tensor-core gate/up); random and concentrated routing (24 experts,
#      as the random preset routes) at 16 and 64 tokens; then the fused kernels against the
#      per-expert loop (eager) at 1, 64, 2048 tokens -> moe_s6_sweep.json;
#   2. scripts/gpu_gemv_sweep.py (<= 50 s) on the model's attention linears (qkv 5120x2048,
#      o_proj 2048x4096) at 1, 2, 4, 8 rows: the Triton GEMV against cuBLAS, merged with
#      main's sweep -> gemv_sweep.json, gemv_table.py (the table with their rows).
# Run from the repository root on the GPU machine; OUT (default gpu_s6_moe) gets the JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s6_moe}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
echo "== 1. MoE layer sweep ($SECONDS s)"
BUDGET_S=${BUDGET_S:-85} timeout 115 $PY scripts/gpu_s6_moe.py > "$OUT/moe_sweep.log" 2>&1
echo "rc $?"
grep -v "^USDT" "$OUT/moe_sweep.log" | grep -E "best|eager|compiled|copy bandwidth|DECODE|done|Error|error|WRONG" | tail -40
echo "== 2. GEMV sweep, attention linears of Qwen3-30B-A3B ($SECONDS s)"
timeout 50 $PY scripts/gpu_gemv_sweep.py --ms 1,2,4,8 --shapes moe_qkv,moe_o_proj --probe-jobs 15 \
    --merge docs/figures/h200_gemv_sweep.json > "$OUT/gemv_sweep.log" 2>&1
echo "rc $?"
grep -v "^USDT" "$OUT/gemv_sweep.log" | grep -iE "moe_|skip|TABLE|error" | tail -20
echo "== end at $SECONDS s"
