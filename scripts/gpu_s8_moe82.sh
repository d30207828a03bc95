#!/usr/bin/env bash
# Issue 27, session 8, second H200 round (branch moe8, budget 100 s): scripts/gpu_s8_moe82.py
# (the first round's JSON was lost): the sparse layer alone at 1 token (committed, PDL, the
# picked few-token tiles and neighbours) and 64 tokens (committed, PDL, 16-warp alignment);
# then one engine, routing counters off: the kernel profile of a 1x200 and a 64x200 step
# with the committed path, the first round's picks, and the picks with PDL off everywhere
# (each kernel's own time). -> $OUT/moe82.json, $OUT/moe82_log.txt.
#   OUT=$OUT/gpu_s8 PREFIX=s8_ bash scripts/gpu_call.sh moe82:100
# CPU dry run: SMOKE=1 DEVICE=cpu MODEL=random:tiny-qwen3-moe TRITON_INTERPRET=1 BUDGET=400 OUT=/tmp/m82 bash scripts/gpu_s8_moe82.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_moe82}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
unset PDSERVE_MOE_ROUTING_STATS PDSERVE_MOE_GEMV_MAX_TOKENS PDSERVE_TRITON_PDL
BUDGET=${BUDGET:-96}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git log --oneline -1 2>/dev/null
echo "== moe82: layer variants, then the engine's profiles ($SECONDS s, budget $BUDGET s)"
OUT="$WORK" BUDGET_S=$((BUDGET - 8)) A_S=${A_S:-22} timeout -k 3 $((BUDGET - 5)) $PY scripts/gpu_s8_moe82.py > "$WORK/run.log" 2>&1
echo "rc $? ($SECONDS s)"
grep -v "^USDT\|profiler_st\|^\[W\|STAGE:" "$WORK/run.log" | grep -E "^\[|^T +|^ +[0-9]|WRONG|Error|error" | tail -100 > "$OUT/moe82_log.txt"
cp "$WORK/moe82.json" "$OUT/moe82.json" 2>/dev/null || echo '{"missing": "moe82.json"}' > "$OUT/moe82.json"
$PY - "$OUT/moe82.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("layers", []):
    for n, v in sorted(r["candidates"].items(), key=lambda kv: kv[1].get("us", 1e9)):
        if "us" in v:
            print(f"layer T {r['tokens']:>2} {r['regime']:<7} {v['us']:6.1f} us ({v['fraction']:.2f}) {v['label']:<11} {n[:70]}")
e = d.get("engine", {})
print("engine start s:", d.get("engine_start_s"), "recapture s:", e.get("recapture_s"))
for lab, p in e.get("profile", {}).items():
    for rows, r in p.items():
        if isinstance(r, dict) and "step_ms" in r:
            print(f"profile {lab} {rows}x200: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms, {r['kernels_per_step']:.0f}/step")
            for k, v in list(r["kernels"].items())[:12]:
                print(f"   {v['us_per_step']:8.1f} us/step {v['per_layer']:5.2f}/layer {v['us_each']:6.2f} us  {k[:70]}")
print("errors:", d.get("part_a_error"), d.get("part_b_error"))
PYEOF
find "$OUT" -mindepth 1 -not -name moe82.json -not -name moe82_log.txt -not -name output.txt -delete 2>/dev/null
echo "== end at $SECONDS s"
