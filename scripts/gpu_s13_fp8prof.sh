#!/usr/bin/env bash
# Issue 26, session 13, part fp8prof of one H200 call (budget 150 s): where today's FP8-weights
# + e4m3-KV decode steps spend their time, for the three targets still open (1 prompt >= 400
# tok/s, 64 prompts >= 15,000, the 32 x 4,096 step <= 0.6 of bf16's): scripts/gpu_step_profile.py
# at 1 x 200, 64 x 200 and 32 x 4,096 (SHAPES) on one engine (random:llama-3.1-8b,
# --quantization fp8 --kv-cache-dtype fp8_e4m3, graphs up to 64 rows): each step's wall time,
# its kernels' GPU time and the host gap, the 25 kernels that take most of it with their
# launches a step -> step_profile_fp8.json. Run as
#   OUT=$OUT/g4 PREFIX= bash scripts/gpu_call.sh s13_fp8prof:150
# CPU check of the script (~1 min): DEVICE=cpu MODEL=random:tiny SHAPES="2x40" QUANT_ARGS= \
#   PYTHON=.venv/bin/python OUT=/tmp/fp8prof bash scripts/gpu_s13_fp8prof.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s13_fp8prof}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-150}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
# shellcheck disable=SC2086  # SHAPES and QUANT_ARGS are lists of words
timeout -k 3 $((BUDGET - 5)) $PY scripts/gpu_step_profile.py ${SHAPES:-1x200 64x200 32x4096} \
    --model "${MODEL:-random:llama-3.1-8b}" --device "${DEVICE:-cuda}" \
    ${QUANT_ARGS---quantization fp8 --kv-cache-dtype fp8_e4m3} --max-running-requests 64 \
    --kv-cache-memory "${KV_GIB:-24}" --top 25 --json step_profile_fp8.json 2>&1 | grep -v "^USDT"
echo "rc ${PIPESTATUS[0]} at $SECONDS s"
