#!/usr/bin/env bash
# Issue 24, session 8, part mm64 of one H200 call (budget 140 s): bf16 linear layers at 64-256
# decode rows.
#   1. in the background, beside the model load: scripts/gpu_s8_mm64.py micro (no model):
#      per linear shape x rows (64, 128, 256) cuBLAS (F.linear, mm on a pre-transposed
#      weight, cublasLt) vs the skinny Triton GEMM (pdserve/model/triton_skinny.py: split-K,
#      early weight reads under PDL, gate/up with SwiGLU in the epilogue), each timed alone,
#      with a d2d copy and a bf16 matmul measured beside them -> mm64_micro.json
#   2. scripts/gpu_s8_mm64.py engine, one engine load: the 64x200 / 256x200 step profile,
#      the micro sweep's winners in skinny_table on vs off (greedy tokens compared), bench
#      offline's 64 / 256 rows, the 256-prompt all-decoding step timed step by step -> mm64.json
# One file is left under $OUT: mm64.json (the micro JSON inside it). Run as:
#   OUT=$OUT/gpu_s8 PREFIX=s8_ bash scripts/gpu_call.sh mm64:140
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_mm64}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-140}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
rm -f "$OUT/mm64_micro.json.done"
echo "== 1. micro sweep in the background ($SECONDS s)"
(
    timeout -k 3 ${T_MICRO:-55} $PY scripts/gpu_s8_mm64.py micro --device "$DEVICE" \
        --budget-s ${MICRO_S:-42} ${MICRO_ARGS:-} > "$OUT/micro.log" 2>&1
    echo "micro exit $? (124: cut by its timeout)" >> "$OUT/micro.log"
    touch "$OUT/mm64_micro.json.done"
) &
micro_pid=$!
left=$((BUDGET - 12 - SECONDS))
echo "== 2. engine ($SECONDS s; $left s left)"
timeout -k 5 "$left" $PY scripts/gpu_s8_mm64.py engine --model "$MODEL" --device "$DEVICE" \
    --deadline-s $((left - 10)) ${ENGINE_ARGS:-} 2>&1 | grep -v "^USDT\|profiler_st"
echo "engine exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
kill "$micro_pid" 2>/dev/null
wait "$micro_pid" 2>/dev/null
echo "== the micro sweep's log"
grep -v "^USDT" "$OUT/micro.log" | tail -30
echo "== summary ($SECONDS s)"
timeout 8 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    r = json.loads((out / "mm64.json").read_text())
except (OSError, ValueError) as exc:
    sys.exit(f"no mm64.json: {exc}")
if "micro" not in r and (out / "mm64_micro.json").exists():  # the engine never read it
    r["micro"] = json.loads((out / "mm64_micro.json").read_text())
    (out / "mm64.json").write_text(json.dumps(r, indent=1))
print("parts", r.get("parts_done"), "skipped", r.get("skipped"), "errors", r.get("errors"))
m = r.get("micro") or {}
print("copy GB/s", m.get("copy_gbps"), "matmul TFLOP/s", m.get("matmul_tflops"), "micro errors", m.get("errors"))
for row in m.get("rows", []):
    print(f"{row['shape']:8s} M={row['M']:4d} " + " ".join(f"{k}={v:.1f}" for k, v in sorted(row['us'].items(), key=lambda kv: kv[1])[:3]))
for tag in ("base_profile", "skinny_profile", "base_again_profile"):
    for s, p in (r.get(tag) or {}).items():
        print(f"{tag:18s} {s:8s} step {p['step_ms']:.3f} kernels {p['kernel_ms']:.3f}")
for tag in ("base_offline", "skinny_offline"):
    for o in r.get(tag) or []:
        print(f"{tag:14s} {o['num_prompts']:4d}: {o['tok_s']:.0f} tok/s decode {o['decode_ms_per_step']:.2f} ms")
print("table", r.get("skinny_notes"), "same outputs", r.get("skinny_same_outputs"))
for s in r.get("steady_256") or []:
    print(f"steady max_tokens {s['max_tokens']}: {s['step_ms']:.2f} ms/step; running {s['running'][:4]} waiting {s['waiting'][:4]}")
PYEOF
rm -f "$OUT/micro.log" "$OUT/mm64_micro.json" "$OUT/mm64_micro.json.done"
echo "== end at $SECONDS s"
