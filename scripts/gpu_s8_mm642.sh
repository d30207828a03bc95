#!/usr/bin/env bash
# Issue 24, session 8, part mm642 of the second H200 call (budget 100 s, the model load
# included): the first round (gpu_s8_mm64.sh) lost its JSON. One engine load
# (random:llama-3.1-8b bf16), scripts/gpu_s8_mm642.py: the 64x200 decode step and bench
# offline's 64-prompt run with the skinny GEMM's first-round picks (all four linears,
# swiglu alone, swiglu+o+down, swiglu+o) vs base (A/B/A), greedy tokens against base (the
# first differing position per sequence), then the 128x200 step base vs swiglu.
# Leaves $OUT/mm642.json; a compact SUMMARY_JSON line is printed too. Run as:
#   OUT=$OUT/gpu_s8 PREFIX=s8_ bash scripts/gpu_call.sh mm642:100
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_mm642}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-100}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
left=$((BUDGET - 6 - SECONDS))
echo "== engine ($SECONDS s; $left s left)"
timeout -k 3 "$left" $PY scripts/gpu_s8_mm642.py --model "$MODEL" --device "$DEVICE" \
    --deadline-s $((left - 7)) ${ENGINE_ARGS:-} 2>&1 | grep -v "^USDT\|profiler_st"
echo "engine exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
ls "$OUT"
echo "== end at $SECONDS s"
