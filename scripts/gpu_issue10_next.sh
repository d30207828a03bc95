#!/usr/bin/env bash
# Issue 10's next GPU call, in one command (~450 s on one H200): the GPU tests, the decode
# graph with our GEMVs at 64 rows with and without programmatic dependent launch (PDL), then
# the 64-prompt `bench offline` row with and without PDSERVE_TRITON_PDL=1.
# Run from the repository root on the GPU machine, pdserve and its dependencies importable
# (see ../shared/facts/GPU.md: how pdserve is carried there). Writes under ${OUT:-gpu_next}.
# Decide from it: PDL becomes the default (pdserve/envs.py) when the engine's 64-prompt
# decode ms/step is lower with it and the GPU tests pass with it on.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_next}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
echo "== gpu tests"
timeout 230 $PY -m pytest -q --timeout=220 -m gpu tests 2>&1 | tail -12 | tee "$OUT/gpu_tests.txt"
echo "== decode graph, our GEMVs at 64 rows, without and with PDL ($SECONDS s)"
OUT=$OUT timeout 200 $PY scripts/gpu_graph_profile.py gemv-nosilu gemv-nosilu+tri64 gemv-nosilu+tri64+pdl 2>&1 | tail -30
O=(--model random:llama-3.1-8b --device cuda --dtype bfloat16 --num-prompts 64 --max-tokens 128 --repeats 2)
echo "== bench offline, 64 prompts, PDL off ($SECONDS s)"
timeout 120 $PY -m pdserve bench offline "${O[@]}" --json "$OUT/offline64_nopdl.json" 2>&1 | tail -6
echo "== bench offline, 64 prompts, PDL on ($SECONDS s)"
PDSERVE_TRITON_PDL=1 timeout 120 $PY -m pdserve bench offline "${O[@]}" --json "$OUT/offline64_pdl.json" 2>&1 | tail -6
echo "== end at $SECONDS s"
