#!/usr/bin/env bash
# Issue 24, session 9, second round of part bf16row (budget 120 s, one engine load): does a
# garbage collection land inside bench offline's timed runs? scripts/gpu_s9_bf16row2.py:
# `pdserve bench offline --ours-only --num-prompts 64,256 --max-tokens 128 --repeats 3`
# (its own engine, as S8-CONFIRM ran it) with its start-up freeze switched off, every
# collection timed and placed in the timed run it stopped; then on the same engine the time
# of a full collection, the freeze, and the 64 / 256 rows again -> bf16row2.json (bench
# offline's JSON inside it). Run as:
#   OUT=$OUT/gpu_s9 PREFIX=s9_ bash scripts/gpu_call.sh bf16row2:120
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s9_bf16row2}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-120}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
left=$((BUDGET - 6 - SECONDS))
echo "== bench offline with every collection timed ($SECONDS s; $left s for it)"
timeout -k 3 "$left" $PY scripts/gpu_s9_bf16row2.py --deadline-s $((left - 15)) ${ARGS2:-} -- \
    --model "$MODEL" --device "$DEVICE" --ours-only --num-prompts ${COUNTS:-64,256} \
    --max-tokens ${MAX_TOKENS:-128} --repeats ${REPEATS:-3} --json "$OUT/offline.json" ${BENCH_ARGS:-} 2>&1 \
    | grep --line-buffered -v "^USDT\|profiler_st\|^gc: "
echo "exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
rm -f "$OUT/offline.json"
echo "== end at $SECONDS s"
