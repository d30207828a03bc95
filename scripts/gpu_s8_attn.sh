#!/usr/bin/env bash
# Issues 26 / 24, session 8, branch attn (budget 150 s; the timeouts add up to < 150 s):
# the split-KV decode attention per variant, and the FP8-KV engine step with the fastest.
#   1. in the background from the start, niced (its random weights are drawn on the CPU
#      while 2 runs and compiles): scripts/gpu_s8_attn.py engine: random:llama-3.1-8b, --quantization fp8,
#      --kv-cache-dtype fp8_e4m3, 32 running requests; once the sweep is over (no overlap
#      of the timed parts), the all-decoding step at 32 x 4,096 (bench offline's
#      steady_decode_step) and 8 greedy tokens of the 32 prompts, for the current kernel and
#      for 2's fastest e4m3 variant at 32 x 4,096 (decode graphs captured again), the tokens
#      compared -> engine.json
#   2. scripts/gpu_s8_attn.py sweep (no model): one step's decode attention (32 layers of a
#      page-major pool, one CUDA graph) per variant at 32x4096 (bf16: the current kernel
#      only; e4m3: 14 variants), 256x200 and 64x200 (bf16), until 48 / 58 / 66 s; bytes / s
#      against a torch copy of the same run, output against the current kernel's -> sweep.json
# Then both merged into attn.json (the others deleted) and a compact summary. Run as
#   OUT=$OUT PREFIX=s8_ bash scripts/gpu_call.sh attn:150
# from the repository root on the GPU machine, with the wheels in ${WHEELS:-.whl}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s8_attn}
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
rm -f "$OUT/sweep.done" "$OUT/sweep.json" "$OUT/engine.json"
touch "$OUT/sweep.done"
ENGINE_T=$((BUDGET - 18 - SECONDS))
echo "== 1. the engine, in the background ($SECONDS s; $ENGINE_T s for it)"
(
    timeout -k 5 "$ENGINE_T" nice -n 10 $PY scripts/gpu_s8_attn.py engine --device "$DEVICE" --model "$MODEL" \
        --deadline-s $((ENGINE_T - 6)) --json engine.json --sweep-json "$OUT/sweep.json" \
        --done "$OUT/sweep.done" ${ENGINE_ARGS:-} > "$OUT/engine.log" 2>&1
    echo "engine exit $? (124: cut by its timeout)" >> "$OUT/engine.log"
) &
engine_pid=$!
echo "== 2. the decode attention sweep ($SECONDS s)"
timeout -k 3 ${T_SWEEP:-74} $PY scripts/gpu_s8_attn.py sweep --device "$DEVICE" \
    --deadline-s ${SWEEP_S:-66} --shape-deadlines ${SHAPE_S:-48,58,66} --json sweep.json --done "$OUT/sweep.done" ${SWEEP_ARGS:-} 2>&1 \
    | grep --line-buffered -v "^USDT"
echo "sweep exit ${PIPESTATUS[0]} (124: cut by its timeout) at $SECONDS s"
echo "sweep done" >> "$OUT/sweep.done"  # the engine waits for this line
wait "$engine_pid"
echo "== the engine's log ($SECONDS s)"
grep -v "^USDT\|profiler_st\|Warning\|warn(" "$OUT/engine.log" | tail -20
echo "== merge ($SECONDS s)"
timeout 8 $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
res = {"sweep": load("sweep.json"), "engine": load("engine.json")}
(out / "attn.json").write_text(json.dumps(res, indent=1))
for name in ("sweep.json", "engine.json", "engine.log", "sweep.done"):
    (out / name).unlink(missing_ok=True)
sw = res["sweep"] or {}
for key, r in (sw.get("shapes") or {}).items():
    v = r["variants"]
    cur, best = v.get("current", {}), v.get(r.get("best"), {})
    print(f"{key}: current {cur.get('layer_us', 0):.1f} us/layer ({cur.get('of_copy', 0):.2f} of copy), "
          f"best {r.get('best')} {best.get('layer_us', 0):.1f} ({best.get('of_copy', 0):.2f}), "
          f"again {v.get('current_again', {}).get('layer_us', 0):.1f}")
print("copy GB/s", (sw.get("copy_before") or {}).get("moved_gb_s"), (sw.get("copy_after") or {}).get("moved_gb_s"))
e = res["engine"] or {}
print("engine:", {k: e.get(k) for k in ("variant", "current_step_ms", "engine_start_s", "greedy_same_rows",
                                        "greedy_same_tokens", "variant_over_current", "errors")},
      {k: v for k, v in e.items() if k.endswith("_step_ms")})
PYEOF
echo "== end at $SECONDS s"
