#!/usr/bin/env bash
# Speculative decoding with the verify step under CUDA graphs (issue 25), one H200, under
# 6 minutes (bench first: it is the measurement; ~2 min, most of it making the weights):
#   1. the gpu-marked tests of tests/engine/test_verify_graph.py (and of
#      tests/engine/test_cuda_graphs.py: the decode graphs share the runner): a captured verify graph
#      against the eager verify step (fp32: logits within 1e-3 and the same kept tokens;
#      bf16: within 0.5, argmax of >= 6 of 7 positions), and a whole fp32 run through the
#      verify graphs equal to the plain run token for token (reference mode, no override);
#   2. (run first) `pdserve bench offline --speculative reference:0.8` (the benchmark-only
#      acceptance-controlled mode that holds its rate in bf16: engine/spec/drafter.py
#      ReferenceDrafter), k = 4, random:llama-3.1-8b bf16, 1 / 16 / 64 prompts x 128 tokens,
#      plain and speculative runs of the same engine side by side (targets: 1 prompt
#      >= 500 tok/s and >= 2.2x plain; 16 prompts >= 1.6x; 64 reported).  Each row of the
#      JSON carries plain_tok_s, spec_tok_s, speedup, acceptance_length (~3.36 expected at
#      0.8, k = 4), reference_mismatches (kept positions where the verify forward's bf16
#      argmax differed from the plain run's) and verify_steps {graph, eager}.
# DRAFT=random:llama-3.2-1b adds the same with that draft model run every step for its cost
# (its proposals replaced by the reference ones; 1 / 16 prompts; spec_draft.json; the
# target's pool capped at 24 GiB: the bench sizes it before the draft model loads).
# Run from the repository root on the GPU machine (wheels in ${WHEELS:-.whl}, see
# scripts/gpu_setup.sh); writes gpu_tests.txt and spec.json under ${OUT:-gpu_spec_graph}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_spec_graph}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
MODEL=${MODEL:-random:llama-3.1-8b}
COUNTS=${COUNTS:-1,16,64}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
. scripts/gpu_setup.sh
echo "== bench offline --speculative reference:0.8, k=4, prompts $COUNTS ($SECONDS s)"
timeout 230 $PY -m pdserve bench offline --model "$MODEL" --device cuda --dtype bfloat16 \
    --speculative reference:0.8 --num-speculative-tokens 4 --num-prompts "$COUNTS" \
    --max-tokens 128 --repeats 2 --ours-only --json "$OUT/spec.json" 2>&1 | tail -12
echo "== gpu-marked tests: verify graphs, and the decode graphs they share a runner with ($SECONDS s)"
timeout 120 $PY -m pytest -x -q --timeout=110 -m gpu tests/engine/test_verify_graph.py \
    tests/engine/test_cuda_graphs.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
if [ -n "${DRAFT:-}" ]; then  # optional, ~2 more minutes: e.g. DRAFT=random:llama-3.2-1b
    echo "== the same at 1,16 prompts with the draft model $DRAFT run for its cost ($SECONDS s)"
    timeout 230 $PY -m pdserve bench offline --model "$MODEL" --device cuda --dtype bfloat16 \
        --speculative reference:0.8 --speculative-model "$DRAFT" --num-speculative-tokens 4 \
        --num-prompts 1,16 --max-tokens 128 --repeats 2 --ours-only --kv-cache-memory 24 \
        --json "$OUT/spec_draft.json" 2>&1 | tail -8
fi
echo "== done ($SECONDS s)"
