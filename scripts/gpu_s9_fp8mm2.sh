#!/usr/bin/env bash
# Issue 26, session 9, second round of part fp8mm (budget 120 s): the skinny GEMM's "skinny8"
# form on e4m3 weights (the bf16 activations quantized to e4m3 inside the kernel, one scale
# per row and BLOCK_K columns, FP8 dots; no activation-quantization kernel, o's and down's
# split-K partials summed by the next add + RMSNorm, gate/up with SwiGLU) at 64 decode rows.
#   1. in the background, beside the model load: scripts/gpu_s9_fp8mm.py micro --kind skinny8
#      (no model): the four FP8 linears at 64 rows, the current w8a8 path (with its quantize /
#      reduce / silu_mul kernels as the engine runs them) vs skinny8 tiles -> fp8mm2_micro.json
#   2. scripts/gpu_s9_fp8mm.py engine: one FP8 + e4m3-KV engine, the 64x200 step and bench
#      offline's 64-prompt row with the current paths vs the picks (those faster alone; then
#      every shape's best tile, "all"), graphs captured again, greedy tokens compared
#      -> fp8mm2.json (the micro JSON inside)
# One file is left under $OUT: fp8mm2.json. Run as:
#   OUT=$OUT/gpu_s9 PREFIX=s9_ bash scripts/gpu_call.sh fp8mm2:120
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s9_fp8mm2}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-120}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
rm -f "$OUT/fp8mm2_micro.json.done"
echo "== 1. micro sweep in the background ($SECONDS s)"
(
    timeout -k 3 ${T_MICRO:-80} $PY scripts/gpu_s9_fp8mm.py micro --device "$DEVICE" \
        --kind skinny8 --micro-json fp8mm2_micro.json --budget-s ${MICRO_S:-60} ${MICRO_ARGS:-} > "$OUT/micro.log" 2>&1
    echo "micro exit $? (124: cut by its timeout)" >> "$OUT/micro.log"
    touch "$OUT/fp8mm2_micro.json.done"
) &
micro_pid=$!
left=$((BUDGET - 10 - SECONDS))
echo "== 2. engine ($SECONDS s; $left s left)"
timeout -k 5 "$left" $PY scripts/gpu_s9_fp8mm.py engine --model "$MODEL" --device "$DEVICE" \
    --kind skinny8 --micro-json fp8mm2_micro.json --json fp8mm2.json --deadline-s $((left - 6)) ${ENGINE_ARGS:-} 2>&1 | grep -v "^USDT\|profiler_st\|^\[W"
echo "engine exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
kill "$micro_pid" 2>/dev/null
wait "$micro_pid" 2>/dev/null
echo "== the micro sweep's log"
grep -v "^USDT" "$OUT/micro.log" | tail -45
timeout 5 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    r = json.loads((out / "fp8mm2.json").read_text())
except (OSError, ValueError) as exc:
    r = {"engine_error": f"no fp8mm2.json: {exc}"}
m = r.get("micro")
if (not m or "shapes" not in m) and (out / "fp8mm2_micro.json").exists():  # the engine never read it
    r["micro"] = json.loads((out / "fp8mm2_micro.json").read_text())
(out / "fp8mm2.json").write_text(json.dumps(r, indent=1))
print("parts", r.get("parts_done"), "skipped", r.get("skipped"), "errors", r.get("errors"))
for s in r.get("steps", []):
    print(f"step {s['label']:4s} {s['step_ms']:.3f} ms kernels {s['kernel_ms']:.3f} ({s['kernels_per_step']:.0f})")
for o in r.get("offline", []):
    print(f"bench {o['label']:4s} {o['tok_s']:.0f} tok/s first {o['first_token_s'] * 1e3:.1f} ms decode {o['decode_ms_per_step']:.3f} ms")
print("greedy", r.get("greedy_on_vs_off"))
PYEOF
rm -f "$OUT/micro.log" "$OUT/fp8mm2_micro.json" "$OUT/fp8mm2_micro.json.done" "$OUT"/*.tmp
echo "== end at $SECONDS s"
