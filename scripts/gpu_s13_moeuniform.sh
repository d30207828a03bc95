#!/usr/bin/env bash
# Issue 27, session 13, part moeuniform of one H200 call (budget 170 s): bench offline
# random:qwen3-30b-a3b 1 / 64 prompts x 128 tokens with --moe-routing uniform (each layer's
# tokens routed by a fixed random table: spread over the experts as a trained router's load
# balancing spreads a batch; the random preset's own router sends a 64-token step to ~15
# experts a layer) and the routing counters on, so the roofline counts the experts actually
# read -> offline_moe_uniform.json. The same rows with the model's routing: S13-CONFIRM.
#   OUT=$OUT/g6 PREFIX= bash scripts/gpu_call.sh s13_moeuniform:170
# CPU check (~1 min): MODEL=random:tiny-qwen3-moe DEVICE=cpu DTYPE=float32 MAX_TOKENS=4 \
#   PYTHON=.venv/bin/python OUT=/tmp/moeu bash scripts/gpu_s13_moeuniform.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s13_moeuniform}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-170}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
PDSERVE_MOE_ROUTING_STATS=1 timeout -k 3 $((BUDGET - 5)) $PY -m pdserve bench offline \
    --model "${MODEL:-random:qwen3-30b-a3b}" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" \
    --ours-only --num-prompts 1,64 --max-tokens "${MAX_TOKENS:-128}" --repeats 1 --moe-routing uniform \
    --json "$OUT/offline_moe_uniform.json" 2>&1 | grep -v "^USDT" | tail -8
echo "rc ${PIPESTATUS[0]} at $SECONDS s"
