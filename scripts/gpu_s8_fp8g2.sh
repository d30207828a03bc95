#!/usr/bin/env bash
# Issue 26, session 8, second call (branch fp8g, budget 75 s, no model load): the FP8 GEMV
# variants' sweep again (its JSON did not come back from the first call) and the candidates
# in a 32-layer chain of the four FP8 linears under one CUDA graph (scripts/gpu_s8_fp8g2.py)
# -> $OUT/fp8g2.json and fp8g2_log.txt; then the fixed quantize_rows tests on the GPU.
#   OUT=$OUT/gpu_s8b PREFIX=s8_ bash scripts/gpu_call.sh fp8g2:75
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_fp8g2}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
T_MAIN=${T_MAIN:-60}
echo "== 1. sweep + chain ($SECONDS s)"
timeout -k 3 $T_MAIN $PY scripts/gpu_s8_fp8g2.py --limit $(( T_MAIN - 2 )) ${FP8G2_FLAGS:-} 2>&1 \
    | tee "$OUT/_main.log" | grep -v "^USDT\|profiler_st\|^\[W" \
    | grep "PRE\|SHAPE\|SUM\|CHAIN\|QUANT\|END\|Error\|error" | cut -c1-700 | tail -40
left=$(( ${BUDGET:-72} - SECONDS ))
echo "== 2. the quantize_rows and gemvk tests on the GPU ($SECONDS s, $left left)"
if [ $left -gt 6 ] && [ -z "${FP8G2_FLAGS:-}" ]; then
    timeout -k 2 $left $PY -m pytest -q -p no:cacheprovider tests/model/test_triton_w8a8.py \
        -k "quantize_rows or gemvk" --tb=line 2>&1 | tail -6 | tee "$OUT/_tests.log"
fi
{ echo "== main"; grep -v "^USDT\|profiler_st" "$OUT/_main.log" | tail -150
  [ -f "$OUT/_tests.log" ] && { echo "== tests"; cat "$OUT/_tests.log"; }
} > "$OUT/fp8g2_log.txt" 2>/dev/null
rm -f "$OUT"/_main.log "$OUT"/_tests.log
echo "== end at $SECONDS s"
