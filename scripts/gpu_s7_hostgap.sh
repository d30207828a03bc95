#!/usr/bin/env bash
# Session 7: where the decode step's ~1.5 ms host gap at 32 x 4,096 goes
# (scripts/gpu_s7_hostgap.py: one bf16 engine, the step profile and cProfile of the host
# at 32x4096 and 64x200) -> $OUT/hostgap.json. About 100 s on the H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s7_hostgap}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
timeout ${T_HOST:-150} $PY scripts/gpu_s7_hostgap.py ${SHAPES:-32x4096 64x200} 2>&1 | grep -v "^USDT" | tail -40
echo "== end at $SECONDS s"
