#!/usr/bin/env bash
# Issue 26, session 6: the confirm call after merging (budget 180 s; the timeouts add up to
# 175 s; one model load), on main as merged:
#   1. scripts/gpu_fp8_attn_probe.py at 1 x 200, 64 x 200, 32 x 4,096 (no model, no tile
#      variants): the e4m3 decode kernel with fp16 dots (F16_DOT) against the bf16 cache's;
#      the first call (gpu_s6_fp8.sh, bf16 dots) had 5.5 / 18.4 / 123.7 µs against bf16's
#      5.0 / 18.5 / 135.0 -> fp8_attn_probe.json
#   2. scripts/gpu_fp8_offline.py: bench offline --quantization fp8 --kv-cache-dtype
#      fp8_e4m3 --ours-only at 1 and 512 prompts (512: the first call's best batch,
#      19,851 tok/s) + 32x4096, 128 tokens -> offline_fp8_confirm.json; then on the same
#      engine the step profile at 1 x 200 -> step_profile_fp8_confirm.json (first call:
#      3.027 ms, 369 kernels, the e4m3 store already in the RoPE kernel)
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
echo "== 1. decode attention, bf16 vs e4m3 cache (fp16 dots), one layer ($SECONDS s)"
timeout ${T_PROBE:-30} $PY scripts/gpu_fp8_attn_probe.py --device ${DEVICE:-cuda} --no-silu-gemv \
    --variants "" ${PROBE_SHAPES:-1x200 64x200 32x4096} 2>&1 | grep -v "^USDT" | tail -6
echo "== 2. bench offline FP8 weights + FP8 KV, ${COUNTS:-1,512} + ${LONG:-32x4096}, then the 1 x 200 step profile ($SECONDS s)"
timeout ${T_OFFLINE:-145} $PY scripts/gpu_fp8_offline.py --profile ${PROFILE_SHAPES:-1x200} \
    --profile-json step_profile_fp8_confirm.json -- --model ${MODEL:-random:llama-3.1-8b} \
    --device ${DEVICE:-cuda} --dtype ${DTYPE:-bfloat16} --ours-only --quantization fp8 \
    --kv-cache-dtype fp8_e4m3 --num-prompts ${COUNTS:-1,512} --long-context ${LONG:-32x4096} \
    --max-tokens ${MAX_TOKENS:-128} --repeats 1 --json "$OUT/offline_fp8_confirm.json" 2>&1 \
    | grep -v "^USDT\|profiler_st" | tail -24
echo "== end at $SECONDS s"
