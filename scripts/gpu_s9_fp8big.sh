#!/usr/bin/env bash
# Issue 26, session 9, part fp8big of one H200 call (budget 150 s): FP8 weights + e4m3 KV at
# 256-1,024 prompts (the best-batch target, >= 27,000 output tok/s), one engine load.
#   1. in the background, beside the model load (the GPU idle meanwhile):
#      scripts/gpu_s9_fp8big.py micro: the e4m3 decode attention at 1,024 x 200 / 512 x 200
#      per tile variant (bf16 beside it), the four FP8 linears at 512 / 1,024 / 16,384 rows
#      (_scaled_mm and its quantization, w8a8 tiles, bf16) -> fp8big_micro.json
#   2. scripts/gpu_s9_fp8big.py engine (random:llama-3.1-8b --quantization fp8
#      --kv-cache-dtype fp8_e4m3, 1,024 running, budget 16,384, 40 GiB KV): the prefill chunk
#      and the all-decoding step at 1,024 / 512 / 256 rows profiled, the 1,024 step eager and
#      with variants' graphs; bench offline's row procedure at 1,024 / 512 / 256 prompts,
#      and at 1,024 with the heap frozen, budget 8,192, 256 running -> fp8big.json
# One file is left under $OUT: fp8big.json (the micro JSON inside it). Run as:
#   OUT=$OUT/gpu_s9 PREFIX=s9_ bash scripts/gpu_call.sh fp8big:150
# CPU check: TRITON_INTERPRET=1 DEVICE=cpu MODEL=random:tiny TOY=1 PYTHON=.venv/bin/python BUDGET=300 MICRO_ARGS=--no-attn \
#   ENGINE_ARGS="--dtype float32 --steps 4" OUT=/tmp/s9 bash scripts/gpu_s9_fp8big.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s9_fp8big}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-150}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3.1-8b}
TOYARG=
[ -n "${TOY:-}" ] && TOYARG=--toy
rm -f "$OUT/fp8big_micro.json.done"
echo "== 1. micro sweep in the background ($SECONDS s)"
(
    timeout -k 3 ${T_MICRO:-62} $PY scripts/gpu_s9_fp8big.py micro --device "$DEVICE" $TOYARG \
        --attn-deadline-s ${ATTN_S:-32} --deadline-s ${MICRO_S:-55} ${MICRO_ARGS:-} > "$OUT/micro.log" 2>&1
    echo "micro exit $? (124: cut by its timeout)" >> "$OUT/micro.log"
    touch "$OUT/fp8big_micro.json.done"
) &
micro_pid=$!
left=$((BUDGET - 12 - SECONDS))
echo "== 2. engine ($SECONDS s; $left s left)"
timeout -k 4 "$left" $PY scripts/gpu_s9_fp8big.py engine --model "$MODEL" --device "$DEVICE" \
    --deadline-s $((left - 5)) $TOYARG ${ENGINE_ARGS:-} 2>&1 | grep -v "^USDT\|profiler_st\|^STAGE:"
echo "engine exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
kill "$micro_pid" 2>/dev/null
wait "$micro_pid" 2>/dev/null
echo "== the micro sweep's log"
grep -v "^USDT" "$OUT/micro.log" | tail -40
echo "== summary ($SECONDS s)"
timeout 5 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    r = json.loads((out / "fp8big.json").read_text())
except (OSError, ValueError) as exc:
    r = {"errors": {"engine": f"no fp8big.json: {exc}"}}
if not r.get("micro") and (out / "fp8big_micro.json").exists():  # the engine never read it
    try:
        r["micro"] = json.loads((out / "fp8big_micro.json").read_text())
    except ValueError:
        pass
(out / "fp8big.json").write_text(json.dumps(r, indent=1))
print("start", r.get("engine_start_s"), "capture", r.get("capture_s"), "graphs", r.get("graphs"))
print("parts", r.get("parts_done"), "skipped", r.get("skipped"), "errors", r.get("errors"))
st = r.get("steady") or {}
for n in ("1024", "512", "256"):
    s = st.get(n)
    if s:
        print(f"steady {n}: {s['step_ms']:.2f} ms, kernels {s['profile']['kernel_ms']:.2f} ms")
for name, v in (st.get("variants") or {}).items():
    if isinstance(v, dict) and "step_ms" in v:
        print(f"variant {name}: {v['step_ms']:.2f}")
    elif isinstance(v, dict):
        a, b = v.get("variant"), v.get("current_again")
        print(f"variant {name}: {a and round(a['step_ms'], 3)} vs {b and round(b['step_ms'], 3)}")
for row in r.get("rows", []):
    print(f"row {row['label']} {row['num_prompts']}: {row['tok_s']:.0f} tok/s first {row['first_token_s']:.3f} s "
          f"decode {row['decode_ms_per_step']:.2f} ms gc {row['gc_full']['ms']}")
PYEOF
rm -f "$OUT/micro.log" "$OUT/fp8big_micro.json" "$OUT/fp8big_micro.json.done" "$OUT"/*.tmp
echo "== end at $SECONDS s"
