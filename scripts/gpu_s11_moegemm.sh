#!/usr/bin/env bash
# Issue 27, session 11, one H200 part (branch moegemm, budget 120 s): scripts/gpu_s11_moegemm.py.
# The persistent grouped GEMMs (MoEPlan.persist, moe_table.PERSISTENT: off by default) against
# the committed grid kernels: the sparse layer alone at 1 token and 64 tokens (uniform / 24
# experts), us and the roofline fraction, the same bits; then one engine
# (random:qwen3-30b-a3b, bf16, PDSERVE_MOE_ROUTING_STATS=1): the 64-row bucket's graphs
# captured again per plan, greedy tokens against today's, the 64-prompt all-decoding step
# interleaved with today's (paired medians), the step's profile, bench offline 64 prompts
# -> $OUT/moegemm.json (the summary on stdout: output.txt).
#   OUT=$OUT/gpu_s11 PREFIX=s11_ bash scripts/gpu_call.sh moegemm:120
# CPU dry run (the MoE kernels under the interpreter; ~5 min): PDSERVE_MOE_EXPERTS=fused ROUNDS=2 SPAN=2 SMOKE=1 DEVICE=cpu
#   MODEL=random:tiny-qwen3-moe TRITON_INTERPRET=1 TOKENS=8 BUDGET=1500 A_S=300 PYTHON=.venv/bin/python OUT=/tmp/mgg bash scripts/gpu_s11_moegemm.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s11_moegemm}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
unset PDSERVE_MOE_GEMV_MAX_TOKENS PDSERVE_TRITON_PDL
export PDSERVE_MOE_ROUTING_STATS=1
BUDGET=${BUDGET:-114}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git log --oneline -1 2>/dev/null
echo "== moegemm: the layer's persistent plans, then one engine's 64-row step ($SECONDS s, budget $BUDGET s)"
REST=$((BUDGET - SECONDS))
OUT="$WORK" BUDGET_S=$((REST - 5)) A_S=${A_S:-24} timeout -k 2 $((REST - 2)) $PY scripts/gpu_s11_moegemm.py > "$WORK/run.log" 2>&1
echo "rc $? ($SECONDS s)"
grep -v "^USDT\|profiler_st\|^\[W\|STAGE:" "$WORK/run.log" | grep -E "^\[|^T +|^ +[0-9]|WRONG|Error|error|Traceback" | tail -70
cp "$WORK/moegemm.json" "$OUT/moegemm.json" 2>/dev/null || echo '{"missing": "moegemm.json"}' > "$OUT/moegemm.json"
$PY - "$OUT/moegemm.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("layers", []):
    base = next((v["us"] for v in r["candidates"].values() if "us" in v), None)
    for n, v in sorted(r["candidates"].items(), key=lambda kv: kv[1].get("us", 1e9)):
        if "us" in v:
            print(f"layer T {r['tokens']:>2} {r['regime']:<7} {r['routed_experts']:>3} exp {v['us']:6.1f} us "
                  f"({v['fraction']:.2f}) {'same' if v['same_bits'] else 'diff'} {n}")
        else:
            print(f"layer T {r['tokens']:>2} {r['regime']:<7} {n}: {v}")
print("order:", d.get("order"), "pick_ok (layer):", d.get("pick_ok"))
print("engine start s:", d.get("engine_start_s"), "greedy:", d.get("greedy"))
for n, v in ((d.get("ab") or {}).get("variants") or {}).items():
    print(f"ab 64 {n:<11} {v['median_ms']:.4f} ms paired {v['paired_diff_median_ms']:+.4f} ({v['lower_rounds']} lower)")
print("pick:", d.get("pick"))
for lab, p in (d.get("profile") or {}).items():
    print(f"profile {lab}: step {p['step_ms']:.3f} ms, {p['kernels_per_step']:.0f} kernels/step")
    for k, v in list(p["kernels"].items())[:8]:
        print(f"   {v['us_per_step']:8.1f} us/step {v['per_layer']:5.2f}/layer {v['us_each']:6.2f} us  {k[:70]}")
for lab, b in (d.get("bench") or {}).items():
    for r in b.get("results", []):
        print("bench", lab, r)
print("errors:", d.get("errors"), "skipped:", d.get("skipped"))
PYEOF
find "$OUT" -mindepth 1 -not -name moegemm.json -not -name output.txt -delete 2>/dev/null
echo "== end at $SECONDS s"
