#!/usr/bin/env bash
# Issue 26, session 6: the confirm call after merging (budget 180 s, one model load): FP8
# weights + FP8 KV through bench offline in the engine as merged.
#   scripts/gpu_fp8_offline.py: bench offline --quantization fp8 --kv-cache-dtype fp8_e4m3
#   --ours-only at ${COUNTS} prompts (1: the one-row step with the e4m3 store in the RoPE
#   kernel; the best batch of the first call) + --long-context 32x4096, 128 tokens ->
#   offline_fp8_confirm.json, then on the same engine the step profile at 1 x 200 ->
#   step_profile_fp8_confirm.json (the one-row step's kernels: the e4m3 store gone from them).
# Run from the repository root on the GPU machine with the wheels in ${WHEELS:-.whl}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s6_fp8_confirm}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
echo "== bench offline FP8 weights + FP8 KV, ${COUNTS:-1,1024} + ${LONG:-32x4096}, then the 1 x 200 step profile ($SECONDS s)"
timeout ${T_OFFLINE:-170} $PY scripts/gpu_fp8_offline.py --profile ${PROFILE_SHAPES:-1x200} \
    --profile-json step_profile_fp8_confirm.json -- --model ${MODEL:-random:llama-3.1-8b} \
    --device ${DEVICE:-cuda} --dtype ${DTYPE:-bfloat16} --ours-only --quantization fp8 \
    --kv-cache-dtype fp8_e4m3 --num-prompts ${COUNTS:-1,1024} --long-context ${LONG:-32x4096} \
    --max-tokens ${MAX_TOKENS:-128} --repeats 1 --json "$OUT/offline_fp8_confirm.json" 2>&1 \
    | grep -v "^USDT\|profiler_st" | tail -30
echo "== end at $SECONDS s"
