#!/usr/bin/env bash
# Session 10's check of main after the merges (issues 24, 26, 27), one H200 call of ~8 min:
#   1. bench offline bf16 1 / 64 / 256 prompts x 128 tokens and the 32 x 4,096 long-context row (the
#      FP8-KV step is judged against its step in the same call), BF16_REPEATS (3) runs each, the
#      median reported (random:llama-3.1-8b, the all-decoding step and its roofline beside
#      each row)                                                     -> $OUT/offline_bf16.json
#   2. bench offline --quantization fp8 --kv-cache-dtype fp8_e4m3, FP8_PROMPTS (1 / 64 /
#      512 / 1,024) prompts and the 32 x 4,096 long-context row, FP8_FLAGS added
#                                                                    -> $OUT/offline_fp8.json
#   3. bench offline random:qwen3-30b-a3b 1 / 64 prompts, the roofline over the experts
#      routed to (PDSERVE_MOE_ROUTING_STATS=1)                       -> $OUT/offline_moe.json
#      3b. its 64 prompts with --moe-routing uniform (a checkpoint's spread of experts,
#      session 13; T_MOE_UNIFORM, 0 skips)                          -> $OUT/offline_moe_uniform.json
#   4. the gpu-marked tests of the skinny GEMM, the fused norms (FP8 quantization for
#      _scaled_mm) and the MoE kernels, or GPU_TESTS (failures named)
# Each under its own timeout (T_BF16, T_FP8, T_MOE, T_TESTS seconds; T_BF16=0 / T_FP8=0 /
# T_MOE=0 skip 1 / 2 / 3 (BF16_PROMPTS: 1's prompt counts), T_TESTS=0 (the default: session 10 ran all
# 52 gpu-marked tests in a call of their own, 335 s) skips 4; GPU_TESTS:
# the test files of 4 instead of these); run as
#   OUT=$OUT/gpu_s10 PREFIX=s10_ bash scripts/gpu_call.sh confirm:580
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s10_confirm}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
echo "== 1. bench offline bf16 ${BF16_PROMPTS:-1,64,256} + 32x4096 ($SECONDS s)"
[ "${T_BF16:-175}" -gt 0 ] && timeout ${T_BF16:-175} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --ours-only --num-prompts ${BF16_PROMPTS:-1,64,256} --long-context 32x4096 --max-tokens 128 --repeats ${BF16_REPEATS:-3} \
    --json "$OUT/offline_bf16.json" 2>&1 | grep -v "^USDT" | tail -6
echo "== 2. bench offline fp8 + fp8 KV ${FP8_PROMPTS:-1,64,512,1024} + 32x4096 ($SECONDS s)"
[ "${T_FP8:-200}" -gt 0 ] && timeout ${T_FP8:-200} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8_e4m3 --ours-only --num-prompts ${FP8_PROMPTS:-1,64,512,1024} ${FP8_FLAGS:-} \
    --long-context 32x4096 --max-tokens 128 --repeats 1 --json "$OUT/offline_fp8.json" 2>&1 \
    | grep -v "^USDT" | tail -6
echo "== 3. bench offline qwen3-30b-a3b 1/64 ($SECONDS s)"
[ "${T_MOE:-120}" -gt 0 ] && PDSERVE_MOE_ROUTING_STATS=1 timeout ${T_MOE:-120} $PY -m pdserve bench offline \
    --model random:qwen3-30b-a3b --device cuda --dtype bfloat16 --ours-only --num-prompts 1,64 \
    --max-tokens 128 --repeats 1 --json "$OUT/offline_moe.json" 2>&1 | grep -v "^USDT" | tail -6
echo "== 3b. bench offline qwen3-30b-a3b 64, --moe-routing uniform ($SECONDS s)"
[ "${T_MOE_UNIFORM:-110}" -gt 0 ] && PDSERVE_MOE_ROUTING_STATS=1 timeout ${T_MOE_UNIFORM:-110} $PY -m pdserve bench offline \
    --model random:qwen3-30b-a3b --device cuda --dtype bfloat16 --ours-only --num-prompts 64 \
    --moe-routing uniform --max-tokens 128 --repeats 1 --json "$OUT/offline_moe_uniform.json" 2>&1 \
    | grep -v "^USDT" | tail -3
echo "== 4. gpu-marked skinny, fused-norm and MoE tests ($SECONDS s)"
[ "${T_TESTS:-0}" -gt 0 ] && timeout ${T_TESTS} $PY -m pytest -q -p no:cacheprovider -m gpu -rf ${GPU_TESTS:-tests/model/test_triton_skinny.py \
    tests/model/test_fused_ops.py tests/model/test_triton_moe.py tests/model/test_moe.py} 2>&1 | grep -v "^USDT" \
    | grep -E "^FAILED|passed|failed|Error" | cut -c1-300 | tail -15
echo "== end at $SECONDS s"
