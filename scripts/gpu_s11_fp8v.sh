#!/usr/bin/env bash
# Issue 26, session 11, part fp8v of one H200 call (budget 120 s; the timeouts add up to less):
# the e4m3 decode attention with its V tiles converted to 16 bits in registers before their
# layout change (DecodeConfig.vmul, triton_backend.FP8_KV_VMUL: off) against the current
# kernel at 32 x 4,096, then one engine's all-decoding step A/B, with scripts/gpu_s11_fp8v.py:
#   1. in the background from the start, niced: one FP8 + e4m3-KV engine (random:llama-3.1-8b,
#      --quantization fp8, --kv-cache-dtype fp8_e4m3, 32 running, graphs of the 32 bucket
#      only); once the sweep is over: its fastest variant of the same bits as the current
#      kernel (vmul / even / both) captured as a second long-context graph, the 32 x 4,096
#      all-decoding step in interleaved spans of both (paired medians), 8 greedy tokens of
#      the 32 prompts under each, compared (identical expected: the same arithmetic)
#   2. the decode attention alone at 32 x 4,096 (32 layers of a page-major pool, one CUDA
#      graph): bf16 current (the reference), e4m3 current / vmul / vmul even / even / vmul
#      with other tiles, warps, stages, pieces: µs a layer, KV GB/s and its fraction of a
#      copy, registers / spills / shared memory; the current and the 3 fastest again in
#      5 interleaved rounds
# -> fp8v.json (the rest deleted). Run as
#   OUT=$OUT/gpu_s11 PREFIX=s11_ bash scripts/gpu_call.sh fp8v:120
# CPU check (slow: the interpreter): TRITON_INTERPRET=1 DEVICE=cpu MODEL=random:tiny TOY=1 BUDGET=900 \
#   PYTHON=.venv/bin/python SWEEP_S=400 SHAPE_S=300 T_SWEEP=600 \
#   ENGINE_ARGS="--dtype float32 --engine-shape 4x40 --kv-cache-memory 1 --span-steps 2 --rounds 2 --span-tokens 20 --greedy-tokens 3" \
#   OUT=/tmp/s11 bash scripts/gpu_s11_fp8v.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s11_fp8v}
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
TOYARG=
[ -n "${TOY:-}" ] && TOYARG="--toy --reps 1"
rm -f "$OUT/sweep.done" "$OUT/sweep.json" "$OUT/engine.json"
touch "$OUT/sweep.done"
ENGINE_T=$((BUDGET - 9 - SECONDS))
echo "== 1. the engine, in the background ($SECONDS s; $ENGINE_T s for it)"
(
    timeout -k 3 "$ENGINE_T" nice -n 10 $PY scripts/gpu_s11_fp8v.py engine --device "$DEVICE" --model "$MODEL" \
        --deadline-s $((ENGINE_T - 3)) --json engine.json --sweep-json "$OUT/sweep.json" \
        --done "$OUT/sweep.done" ${ENGINE_ARGS:-} > "$OUT/engine.log" 2>&1
    echo "engine exit $? (124: cut by its timeout)" >> "$OUT/engine.log"
) &
engine_pid=$!
echo "== 2. the decode attention sweep ($SECONDS s)"
timeout -k 3 ${T_SWEEP:-50} $PY scripts/gpu_s11_fp8v.py sweep --device "$DEVICE" $TOYARG --set fp8v \
    --confirm-rounds 5 --shapes 32x4096 --deadline-s ${SWEEP_S:-46} --shape-deadlines ${SHAPE_S:-32} --json sweep.json \
    --done "$OUT/sweep.done" ${SWEEP_ARGS:-} 2>&1 | grep --line-buffered -v "^USDT"
echo "sweep exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
echo "sweep done" >> "$OUT/sweep.done"  # the engine waits for this line
wait "$engine_pid"
echo "== the engine's log ($SECONDS s)"
grep -v "^USDT\|profiler_st\|Warning\|warn(" "$OUT/engine.log" | tail -20
echo "== merge ($SECONDS s)"
timeout 5 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
res = {"sweep": load("sweep.json"), "engine": load("engine.json")}
(out / "fp8v.json").write_text(json.dumps(res, indent=1))
for name in ("sweep.json", "engine.json", "engine.log", "sweep.done"):
    (out / name).unlink(missing_ok=True)
sw = res["sweep"] or {}
shapes = sw.get("shapes") or {}
bf16 = (shapes.get("32x4096 bf16") or {}).get("variants", {}).get("current", {})
for key, r in shapes.items():
    v = r["variants"]
    cur, best = v.get("current", {}), v.get(r.get("best"), {})
    print(f"{key}: current {cur.get('layer_us', 0):.1f} us/layer ({cur.get('of_copy', 0):.2f} of copy), "
          f"best same bits {r.get('best')} {best.get('layer_us', 0):.1f}, best of all {r.get('best_any')}, "
          f"confirm {r.get('confirm')}")
    if bf16.get("layer_us") and key.endswith(" fp8"):
        print("   of bf16's layer time:", {n: round(x["layer_us"] / bf16["layer_us"], 3)
                                         for n, x in v.items() if "layer_us" in x})
print("copy GB/s", (sw.get("copy_before") or {}).get("moved_gb_s"), (sw.get("copy_after") or {}).get("moved_gb_s"))
e = res["engine"] or {}
print("engine:", {k: e.get(k) for k in ("variant", "variant_fields", "engine_start_s", "greedy_same_rows",
                                        "greedy_same_tokens", "greedy_first_diff_median", "variant_over_current",
                                        "paired_faster_rounds", "mean_context", "errors")},
      {k: v for k, v in e.items() if k.endswith("_step_ms")})
PYEOF
echo "== end at $SECONDS s"
