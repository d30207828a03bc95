#!/usr/bin/env bash
# Second H200 call of a session (~8 min): FP8 on the H200 and the decode step the
# roofline describes, each step under its own timeout:
#   1. scripts/gpu_fp8_check.sh (issue 26: FP8 tests on CUDA, kernels, engine tok/s with
#      FP8 weights + FP8 KV and with bf16 KV, the KV transfer in e4m3) -> fp8/*.json
#   2. bench offline --ours-only at 64 and 256 prompts and 32 x 4,096 (issue 24), with the
#      step timed once every prompt decodes (--steady-steps) -> offline.json
# (bench quality needs the embedded model's 94 MB GGUF, over what a call can carry.)
# fp8/ is packed as fp8.tgz (a call brings back at most 8 files).
# Run from the repository root on the GPU machine with the wheels in ${WHEELS:-.whl}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_b}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
echo "== 1. FP8 ($SECONDS s)"
OUT="$OUT/fp8" bash scripts/gpu_fp8_check.sh 2>&1 | grep -v "^USDT" | tail -80
echo "== 2. bench offline, all-decoding step ($SECONDS s)"
timeout ${T_OFFLINE:-200} $PY -m pdserve bench offline --model random:llama-3.1-8b --device cuda \
    --dtype bfloat16 --ours-only --num-prompts 64,256 --long-context 32x4096 --max-tokens 128 \
    --repeats 1 --json "$OUT/offline.json" 2>&1 | tail -12
tar czf "$OUT/fp8.tgz" -C "$OUT" fp8 && rm -rf "$OUT/fp8"
echo "== end at $SECONDS s"
