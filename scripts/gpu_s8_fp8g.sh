#!/usr/bin/env bash
# Issue 26, session 8 (branch fp8g, budget 140 s): FP8 weight GEMV variants at one row and
# 64-row tiles, timed per shape alone (GB/s beside a torch copy of the same bytes, output
# against the current path's), then the winners in the engine: the 1x200 (and 64x200) step
# off / on / off / on, greedy tokens, bench offline 1,64 prompts with them
# (scripts/gpu_s8_fp8g.py) -> $OUT/fp8g.json and fp8g_log.txt; the quantize_rows tests last.
#   OUT=$OUT/gpu_s8 PREFIX=s8_ bash scripts/gpu_call.sh fp8g:140
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_fp8g}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
MODEL=${MODEL:-random:llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
T_MAIN=${T_MAIN:-124}
echo "== 1. bench offline 1,64 (FP8 + FP8 KV), the sweep, the engine A/B, bench with the winners ($SECONDS s)"
timeout -k 5 $T_MAIN $PY scripts/gpu_s8_fp8g.py --budget $(( T_MAIN - 20 )) --sweep-budget $(( T_MAIN - 34 )) --limit $(( T_MAIN - 3 )) \
    ${FP8G_FLAGS:-} -- --model $MODEL --device $DEVICE --dtype bfloat16 --ours-only \
    --num-prompts 1,64 --max-tokens ${MAX_TOKENS:-128} --repeats 2 \
    --quantization fp8 --kv-cache-dtype fp8_e4m3 2>&1 \
    | tee "$OUT/_main.log" | grep -v "^USDT\|profiler_st\|^\[W" \
    | grep "SHAPE\|WINNER\|STEP\|GREEDY\|BENCH\|QUANT\|PRECOMPILE\|precompile\|END\|engine up\|Error\|error\|current " | tail -60
left=$(( ${BUDGET:-136} - SECONDS ))
echo "== 2. the quantize_rows tests on the GPU ($SECONDS s, $left left)"
if [ $left -gt 8 ] && [ "$DEVICE" = cuda ]; then
    timeout -k 2 $left $PY -m pytest -q -p no:cacheprovider tests/model/test_triton_w8a8.py \
        -k "quantize_rows or gemvk" --tb=line 2>&1 | tail -8 | tee "$OUT/_tests.log"
fi
rm -f "$OUT"/_bench_*.json
{ echo "== main"; grep -v "^USDT\|profiler_st" "$OUT/_main.log" | tail -150
  [ -f "$OUT/_tests.log" ] && { echo "== tests"; cat "$OUT/_tests.log"; }
} > "$OUT/fp8g_log.txt" 2>/dev/null
rm -f "$OUT"/_main.log "$OUT"/_tests.log
echo "== end at $SECONDS s"
