#!/usr/bin/env bash
# An H200 call (~9.5 min) measuring session 5's merged work, each step under its own timeout:
#   1. scripts/gpu_serve_check.sh, 2 x 64 requests at 8 req/s with per-phase timings and
#      stream_back split (issue 24), printing every worker's Triton compiles after start-up
#      (the start-up warm-up's point) and its gc figures -> serve/
#   2. scripts/gpu_fp8_kernels2.sh (issue 26: the fused activation quantization, the w8a8
#      and w8a16s tiles, the FP8 GEMV; the four linears x 32 per row count; the path table)
#   3. scripts/gpu_moe_decode_check.sh (issue 27: the few-token expert path and the fused
#      norms; bench offline 1 / 64 prompts on random:qwen3-30b-a3b, per-layer kernel count)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_d}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}; WHEELS=${WHEELS:-.whl}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
echo "== 1. serve check ($SECONDS s)"
PHASES=1 INTERFERENCE=0 RATES=8,8 NREQ=64 OUT="$OUT/serve" timeout ${T_SERVE:-170} \
    bash scripts/gpu_serve_check.sh 2>&1 | grep -v "^USDT" | tail -48
echo "== 2. FP8 kernels ($SECONDS s)"
OUT="$OUT/fp8" timeout ${T_FP8:-190} bash scripts/gpu_fp8_kernels2.sh 2>&1 | grep -v "^USDT" | tail -40
echo "== 3. MoE decode ($SECONDS s)"
OUT="$OUT/moe" timeout ${T_MOE:-225} bash scripts/gpu_moe_decode_check.sh 2>&1 | grep -v "^USDT" | tail -30
echo "== end at $SECONDS s"
