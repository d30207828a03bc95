#!/usr/bin/env bash
# Issue 26, session 6, one H200 call (budget 270 s; the timeouts add up to 250 s): FP8 at
# large batches and the FP8 KV cache's decode step.
#   1. scripts/gpu_fp8_attn_probe.py (no model): a one-row SwiGLU + FP8 down gemv, two
#      launches vs the gemv computing the activation (fp8.FUSE_SILU_GEMV's question); one
#      layer's decode attention, bf16 vs e4m3
#      cache, at 1 x 200, 64 x 200, 32 x 4,096 (the KV-only ratio of the attention kernel),
#      four decode tiles/warps/stages on both caches at 1 x 200 and 32 x 4,096 (does e4m3 want
#      more tokens a tile?), and RoPE + KV store + attention as a step runs them: bf16, e4m3 with the old unfused
#      store (torch quantization + store kernel), e4m3 with the store fused into RoPE
#      -> fp8_attn_probe.json
#   2. in the background during 3's model load: tests/model/test_fused_ops.py's
#      rope_store_kv tests on CUDA (the fused e4m3 store byte for byte as the unfused one,
#      the GPU's own cast) -> fused_store_tests.txt; beside it scripts/gpu_fp8_kernels2.py
#      --rows 4096,16384 (35 s at most): the FP8 linear paths at prefill chunk sizes past the path table's
#      1,024 rows (which path_for extends with the 1,024 pick, _scaled_mm) -> large_m/
#   3. scripts/gpu_fp8_offline.py: bench offline --quantization fp8 --kv-cache-dtype
#      fp8_e4m3 --ours-only at 256 / 512 / 1,024 prompts (128 tokens; the step budget
#      bench offline now gives them: 4,096 / 8,192 / 16,384 tokens, every prompt running
#      at once) + --long-context 32x4096 -> offline_fp8.json (best_batch in it, written
#      after each row), then on the same engine the step profile at 1 x 200 and 32 x 4,096
#      (kernels per step by name, graph launches) -> step_profile_fp8.json
#   4. only if >= 110 s are left: FP8 weights + bf16 KV, the step profile at 1 x 200 and
#      32 x 4,096 (the bf16-KV step of the 0.6 target, measured) -> step_profile_fp8w_bf16kv.json
# Then a compact summary (summary.json). Run from the repository root on the GPU machine
# with the wheels in ${WHEELS:-.whl}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s6_fp8}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-270}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
export OUT
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
. scripts/gpu_setup.sh
git log --oneline -1 2>/dev/null
MODEL=${MODEL:-random:llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
echo "== 1. decode attention, bf16 vs e4m3 cache, one layer ($SECONDS s)"
timeout ${T_PROBE:-55} $PY scripts/gpu_fp8_attn_probe.py --device "$DEVICE" ${PROBE_ARGS:-} ${PROBE_SHAPES:-1x200 64x200 32x4096} \
    2>&1 | grep -v "^USDT" | tail -14
echo "== 2. fused e4m3 store tests on CUDA, in the background ($SECONDS s)"
(
    timeout ${T_TESTS:-40} $PY -m pytest -q -p no:cacheprovider tests/model/test_fused_ops.py \
        -k rope_store_kv_equals > "$OUT/fused_store_tests.txt" 2>&1
    echo "pytest exit $? (124: cut by its timeout)" >> "$OUT/fused_store_tests.txt"
) &
tests_pid=$!
# Beside it, the FP8 linear paths at prefill chunk sizes; both end within 40 s, while 3
# still generates its random weights on the CPU (40-90 s): nothing runs beside 3's timings.
large_pid=
if [ "$DEVICE" = cuda ]; then
    mkdir -p "$OUT/large_m"
    (
        OUT="$OUT/large_m" timeout ${T_LARGE_M:-35} $PY scripts/gpu_fp8_kernels2.py \
            --rows ${LARGE_M_ROWS:-4096,16384} --budget-s 15 > "$OUT/large_m/output.txt" 2>&1
        echo "exit $? (124: cut by its timeout)" >> "$OUT/large_m/output.txt"
    ) &
    large_pid=$!
fi
echo "== 3. bench offline FP8 weights + FP8 KV, 256/512/1,024 + 32x4096, then the step profile ($SECONDS s)"
timeout ${T_OFFLINE:-195} $PY scripts/gpu_fp8_offline.py --profile ${PROFILE_SHAPES:-1x200,32x4096} \
    --profile-json step_profile_fp8.json -- --model "$MODEL" --device "$DEVICE" \
    --dtype ${DTYPE:-bfloat16} --ours-only --quantization fp8 --kv-cache-dtype fp8_e4m3 \
    --num-prompts ${COUNTS:-256,512,1024} --long-context ${LONG:-32x4096} --max-tokens ${MAX_TOKENS:-128} \
    --repeats 1 --json "$OUT/offline_fp8.json" 2>&1 | grep -v "^USDT\|profiler_st" | tail -40
wait $tests_pid $large_pid
tail -3 "$OUT/fused_store_tests.txt"
[ -f "$OUT/large_m/output.txt" ] && grep "picks\|exit\|M=" "$OUT/large_m/output.txt"
left=$((BUDGET - 8 - SECONDS))
echo "== 4. FP8 weights + bf16 KV step profile ($SECONDS s; $left s left)"
if [ "$left" -ge ${MIN_LEFT:-110} ]; then
    timeout "$left" $PY scripts/gpu_step_profile.py --model "$MODEL" --device "$DEVICE" \
        --dtype ${DTYPE:-bfloat16} --quantization fp8 --kv-cache-memory ${KV_GIB:-24} \
        --json step_profile_fp8w_bf16kv.json \
        ${PROFILE_KV_SHAPES:-1x200 32x4096} 2>&1 | grep -v "^USDT\|profiler_st" | tail -30
else
    echo "skipped: under ${MIN_LEFT:-110} s left"
fi
echo "== summary ($SECONDS s)"
timeout 10 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    p = out / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
s = {}
off = load("offline_fp8.json")
if off:
    s["offline"] = {
        "complete": off.get("complete"), "best_batch": off.get("best_batch"),
        "max_num_batched_tokens": off.get("max_num_batched_tokens"),
        "rows": [{k: r.get(k) for k in ("num_prompts", "mean_prompt_len", "ours_tok_s",
                  "ours_first_token_s", "ours_decode_ms_per_step", "ours_step_ms_all_decoding",
                  "roofline_fraction")} for r in off["results"]],
    }
for name in ("step_profile_fp8.json", "step_profile_fp8w_bf16kv.json"):
    prof = load(name)
    if prof:
        s[name] = {shape: {k: r[k] for k in ("step_ms", "kernel_ms", "gap_ms",
                   "graph_launches_per_step", "kernels_per_step")} | {
                   "top5": dict(list(r["top_kernels_ms"].items())[:5])} for shape, r in prof.items()}
probe = load("fp8_attn_probe.json")
if probe:
    s["attn_probe"] = {k: {"attn_us": v["attn_us"], "fp8_over_bf16": v["fp8_over_bf16"],
                           "block_ms_per_step": v["block_ms_per_step"]}
                       for k, v in probe.items() if isinstance(v, dict) and "attn_us" in v}
    s["attn_probe_variants"] = {k: v.get("variants_us") for k, v in probe.items()
                                if isinstance(v, dict) and "variants_us" in v}
    s["silu_gemv"] = probe.get("silu_gemv")
(out / "summary.json").write_text(json.dumps(s, indent=1))
print(json.dumps(s, indent=1)[:6000])
PYEOF
echo "== end at $SECONDS s"
