#!/usr/bin/env bash
# Issue 26, session 10, part fp8kv of one H200 call (budget 110 s; the timeouts add up to less):
# the e4m3 split-KV decode attention at 32 x 4,096 per variant, and the FP8-KV engine step
# with the fastest against the current kernel.
#   1. in the background from the start, niced (its random weights are drawn on the CPU
#      while 2 runs): scripts/gpu_s10_fp8kv.py engine: random:llama-3.1-8b, --quantization
#      fp8, --kv-cache-dtype fp8_e4m3, 32 running requests, graphs of the 32 bucket only;
#      once the sweep is over: the sweep's fastest variant's graph captured beside the
#      current one, 8 greedy tokens of 32 random 4,096-token prompts under each (compared),
#      then the all-decoding step, the two graphs interleaved span by span (paired medians)
#   2. scripts/gpu_s10_fp8kv.py sweep (no model): one step's decode attention (32 layers of a
#      page-major pool, one CUDA graph) at 32 x 4,096: bf16 (current, unroll 2) and e4m3 (18
#      variants: loop unrolling, prefetch, tiles, warps, stages, pieces, evict-first), the
#      registers / spills / shared memory of each compiled kernel, then the 3 fastest e4m3
#      variants and the current kernel again in interleaved rounds
# Both merged into fp8kv.json (the rest deleted). Run as
#   OUT=$OUT/gpu_s10 PREFIX=s10_ bash scripts/gpu_call.sh fp8kv:110
# CPU check (slow: the interpreter): TRITON_INTERPRET=1 DEVICE=cpu MODEL=random:tiny TOY=1 BUDGET=900 \
#   PYTHON=.venv/bin/python SWEEP_S=400 SHAPE_S=300 T_SWEEP=600 \
#   ENGINE_ARGS="--dtype float32 --engine-shape 4x40 --kv-cache-memory 1 --span-steps 2 --rounds 2 --span-tokens 20 --greedy-tokens 3" \
#   OUT=/tmp/s10 bash scripts/gpu_s10_fp8kv.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s10_fp8kv}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-110}
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
    timeout -k 3 "$ENGINE_T" nice -n 10 $PY scripts/gpu_s10_fp8kv.py engine --device "$DEVICE" --model "$MODEL" \
        --deadline-s $((ENGINE_T - 3)) --json engine.json --sweep-json "$OUT/sweep.json" \
        --done "$OUT/sweep.done" ${ENGINE_ARGS:-} > "$OUT/engine.log" 2>&1
    echo "engine exit $? (124: cut by its timeout)" >> "$OUT/engine.log"
) &
engine_pid=$!
echo "== 2. the decode attention sweep ($SECONDS s)"
timeout -k 3 ${T_SWEEP:-50} $PY scripts/gpu_s10_fp8kv.py sweep --device "$DEVICE" $TOYARG \
    --shapes 32x4096 --deadline-s ${SWEEP_S:-46} --shape-deadlines ${SHAPE_S:-32} --json sweep.json \
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
(out / "fp8kv.json").write_text(json.dumps(res, indent=1))
for name in ("sweep.json", "engine.json", "engine.log", "sweep.done"):
    (out / name).unlink(missing_ok=True)
sw = res["sweep"] or {}
for key, r in (sw.get("shapes") or {}).items():
    v = r["variants"]
    cur, best = v.get("current", {}), v.get(r.get("best"), {})
    print(f"{key}: current {cur.get('layer_us', 0):.1f} us/layer ({cur.get('of_copy', 0):.2f} of copy), "
          f"best {r.get('best')} {best.get('layer_us', 0):.1f}, confirm {r.get('confirm')}")
print("copy GB/s", (sw.get("copy_before") or {}).get("moved_gb_s"), (sw.get("copy_after") or {}).get("moved_gb_s"))
e = res["engine"] or {}
print("engine:", {k: e.get(k) for k in ("variant", "engine_start_s", "greedy_same_rows", "greedy_same_tokens",
                                        "greedy_first_diff_median", "variant_over_current",
                                        "paired_faster_rounds", "mean_context", "errors")},
      {k: v for k, v in e.items() if k.endswith("_step_ms")})
PYEOF
echo "== end at $SECONDS s"
