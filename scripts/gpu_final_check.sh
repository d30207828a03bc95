#!/usr/bin/env bash
# The last GPU call of a session (~8 min on one H200): every gpu-marked test (`make test-gpu`),
# the FP8 linears against the dequantized weight (scripts/gpu_fp8_diag.py), then the shortest
# figures of the new capabilities: speculation acceptance-controlled at 0.8 with k = 4 on one
# prompt, and random Qwen3-30B-A3B (fused experts) at 1 and 64 prompts. Each step has its own
# timeout and the script goes on when one fails. Run from the repository root on the GPU
# machine, wheels in ${WHEELS:-.whl}; writes under ${OUT:-gpu_final}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_final}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
echo "== gpu tests ($SECONDS s)"
timeout ${T_TESTS:-200} $PY -m pytest -q --timeout=120 -m gpu tests -p no:cacheprovider 2>&1 \
    | grep -v "^$" | tail -25 | tee "$OUT/gpu_tests.txt"
echo "== fp8 linear vs dequantized ($SECONDS s)"
timeout 60 $PY scripts/gpu_fp8_diag.py 2>&1 | tail -50
echo "== speculation, replay 0.8, k=4, 1 prompt ($SECONDS s)"
timeout ${T_SPEC:-110} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --max-tokens 128 --repeats 2 --num-speculative-tokens 4 --num-prompts 1 \
    --speculative replay:0.8 --json "$OUT/spec_replay.json" 2>&1 | tail -8
echo "== MoE qwen3-30b-a3b fused, 1 and 64 prompts ($SECONDS s)"
PDSERVE_MOE_EXPERTS=fused PDSERVE_MOE_ROUTING_STATS=1 timeout ${T_MOE:-130} $PY -m pdserve \
    bench offline --model random:qwen3-30b-a3b --device cuda --dtype bfloat16 --ours-only \
    --num-prompts 1,64 --max-tokens 128 --repeats 1 --json "$OUT/moe_fused.json" 2>&1 | tail -8
echo "== end at $SECONDS s"
