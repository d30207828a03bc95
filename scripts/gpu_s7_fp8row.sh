#!/usr/bin/env bash
# Issue 26, session 7 (branch fp8row, budget 270 s): the one-row decode step, FP8 weights +
# FP8 KV and bf16, with each kernel lever on and off in one engine per dtype
# (scripts/gpu_s7_fp8row.py: PDL, the first gemv weight tile read before the PDL wait,
# w8a8 weight lines prefetched to L2 before it, the activation quantization inside add +
# RMSNorm, SwiGLU inside the down gemv, w8a8 or 3-stage gemv tiles at one row, one decode
# split), the new kernels' bits under PDL,
# then bench offline 1 prompt x 128 tokens again with the fastest deployable variant ->
# $OUT/fp8row.json (keys fp8, bf16) and fp8row_log.txt (the last lines of each run's
# output); the gpu-marked tests of the new kernels if time is left.
#   OUT=$OUT PREFIX=s7_ bash scripts/gpu_call.sh fp8row:270
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s7_fp8row}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
MODEL=${MODEL:-random:llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
BENCH="--model $MODEL --device $DEVICE --dtype ${DTYPE:-bfloat16} --ours-only --num-prompts 1 --max-tokens ${MAX_TOKENS:-128}"
FP8_VARIANTS=${FP8_VARIANTS:-base,pdl,pdl+fq,pdl+early,pdl+wpre,pdl+silu}
FP8_LATE=${FP8_LATE:-pdl+attn1,pdl+a8+fq,pdl+s3}
BF16_VARIANTS=${BF16_VARIANTS:-base,pdl,pdl+attn1}
echo "== 1. FP8 weights + FP8 KV: bench offline, the variants at 1x200, bench offline with the best ($SECONDS s)"
timeout -k 5 ${T_FP8:-178} $PY scripts/gpu_s7_fp8row.py --key fp8 --variants "$FP8_VARIANTS" --combine \
    --late "$FP8_LATE" \
    --budget $(( ${T_FP8:-178} - 32 )) \
    --steps ${STEPS:-24} -- $BENCH --quantization fp8 --kv-cache-dtype fp8_e4m3 --repeats 2 2>&1 \
    | tee "$OUT/_fp8.log" | grep -v "^USDT\|profiler_st\|^\[W" | grep "VARIANT\|BEST\|CHECKS\|SKIPPED\|^ *1 \|engine up\|Error\|error" | tail -20
echo "== 2. bf16: the same, fewer variants ($SECONDS s)"
left=$(( ${BUDGET:-262} - SECONDS ))
if [ $left -gt 30 ]; then
    timeout -k 5 $left $PY scripts/gpu_s7_fp8row.py --key bf16 --variants "$BF16_VARIANTS" \
        --budget $(( left - 14 )) \
        --steps ${STEPS:-24} -- $BENCH --repeats 1 2>&1 \
        | tee "$OUT/_bf16.log" | grep -v "^USDT\|profiler_st\|^\[W" | grep "VARIANT\|BEST\|CHECKS\|SKIPPED\|^ *1 \|engine up\|Error\|error" | tail -10
else
    echo "skipped: $left s left"
fi
left=$(( ${BUDGET:-262} - SECONDS ))
echo "== 3. gpu tests of the fused norm + quantization and the early gemv read ($SECONDS s, $left left)"
if [ $left -gt 20 ] && [ "$DEVICE" = cuda ]; then
    timeout -k 3 $left $PY -m pytest -q -p no:cacheprovider tests/model/test_fused_ops.py \
        tests/model/test_triton_w8a8.py -k "quant or early or gemv or norm_linear" 2>&1 | tail -2
fi
rm -f "$OUT"/_bench_*.json
# the one text file kept: the last lines of each run's full output (profiles, tracebacks)
for f in "$OUT"/_fp8.log "$OUT"/_bf16.log; do
    [ -f "$f" ] && { echo "== $f"; grep -v "^USDT\|profiler_st" "$f" | tail -120; }
done > "$OUT/fp8row_log.txt" 2>/dev/null
rm -f "$OUT"/_fp8.log "$OUT"/_bf16.log
$PY - "$OUT/fp8row.json" <<'PYEOF' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
for key, r in d.items():
    for v, x in r.get("variants", {}).items():
        print(f"{key:5} {v:22} step {x.get('step_ms', 0):6.3f} ms kernels {x.get('kernel_ms', 0):6.3f} n {x.get('kernels_per_step', 0):4.0f} same {x.get('same_tokens_as_first')} {x.get('error', '')[:60]}")
    for b in ("bench_default", "bench_best"):
        for row in r.get(b, {}).get("rows", []):
            print(f"{key:5} {b:13} {r.get('best', '') if b == 'bench_best' else 'defaults':22} {row['ours_tok_s']:8.1f} tok/s step {row['ours_step_ms_all_decoding'] or 0:.3f} ms")
PYEOF
echo "== end at $SECONDS s"
