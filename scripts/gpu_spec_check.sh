#!/usr/bin/env bash
# Speculative decoding on one GPU (issue 25's H200 targets), `pdserve bench offline
# --speculative` (bench/speculative.py): the same engine with and without speculation,
# greedy, EOS ignored, outputs checked identical.
#   1. acceptance-controlled (replay:0.8: the plain run's greedy output proposed back, each
#      draft token corrupted with probability 0.2), k = 4, random:llama-3.1-8b bf16,
#      1 / 16 / 64 prompts (targets: 1 prompt >= 500 tok/s and >= 2.2x; 16 prompts >= 1.6x);
#   2. the same with the draft model random:llama-3.2-1b run every step for its cost (its
#      proposals replaced by the replayed ones: same acceptance), 1 / 16 prompts;
#   3. the draft model's own proposals (random weights: acceptance near 0; what a verify
#      step costs when drafts are wrong), 1 prompt.
# The verify step runs eagerly (no CUDA graph of it yet); plain decode uses its graphs.
# Usage (repository root): scripts/gpu_spec_check.sh [MODEL] [DEVICE]
#   MODEL default random:llama-3.1-8b, DEVICE default cuda (cpu + random:tiny: a dry run).
# Writes spec_replay.json, spec_replay_draft.json, spec_draft.json under ${OUT:-gpu_spec};
# about 3-4 minutes (most of it generating the random weights, once per command).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-random:llama-3.1-8b}
DEVICE=${2:-cuda}
OUT=${OUT:-gpu_spec}
PY=${PYTHON:-python3}
MAXTOK=${MAXTOK:-128}
COUNTS=${COUNTS:-1,16,64}
DT=bfloat16; [ "$DEVICE" = cpu ] && DT=float32
mkdir -p "$OUT"
common=(--model "$MODEL" --dtype $DT --device "$DEVICE" --max-tokens "$MAXTOK" --repeats 2
        --num-speculative-tokens 4)
echo "== acceptance-controlled 0.8, k=4, prompts $COUNTS"
$PY -m pdserve bench offline "${common[@]}" --num-prompts "$COUNTS" \
  --speculative replay:0.8 --json "$OUT/spec_replay.json"
DRAFT=${DRAFT:-random:llama-3.2-1b}; [ "$DEVICE" = cpu ] && DRAFT=$MODEL
echo "== acceptance-controlled 0.8 with the draft model $DRAFT paid for, k=4, prompts 1,16"
$PY -m pdserve bench offline "${common[@]}" --num-prompts 1,16 --speculative replay:0.8 \
  --speculative-model "$DRAFT" --json "$OUT/spec_replay_draft.json"
echo "== draft model $DRAFT's own proposals, k=4, 1 prompt"
$PY -m pdserve bench offline "${common[@]}" --num-prompts 1 --speculative draft \
  --speculative-model "$DRAFT" --spec-workload gsm8k --json "$OUT/spec_draft.json"
