#!/usr/bin/env bash
# Session 14, one H200 part (budget 170 s): RoPE (+ q/k norm) and the KV store inside the
# split-KV decode kernel (triton_backend.DECODE_ROPE) against the RoPE + KV store kernel
# before it, with scripts/gpu_s14_ropeattn.py: engines in turn, each bucket's decode graphs
# captured with the flag off and on, the all-decoding step in interleaved spans (paired
# medians), 8 greedy tokens compared: FP8 + e4m3-KV random:llama-3.1-8b 1 x 200 and
# 32 x 4,096, then (if the budget allows) random:qwen3-30b-a3b bf16 1 x 200 with the
# routing counters on -> $OUT/ropeattn.json (the summary: output.txt).
#   OUT=$OUT/g1 PREFIX= bash scripts/gpu_call.sh s14_ropeattn:170
# CPU dry run (~7 min; tiny models, TRITON_INTERPRET=1, no graphs: the flag read by each
# eager step):
#   DEVICE=cpu MODEL_FP8=random:tiny MODEL_MOE=random:tiny-qwen3-moe TRITON_INTERPRET=1 \
#   BUDGET=420 PYTHON=.venv/bin/python OUT=/tmp/s14_ropeattn bash scripts/gpu_s14_ropeattn.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s14_ropeattn}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
export PDSERVE_MOE_ROUTING_STATS=1
BUDGET=${BUDGET:-170}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git log --oneline -1 2>/dev/null
echo "== s14_ropeattn ($SECONDS s, budget $BUDGET s)"
REST=$((BUDGET - SECONDS))
OUT="$WORK" BUDGET_S=$((REST - 6)) timeout -k 2 $((REST - 2)) $PY scripts/gpu_s14_ropeattn.py > "$WORK/run.log" 2>&1
echo "rc $? ($SECONDS s)"
grep -v "^USDT\|profiler_st\|^\[W\|STAGE:" "$WORK/run.log" | grep -E "^\[|Error|error|Traceback" | tail -40
cp "$WORK/ropeattn.json" "$OUT/ropeattn.json" 2>/dev/null || echo '{"missing": "ropeattn.json"}' > "$OUT/ropeattn.json"
find "$OUT" -mindepth 1 -not -name ropeattn.json -not -name output.txt -delete 2>/dev/null
echo "== end at $SECONDS s"
