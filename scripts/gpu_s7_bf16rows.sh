#!/usr/bin/env bash
# Issue 24, session 7, one H200 call (budget 270 s): bf16 decode at 64 and 256 rows.
#   1. in the background, beside the model load (its random weights are drawn on the CPU):
#      scripts/gpu_s7_mm_sweep.py, the persistent TMA matmul (pdserve/model/triton_mm.py)
#      vs F.linear at the four Llama-3.1-8B linear shapes and 256/128/192/96 rows, no model
#      (<= 85 s; gate_up first) -> mm_sweep.json
#   2. scripts/gpu_s7_bf16rows.py, one engine load: the step profile at 64x200 / 256x200;
#      bench offline's 64 / 256 GSM8K rows (128 tokens) at step budgets 4,096 / 8,192 /
#      16,384; one prefill step of 4,096 / 8,192 / 16,384 tokens profiled; the engine with
#      the sweep's winning table (if any); the 64-row split-K reduce folded into the next
#      add + RMSNorm (pdserve/model/fused_splitk_norm.py) vs not; PDSERVE_TRITON_PDL=1 vs off
#      -> bf16rows.json
# Then a compact summary on stdout. Two files are left under $OUT: bf16rows.json and
# mm_sweep.json. Run as: OUT=$OUT PREFIX=s7_ bash scripts/gpu_call.sh bf16rows:270
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s7_bf16rows}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-270}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
rm -f "$OUT/mm_sweep.done"
echo "== 1. the TMA matmul sweep, in the background ($SECONDS s)"
(
    timeout ${T_SWEEP:-85} $PY scripts/gpu_s7_mm_sweep.py --device "$DEVICE" --budget-s ${SWEEP_S:-65} \
        ${SWEEP_ARGS:-} > "$OUT/mm_sweep.log" 2>&1
    echo "sweep exit $? (124: cut by its timeout)" >> "$OUT/mm_sweep.log"
    touch "$OUT/mm_sweep.done"
) &
sweep_pid=$!
left=$((BUDGET - 14 - SECONDS))
echo "== 2. one engine: profile, offline rows by budget, prefill steps, mm table, PDL ($SECONDS s; $left s left)"
timeout -k 5 "$left" $PY scripts/gpu_s7_bf16rows.py --model "$MODEL" --device "$DEVICE" \
    --deadline-s $((left - 8)) ${ENGINE_ARGS:-} 2>&1 | grep -v "^USDT\|profiler_st"
echo "engine script exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
kill "$sweep_pid" 2>/dev/null
wait "$sweep_pid" 2>/dev/null
echo "== the sweep's log"
grep -v "^USDT" "$OUT/mm_sweep.log" | tail -24
rm -f "$OUT/mm_sweep.log" "$OUT/mm_sweep.done"
echo "== summary ($SECONDS s)"
timeout 10 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    r = json.loads((out / "bf16rows.json").read_text())
except (OSError, ValueError) as exc:
    sys.exit(f"no bf16rows.json: {exc}")
print("parts", r.get("parts_done"), "skipped", r.get("skipped"), "errors", r.get("errors"))
def steps(tag, prof):
    for s, p in (prof or {}).items():
        print(f"{tag:10s} {s:8s} step {p['step_ms']:.3f} kernels {p['kernel_ms']:.3f} gap {p['gap_ms']:.3f}")
steps("base", r.get("profile"))
steps("mm", r.get("mm_profile"))
steps("mm-base", r.get("mm_base_again"))
steps("splitk", r.get("splitk_profile"))
steps("splitk-base", r.get("splitk_base_again"))
steps("pdl", r.get("pdl_profile"))
steps("pdl-off", r.get("pdl_off_again"))
for tag in ("offline", "mm_offline", "splitk_offline", "pdl_offline"):
    for o in r.get(tag) or []:
        print(f"{tag:11s} {o['num_prompts']:4d} @ {o['budget']:6d}: first {o['first_token_s']*1e3:7.1f} ms "
              f"tok/s {o.get('tok_s', 0):8.0f} decode {o.get('decode_ms_per_step', 0):.2f} ms")
for p in r.get("prefill") or []:
    print(f"prefill {p['tokens']:6d} tok: {p['wall_ms']:.1f} ms wall ({p['tok_s']:.0f} tok/s, "
          f"{p['tflops_wall']:.0f} TFLOP/s), kernels {p['kernel_ms']:.1f} ms")
print("mm table:", r.get("mm_table"), "| split-K folded, same outputs:", r.get("splitk_same_outputs"))
PYEOF
echo "== end at $SECONDS s"
