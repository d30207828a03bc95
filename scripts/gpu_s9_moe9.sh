#!/usr/bin/env bash
# Issue 27, session 9 (branch moe9, budget 120 s): scripts/gpu_s9_moe9.py. The sparse layer
# alone at 1 token (the top-k sum inside the down kernel, gate/up tiles of 16 columns and
# other neighbours) and 64 tokens (uniform / 24 experts: the alignment in one program per
# expert, row blocks of 32); then one engine, routing counters off: greedy tokens and the
# kernel profile of a 1x200 and a 64x200 step with the committed path, then with the picks,
# then 1x200 with the picks and PDL off (each kernel's own time); bench offline 1 / 64 if
# seconds remain. -> $OUT/moe9.json (the summary echoed to stdout: output.txt).
#   OUT=$OUT/gpu_s9 PREFIX=s9_ bash scripts/gpu_call.sh moe9:120
# CPU dry run: SMOKE=1 DEVICE=cpu MODEL=random:tiny-qwen3-moe TRITON_INTERPRET=1 BUDGET=600 OUT=/tmp/m9 bash scripts/gpu_s9_moe9.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s9_moe9}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
unset PDSERVE_MOE_ROUTING_STATS PDSERVE_MOE_GEMV_MAX_TOKENS PDSERVE_TRITON_PDL
BUDGET=${BUDGET:-114}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git log --oneline -1 2>/dev/null
echo "== moe9: layer variants, then the engine ($SECONDS s, budget $BUDGET s)"
REST=$((BUDGET - SECONDS))
OUT="$WORK" BUDGET_S=$((REST - 6)) A_S=${A_S:-24} timeout -k 2 $((REST - 3)) $PY scripts/gpu_s9_moe9.py > "$WORK/run.log" 2>&1
echo "rc $? ($SECONDS s)"
grep -v "^USDT\|profiler_st\|^\[W\|STAGE:" "$WORK/run.log" | grep -E "^\[|^T +|WRONG|Error|error" | tail -60
cp "$WORK/moe9.json" "$OUT/moe9.json" 2>/dev/null || echo '{"missing": "moe9.json"}' > "$OUT/moe9.json"
$PY - "$OUT/moe9.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("layers", []):
    for n, v in sorted(r["candidates"].items(), key=lambda kv: kv[1].get("us", 1e9)):
        if "us" in v:
            print(f"layer T {r['tokens']:>2} {r['regime']:<7} {v['us']:6.1f} us ({v['fraction']:.2f}) "
                  f"{'same' if v['same_bits'] else 'diff'} {v['label']:<11} {n[:90]}")
print("table:", d.get("table"))
e = d.get("engine", {})
print("engine start s:", d.get("engine_start_s"), "recapture s:", e.get("recapture_s"))
print("greedy same:", e.get("greedy_same"), "of", e.get("greedy_of"))
for lab, p in e.get("profile", {}).items():
    for rows, r in p.items():
        if isinstance(r, dict) and "step_ms" in r:
            print(f"profile {lab} {rows}x200: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms, {r['kernels_per_step']:.0f}/step")
            for k, v in list(r["kernels"].items())[:14]:
                print(f"   {v['us_per_step']:8.1f} us/step {v['per_layer']:5.2f}/layer {v['us_each']:6.2f} us  {k[:70]}")
for r in (e.get("bench") or {}).get("results", []) or []:
    print("bench", r)
print("errors:", d.get("part_a_error"), d.get("part_b_error"))
PYEOF
find "$OUT" -mindepth 1 -not -name moe9.json -not -name output.txt -delete 2>/dev/null
echo "== end at $SECONDS s"
