#!/usr/bin/env bash
# Issue 27, session 10, one H200 part (branch moe10, budget 120 s): scripts/gpu_s10_moe10.py.
# One engine (random:qwen3-30b-a3b, bf16, PDSERVE_MOE_ROUTING_STATS=1): the 1-row bucket's
# graphs captured again per variant (the top-k sum in the next add + RMSNorm; the decode
# attention of 1 row in one / two splits; both), greedy tokens against today's, the 1-row
# step interleaved against today's; bench offline 1 / 64 prompts x 128 with the best; the
# 64-prompt step's kernel profile with the bench's prompts -> $OUT/moe10.json (the summary
# on stdout: output.txt).
#   OUT=$OUT/gpu_s10 PREFIX=s10_ bash scripts/gpu_call.sh moe10:120
# CPU dry run: DEVICE=cpu MODEL=random:tiny-qwen3-moe TOKENS=8 BUDGET=300 PYTHON=.venv/bin/python OUT=/tmp/m10 bash scripts/gpu_s10_moe10.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s10_moe10}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
unset PDSERVE_MOE_GEMV_MAX_TOKENS PDSERVE_TRITON_PDL
export PDSERVE_MOE_ROUTING_STATS=1
BUDGET=${BUDGET:-114}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git log --oneline -1 2>/dev/null
echo "== moe10: one engine, the 1-row variants, bench ($SECONDS s, budget $BUDGET s)"
REST=$((BUDGET - SECONDS))
OUT="$WORK" BUDGET_S=$((REST - 5)) timeout -k 2 $((REST - 2)) $PY scripts/gpu_s10_moe10.py > "$WORK/run.log" 2>&1
echo "rc $? ($SECONDS s)"
grep -v "^USDT\|profiler_st\|^\[W\|STAGE:" "$WORK/run.log" | grep -E "^\[|^ +[0-9]|Error|error|Traceback" | tail -70
cp "$WORK/moe10.json" "$OUT/moe10.json" 2>/dev/null || echo '{"missing": "moe10.json"}' > "$OUT/moe10.json"
find "$OUT" -mindepth 1 -not -name moe10.json -not -name output.txt -delete 2>/dev/null
echo "== end at $SECONDS s"
