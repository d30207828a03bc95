#!/usr/bin/env bash
# The GPU check of a change that must not move the figures, in one command (~7 min on one
# H200; one bench offline run with its transformers side takes ~4 min, so with REF set
# the whole takes ~11 min: over one device call's 10, run REF alone in a second call): `make test-gpu`, then `pdserve bench offline` at 1 and 64 prompts (random
# llama-3.1-8b, bf16), for this tree and, when REF names a folder holding another tree's
# `pdserve/` package (e.g. `git archive <commit> pdserve | tar -x -C .ref`), for that tree
# right after it, so the two figures come from one run on one machine.
#
# Run from the repository root on the GPU machine. Missing Python packages are installed
# from wheels in ${WHEELS:-.whl} when that folder exists (only those not importable: the
# machine's own pydantic/httpx stay, see ../shared/facts/GPU.md), and the
# tokenizer from $WHEELS/cache/tokenizers (copied from this machine's PDSERVE_CACHE_DIR). Writes under ${OUT:-gpu_check}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
. scripts/gpu_setup.sh
echo "== the gpu tests (make test-gpu)"
timeout 260 $PY -m pytest -x -q --timeout=250 -m gpu tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
O=(--model random:llama-3.1-8b --device cuda --dtype bfloat16 --num-prompts 1,64 --max-tokens 128)
echo "== bench offline, this tree ($SECONDS s)"
timeout 330 $PY -m pdserve bench offline "${O[@]}" --json "$OUT/offline_new.json" 2>&1 | tail -14
if [ -n "${REF:-}" ]; then
    echo "== bench offline, the tree in $REF ($SECONDS s)"
    # from inside $REF, so that its pdserve/ comes first on sys.path
    (cd "$REF" && timeout 330 $PY -m pdserve bench offline "${O[@]}" \
        --json "$OUT/offline_ref.json") 2>&1 | tail -14
fi
echo "== end at $SECONDS s"
