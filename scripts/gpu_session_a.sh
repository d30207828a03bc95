#!/usr/bin/env bash
# First H200 call of a session (~8 min): where a decode step goes, the PD first token, and
# the CUDA side of the FP8 / MoE kernel fixes, each step under its own timeout:
#   1. scripts/gpu_step_profile.py at 1/64/256 x 200 and 32 x 4,096 (issue 24: wall step vs
#      kernel time per step, top kernels, graph launches) -> step_profile.json
#   2. scripts/gpu_serve_check.sh with per-phase timings, three runs of 64 requests at
#      8 req/s (issue 24's PD TTFT target: PD median <= mixed + 5 ms, p99 <= 2 x median)
#      -> serve/serve.json, serve/serve.png, serve/serve.phases.png
#   3. the FP8 linear tests and the gpu-marked MoE kernel tests on CUDA -> tests.txt
#      (TESTS=0 leaves them out)
# Run from the repository root on the GPU machine with the wheels in ${WHEELS:-.whl}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_a}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
echo "== 1. step profile ($SECONDS s)"
timeout ${T_PROFILE:-230} $PY scripts/gpu_step_profile.py 2>&1 | grep -v "^USDT\|profiler_st" | tail -70
echo "== 2. serve check, PD vs mixed, 3 x 64 at 8 req/s ($SECONDS s)"
PHASES=1 INTERFERENCE=0 RATES=8,8,8 NREQ=64 OUT="$OUT/serve" timeout ${T_SERVE:-240} \
    bash scripts/gpu_serve_check.sh 2>&1 | tail -60
[ "${TESTS:-1}" = 1 ] || { echo "== end at $SECONDS s"; exit 0; }
echo "== 3. FP8 and MoE tests on CUDA ($SECONDS s)"
timeout ${T_TESTS:-150} $PY -m pytest -q --timeout=80 -p no:cacheprovider tests/model/test_triton_fp8.py \
    tests/model/test_triton_moe.py tests/model/test_moe.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
echo "== end at $SECONDS s"
