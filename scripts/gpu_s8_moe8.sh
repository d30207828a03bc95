#!/usr/bin/env bash
# Issue 27, session 8 (branch moe8, budget 150 s): MoE decode on random:qwen3-30b-a3b.
# scripts/gpu_s8_moe8.py, one process: A. the sparse layer alone at 1 and 64 tokens, the
# committed path against PDL on its kernels, other grouped tiles, route_align with 16-warp
# alignment, and the few-token path (routing fused into the gate/up launch; down per
# assignment + top-k sum, or one-launch down + sum), outputs checked; B. one engine: greedy
# tokens and the kernel profile of a 1x200 and a 64x200 step with the committed path, then
# with A's picks (greedy compared), then bench offline --num-prompts 1,64 x 128 with the
# picks (PDSERVE_MOE_ROUTING_STATS=1: the roofline over the experts routed to).
# -> $OUT/moe8.json, $OUT/moe8_log.txt (the log's last lines).
#   OUT=$OUT/gpu_s8 PREFIX=s8_ bash scripts/gpu_call.sh moe8:150
# CPU dry run: SMOKE=1 DEVICE=cpu MODEL=random:tiny-qwen3-moe TRITON_INTERPRET=1 BUDGET=900 OUT=/tmp/m8 bash scripts/gpu_s8_moe8.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_moe8}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PY WHEELS
. scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
export PDSERVE_MOE_ROUTING_STATS=1
unset PDSERVE_MOE_GEMV_MAX_TOKENS
BUDGET=${BUDGET:-146}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git log --oneline -1 2>/dev/null
echo "== moe8: layer variants, then the engine ($SECONDS s, budget $BUDGET s)"
OUT="$WORK" BUDGET_S=$((BUDGET - 12)) timeout -k 3 $((BUDGET - 7)) $PY scripts/gpu_s8_moe8.py > "$WORK/run.log" 2>&1
echo "rc $? ($SECONDS s)"
grep -v "^USDT\|profiler_st\|^\[W\|STAGE:" "$WORK/run.log" | grep -E "^\[|^T +|^ +[0-9]|WRONG|Error|error|prompts|^ +(1|64) " | tail -120 > "$OUT/moe8_log.txt"
cp "$WORK/moe8.json" "$OUT/moe8.json" 2>/dev/null || echo '{"missing": "moe8.json"}' > "$OUT/moe8.json"
$PY - "$OUT/moe8.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("layers", []):
    c = r["candidates"]
    ok = sorted((v["us"], n) for n, v in c.items() if v.get("ok"))
    base = next((v for v in c.values() if v.get("label") == "committed" and "us" in v), {})
    print(f"layer T {r['tokens']:>2} {r['regime']:<7} {r['routed_experts']:>3} exp roof {r['roofline_us']:.1f} us: "
          f"committed {base.get('us', 0):.1f}; best " + (f"{ok[0][0]:.1f} {ok[0][1]}" if ok else "-"))
print("table:", d.get("table"))
e = d.get("engine", {})
print("greedy same:", e.get("greedy_same"), "of", e.get("greedy_of"), "recapture s:", e.get("recapture_s"))
for lab, p in e.get("profile", {}).items():
    for rows, r in p.items():
        if "step_ms" in r:
            print(f"profile {lab} {rows}x200: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms")
for r in (e.get("bench") or {}).get("results", []):
    print(f"bench {r['num_prompts']:>3} prompts: {r['ours_tok_s']:.1f} tok/s, step {r['ours_step_ms_all_decoding']} ms, "
          f"roofline fraction {r['roofline_fraction']}")
print("errors:", d.get("part_a_error"), d.get("part_b_error"))
PYEOF
find "$OUT" -mindepth 1 -not -name moe8.json -not -name moe8_log.txt -not -name output.txt -delete 2>/dev/null
echo "== end at $SECONDS s"
