#!/usr/bin/env bash
# Issue 26, session 14, part fp8merge of one H200 call (budget 150 s): the split-KV merge and
# o_proj's per-row e4m3 quantization in one kernel (fp8.FUSE_MERGE_QUANT; its grid and warps,
# triton_backend.MERGE_QUANT_HEADS / MERGE_QUANT_WARPS) and a split-K w8a8 linear's reduce
# folded into the next add + RMSNorm + quantization (fp8.FUSE_SPLITK_NORM), each against the
# two kernels it replaces, in one FP8 + e4m3-KV engine (random:llama-3.1-8b, --quantization
# fp8 --kv-cache-dtype fp8_e4m3, graphs of the 32- and 64-row buckets) with
# scripts/gpu_s14_fp8merge.py: per case (32 x 4,096: the 32-row long-context graph, 8 splits
# and a merge a layer, down on a 4-way split-K tile; 64 x 200: the 64-row short one, one split
# and no merge, o_proj and down on 2-way split-K tiles) the graph captured again per variant
# (VARIANTS: off, on, on_w16, g4, sk_off, sk; the .py's docstring), one replay of each
# profiled (kernels a step and their µs), the all-decoding step in interleaved spans of every
# variant (paired medians), 8 greedy tokens under each compared with its pair's (identical
# expected: the same bits) -> fp8merge.json. Run as
#   OUT=$OUT/g1 PREFIX= bash scripts/gpu_call.sh s14_fp8merge:150
# CPU dry run of the script (~15 s: no graphs, torch_sdpa; the flags change nothing there):
#   TRITON_INTERPRET=1 DEVICE=cpu MODEL=random:tiny CASES=2x70,4x20 BUDGET=400 \
#   ARGS="--dtype float32 --kv-cache-memory 0.05 --rounds 2 --span-steps 2 --greedy-tokens 3" \
#   PYTHON=.venv/bin/python OUT=/tmp/s14 bash scripts/gpu_s14_fp8merge.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s14_fp8merge}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-150}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
# shellcheck disable=SC2086  # ARGS is a list of words
timeout -k 3 $((BUDGET - 6)) $PY scripts/gpu_s14_fp8merge.py --device "${DEVICE:-cuda}" \
    --model "${MODEL:-random:llama-3.1-8b}" --cases "${CASES:-32x4096,64x200}" \
    --variants "${VARIANTS:-off,on,on_w16,g4,sk_off,sk}" --deadline-s $((BUDGET - 10)) ${ARGS:-} 2>&1 \
    | grep --line-buffered -v "^USDT\|profiler_st\|warn("
echo "rc ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
timeout 5 $PY - "$OUT/fp8merge.json" <<'PYEOF'
import json, sys
try:
    res = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no fp8merge.json: {exc}")
print("engine up", round(res.get("engine_start_s", 0), 1), "s; errors", res.get("errors"))
for case, c in res.get("cases", {}).items():
    print(f"{case} (graph {c.get('graph_key')}): step ms {({k: round(v, 4) for k, v in c.get('step_ms', {}).items()})}")
    for tag, v in c.get("variants", {}).items():
        prof = v.get("profile") or {}
        keep = {k: v.get(k) for k in v if k.startswith(("over_", "paired_", "greedy_", "missing"))}
        small = {k[:40]: (int(n), round(us, 1)) for k, (n, us) in (prof.get("by_name") or {}).items()
                 if any(w in k for w in ("merge", "quant_rows", "reduce", "norm"))}
        print(f"   {tag}: kernels {prof.get('kernels')} (launches, us a replay) {small} {keep}")
    if c.get("errors"):
        print("   errors", c["errors"])
PYEOF
echo "== end at $SECONDS s"
