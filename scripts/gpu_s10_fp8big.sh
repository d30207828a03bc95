#!/usr/bin/env bash
# Issue 26, session 10, part fp8big of one H200 call (budget 130 s): FP8 weights + e4m3 KV at
# 512-1,024 rows (the best-batch target, >= 27,000 output tok/s), one engine load; two picks
# judged in it, on and off in turn: decode_attn_table.FP8_ONE (the e4m3 one-split decode
# tiles of 16 tokens, 1 warp from 512 rows) and fp8.FUSE_SILU_QUANT (SwiGLU writes the down
# projection's e4m3 rows).
#   1. in the background, beside the model load (the GPU idle meanwhile):
#      scripts/gpu_s10_fp8big.py micro: SwiGLU + quantization two kernels vs one at 16-16,384
#      rows (bits compared); the e4m3 decode attention at 1,024-128 x 200 per tile variant
#      -> fp8big_micro.json
#   2. scripts/gpu_s10_fp8big.py engine (random:llama-3.1-8b --quantization fp8
#      --kv-cache-dtype fp8_e4m3, 1,024 running, budget 16,384, 40 GiB KV): prefill chunks
#      with the SwiGLU pick on / off in turn; all-decoding steps at 1,024 / 512 rows under the
#      four combinations (256 / 64 rows: SwiGLU on / off), rounds in turn, graphs captured
#      again; bench offline's row procedure at 1,024 prompts, picks on / off / on / off, the
#      greedy tokens compared -> fp8big.json
# One file is left under $OUT: fp8big.json (the micro JSON inside it). Run as:
#   OUT=$OUT/gpu_s10 PREFIX=s10_ bash scripts/gpu_call.sh fp8big:130
# CPU check: TRITON_INTERPRET=1 DEVICE=cpu MODEL=random:tiny TOY=1 PYTHON=.venv/bin/python BUDGET=400 \
#   ENGINE_ARGS="--dtype float32 --toy-graphs" OUT=/tmp/s10 bash scripts/gpu_s10_fp8big.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s10_fp8big}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-130}
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
    timeout -k 3 ${T_MICRO:-50} $PY scripts/gpu_s10_fp8big.py micro --device "$DEVICE" $TOYARG \
        --attn-deadline-s ${ATTN_S:-40} --deadline-s ${MICRO_S:-20} > "$OUT/micro.log" 2>&1
    echo "micro exit $? (124: cut by its timeout)" >> "$OUT/micro.log"
    touch "$OUT/fp8big_micro.json.done"
) &
micro_pid=$!
left=$((BUDGET - 10 - SECONDS))
echo "== 2. engine ($SECONDS s; $left s left)"
timeout -k 4 "$left" $PY scripts/gpu_s10_fp8big.py engine --model "$MODEL" --device "$DEVICE" \
    --deadline-s $((left - 4)) $TOYARG ${ENGINE_ARGS:-} 2>&1 | grep -v "^USDT\|profiler_st\|^STAGE:"
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
print("start", r.get("engine_start_s"), "buckets", r.get("buckets"))
print("parts", r.get("parts_done"), "skipped", r.get("skipped"), "errors", r.get("errors"))
st = r.get("steady") or {}
print("prefill chunk ms silu off", st.get("prefill_chunk_ms_silu_off"), "on", st.get("prefill_chunk_ms_silu_on"))
for n in ("1024", "512", "256", "64", "16", "8"):
    s = st.get(n)
    if s and s.get("median_ms"):
        print(f"steady {n} medians: {s['median_ms']}")
for row in r.get("rows", []):
    print(f"row {row['label']}: {row['tok_s']:.0f} tok/s first {row['first_token_s']:.3f} s "
          f"decode {row['decode_ms_per_step']:.2f} ms same {row.get('same_outputs')}")
PYEOF
rm -f "$OUT/micro.log" "$OUT/fp8big_micro.json" "$OUT/fp8big_micro.json.done" "$OUT"/*.tmp
echo "== end at $SECONDS s"
