#!/usr/bin/env bash
# Issue 24, session 6's engine check after merging attn6 (the one-pass greedy pick, the fp32
# lm_head output, the decode attention picks for 32/128/256 rows): the gpu-marked tests of
# the greedy pick and fp32 logits, then bench offline 1 / 64 / 256 prompts x 128 tokens
# (bf16, random:llama-3.1-8b, the all-decoding step beside each row) -> $OUT/offline.json.
# About 2.5 minutes on the H200 (one model load); each step under its own timeout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s6_offline}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
echo "== 1. gpu-marked greedy pick and fp32 logits tests ($SECONDS s)"
timeout 40 $PY -m pytest -q -p no:cacheprovider -m gpu tests/model/test_triton_greedy.py \
    tests/model/test_logits_fp32.py 2>&1 | tail -3 | tee "$OUT/greedy_test.txt"
echo "== 2. bench offline 1/64/256 ($SECONDS s)"
timeout ${T_OFFLINE:-170} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --ours-only --num-prompts 1,64,256 --max-tokens 128 --repeats 1 \
    --json "$OUT/offline.json" 2>&1 | grep -v "^USDT" | tail -10
echo "== end at $SECONDS s"
