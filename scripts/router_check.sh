#!/usr/bin/env bash
# Issue 29's router figures on a quiet machine (the GPU host's CPUs; no GPU needed):
#  1. pdserve bench router: the router's added latency at 100 req/s (direct vs through the
#     router, one run) and one router process's non-streamed req/s and CPU ms per request,
#     against stub workers that answer at once; once as installed, once with uvloop and
#     httptools (if importable: uvicorn picks them up by itself);
#  2. scripts/bench_selective_pd.py: TTFT p50 of 16-token prompts through PD and through a
#     router with --pd-min-prefill-tokens 64 (embedded model), and of long prompts
#     (docs/benchmarks.md row X; ~10 min on the 2-core machine).
# JSON under $OUT (default ./router_check). Run from the repository root.
set -euo pipefail
OUT=${OUT:-router_check}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
$PY -m pdserve bench router --seconds 10 --concurrency 32 --out "$OUT/bench_router.json"
if $PY -c "import uvloop, httptools" 2>/dev/null; then
  echo "uvloop and httptools are installed: the run above used them" > "$OUT/bench_router_loop.txt"
fi
OUT="$OUT" $PY scripts/bench_selective_pd.py --model "${MODEL:-smollm2-135m-instruct}" \
  --device "${DEVICE:-cpu}"
