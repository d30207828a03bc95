#!/usr/bin/env bash
# An H200 call (~9 min) that re-measures issue 24 after the CPU-side changes of session 4:
#   1. scripts/gpu_serve_check.sh, three runs of 64 requests at 8 req/s with per-phase
#      timings (PD TTFT median <= mixed + 5 ms, p99 <= 2 x median); fresh prompts per rate
#      (bench serve seeds each rate) and every worker's garbage collections printed at the
#      end (pdserve/gc_watch.py: were the 300-450 ms stalls collections?) -> serve/
#   2. bench offline --ours-only at 1 / 64 / 256 prompts and 32 x 4,096 (the mixed step's
#      leading decode rows now go through the split-KV decode kernel, eac4b58) -> offline.json
# Run from the repository root on the GPU machine with the wheels in ${WHEELS:-.whl}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_c}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
echo "== 1. serve check, PD vs mixed, 3 x 64 at 8 req/s ($SECONDS s)"
PHASES=1 INTERFERENCE=0 RATES=8,8,8 NREQ=64 OUT="$OUT/serve" timeout ${T_SERVE:-250} \
    bash scripts/gpu_serve_check.sh 2>&1 | grep -v "^USDT" | tail -45
echo "== 2. bench offline 1/64/256 and 32 x 4,096 ($SECONDS s)"
timeout ${T_OFFLINE:-290} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --ours-only --num-prompts 1,64,256 --long-context 32x4096 --max-tokens 128 \
    --repeats 1 --json "$OUT/offline.json" 2>&1 | grep -v "^USDT" | tail -14
echo "== end at $SECONDS s"
