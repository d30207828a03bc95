#!/usr/bin/env bash
# Session 7's check of main after the merges (issues 24 and 26), one H200 call of ~4.5 min:
#   1. bench offline bf16 1 / 64 / 256 prompts x 128 tokens (random:llama-3.1-8b, the
#      all-decoding step and its roofline beside each row)          -> $OUT/offline_bf16.json
#   2. bench offline --quantization fp8 --kv-cache-dtype fp8_e4m3, 1 / 64 prompts
#                                                                    -> $OUT/offline_fp8.json
# Each under its own timeout (T_BF16, T_FP8 seconds); run as
#   OUT=gpu_s7 PREFIX=s7_ bash scripts/gpu_call.sh confirm:290
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s7_confirm}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
echo "== 1. bench offline bf16 1/64/256 ($SECONDS s)"
timeout ${T_BF16:-160} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --ours-only --num-prompts 1,64,256 --max-tokens 128 --repeats 1 \
    --json "$OUT/offline_bf16.json" 2>&1 | grep -v "^USDT" | tail -8
echo "== 2. bench offline fp8 + fp8 KV 1/64 ($SECONDS s)"
timeout ${T_FP8:-120} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8_e4m3 --ours-only --num-prompts 1,64 \
    --max-tokens 128 --repeats 1 --json "$OUT/offline_fp8.json" 2>&1 | grep -v "^USDT" | tail -8
echo "== end at $SECONDS s"
