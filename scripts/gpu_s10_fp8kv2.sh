#!/usr/bin/env bash
# Issue 26, session 10, part fp8kv2 (round 2, rides in the confirm call; budget 90 s): the e4m3
# decode kernel's whole tiles without masks (DecodeConfig.even, FP8_DECODE_TILES["long"]'s
# pick: the same bits, fewer instructions a tile) on and off, with scripts/gpu_s10_fp8kv.py:
#   1. in the background: one FP8 + e4m3-KV engine (32-row graphs only); the long-context
#      graph with DecodeConfig.even flipped from the engine's own captured beside it, the
#      32 x 4,096 all-decoding step in interleaved spans of both, 8 greedy tokens under each
#      compared (they should be identical: the same arithmetic)
#   2. the decode attention alone at 32 x 4,096 (32 layers, one graph), e4m3 and bf16, even
#      on / off / the engine's own, then interleaved rounds of all three
# -> fp8kv2.json (the rest deleted). Run as
#   OUT=$OUT/gpu_s10 PREFIX=s10_ bash scripts/gpu_call.sh fp8kv2:90
# CPU check: as gpu_s10_fp8kv.sh's header, with this script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_s10_fp8kv2}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-90}
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
        --done "$OUT/sweep.done" --force-fields toggle-even ${ENGINE_ARGS:-} > "$OUT/engine.log" 2>&1
    echo "engine exit $? (124: cut by its timeout)" >> "$OUT/engine.log"
) &
engine_pid=$!
echo "== 2. the decode attention sweep ($SECONDS s)"
timeout -k 3 ${T_SWEEP:-40} $PY scripts/gpu_s10_fp8kv.py sweep --device "$DEVICE" $TOYARG --set even \
    --confirm-rounds 5 --shapes 32x4096 --deadline-s ${SWEEP_S:-36} --shape-deadlines ${SHAPE_S:-22} --json sweep.json \
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
(out / "fp8kv2.json").write_text(json.dumps(res, indent=1))
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
